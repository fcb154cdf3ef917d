"""`python -m rawgpu.train`: train an MLP on MNIST-like data, one CUDA graph launch per training step.

A thin layer over `rawgpu.Trainer`: it checks the arguments and files, loads the data, then trains, saves and plots.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

from ..model import recipe as rc
from . import train_rank
from .train_run import train
from .common import (add_device_option, add_step_option, add_version_option, check_data_options, check_step_option,
                     count, parallel_problem, program, seconds, usage_error)
from .console import RunInfo, Summary
from .tables import TASK_OPTIONS, add_table_options, check_table_flags, fraction, read_table
from ..runtime.driver import WATCHDOG_SECONDS, set_watchdog
from ..runtime.errors import RawgpuError, StepUnsupported, interrupt_status, stop_on_sigterm
from ..data.datasets import DATASET_NAMES
from ..steps import MODES
from ..training.trainer import MAX_AUTO_STEPS_PER_GRAPH, RunPlan, Trainer, TrainingDiverged, check_resumable

RECIPE_OPTIONS = ("hidden", "layers", "activation", "batch", "epochs", "optimizer", "lr", "momentum", "nesterov",
                  "betas", "eps", "weight_decay", "schedule", "warmup", "accum", "seed")


def build_parser() -> argparse.ArgumentParser:
    d = rc.DEFAULTS
    description = (f"{__doc__}\n\nDefault recipe (reaches >= 98% test accuracy at --hidden {d['hidden']}): batch "
                   f"{d['batch']}, {rc.Recipe().optimizer_text},\nlr {rc.Recipe().lr} with a {d['schedule']} decay to 0 "
                   f"over the run, {d['epochs']} epochs, {d['accum']} accumulation, seed {d['seed']}.")
    p = argparse.ArgumentParser(
        prog=program("train"), description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 done, 1 runtime error (no GPU, out of memory, data, a GPU that stopped), 2 bad "
               "arguments, 130 Ctrl-C, 143 SIGTERM (both stop at a step boundary and save as --save says).")
    rc.add_options(p.add_argument_group("model"), RECIPE_OPTIONS[:3])
    o = p.add_argument_group("optimisation")
    rc.add_options(o, RECIPE_OPTIONS[3:5])
    o.add_argument("--steps", type=rc.argument_type("steps", rc.RUN_OPTIONS["steps"]), default=None, metavar="STEPS",
                   help="total training steps; overrides --epochs (the benchmark workload uses 5000)")
    rc.add_options(o, RECIPE_OPTIONS[5:])
    d = p.add_argument_group("data and checkpoints")
    add_table_options(d)
    d.add_argument("--val-fraction", metavar="F", type=fraction, default=None,
                   help="hold out this share of the training rows (chosen by --seed) and score every epoch on them; "
                        "the test set is scored once, at the end")
    d.add_argument("--dataset", choices=DATASET_NAMES, default=None,
                   help="mnist, fashion-mnist and kmnist are checked against their published checksums and downloaded "
                        "when missing; idx takes any four IDX files from --data-dir (any image size and count, "
                        "classes from the labels; structural checks only) (default mnist, or the checkpoint's)")
    d.add_argument("--data-dir", default=None, help="directory with the four IDX files (raw or .gz); default: "
                   "$RAWGPU_DATA (mnist only), then the cache, then download")
    d.add_argument("--save", metavar="PATH", default=None,
                   help="write a checkpoint (safetensors) at the end, on Ctrl-C and every --save-every steps; "
                        "atomically, so a crash never leaves half a file (default with --resume: the resumed file)")
    d.add_argument("--save-every", metavar="N", type=count(1, what="steps"), default=None,
                   help="also save every N steps")
    d.add_argument("--resume", metavar="PATH", default=None,
                   help="continue the run a checkpoint saved (recipe, optimiser state, step, schedule and data "
                        "order): it ends bit-identical to the uninterrupted run")
    d.add_argument("--plot", metavar="PATH", default=None,
                   help="write a PNG of train loss and test accuracy per epoch (needs matplotlib: the plot extra)")
    r = p.add_argument_group("run")
    add_device_option(r)
    r.add_argument("--no-graph", action="store_true",
                   help="launch the same kernels one by one instead of replaying CUDA graphs (for comparison)")
    r.add_argument("--steps-per-graph", type=count(1, 1000), default=None,
                   help="training steps captured into one graph (default: one progress tick's steps, "
                        f"{MAX_AUTO_STEPS_PER_GRAPH} at most)")
    add_step_option(r)
    r.add_argument("--gpus", type=count(1, 64, what="GPUs"), default=1, metavar="N",
                   help="train on GPUs 0..N-1 of this machine, one process each, split as --parallel says (needs "
                        "NCCL: the multi extra, multi-cu12 with the cu12 stack); default 1")
    r.add_argument("--rendezvous-timeout", type=seconds, default=120.0, metavar="S",
                   help="as one rank of a launcher's job (torchrun, SLURM, mpirun, rawgpu.launch): how long rank 0 "
                        "waits for every rank to arrive before it ends the job naming the missing ones (default 120)")
    r.add_argument("--parallel", choices=MODES, default="auto",
                   help="with --gpus: tensor (each GPU a slice of every layer; the activations are summed), data (each "
                        "GPU the whole model and 1/N of every batch; the gradients are summed) or auto (default: the "
                        "one that moves fewer bytes per step)")
    r.add_argument("--no-overlap", action="store_true",
                   help="layered step on sm_90+: start each kernel only when the one before has finished, instead of "
                        "overlapping its start with that kernel's end (programmatic dependent launch; for comparison)")
    r.add_argument("--watchdog", type=seconds, default=WATCHDOG_SECONDS, metavar="S",
                   help="give the GPU up when work it was given has not finished after S seconds: one line, exit 1 "
                        f"(a stopped GPU or driver; default {WATCHDOG_SECONDS:g})")
    r.add_argument("--json", action="store_true", help="print one JSON object per epoch on stdout and nothing else")
    add_version_option(p)
    return p


def make_plan(args: argparse.Namespace, train_rows: int = rc.TRAIN_ROWS) -> RunPlan:
    total, epochs = rc.run_length(args.batch, args.epochs, args.steps, train_rows)
    return RunPlan(epochs, total, train_rows // args.batch)


def make_recipe(args: argparse.Namespace, plan: RunPlan, shape: dict[str, int] | None = None) -> rc.Recipe:
    """The recipe of the arguments; shape: the data's (default MNIST's)."""
    return rc.from_args(args, plan.total_steps, **(shape or {}))


def train_on_gpus(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """--gpus N: N processes of this command, one per GPU, started as rawgpu.launch starts one host's ranks (each
    finds its GPU and the others through torchrun's variables: train_rank.py); rank 0 shows the run. A rank that fails
    ends them all (jobs/job.py)."""
    from ..jobs import processes

    if (count := processes.visible_gpus()) is not None and args.gpus > count:
        parser.error(f"argument --gpus: {args.gpus} GPUs asked for, this machine has {count}")
    saved = f"; {args.save} keeps the last checkpoint saved" if args.save else ""
    ranks = lambda: processes.start(main, argv, args.gpus, launcher=f"rawgpu.train --gpus {args.gpus}")  # noqa: E731
    return processes.run(ranks, 0, f"rawgpu: interrupted: every GPU's process stopped{saved}", name="rawgpu")


def explicit_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options typed on the command line (not left at their defaults)."""
    quiet = copy.deepcopy(parser)
    for action in quiet._actions:  # argparse has no public "was it given" query
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def check_resume(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str], ckpt) -> None:
    """--resume continues the saved run as it was: an option typed with another value than the checkpoint's is a
    usage error."""
    r = ckpt.recipe
    saved = {**{n: getattr(r, {"warmup": "warmup_steps"}.get(n, n)) for n in RECIPE_OPTIONS + TASK_OPTIONS
                if n not in ("epochs", "betas")},
             "betas": [r.beta1, r.beta2],
             "epochs": rc.cdiv(r.total_steps, r.steps_per_epoch), "steps": r.total_steps,
             "dataset": ckpt.dataset.get("name"), "step": ckpt.step_kind}
    for name in sorted(given & set(saved)):
        if name == "step" and args.step == "auto":
            continue
        value, want = getattr(args, name), saved[name]
        if name == "hidden":  # one width, or a width per layer: the same model either way
            same = value in ([r.hidden], list(r.hidden_widths))
            value, want = " ".join(map(str, value)), " ".join(map(str, r.hidden_widths if not r.uniform else [want]))
        else:
            same = value == want
        if not same:
            parser.error(f"argument --{name}: {value} differs from the checkpoint's {want}; "
                         "--resume continues the saved run as it was")


def check_run(parser: argparse.ArgumentParser, args: argparse.Namespace, shape: dict[str, int],
              data=None) -> rc.Recipe:
    """The recipe of the arguments on data of this shape, checked by the rules the Python API applies (Recipe and
    recipe.plan_run: the batch against the training images, the warm-up against the schedule and the run's length,
    the optimiser's settings; with the data read, trainer.fit_to_data: the task and the features' dtype), each
    failure a usage error naming the flag."""
    from ..training.trainer import fit_to_data

    try:
        recipe = rc.from_args(args, 0, **shape)
        if data is not None:
            recipe = fit_to_data(recipe, data)
        elif recipe.regression:
            raise rc.SettingError("loss", f"{recipe.loss} is a regression's loss; {args.dataset} has class labels "
                                          "(a regression's values come with --data)")
        recipe = rc.plan_run(recipe, args.epochs, args.steps)
    except ValueError as exc:  # recipe.SettingError names the parameter; hidden_of's the flag
        usage_error(parser, exc)
    check_step_option(parser, recipe, args.step)
    return recipe


def check_resumed_data(args: argparse.Namespace, ckpt) -> None:
    """--resume: the data the run continues on must be the checkpoint's (its images, classes and training set), which
    a named set's table says before any file is read or the GPU is opened; CheckpointError naming the file. The idx
    set (read from --data-dir) is checked once it is read, as Trainer.load checks any data."""
    from ..training.checkpoint import CheckpointError
    from ..data.datasets import known_shape

    if args.data is not None:  # a table: checked once it is read (check_resumable)
        return
    name = args.dataset or ckpt.dataset.get("name")
    if ckpt.dataset.get("columns") is not None:
        raise CheckpointError(f"{args.resume}: trained on a table ({name}); pass its file again with --data")
    if name not in DATASET_NAMES:
        raise CheckpointError(f"{args.resume}: the checkpoint names no known dataset ({name!r}); pass --dataset")
    shape, r = known_shape(name), ckpt.recipe
    if shape is None:
        return
    if (shape["inputs"], shape["train_rows"]) != (r.inputs, r.train_rows) or shape["classes"] > r.classes:
        raise CheckpointError(f"{args.resume}: trained on {r.train_rows} images of {r.inputs} pixels and {r.classes} "
                              f"classes; {name} has {shape['train_rows']} of {shape['inputs']} pixels and "
                              f"{shape['classes']} classes: --resume continues on the checkpoint's data")


def read_data(args: argparse.Namespace, console):
    """The run's data: --data's table (its progress on the console while a CSV is read) or the named dataset."""
    from ..data.datasets import load_dataset

    if args.data is None:
        return load_dataset(args.dataset, args.data_dir, progress=console.download)
    return read_table(args, args.seed, console.reading)


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, writes: bool = True) -> None:
    """Files the run reads or writes, before anything expensive. writes: whether this process writes the checkpoint
    and the plot (in a launcher's job only rank 0 does, on its own host)."""
    from ..training.checkpoint import check_writable

    check_table_flags(parser, args, args.dataset is not None)
    if args.data is None:
        check_data_options(parser, args.dataset, args.data_dir)
    if args.save_every is not None and not args.save:
        parser.error("argument --save-every: needs --save PATH")
    if not writes:
        return
    if args.save and (problem := check_writable(args.save)):
        parser.error(f"argument --save: {problem}")
    if args.plot:
        from ..training.plot import check_plot_path, plot_available

        if problem := check_plot_path(args.plot):
            parser.error(f"argument --plot: {problem}")
        if not plot_available():
            from ..runtime.install import hint

            parser.error(f"argument --plot: needs matplotlib: {hint('plot')}")


def check_gpus(parser: argparse.ArgumentParser, args: argparse.Namespace, ranks: int, launched: bool) -> None:
    """--gpus N > 1: the options it cannot go with, and NCCL, before the data and the GPUs. ranks: the processes
    the model is split over (--gpus N, or a launcher's job); launched: this process is one of them
    (train_rank.launcher_world checked NCCL)."""
    if ranks > 1 and args.val_fraction is not None:
        parser.error(f"argument --val-fraction: scores the finished model on one GPU; a run on {ranks} GPUs reports "
                     "the test set every epoch (drop --val-fraction)")
    if ranks > 1 and args.step != "auto":
        parser.error(f"argument --{'gpus' if args.gpus > 1 else 'step'}: a model on {ranks} GPUs runs the tensor- or "
                     f"data-parallel step, not --step {args.step}")
    if args.gpus == 1 or launched:
        if args.parallel != "auto" and ranks == 1:
            parser.error("argument --parallel: splits a model over several GPUs; add --gpus N")
        return
    if args.device:
        parser.error(f"argument --gpus: the run takes GPUs 0..{args.gpus - 1}; drop --device")
    from ..runtime.install import nccl_stack_problem
    from ..jobs.processes import in_fork
    from ..runtime import nccl

    why = nccl_stack_problem()  # NCCL of the other CUDA stack: refused before it is loaded
    if why is None:
        try:
            why = in_fork(nccl.available)  # this process may fork the ranks next: NCCL stays out of it
        except RuntimeError as exc:  # loading NCCL killed the check's process
            why = f"NCCL could not be loaded ({exc})"
    if why is not None:  # the installation's failing, not the arguments': one line, exit 1
        print(f"rawgpu: error: --gpus {args.gpus}: {why}", file=sys.stderr)
        raise SystemExit(1)


def check_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace, recipe: rc.Recipe, ranks: int) -> None:
    """--parallel: the split must run the recipe on `ranks` GPUs."""
    if why := parallel_problem(recipe, args.parallel, [ranks]):
        parser.error(f"argument --parallel: {why}")


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    stop_on_sigterm()
    parser = build_parser()
    args = parser.parse_args(argv)
    world = train_rank.launcher_world(parser, args)  # one rank of a launcher's job, or None
    ranks = world.size if world is not None else args.gpus
    if args.no_graph and args.steps_per_graph not in (None, 1):
        parser.error("--steps-per-graph needs graphs; drop it or --no-graph")
    ckpt = None
    if args.resume:
        from ..training.checkpoint import CheckpointError, load

        try:
            ckpt = load(args.resume)  # a file: cheap, before the data and the GPU
            check_resume(parser, args, explicit_options(parser, argv), ckpt)
            check_parallel(parser, args, ckpt.recipe, ranks)
            check_resumed_data(args, ckpt)
        except CheckpointError as exc:
            print(f"rawgpu: error: {exc}", file=sys.stderr)
            return 1
        if args.data is None:
            args.dataset = args.dataset or ckpt.dataset.get("name")
        args.save = args.save or args.resume
    if args.data is None:
        args.dataset = args.dataset or "mnist"
    check_paths(parser, args, writes=world is None or world.rank == 0)
    check_gpus(parser, args, ranks, launched=world is not None)
    from ..data.datasets import known_shape

    recipe = None
    if ckpt is None and args.data is None and (shape := known_shape(args.dataset)) is not None:
        recipe = check_run(parser, args, shape)  # the named sets' shape is known: no need to read them first
        check_parallel(parser, args, recipe, ranks)
    if world is None and args.gpus > 1:  # the ranks read the data and start CUDA themselves, each on its GPU
        return train_on_gpus(parser, args, argv)
    from ..runtime import driver
    from .console import make_console
    from ..jobs.job import meeting_or_fail

    meeting = meeting_or_fail(world, args.rendezvous_timeout)  # a rank's: overlaps the data and CUDA's start
    driver.init_in_background()  # CUDA starts while the data is read

    console = make_console("json" if args.json else "auto")
    try:
        data = read_data(args, console)
        final = None  # with --val-fraction: the training rows with the test set, scored once at the end
        if args.val_fraction is not None:
            data, final = data.validation_split(args.val_fraction, args.seed)
        if data.unverified:
            console.message(f"{data.name}: {len(data.unverified)} files checked for structure only (no published "
                            f"checksum applies): {', '.join(Path(p).name for p in data.unverified)}")
        if ckpt is None and recipe is None:
            recipe = check_run(parser, args, dict(inputs=data.inputs, classes=data.classes,
                                                  train_rows=len(data.train_labels), test_rows=len(data.test_labels)),
                               data)
            check_parallel(parser, args, recipe, ranks)
        if ckpt is not None:
            check_resumable(ckpt, data, args.resume)  # the data read (the idx set's shape): before the GPU too
        driver.init()
        count = driver.device_count()
        if args.device >= count:
            parser.error(f"argument --device: no GPU with index {args.device}; this machine has {count} "
                         f"(0..{count - 1})" if count else "argument --device: this machine has no CUDA GPU")
        if world is not None:
            console.close()  # rank 0 shows the run from the job's console
            return train_rank.run(args, data, recipe, t_start, ckpt, world, count, meeting)
        return train(args, data, recipe, console, t_start, ckpt, final=final)
    except StepUnsupported as exc:  # the step kind asked for, on this GPU's arch: a usage error too
        console.close()
        print(f"rawgpu: error: argument --step: {exc}", file=sys.stderr)
        return 2
    except RawgpuError as exc:
        console.close()
        if world is not None:
            from ..jobs.job import fail

            fail(world, str(exc))
        print(f"rawgpu: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        console.close()
        print("rawgpu: interrupted before training started", file=sys.stderr)
        return interrupt_status(exc)
    finally:
        console.close()
        if meeting is not None:
            meeting.close()


if __name__ == "__main__":
    sys.exit(main())
