"""Where the cluster step's time goes: per-mark GPU time of cu/cluster_step.cu.

Builds the kernel with -DCS_PROFILE (CTA 0 stamps %globaltimer at every mark: after its own work in a phase, and
after each barrier), trains the benchmark workload (batch 32, lr 0.003, plain SGD) on MNIST for --steps steps in one
launch, and prints the median time that closes at each mark, over the steps after the first 20. A mark after a
barrier includes the wait for the slowest CTA.

    python scripts/cluster_phases.py --hidden 128 [--layers 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rawgpu import compiler  # noqa: E402
from rawgpu.data import load_mnist  # noqa: E402
from rawgpu.driver import Device, Module, Stream  # noqa: E402
from rawgpu.errors import RawgpuError  # noqa: E402
from rawgpu.kernels import Kernels  # noqa: E402
from rawgpu.kernels import cluster as kc  # noqa: E402
from rawgpu.memory import Arena  # noqa: E402
from rawgpu.mlp import MLP, TRAIN_ROWS, Recipe  # noqa: E402

from fused_phases import at_least  # noqa: E402 - beside this script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=at_least(1), nargs="+", default=[128])
    p.add_argument("--layers", type=at_least(1), default=3)
    p.add_argument("--steps", type=at_least(30), default=200, help="steps timed (the first 20 are warm-up)")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    try:
        dev, stream = Device(0), Stream()
        kernels = Kernels(dev.arch)
        built = compiler.compile_source(kc.SOURCE, dev.arch, ("-DCS_PROFILE",))
        module = Module(built.cubin, built.resources)
        data = load_mnist(args.data_dir)
        perm = np.random.default_rng(0).permutation(TRAIN_ROWS)
        names = kc.marks(args.layers)
        for h in args.hidden:
            recipe = Recipe(hidden=h, layers=args.layers, batch=32, lr=0.003, momentum=0.0, schedule="constant")
            model = MLP(kernels, recipe, dev.sm_count, step="cluster").allocate()
            model.upload_data(data)
            model.init_parameters(stream)
            model.set_permutation(perm)
            plan = model.cluster_plan
            arena = Arena()
            stamps = arena.tensor("stamps", 3 + args.steps * len(names), np.uint64)
            arena.allocate()
            arena.zero()
            model.table.upload(kc.param_table(model, plan, stamps.ptr))
            profiled = module.kernel(plan.kernel, kc.SIGNATURE)
            profiled.bind(plan.ctas, kc.THREADS, plan.smem_bytes, model.table, args.steps, cluster=plan.ctas).run(stream)
            stream.synchronize()
            raw = stamps.download().astype(np.int64)
            times, (c0, c1) = raw[:-2], raw[-2:]
            ghz = (c1 - c0) / (times[-1] - times[0])  # SM cycles per ns over the launch
            t = np.diff(times).reshape(args.steps, len(names))[20:]
            med = np.median(t, axis=0) / 1e3
            print(f"\n{dev.name}: H={h}, {args.layers} hidden layers, {plan.ctas} CTAs x {plan.n} columns: "
                  f"{med.sum():.2f} us per step (medians per mark); SM clock {ghz:.2f} GHz")
            for name, us in zip(names, med):
                print(f"  {name:<26} {us:6.2f} us")
            arena.close()
            model.arena.close()
    except (RawgpuError, ValueError) as exc:
        print(f"cluster_phases: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
