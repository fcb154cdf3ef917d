"""Where the cluster step's time goes: per-mark GPU time of cu/cluster_step.cu.

Builds the kernel with -DCS_PROFILE (CTA 0 stamps %globaltimer at every mark: after its own work in a phase, and
after each barrier), trains the benchmark workload (batch 32, lr 0.003, plain SGD) on MNIST for --steps steps in one
launch, and prints the median time that closes at each mark, over the steps after the first 20. A mark after a
barrier includes the wait for the slowest CTA.

    python dev/cluster_phases.py --hidden 128 [--layers 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rawgpu.runtime.errors import RawgpuError
from rawgpu.kernels import cluster as kc
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import Recipe
from rawgpu.steps import plan_model

from fused_phases import add_profile_args, at_least, profiling_setup  # beside this script: its folder is on the path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p, [128])
    p.add_argument("--layers", type=at_least(1), default=3)
    args = p.parse_args(argv)
    try:
        dev, stream, kernels, module, data, perm = profiling_setup(kc.SOURCE, "-DCS_PROFILE", args.data_dir)
        names = kc.marks(args.layers)
        for h in args.hidden:
            recipe = Recipe(hidden=h, layers=args.layers, batch=32, lr=0.003, momentum=0.0, schedule="constant")
            model = plan_model(recipe, "cluster", kernels=kernels, sm_count=dev.sm_count).allocate()
            model.upload_data(data)
            model.init_parameters(stream)
            model.set_permutation(perm)
            plan = model.step.plan
            arena = Arena()
            stamps = arena.tensor("stamps", 3 + args.steps * len(names), np.uint64)
            arena.allocate()
            arena.zero()
            model.step.table.upload(model.step.param_table(stamps.ptr))
            profiled = module.kernel(plan.kernel, kc.SIGNATURE)
            profiled.bind(plan.ctas, kc.THREADS, plan.smem_bytes, model.step.table, args.steps, cluster=plan.ctas).run(stream)
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
