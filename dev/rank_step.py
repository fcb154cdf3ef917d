"""One rank's part of a step on several GPUs, timed on one GPU with its all-reduces left out, beside the one-GPU step.

    python dev/rank_step.py [--hidden 4096 8192 16384] [--ranks 1 2 4 8] [--recipe seed default adam] [--long]
                            [--parallel tensor|data] [--batch B] [--kernels]

What a rank of an N-GPU run computes (its slice of every layer, steps/sharded.py; or, with --parallel data, the
whole model over its 1/N of the batch, steps/replicated.py) is timed here alone: the all-reduces are replaced by
nothing, so the figure is the step of an N-GPU run without its collectives, a floor for it, not a measurement of
several GPUs. Rank 0's slices are the widest (the others' are the same size or padding). Every step trains on MNIST
($RAWGPU_DATA or --data-dir) from the recipe's initial parameters, as a run does (at the GPU's power limit the time
depends on the values). Timed as scripts/bench.py times (benchmarks.training's step_alone_us): CUDA events around
replays of a graph of steps, median of trials. --long: the tensor-parallel step's long form. --batch: the recipe's
batch instead. --kernels: each kernel of the rank's step alone too.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.timing import time_graph
from benchmarks.training import RECIPES, NoSums, rawgpu_recipe, step_alone_us
from rawgpu.cli.common import check_data_options, count
from rawgpu.kernels import Kernels
from rawgpu.runtime.errors import run_cli
from rawgpu.steps import StepOptions, plan_model


def kernel_times(model, stream, repeats: int, trials: int, title: str) -> None:
    """Each kernel launch of the model's step alone, `repeats` to a graph: its own time, without the overlap with the
    kernel before it that the step's chain allows (so the parts add up to more than the step)."""
    print(f"# {title}", flush=True)
    parts = []
    for launch in model.step_launches(1):
        if not hasattr(launch, "kernel"):  # an all-reduce left out
            continue
        us = time_graph(stream, lambda: [launch.run(stream) for _ in range(repeats)], repeats, trials)
        parts.append(us)
        print(f"#   {launch.kernel.name:<34} grid {'x'.join(map(str, launch.grid)):<12} {us:8.2f} us", flush=True)
    print(f"#   {len(parts)} kernels, their sum {sum(parts):.1f} us", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=count(1), nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--ranks", type=count(1), nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--recipe", nargs="+", choices=tuple(RECIPES), default=["seed", "default"])
    p.add_argument("--long", action="store_true", help="the tensor-parallel step's long form")
    p.add_argument("--parallel", choices=("tensor", "data"), default="tensor")
    p.add_argument("--batch", type=count(1), default=None)
    p.add_argument("--steps", type=count(1), default=20, help="steps per graph")
    p.add_argument("--trials", type=count(1), default=10)
    p.add_argument("--data-dir", default=None, help="MNIST directory (default: $RAWGPU_DATA, the cache, download)")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel of the rank's step alone, repeated in a graph (where the step's time goes)")
    args = p.parse_args(argv)
    check_data_options(p, None, args.data_dir)
    return run_cli(lambda: run(args), "rank_step")


def run(args) -> int:
    from rawgpu.data.datasets import load_mnist
    from rawgpu.runtime.driver import Device, Stream

    mnist = load_mnist(args.data_dir)
    device = Device(0)
    kernels, stream = Kernels(device.arch), Stream()
    options = StepOptions(short=not args.long, l2_bytes=device.l2_bytes)
    print(f"# {device.name} ({device.arch}); one rank's step ({args.parallel} parallel) without its all-reduces, us "
          f"per step, median of {args.trials} x {args.steps} steps")
    print(f"{'recipe':>8} {'H':>6} {'one GPU':>9} " + " ".join(f"{f'{n} ranks':>16}" for n in args.ranks))
    for name in args.recipe:
        r = RECIPES[name]
        for h in args.hidden:
            recipe = rawgpu_recipe(h, {**r, "batch": args.batch or r["batch"]}, 1000, 0)
            one = plan_model(recipe, kernels=kernels, sm_count=device.sm_count, options=options).allocate()
            try:
                base = step_alone_us(one, stream, args.steps, args.trials, mnist)
            finally:
                one.arena.close()
            cells = []
            for n in args.ranks:
                m = plan_model(recipe, args.parallel, kernels=kernels, sm_count=device.sm_count, options=options,
                               ranks=n, group=NoSums()).allocate()
                try:
                    t = step_alone_us(m, stream, args.steps, args.trials, mnist)
                    if args.kernels:
                        kernel_times(m, stream, args.steps, args.trials, f"{name} H={h}, rank 0 of {n}: {t:.1f} us")
                finally:
                    m.arena.close()
                cells.append(f"{t:9.1f} ({base / t:4.2f}x)")
            print(f"{name:>8} {h:>6} {base:9.1f} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
