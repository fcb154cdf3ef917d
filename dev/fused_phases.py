"""Where the fused step's time goes: per-phase GPU time of cu/fused_step.cu, and what one grid barrier costs.

Builds the kernel with its `// mark next` comments made stamps (dev/variants.py: block 0 stamps %globaltimer after
every phase's barrier), trains the benchmark
workload (batch 32, lr 0.003, plain SGD) on MNIST for --steps steps in one launch, and prints the median time of
each phase over the steps after the first 20. A phase's time is its slowest block's work plus the barrier.

    python dev/fused_phases.py --hidden 128 512 1024 [--batch 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import variants  # beside this script: its folder is on the path
from rawgpu.data.datasets import load_mnist
from rawgpu.runtime.driver import Device, Event, Module, Stream
from rawgpu.runtime.errors import RawgpuError
from rawgpu.kernels import Kernels
from rawgpu.kernels import fused as kf
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import TRAIN_ROWS, Recipe
from rawgpu.steps import plan_model


def at_least(low: int):
    """argparse type: an integer >= low (a one-line usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def add_profile_args(p: argparse.ArgumentParser, hidden: list[int]) -> None:
    """The options both phase profilers (this script and cluster_phases.py) take."""
    p.add_argument("--hidden", type=at_least(1), nargs="+", default=hidden)
    p.add_argument("--steps", type=at_least(30), default=200, help="steps timed (the first 20 are warm-up)")
    p.add_argument("--data-dir", default=None)


# n grid barriers and nothing else: what one phase boundary costs (appended to the fused step's variant)
GRID_BARRIERS = """
extern "C" __global__ void grid_barriers(u64* counter, int n) {
    for (int i = 0; i < n; ++i) grid_barrier(counter);
}
"""


def profiling_setup(source: str, data_dir: str | None, marks: int, extra: str = ""):
    """What both phase profilers start from: the device, a stream, the kernel set, `source` with its marks made stamps
    (room for `marks` of them) and `extra` appended, MNIST on the host and a fixed shuffle."""
    dev, stream = Device(0), Stream()
    text = variants.instrument(variants.source_text(source), source) + extra
    module = variants.load(source, text, dev.arch, (f"-DRG_MARKS={marks}",))
    perm = np.random.default_rng(0).permutation(TRAIN_ROWS)
    return dev, stream, Kernels(dev.arch), module, load_mnist(data_dir), perm


def barrier_us(module: Module, stream: Stream, grid: int, n: int = 2000) -> float:
    arena = Arena()
    counter = arena.tensor("counter", 1, np.int64)
    arena.allocate()
    arena.zero()
    launch = module.kernel("grid_barriers", "pi").bind(grid, kf.THREADS, 0, counter, n, cooperative=True)
    launch.run(stream)
    start, end = Event(), Event()
    start.record(stream)
    launch.run(stream)
    end.record(stream)
    us = start.elapsed_ms(end) * 1e3 / n
    arena.close()
    return us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p, [128, 512, 1024])
    p.add_argument("--batch", type=at_least(1), default=32)
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0: the benchmark workload's)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    args = p.parse_args(argv)
    try:
        most = 1 + args.steps * 2 * kf.MAX_LINEAR_LAYERS  # a start, then two phases per linear layer and step
        dev, stream, kernels, module, data, perm = profiling_setup(kf.SOURCE, args.data_dir, most, GRID_BARRIERS)
        profiled = module.kernel(kf.kernel_name(args.optimizer != "sgd"))
        print(f"{dev.name}: one grid barrier over {dev.sm_count} blocks: {barrier_us(module, stream, dev.sm_count):.2f} us")
        for h in args.hidden:
            recipe = Recipe(hidden=h, batch=args.batch, optimizer=args.optimizer, lr=0.003,
                            momentum=args.momentum if args.optimizer == "sgd" else None, schedule="constant")
            model = plan_model(recipe, "fused", kernels=kernels, sm_count=dev.sm_count).allocate()
            model.upload_data(data)
            model.init_parameters(stream)
            model.set_permutation(perm)
            names = [name for name, _, _ in kf.phase_tasks(recipe.batch, model.padded)]
            variants.clear_marks(module)
            grid = model.step.grid()
            profiled.bind(grid, kf.THREADS, kf.smem_bytes(dev.arch), model.step.table, args.steps, cooperative=True).run(stream)
            stream.synchronize()
            times = variants.read_marks(module)[0][:1 + args.steps * len(names)]
            t = np.diff(times).reshape(args.steps, len(names))[20:]
            med = np.median(t, axis=0) / 1e3
            print(f"\nH={h} batch {args.batch}: {med.sum():.1f} us per step (median per phase)")
            for name, us in zip(names, med):
                print(f"  {name:<12} {us:6.2f} us")
            model.arena.close()
    except (RawgpuError, ValueError) as exc:  # ValueError: a recipe the model refuses (e.g. batch > 60000)
        print(f"fused_phases: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
