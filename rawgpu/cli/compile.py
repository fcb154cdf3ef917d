"""`python -m rawgpu.compile`: fill the kernel cache ahead of a run, no GPU needed (a Docker build, a cluster's
shared cache directory): the kernel units one recipe's session launches, or every unit with --all."""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..model import recipe as rc
from ..runtime.errors import RawgpuError, StepUnsupported, run_cli
from ..runtime.files import cannot_create_in
from ..contract.arch import TYPICAL_SMS
from .common import add_step_option, add_version_option, count, program, usage_error
from .tables import add_shape_options



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("compile"), description=__doc__,
                                epilog="Exit status: 0 done, 1 compile error, 2 bad arguments.")
    p.add_argument("--arch", default=None, help="the GPU architecture to build for, e.g. sm_90 (default: the GPU "
                   "here)")
    p.add_argument("--all", action="store_true", help="every kernel unit of the arch (default: those of the recipe "
                   "below)")
    rc.add_options(p.add_argument_group("recipe (as python -m rawgpu.train takes it)"),
                   ("hidden", "layers", "activation", "batch", "optimizer", "momentum", "weight_decay", "accum"))
    add_shape_options(p)
    add_step_option(p)
    p.add_argument("--sms", type=count(1, 1024, what="SM count"), default=None,
                   help="SMs of the GPU the recipe is planned for (default: the GPU here, else the arch's largest "
                        f"chip: {', '.join(f'{a} {n}' for a, n in TYPICAL_SMS.items())})")
    p.add_argument("--cache-dir", default=None, help="where the cubins go (default: $RAWGPU_CACHE, else "
                   "~/.cache/rawgpu)")
    p.add_argument("--jobs", type=count(1, 1024, what="count"), default=os.cpu_count() or 1,
                   help="parallel builds (default: the CPU count)")
    add_version_option(p)
    return p


def local_gpu() -> tuple[str, int] | None:
    """(arch, SM count) of GPU 0, or None when no driver or GPU is usable here."""
    try:
        from ..runtime.driver import Device

        device = Device(0)
        try:
            return device.arch, device.sm_count
        finally:
            device.close()
    except RawgpuError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cache_dir is not None:
        cache = Path(args.cache_dir).expanduser()
        if cache.exists() and not cache.is_dir():
            parser.error(f"argument --cache-dir: {cache} is not a directory")
        os.environ["RAWGPU_CACHE"] = str(cache)  # compiler.cache_dir() reads it at every build
    return run_cli(lambda: prebuild(parser, args))


def prebuild(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..runtime import compiler

    supported = compiler.supported_archs()
    here = None
    if args.arch is None or (args.sms is None and not args.all):
        here = local_gpu()
    if args.arch is None:
        if here is None:
            parser.error("argument --arch: no usable GPU here to take it from; pass one, e.g. --arch sm_90")
        args.arch = here[0]
    try:
        arch = compiler.normalize_arch(args.arch)
    except (ValueError, RawgpuError) as exc:
        parser.error(f"argument --arch: {exc}")
    if arch not in supported:
        parser.error(f"argument --arch: this NVRTC builds for {', '.join(supported)}, not {arch}")
    if int(arch[3:].rstrip("a")) < 80:
        parser.error(f"argument --arch: rawgpu needs sm_80 or newer (mma.sync, cp.async), not {arch}")
    if args.all:
        units, planned = compiler.all_units(arch), "every kernel unit"
    else:
        sms = args.sms or (here[1] if here is not None and here[0] == arch else TYPICAL_SMS.get(arch, 108))
        try:
            recipe = rc.from_args(args, rc.run_length(args.batch, 1, None)[0], inputs=args.inputs,
                                  classes=args.classes)
        except ValueError as exc:  # a setting the recipe refuses (rc.SettingError names it): a usage error
            usage_error(parser, exc)
        from ..training.session import kernel_units
        from ..steps import choose

        try:
            choice = choose(recipe, arch, args.step)
        except StepUnsupported as exc:
            parser.error(f"argument --step: {exc}")
        units = kernel_units(recipe, arch, sms, choice)
        planned = f"{recipe.name} batch {args.batch}, {choice.kind} step, planned for {sms} SMs"
    kernels = compiler.cache_dir()
    try:  # a build into a cache it cannot write would be thrown away: say so before compiling anything
        kernels.mkdir(parents=True, exist_ok=True)
        problem = cannot_create_in(kernels)
    except OSError as exc:
        problem = f"{exc.strerror or exc}"
    if problem:  # named as the user set it: the option, the variable, or neither (the default)
        named = ("argument --cache-dir: " if args.cache_dir is not None else
                 "$RAWGPU_CACHE: " if os.environ.get("RAWGPU_CACHE") else "")
        parser.error(f"{named}cannot write the kernel cache {kernels}: {problem}")
    print(f"building {len(units)} kernel units for {arch} ({planned}) into {kernels}", flush=True)
    return build(units, arch, args.jobs, args.activation)


def build(units: list, arch: str, jobs: int, activation: str = rc.DEFAULTS["activation"]) -> int:
    """Build the units on `jobs` threads with a progress bar, then one line per unit and the total."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..runtime import compiler

    def one(unit):
        t = time.perf_counter()
        module = compiler.compile_source(unit[0], arch, kernel=unit[1], activation=activation)
        return unit, module.cached, time.perf_counter() - t

    console = Console(stderr=True)
    t0, results = time.perf_counter(), []
    with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=len(units))
        with ThreadPoolExecutor(max_workers=min(jobs, len(units))) as pool:
            for future in as_completed([pool.submit(one, u) for u in units]):
                results.append(future.result())  # the first compile error ends the run with its log
                progress.advance(task)
    for (source, kernel), cached, seconds in sorted(results, key=lambda r: (r[0][0], r[0][1] or "")):
        print(f"  {source:16} {kernel or '(whole source)':34} {'cached' if cached else f'{seconds:5.1f} s'}")
    built = sum(not cached for _, cached, _ in results)
    print(f"built {built} of {len(units)} kernel units for {arch} in {time.perf_counter() - t0:.1f} s "
          f"({len(units) - built} were cached already)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
