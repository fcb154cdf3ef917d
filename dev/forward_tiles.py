"""The forward GEMMs of a training step (x @ W + b, ReLU) at one batch size, with every tile config that has the
instance: which tile streams a batch of B rows past a weight fastest.

    python dev/forward_tiles.py [--sizes 256 1024 4096] [--batch 128] [--configs 128x128 64x128 ...] [--splits 2 4]
                                [--shapes MxNxK ...] [--epilogue store|bias_act] [--cublas]

Timed as bench.py gemm times (benchmarks.gemm.bench_ours: a CUDA graph of launches over operand copies past the L2,
each launch overlapping the one before on sm_90, the median of the trials), split-K as the plan chooses it (or each
of --splits, in a cluster where every cluster is resident). --shapes: these GEMMs instead of the sizes' (a rank's
slices of a model on several GPUs, say: N or K a fraction of H). --cublas: torch.matmul's time for each shape beside
(a plain product: compare it with --epilogue store).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.gemm import bench_ours, bench_torch, gemm_shape, open_gpu
from benchmarks.timing import copy_bandwidth
from rawgpu.cli.common import count
from rawgpu.runtime.errors import run_cli
from rawgpu.kernels import gemm as G


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=count(1), nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batch", type=count(1), default=128)
    p.add_argument("--configs", nargs="+", default=["128x128", "64x128", "32x128", "32x128k64", "stream", "tma",
                                                     "tma128"], choices=sorted(G.CONFIGS))
    p.add_argument("--splits", type=count(1), nargs="+", default=[None], help="split-K counts to try")
    p.add_argument("--launches", type=count(1), default=20)
    p.add_argument("--trials", type=count(1), default=15)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", default=None, metavar="MxNxK",
                   help="GEMMs of M rows, N outputs, K inputs instead of --sizes and --batch")
    p.add_argument("--epilogue", default="bias_act", choices=("store", "bias_act"), help="default: bias_act")
    p.add_argument("--cublas", action="store_true", help="time torch.matmul on each shape too")
    args = p.parse_args(argv)
    return run_cli(lambda: run(args), "forward_tiles")


def run(args) -> int:
    if (gpu := open_gpu(0, args.configs, "forward_tiles")) is None:
        return 2
    device, stream, kernels, rng = gpu
    bw = copy_bandwidth(stream)
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}; forward GEMMs ({args.epilogue}), us per launch")
    shapes = args.shapes or [(args.batch, h, fin) for h in args.sizes for fin in sorted({784, h})]
    for m, n, k in shapes:
        default = G.plan_gemm(m, n, k, "rr", args.epilogue, sm_count=device.sm_count, arch=device.arch,
                              capacity=G.cluster_capacity(kernels))
        line = f"{m}x{n}x{k:<5} default {default.config.name}/{default.splits}:"
        for cfg in args.configs:
            if (cfg, "rr", args.epilogue) not in G.INSTANCES:
                continue
            for split in args.splits:
                us, splits = bench_ours(device, stream, kernels, "fwd", m, n, k, "rr", args.epilogue,
                                        args.launches, args.trials, rng, config=cfg, split=split,
                                        overlap=G.sm90_or_later(device.arch))
                line += f"  {cfg}/{splits} {us:.2f}"
        if args.cublas and (us := bench_torch("fwd", m, n, k, args.launches, args.trials, device.l2_bytes)):
            line += f"  cublas {us:.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
