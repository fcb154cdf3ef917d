"""What the CLIs share (train, evaluate, predict, compile, sweep, launch, scripts/inspect_graph.py): argument types,
the options every one of them takes (--device, --step, --version), and the name each goes by in its usage line."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from ..model import recipe as rc
from .. import steps
from ..contract.arch import PLANNING_ARCH
from ..runtime.errors import StepUnsupported


def count(low: int, high: int | None = None, what: str = "count"):
    """An argparse type for the run options that are not part of the recipe."""
    return rc.argument_type(what, rc.Option(None, int, low, high))


def seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def program(name: str) -> str:
    """How the user started a CLI, for its usage and error lines: its console script (rawgpu-NAME) or python -m."""
    script = Path(sys.argv[0]).name
    return script if script == f"rawgpu-{name}" else f"python -m rawgpu.{name}"


def add_device_option(parser) -> None:
    """`--device`: the GPU index, a non-negative integer (every CLI shares it, and its rule with the Python API's
    device=: recipe.RUN_OPTIONS)."""
    parser.add_argument("--device", type=rc.argument_type("device", rc.RUN_OPTIONS["device"]), default=0,
                        metavar="INDEX", help="GPU index (default 0)")


def add_version_option(parser) -> None:
    """`--version`: print "rawgpu VERSION" and exit 0 (every CLI takes it)."""
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"rawgpu {__version__}")


def usage_error(parser: argparse.ArgumentParser, exc: ValueError) -> NoReturn:
    """A setting the run's rules refused (recipe.SettingError, naming the parameter), as a usage error naming the
    flag ("argument --epochs: must be >= 1, got 0"); another ValueError as its own text (exit 2 either way)."""
    parser.error(exc.usage() if isinstance(exc, rc.SettingError) else str(exc))


def add_step_option(parser) -> None:
    """`--step` (alias `--kernels`): the step kind, with the chooser's own rule as help (every CLI shares it)."""
    parser.add_argument("--step", "--kernels", dest="step", choices=steps.CHOICES, default="auto",
                        help=steps.help_text())


def check_step_option(parser: argparse.ArgumentParser, recipe: rc.Recipe, kind: str) -> None:
    """A named step kind that cannot run the recipe is a usage error before any GPU work. The recipe's limits are
    checked against the most capable GPU here; the GPU's own arch is checked once it is open."""
    try:
        steps.choose(recipe, PLANNING_ARCH, kind)
    except StepUnsupported as exc:
        parser.error(f"argument --step: {exc}")


def parallel_problem(recipe: rc.Recipe, mode: str, gpus: list[int]) -> str | None:
    """Why --parallel `mode` cannot run the recipe on one of `gpus` GPU counts (steps.choose, the one chooser,
    says); None when it can. Checked before any GPU work."""
    for n in gpus:
        if n > 1:
            try:
                steps.choose(recipe, PLANNING_ARCH, mode, n)
            except StepUnsupported as exc:
                return str(exc)
    return None


def check_data_options(parser: argparse.ArgumentParser, dataset: str | None, data_dir: str | None) -> None:
    """--data-dir and --dataset, before anything expensive: the folder must hold the dataset's four files."""
    from ..data.datasets import missing_files

    if data_dir is not None and (missing := missing_files(data_dir, dataset or "mnist")):
        parser.error(f"argument --data-dir: {data_dir} lacks " + ", ".join(missing) + " (raw or .gz)"
                     if Path(data_dir).expanduser().is_dir() else f"argument --data-dir: no directory {data_dir}")
    if dataset == "idx" and data_dir is None:
        parser.error("argument --dataset: idx needs --data-dir DIR holding the four IDX files")


def launcher_world(parser: argparse.ArgumentParser, args: argparse.Namespace, gpus_is_world: bool = False):
    """The job of several processes the environment says this process is a rank of (jobs.launchers.World), checked
    against --gpus and --device (a rank runs on GPU LOCAL_RANK, one process per GPU); None where no launcher set one
    (or a job of one process: an ordinary run). gpus_is_world: --gpus N may stay on a rank's command line where N is
    the job's size (train --gpus N starts its ranks so)."""
    import os

    from ..jobs.launchers import world_from_environment

    try:
        world = world_from_environment(os.environ)
    except ValueError as exc:
        parser.error(f"the launcher's environment: {exc}")
    if world is None or world.size == 1:
        return None
    if args.gpus not in ((1, world.size) if gpus_is_world else (1,)):
        parser.error(f"argument --gpus: {started_as(world)}, one process per GPU; drop --gpus")
    if args.device:
        parser.error(f"argument --device: {started_as(world)}; its local rank ({world.local_rank}) names its GPU; drop "
                     "--device")
    return world


def started_as(world) -> str:
    return f"{world.launcher} started this process as rank {world.rank} of {world.size}"
