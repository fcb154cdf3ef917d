"""The forward GEMMs of a training step (x @ W + b, ReLU) at one batch size, with every tile config that has the
instance: which tile streams a batch of B rows past a weight fastest.

    python dev/forward_tiles.py [--sizes 256 1024 4096] [--batch 128] [--configs 128x128 64x128 ...] [--splits 2 4]

Timed as bench.py gemm times (scripts/bench.py bench_ours: a CUDA graph of launches over operand copies past the L2,
each launch overlapping the one before on sm_90, the median of the trials), split-K as the plan chooses it (or each
of --splits, in a cluster where every cluster is resident).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rawgpu, from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "scripts"))  # bench.py

import bench  # noqa: E402
from gemm_variants import open_gpu  # noqa: E402
from rawgpu.kernels import gemm as G  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=bench.positive, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batch", type=bench.positive, default=128)
    p.add_argument("--configs", nargs="+", default=["128x128", "64x128", "32x128", "32x128k64", "stream", "tma",
                                                     "tma128"], choices=sorted(G.CONFIGS))
    p.add_argument("--splits", type=bench.positive, nargs="+", default=[None], help="split-K counts to try")
    p.add_argument("--launches", type=bench.positive, default=20)
    p.add_argument("--trials", type=bench.positive, default=15)
    args = p.parse_args(argv)
    if (gpu := open_gpu(0, args.configs, "forward_tiles")) is None:
        return 2
    device, stream, kernels, rng = gpu
    bw = bench.copy_bandwidth(stream)
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}; forward GEMMs (bias + ReLU), us per launch")
    for h in args.sizes:
        for fin in sorted({784, h}):
            default = G.plan_gemm(args.batch, h, fin, "rr", "bias_relu", sm_count=device.sm_count, arch=device.arch)
            line = f"{h:>5} {args.batch}x{h}x{fin:<5} default {default.config.name:>9}:"
            for cfg in args.configs:
                if (cfg, "rr", "bias_relu") not in G.INSTANCES:
                    continue
                for split in args.splits:
                    us, splits = bench.bench_ours(device, stream, kernels, "fwd", args.batch, h, fin, "rr", "bias_relu",
                                                  args.launches, args.trials, rng, config=cfg, split=split,
                                                  overlap=G.has_tma(device.arch))
                    line += f"  {cfg}/{splits} {us:.2f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
