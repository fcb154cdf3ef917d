"""Where a rank's start-up goes: `python -m rawgpu.train` run in this process with its phases timed (CUDA's init,
the data, the kernels, NCCL's start and end, the first graphs, training, closing), each as start and end seconds since
$STARTUP_T0 (a launcher's start, `date +%s.%N`; default this process's start). Start it as a launcher starts a rank:

    RANK=r WORLD_SIZE=4 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 STARTUP_T0=$(date +%s.%N) python dev/startup_phases.py -- <train args>

Each rank prints its phases to stderr, one line each, prefixed with its rank, at exit.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time

T0 = float(os.environ.get("STARTUP_T0") or time.time())
PHASES: list[tuple[str, float, float]] = [("python start until this script", T0, time.time())]


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.append((label, t, time.time()))

    setattr(owner, name, wrapper)


def report() -> None:
    rank = os.environ.get("RANK", "-")
    for label, a, b in PHASES:
        sys.stderr.write(f"rank {rank} {a - T0:7.3f} {b - T0:7.3f} {b - a:7.3f}  {label}\n")


def main() -> int:
    t = time.time()
    from rawgpu.data import datasets as data
    from rawgpu.runtime import driver
    from rawgpu.model import mlp
    from rawgpu.training import session, trainer
    from rawgpu.cli import train
    from rawgpu.kernels import Kernels
    from rawgpu.jobs import job
    from rawgpu.runtime import nccl

    PHASES.append(("import rawgpu.train", t, time.time()))
    timed(driver, "init", "cuInit")
    timed(driver.Device, "__init__", "context")
    timed(data, "load_dataset", "load data")
    timed(job, "meet", "rendezvous")
    timed(session.Session, "__init__", "session (kernels, NCCL, arena)")
    timed(Kernels, "prefetch", "kernels prefetch")
    timed(nccl.Communicator, "__init__", "ncclCommInitRank")
    timed(nccl.Communicator, "close", "ncclCommDestroy")
    timed(mlp.MLP, "upload_data", "upload data")
    timed(mlp.MLP, "init_parameters", "init parameters")
    timed(trainer.Trainer, "fit", "fit")
    timed(trainer.Trainer, "close", "close")
    timed(session.Session, "capture_step", "capture step graph")
    atexit.register(report)
    argv = sys.argv[1:]
    return train.main(argv[1:] if argv[:1] == ["--"] else argv)


if __name__ == "__main__":
    sys.exit(main())
