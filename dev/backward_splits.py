"""The one-pass backward with an optimiser (kernels/dx_update.py; --optimizer plain: kernels/dx_sgd.py, batch <= 32)
alone, at every column-range count: what plan_dx_update's (plan_dx_sgd's) split rule should be.

    python dev/backward_splits.py [--sizes 256 1024 4096] [--inputs 784] [--batch 128] [--optimizer sgd|adam|plain] [--splits 1 2 4 8]
                                  [--sum cluster workspace] [--roles 1 2]

Each layer shape of a step (--inputs x H without dx, H x H with dx), timed as bench.py times a GEMM: a CUDA graph of
launches over copies of the weights and state past the L2, each overlapping the one before on sm_90, the median of
the trials; the default plan first, then each split count, with the % of copy bandwidth the weight bytes reach;
each line once per way the column ranges add their dx (--sum: in a cluster, through the workspace; cu/one_pass.cuh).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.gemm import bench_dx_sgd, bench_dx_update, open_gpu
from benchmarks.timing import copy_bandwidth
from rawgpu.cli.common import count
from rawgpu.kernels import dx_sgd as D
from rawgpu.kernels import dx_update as U
from rawgpu.model.recipe import cdiv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=count(1), nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batch", type=count(1), default=128)
    p.add_argument("--optimizer", choices=("sgd", "adam", "plain"), default="sgd",
                   help="sgd: with momentum; plain: SGD without state, the batch-32 kernel (kernels/dx_sgd.py)")
    p.add_argument("--inputs", type=count(8), nargs="+", default=[784],
                   help="the first layer's input widths (update alone; default 784, MNIST's)")
    p.add_argument("--splits", type=count(1), nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--sum", nargs="+", choices=("cluster", "workspace"), default=["cluster", "workspace"],
                   help="how the column ranges add their dx (cluster: where the plan can; default both)")
    p.add_argument("--roles", type=int, nargs="+", choices=(1, 2), default=[None],
                   help="1 block per piece for dx and the update, or 2 (blocks of their own); default: the plan's")
    p.add_argument("--launches", type=count(1), default=20)
    p.add_argument("--trials", type=count(1), default=15)
    args = p.parse_args(argv)
    if args.optimizer == "plain" and args.batch > D.MAX_BATCH:
        p.error(f"--optimizer plain runs the batch-{D.MAX_BATCH} kernel: --batch must be <= {D.MAX_BATCH}")
    if any(h % 8 for h in args.sizes):
        p.error("--sizes must be multiples of 8")
    if (gpu := open_gpu(0, [], "backward_splits")) is None:
        return 2
    device, stream, kernels, rng = gpu
    bw = copy_bandwidth(stream)
    per_weight = {"plain": 8, "sgd": 16, "adam": 24}[args.optimizer]
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}, {args.optimizer}; us per launch "
          f"(% of copy at {per_weight} B per weight)")
    for h in args.sizes:
        for IN, with_dx, ways in [(i, False, ["-"]) for i in args.inputs] + [(h, True, args.sum)]:
            chunks = cdiv(h, D.BN if args.optimizer == "plain" else U.BN)
            for way, roles in ((w, r) for w in ways for r in (args.roles if with_dx else [None])):
                line = f"{h:>5} {IN}x{h} {'dx+update' if with_dx else 'update':>9} {way:>9}"
                line += f" roles {roles}:" if roles else ":"
                for s in [None] + [s for s in args.splits if s <= chunks]:
                    cluster = False if way == "workspace" else None  # cluster: wherever the rule lets it
                    if args.optimizer == "plain":
                        us, used = bench_dx_sgd(device, stream, kernels, args.batch, IN, h, args.launches,
                                                args.trials, rng, overlap=True, with_dx=with_dx, splits=s,
                                                cluster=cluster if with_dx else None,
                                                roles=roles if with_dx else None)
                    else:
                        us, used = bench_dx_update(device, stream, kernels, rng, args.batch, IN, h, args.optimizer,
                                                   with_dx, s, args.launches, args.trials, cluster, roles)
                    pct = 100 * per_weight * IN * h / (us * 1e3) / bw
                    line += f"  {'default ' if s is None else ''}{used}: {us:.2f} ({pct:.0f}%)"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
