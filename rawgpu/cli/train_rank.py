"""`python -m rawgpu.train` as one rank of a job that a launcher started on one host or several (torchrun, SLURM,
mpirun, rawgpu.launch): which rank it is and the options that go with that, the rendezvous, and the run, whose end
is the whole job's (jobs/job.py): rank 0 shows the run and writes the checkpoints, in the one-GPU format."""

from __future__ import annotations

import argparse
import io
import sys

from ..jobs.launchers import World
from . import common


def launcher_world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> World | None:
    """The job of several processes the environment says this process is a rank of, checked against the options
    (common.launcher_world; a model on several GPUs runs their split step) and NCCL; None for an ordinary run."""
    world = common.launcher_world(parser, args, gpus_is_world=True)
    if world is None:
        return None
    if args.step != "auto":
        parser.error(f"argument --step: {common.started_as(world)}: a model on {world.size} GPUs runs the tensor- or data-parallel "
                     f"step, not --step {args.step}")
    from ..runtime.install import nccl_stack_problem
    from ..runtime import nccl

    if (why := nccl_stack_problem() or nccl.available()) is not None:  # the installation's failing: exit 1
        from ..jobs.job import fail

        fail(world, why)
    return world


def run(args: argparse.Namespace, data, recipe, t_start: float, ckpt, world: World, gpus_here: int,
        meeting=None) -> int:
    """Meet the other ranks, then train as rank world.rank on GPU world.local_rank; any failure, Ctrl-C or SIGTERM
    here, or a rank lost elsewhere, ends every rank of the job with a line naming the rank. meeting: what
    jobs.job.start_meeting started for the rendezvous."""
    from .. import __version__
    from .console import Console, make_console
    from ..runtime.errors import NoDeviceError
    from ..jobs.job import meet
    from ..runtime.ranks import Rank
    from ..jobs.rendezvous import Identity
    from .train_run import train

    if world.local_rank >= gpus_here:
        raise NoDeviceError(f"rank {world.rank} of {world.size}: its local rank {world.local_rank} names a GPU this "
                            f"host does not have ({gpus_here}: 0..{gpus_here - 1})")
    what = repr(ckpt.recipe if ckpt is not None else recipe)
    what += f"; resumed at step {ckpt.steps_done}" if ckpt is not None else ""

    def log(line: str) -> None:
        print(f"rawgpu: rank 0 of {world.size}: {line}", file=sys.stderr, flush=True)

    job = meet(world, Identity.of(what, data.digest(), __version__), args.rendezvous_timeout, log, meeting)
    root = world.rank == 0
    console = make_console("json" if args.json else "auto") if root else Console(io.StringIO())
    status = None
    try:
        with job.guard():
            status = train(args, data, recipe, console, t_start, ckpt,
                           Rank(world.size, world.rank, job.unique_id, args.parallel, world.local_rank, job))
        job.finish()
    finally:
        console.close()
        job.close()
    return status if status is not None else job.end_status  # the guard ended the job (a real end exits first)
