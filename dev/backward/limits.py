"""What limits the one-pass backward with an optimiser (cu/dx_update.cu) at large H: the kernel timed with parts of
its chunk loop taken out, each a variant of dx_update.cu built here (dev/variants.py; its results are then wrong):

    1 the dx products   2 the G products   4 the optimiser's arithmetic   8 the write-back
    16 the loads of the weights and their state
    32 each 64 x 64 chunk of the weights and state read and written as one contiguous piece (as if stored tile by
       tile: the same bytes in 8-16 KB pieces instead of 64 rows of 128-256 bytes)

    PYTHONPATH=.:scripts:dev python dev/backward/limits.py [--sizes 4096] [--batch 128] [--optimizer sgd adam] [--masks 0 3 7 24]
                                  [--max-stages N]

Each line is one layer shape (H x H with dx, the plan's column ranges and roles) timed as dev/backward_splits.py
times it (benchmarks.gemm.bench_dx_update), once per mask: us per launch and the % of copy bandwidth the full
kernel's weight bytes would reach in that time. If taking the tensor-core work out (3) brings the kernel to the copy
rate, moving it onto Hopper's asynchronous warpgroup MMA can; if the loads and write-back alone (7) stay below it,
its memory path is the limit.
--stream first times stream.cu: the same bytes per weight read and written in place as a plain grid-stride stream
(1, 2 and 4 pieces of each array in flight per thread), the most any structure of the kernel could reach.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from rawgpu import contract
from rawgpu.runtime import driver
from benchmarks.gemm import bench_dx_update, open_gpu
from benchmarks.timing import copy_bandwidth, time_graph
from rawgpu.cli.common import count
from rawgpu.runtime.compiler import compile_file
from rawgpu.runtime.errors import run_cli
from rawgpu.kernels import dx_update as U
from rawgpu.runtime.memory import Arena
import variants  # dev/variants.py: run with PYTHONPATH=.:scripts:dev


PARTS = {1: "dx", 2: "G", 4: "update", 8: "write-back", 16: "weight loads"}
TILED = 32
# bit -> the pieces of cu/dx_update.cu it changes (variants.patch: each must occur there exactly once)
EDITS = {
    1: [("        if (do_dx) {\n", "        if (false) {  // taken out: dx\n")],
    2: [("if (SW && do_update) issue_gradient_wgmma", "if (false) issue_gradient_wgmma"),  # taken out: G
        ("        if (SW) {\n            wg_wait<0>();", "        if (false) {\n            wg_wait<0>();"),
        ("kept here: as a call it changes this kernel's b32 build)\n#pragma unroll 4\n        for (int kk = 0; kk < (SW ? 0 : BB / 16); ++kk)",
         "kept here: as a call it changes this kernel's b32 build)\n#pragma unroll 4\n        for (int kk = 0; kk < 0; ++kk)")],
    # G kept: a store that never runs reads its accumulators (none read, the compiler drops G's multiply too)
    4: [("    using namespace dxu;\n#pragma unroll\n    for (int f = 0; f < GF; ++f)\n#pragma unroll\n"
         "        for (int h = 0; h < 2; ++h) {",
         "    using namespace dxu;\n" + variants.keep_gradient("ms")
         + "    for (int f = 0; f < 0; ++f)\n#pragma unroll\n        for (int h = 0; h < 2; ++h) {")],
    8: [("i < BM * BN / 8; i += THREADS)", "i < 0; i += THREADS)"),
        ("    if (has_m) {\n#pragma unroll 4", "    if (false) {\n#pragma unroll 4")],
    32: [("    auto load_weights = [&](int s, int c) {\n",
          "    auto tile_at = [&](int n) { return ((i64)blockIdx.x * (N / BN) + n / BN) * BM * BN; };\n"
          "    auto load_weights = [&](int s, int c) {\n"),
         ("return (i64)(i0 + r) * ldw + n + col; };",  # store_chunk's: ldw is N in this experiment's arrays
          "return ((i64)blockIdx.x * (ldw / BN) + n / BN) * BM * BN + r * BN + col; };"),
         ("        load_rows<half_t, BM, BN, LDW, THREADS>(sW(s), w16, ldw,",
          "        {\n"
          "            const i64 tile = tile_at(n);\n"
          "            load_rows<half_t, BM, BN, LDW, THREADS>(sW(s), w16 + tile, BN, 0, 0, BM, BN, tid, read_policy);\n"
          "            if (!do_update) return;\n"
          "            load_rows<short, BM, BN, LDW, THREADS>(sL(s), wlo + tile, BN, 0, 0, BM, BN, tid, read_policy);\n"
          "            if (has_m) load_rows<float, BM, BN, LDS, THREADS>(sM(s), mw + tile, BN, 0, 0, BM, BN, tid, normal);\n"
          "            if (ADAM) load_rows<float, BM, BN, LDS, THREADS>(sV(s), vw + tile, BN, 0, 0, BM, BN, tid, normal);\n"
          "            return;\n"
          "        }\n"
          "        load_rows<half_t, BM, BN, LDW, THREADS>(sW(s), w16, ldw,")],
    16: [("auto load_weights = [&](int s, int c) {\n        const int n = n_begin + c * BN;\n",
          "auto load_weights = [&](int s, int c) {\n        const int n = n_begin + c * BN;\n        return;  // taken out\n")],
}


def ablated(mask: int) -> str:
    """cu/dx_update.cu with the parts of `mask` taken out."""
    return variants.masked(U.SOURCE, EDITS, mask)


def ablated_kernels(arch: str, mask: int):
    """The package's kernels with dx_update.cu's parts of `mask` taken out (the package's own builds untouched)."""
    return variants.VariantKernels(arch, U.SOURCE, ablated(mask) if mask else None)


def time_stream(device, stream, opt: str, h: int, launches: int, trials: int) -> list[tuple[int, float]]:
    """(pieces in flight per thread, us per launch) of stream.cu over an h x h layer's master and state."""
    states = 2 if opt == "adam" else 1
    module = driver.Module(compile_file(Path(__file__).parent / "stream.cu", device.arch).cubin)
    n = h * h
    out = []
    with Arena() as arena:
        w16, lo = arena.tensor("w16", n, np.float16), arena.tensor("lo", n, np.int16)
        m, v = arena.tensor("m", n, np.float32), arena.tensor("v", n if states == 2 else 8, np.float32)
        arena.allocate()
        arena.zero()
        for unroll in (1, 2, 4):
            kernel = module.kernel(f"stream_s{states}_u{unroll}", "ppppq")
            launch = kernel.bind(4 * device.sm_count, 512, 0, w16, lo, m, v, n)
            out.append((unroll, time_graph(stream, lambda: [launch.run(stream) for _ in range(launches)],
                                           launches, trials)))
    module.close()
    return out


def describe(mask: int) -> str:
    parts = [name for bit, name in PARTS.items() if mask & bit]
    return ("tiled, " if mask & TILED else "") + ("no " + ", ".join(parts) if parts else "whole")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=count(1), nargs="+", default=[4096])
    p.add_argument("--batch", type=count(1), default=128)
    p.add_argument("--optimizer", choices=("sgd", "adam"), nargs="+", default=["sgd", "adam"])
    p.add_argument("--masks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 7, 8, 24, 31],
                   help="bit sets of the parts taken out, 0..63 (0: the whole kernel)")
    p.add_argument("--stream", action="store_true", help="also time the plain stream of the same bytes (stream.cu)")
    p.add_argument("--max-stages", type=count(1), default=None,
                   help="cap the pipeline's depth below what fits (contract.DXU_MAX_STAGES, for this run only)")
    p.add_argument("--launches", type=count(1), default=20)
    p.add_argument("--trials", type=count(1), default=15)
    args = p.parse_args(argv)
    if any(not 0 <= m < 64 for m in args.masks):
        p.error("--masks are bit sets of 1, 2, 4, 8, 16 and 32 (0..63)")
    if args.batch > U.MAX_BATCH:
        p.error(f"--batch must be <= {U.MAX_BATCH} (the one-pass backward's largest batch tile)")
    if any(h % 64 for h in args.sizes):
        p.error("--sizes must be multiples of 64")
    if args.max_stages is not None:
        if args.max_stages < 2:
            p.error("--max-stages must be at least 2 (the kernel is a pipeline)")
        contract.dx_update.DXU_MAX_STAGES = args.max_stages  # the build and the plan both read it there
    return run_cli(lambda: run(args), "backward_limits")


def run(args) -> int:
    if (gpu := open_gpu(0, [], "backward_limits")) is None:
        return 2
    device, stream, _, rng = gpu
    bw = copy_bandwidth(stream)
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}; pipeline stages at most "
          f"{contract.dx_update.DXU_MAX_STAGES}; us per launch (% of copy at the whole kernel's bytes per weight)")
    for opt in args.optimizer:
        per_weight = {"sgd": 16, "adam": 24}[opt]
        for h in args.sizes:
            if args.stream:
                for unroll, us in time_stream(device, stream, opt, h, args.launches, args.trials):
                    pct = 100 * per_weight * h * h / (us * 1e3) / bw
                    print(f"{opt:>4} {h:>5} x {h:<5} plain stream, {unroll} pieces in flight per thread "
                          f"{us:8.2f} us ({pct:3.0f}%)", flush=True)
            for mask in args.masks:
                us, splits = bench_dx_update(device, stream, ablated_kernels(device.arch, mask), rng, args.batch, h, h,
                                             opt, True, None, args.launches, args.trials)
                pct = 100 * per_weight * h * h / (us * 1e3) / bw
                stages = contract.dxu_stages(U.batch_tile(args.batch), opt, device.arch)
                print(f"{opt:>4} {h:>5} x {h:<5} ranges {splits} stages {stages}  mask {mask:>2} {describe(mask):<40} "
                      f"{us:8.2f} us ({pct:3.0f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
