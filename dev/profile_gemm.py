"""Launch each MLP GEMM of one hidden width a few times, ours and cuBLAS's, for a profiler to read.

Run under Nsight Compute on the device, e.g.
  ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum,... python3 dev/profile_gemm.py
No timing here: scripts/bench.py gemm and dev/gemm_variants.py time; this only gives ncu the kernels, each with cold
caches as ncu leaves them. The launches are scripts/bench.py's (benchmarks.gemm).
"""

from __future__ import annotations

import argparse

from benchmarks.gemm import bench_ours, bench_torch, mlp_gemms, open_gpu
from rawgpu.cli.common import count
from rawgpu.runtime.errors import run_cli
from rawgpu.kernels import gemm as G


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=count(1), default=8192)
    ap.add_argument("--batch", type=count(1), default=32)
    ap.add_argument("--roles", nargs="*", default=["fwd", "dx", "dW+sgd"], choices=["fwd", "dx", "dW+sgd"])
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(G.CONFIGS))
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args), "profile_gemm")


def run(args) -> int:
    if (gpu := open_gpu(0, args.variants, "profile_gemm")) is None:
        return 2
    device, stream, kernels, rng = gpu
    for role, layer, M, N, K, layout, epi in mlp_gemms(args.hidden, args.batch):
        if role not in args.roles or max(M, N, K) < args.hidden:
            continue
        print(f"{role} {M}x{N}x{K}", flush=True)
        for e in dict.fromkeys((epi, "store")):
            bench_ours(device, stream, kernels, role, M, N, K, layout, e, 1, 1, rng)
        for cfg in args.variants:
            for e in dict.fromkeys((epi, "store")):
                if (cfg, layout, e) in G.INSTANCES and (M <= G.CONFIGS[cfg].bm or layout == "cr"
                                                        or M > G.BATCH_STREAM_ROWS):  # as gemm_variants.py
                    bench_ours(device, stream, kernels, role, M, N, K, layout, e, 1, 1, rng, config=cfg)
        if not args.no_torch:
            bench_torch(role, M, N, K, 1, 1, device.l2_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
