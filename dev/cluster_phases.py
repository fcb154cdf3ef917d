"""Where the cluster step's time goes: per-mark GPU time of cu/cluster_step.cu.

Builds the kernel with its `// mark next` comments made stamps (dev/variants.py: CTA 0 stamps %globaltimer at every
mark: after its own work in a phase, and after each barrier), trains the benchmark workload (batch 32, lr 0.003, plain SGD) on MNIST for --steps steps in one
launch, and prints the median time that closes at each mark, over the steps after the first 20. A mark after a
barrier includes the wait for the slowest CTA.

    python dev/cluster_phases.py --hidden 128 [--layers 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import variants  # beside this script: its folder is on the path
from fused_phases import add_profile_args, at_least, profiling_setup
from rawgpu.runtime.errors import RawgpuError
from rawgpu.kernels import cluster as kc
from rawgpu.model.recipe import Recipe
from rawgpu.steps import plan_model


def marks(layers: int) -> list[str]:
    """What each `// mark next` of cu/cluster_step.cu closes in one step (the time since the previous one), in kernel
    order; the kernel's first mark, its start, comes before them."""
    out = []
    for i in range(layers):
        out += [f"forward {i}" + (" (+ convert, gather)" if i == 0 else "") + " + stores", f"receive h{i}"]
    out += ["head loss", "head dy"]
    for i in range(layers - 1, 0, -1):
        out += [f"partial dx {i}", f"update {i}" + (" + head" if i == layers - 1 else ""), "receive partials",
                f"collect dy {i - 1}"]
    out.append("update 0" + (" + head" if layers == 1 else ""))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p, [128])
    p.add_argument("--layers", type=at_least(1), default=3)
    args = p.parse_args(argv)
    try:
        names = marks(args.layers)
        dev, stream, kernels, module, data, perm = profiling_setup(kc.SOURCE, args.data_dir, 1 + args.steps * len(names))
        for h in args.hidden:
            recipe = Recipe(hidden=h, layers=args.layers, batch=32, lr=0.003, momentum=0.0, schedule="constant")
            model = plan_model(recipe, "cluster", kernels=kernels, sm_count=dev.sm_count).allocate()
            model.upload_data(data)
            model.init_parameters(stream)
            model.set_permutation(perm)
            plan = model.step.plan
            variants.clear_marks(module)
            profiled = module.kernel(plan.kernel)
            profiled.bind(plan.ctas, kc.THREADS, plan.smem_bytes, model.step.table, args.steps, cluster=plan.ctas).run(stream)
            stream.synchronize()
            times, cycles = variants.read_marks(module)
            times, cycles = times[:1 + args.steps * len(names)], cycles[:1 + args.steps * len(names)]
            ghz = (cycles[-1] - cycles[0]) / (times[-1] - times[0])  # SM cycles per ns over the launch
            t = np.diff(times).reshape(args.steps, len(names))[20:]
            med = np.median(t, axis=0) / 1e3
            print(f"\n{dev.name}: H={h}, {args.layers} hidden layers, {plan.ctas} CTAs x {plan.n} columns: "
                  f"{med.sum():.2f} us per step (medians per mark); SM clock {ghz:.2f} GHz")
            for name, us in zip(names, med):
                print(f"  {name:<26} {us:6.2f} us")
            model.arena.close()
    except (RawgpuError, ValueError) as exc:
        print(f"cluster_phases: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
