"""Launch each MLP GEMM of one hidden width a few times, ours and cuBLAS's, for a profiler to read.

Run under Nsight Compute on the device, e.g.
  ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum,... python3 dev/profile_gemm.py
No timing here: scripts/bench.py gemm and dev/gemm_variants.py time; this only gives ncu the kernels, each with cold
caches as ncu leaves them. The launches are scripts/bench.py's (imported as a module).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rawgpu, from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "scripts"))  # bench.py (and its peers package)
sys.path.insert(2, str(Path(__file__).resolve().parent))  # gemm_variants.py, beside this script

import bench  # noqa: E402
from gemm_variants import open_gpu  # noqa: E402
from rawgpu.errors import RawgpuError  # noqa: E402
from rawgpu.kernels import gemm as G  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=bench.positive, default=8192)
    ap.add_argument("--batch", type=bench.positive, default=32)
    ap.add_argument("--roles", nargs="*", default=["fwd", "dx", "dW+sgd"], choices=["fwd", "dx", "dW+sgd"])
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(G.CONFIGS))
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except RawgpuError as exc:
        print(f"profile_gemm: error: {exc}", file=sys.stderr)
        return 1


def run(args) -> int:
    if (gpu := open_gpu(0, args.variants, "profile_gemm")) is None:
        return 2
    device, stream, kernels, rng = gpu
    for role, layer, M, N, K, layout, epi in bench.mlp_gemms(args.hidden, args.batch):
        if role not in args.roles or max(M, N, K) < args.hidden:
            continue
        print(f"{role} {M}x{N}x{K}", flush=True)
        for e in dict.fromkeys((epi, "store")):
            bench.bench_ours(device, stream, kernels, role, M, N, K, layout, e, 1, 1, rng)
        for cfg in args.variants:
            for e in dict.fromkeys((epi, "store")):
                if (cfg, layout, e) in G.INSTANCES and (M <= G.CONFIGS[cfg].bm or layout == "cr"):
                    bench.bench_ours(device, stream, kernels, role, M, N, K, layout, e, 1, 1, rng, config=cfg)
        if not args.no_torch:
            bench.bench_torch(role, M, N, K, 1, 1, device.l2_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
