"""GEMM experiments beside `scripts/bench.py gemm`: the MLP's GEMMs with other tile configs (--variants) and with every
tile config and split count that fits each shape (--sweep: the data behind rawgpu/kernels/gemm.py's choices).

    python dev/gemm_variants.py --variants stream tma [--sizes 256 8192]
    python dev/gemm_variants.py --sweep [--sizes 4096] [--json sweep.json]

Each GEMM is timed as bench.py gemm times it (benchmarks.gemm.bench_ours: a CUDA graph of
--launches launches rotating over operand copies past the L2, the median of --trials replays). Per shape the default
plan comes first (plain: C = A @ B stored in fp16, launched after the launch before; fused: the step's kernel,
launched as the step launches it), then each variant and the sweep's best.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from benchmarks.gemm import bench_ours, min_bytes, mlp_gemms, open_gpu
from benchmarks.timing import copy_bandwidth
from benchmarks.training import HIDDEN
from rawgpu.cli.common import count
from rawgpu.runtime.errors import run_cli
from rawgpu.kernels import gemm as G


def sweep_candidates(M: int, K: int, layout: str, arch: str) -> list[tuple[str, int, bool]]:
    """(config, splits, cluster) triples worth timing for a plain GEMM: every tile compiled for the layout (no taller
    than needed at batch-sized M), each with the split counts that leave every split one k-tile at least, the splits
    meeting in the workspace and, where they can (sm_90), in a cluster's shared memory."""
    out = []
    for name, cfg in G.CONFIGS.items():
        if (name, layout, "store") not in G.INSTANCES or (cfg.tma and not G.sm90_or_later(arch)) or (M <= 32 < cfg.bm):
            continue
        if cfg.wgmma and not G.has_wgmma(arch):
            continue
        k_tiles = -(-K // cfg.bk)
        for s in (1, 2, 3, 4, 6, 8, 12, 16):
            if s == 1 or k_tiles // s >= 1:
                if s == 1 or not (cfg.wgmma or cfg.persistent):  # these split in a cluster (split_k's layout) or not at all
                    out.append((name, s, False))
                if (1 < s <= G.MAX_CLUSTER_SPLITS and G.sm90_or_later(arch) and not cfg.staged and not cfg.persistent
                        and (not cfg.wgmma or layout == cfg.split_k)):
                    out.append((name, s, True))
    return out


def run(args) -> int:
    if (gpu := open_gpu(args.device, args.variants, "gemm_variants")) is None:
        return 2
    device, stream, kernels, rng = gpu
    overlap = G.sm90_or_later(device.arch) and not args.no_overlap  # programmatic dependent launch needs sm_90+
    bw = copy_bandwidth(stream)
    print(f"# {device.name} ({device.arch}, {device.sm_count} SMs, L2 {device.l2_bytes >> 20} MiB), "
          f"{dt.date.today()}; measured copy bandwidth {bw:.0f} GB/s (read + write)")
    print(f"# median of {args.trials} graph replays x {args.launches} launches; batch {args.batch}; fused kernels "
          + ("overlap the launch before" if overlap else "launched after the launch before"))

    def timed(role, M, N, K, layout, epilogue, **kw) -> tuple[float, int]:
        return bench_ours(device, stream, kernels, role, M, N, K, layout, epilogue, args.launches, args.trials,
                          rng, **kw)

    def pct_copy(role, M, N, K, us) -> float:
        return 100 * min_bytes(role, M, N, K, True) / (us * 1e3) / bw

    rows = []
    for h in args.sizes:
        for role, layer, M, N, K, layout, epi in mlp_gemms(h, args.batch):
            plain, splits = timed(role, M, N, K, layout, "store")
            fused, _ = timed(role, M, N, K, layout, epi, overlap=overlap)
            row = dict(hidden=h, role=role, layer=layer, M=M, N=N, K=K, splits=splits, plain_us=plain, fused_us=fused,
                       fused_pct_copy=pct_copy(role, M, N, K, fused))
            print(f"{h:>5} {role:>7} {layer:>10} {f'{M}x{N}x{K}':>17}  default: plain {plain:.2f} us (split {splits}), "
                  f"fused {fused:.2f} us ({row['fused_pct_copy']:.1f}% copy)", flush=True)
            for cfg in args.variants:  # the same GEMM with another tile configuration
                # at batch-sized M only the tiles that cover it in one row of tiles; above BATCH_STREAM_ROWS any
                if (cfg, layout, "store") in G.INSTANCES and (M <= G.CONFIGS[cfg].bm or layout == "cr"
                                                              or M > G.BATCH_STREAM_ROWS):
                    us, sp = timed(role, M, N, K, layout, "store", config=cfg)
                    row[f"plain_us_{cfg}"] = us
                    line = f"      variant {cfg}: plain {us:.2f} us (split {sp})"
                    if (cfg, layout, epi) in G.INSTANCES:
                        us_f, _ = timed(role, M, N, K, layout, epi, config=cfg, overlap=overlap)
                        row[f"fused_us_{cfg}"] = us_f
                        line += f", fused {us_f:.2f} us ({pct_copy(role, M, N, K, us_f):.1f}% copy)"
                    print(line, flush=True)
            if args.sweep:  # every tile and split count for the plain GEMM
                times = {}  # "config/splits", + "c" where the splits meet in a cluster
                for cfg, sp, cl in sweep_candidates(M, K, layout, device.arch):
                    times[f"{cfg}/{sp}{'c' if cl else ''}"], _ = timed(role, M, N, K, layout, "store", config=cfg,
                                                                       split=sp, cluster=cl)
                best = min(times, key=times.get)
                row["sweep"] = times
                fastest = sorted(times.items(), key=lambda kv: kv[1])[:6]
                print(f"      sweep: best {best} {times[best]:.2f} us; " + " ".join(f"{k}={v:.2f}" for k, v in fastest),
                      flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device.name, arch=device.arch, date=str(dt.date.today()),
                                                   copy_gbs=bw, batch=args.batch, rows=rows), indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python dev/gemm_variants.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=count(1), nargs="+", default=list(HIDDEN), help="hidden widths H")
    p.add_argument("--batch", type=count(1), default=32)
    p.add_argument("--launches", type=count(1), default=20)
    p.add_argument("--trials", type=count(1), default=30)
    p.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    p.add_argument("--variants", nargs="*", default=[], choices=sorted(G.CONFIGS), metavar="CONFIG",
                   help=f"time the GEMMs with these tile configs too ({' '.join(sorted(G.CONFIGS))})")
    p.add_argument("--sweep", action="store_true",
                   help="time the plain GEMM with every tile config and split count that fits each shape")
    p.add_argument("--no-overlap", action="store_true",
                   help="launch the fused kernels only after the one before has finished (default on sm_90+: they "
                        "overlap the launch before, programmatic dependent launch, as in the step)")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--quick", action="store_true", help="sizes 256 and 8192, fewer trials")
    args = p.parse_args(argv)
    if not args.variants and not args.sweep:
        p.error("nothing to compare: give --variants CONFIG ... and/or --sweep (bench.py gemm times the default plan)")
    if args.quick:
        args.sizes, args.trials = [256, 8192], 10
    return run_cli(lambda: run(args), "gemm_variants")


if __name__ == "__main__":
    sys.exit(main())
