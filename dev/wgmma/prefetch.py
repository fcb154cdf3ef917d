"""Experiment: the weight update's operands (the master's halves, the optimiser's state) of a one-CTA-a-tile warpgroup
GEMM (wg256mc, ...) prefetched into L2 during the tile's last k-tiles, so that its epilogue, which runs with the tensor
cores idle, reads them from L2 instead of DRAM (issue 65: x^T @ dy with its update within 5% of cuBLAS's plain GEMM).

    PYTHONPATH=.:scripts:dev python dev/wgmma/prefetch.py [--shapes MxNxK ...] [--ahead 0 8 16 32] [--optimizer sgd]
                                                          [--trials 20] [--sustained S]

The producer's thread, at k-tile k_tiles - AHEAD and the 7 after it, issues an eighth of the tile's rows of each array
as bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, one a row and array; nothing waits for them); AHEAD 0: the
product's own build. Checks first that each build leaves the product's bytes (w16, lo, states) from the same start on
the planned tile at a few shapes, edge tiles included. Then times the planned GEMM of each shape (M x N the weight,
K the batch) with each build beside cuBLAS's plain x^T @ dy (PyTorch), CUDA events around graphs of 20 launches
rotating over copies beyond the L2, median of trials; --sustained S replays each graph S seconds first (docs/perf.md:
Power). Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

import variants  # dev/variants.py: run with PYTHONPATH=.:scripts:dev
from benchmarks.gemm import bench_torch, gemm_shape
from benchmarks.timing import copies_for, time_graph
from rawgpu.cli.common import count
from rawgpu.contract import GEMM_WGMMA_SOURCE
from rawgpu.kernels import gemm as G
from rawgpu.model.recipe import Option, argument_type
from rawgpu.runtime import driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

_spec = importlib.util.spec_from_file_location("pingpong_run", Path(__file__).parent.parent / "pingpong" / "run.py")
_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_run)  # dev/pingpong/run.py: operand sets, the sm_90 check

HELPER = r'''
// dev/wgmma/prefetch.py: the tile's update operands into L2, an eighth of its rows a call (slice 0..7)
RG_DEVICE void bulk_prefetch_l2(const void* at, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(reinterpret_cast<u64>(at)), "r"(bytes) : "memory");
}
template <class Cfg, int EPI>
RG_DEVICE void prefetch_update_rows(const Params& p, int m0, int n0, int slice) {
    const int cols = min(Cfg::BN, p.N - n0), per = Cfg::BM / 8;
    for (int r = slice * per; r < (slice + 1) * per && m0 + r < p.M; ++r) {
        const i64 at = (i64)(m0 + r) * p.ldc + n0;
        bulk_prefetch_l2(p.w16 + at, cols * 2);
        bulk_prefetch_l2(static_cast<const short*>(p.out) + at, cols * 2);
        if (p.mom) bulk_prefetch_l2(p.mom + at, cols * 4);
        if (EPI == EPI_ADAM) bulk_prefetch_l2(p.var + at, cols * 4);
    }
}

'''
ENTRY = "template <class Cfg, int LA, int LB, int EPI, bool ACC16>\nRG_DEVICE void gemm_wgmma("
LOOP_END = ("                        tma_load_2d_hinted(a + Cfg::A_BYTES, mapB, k, n0, &full[s], hint_b);\n"
            "                    }\n")


def prefetch(ahead: int) -> str:
    """The producer loop's addition: at k-tile k_tiles - ahead and the 7 after it, a slice of the rows each."""
    return ("                    if constexpr (EPI_UPDATES(EPI)) {  // dev/wgmma/prefetch.py\n"
            f"                        const int slice = kt - max(0, k_tiles - {ahead});\n"
            "                        if (!split && slice >= 0 && slice < 8)\n"
            "                            prefetch_update_rows<Cfg, EPI>(p, m0, n0, slice);\n"
            "                    }\n")


def variant_text(ahead: int) -> str | None:
    """gemm_wgmma.cu with the prefetch AHEAD k-tiles before the last (0: None, the product's own build)."""
    if ahead == 0:
        return None
    return variants.patch(variants.source_text(GEMM_WGMMA_SOURCE),
                          [(ENTRY, HELPER + ENTRY), (LOOP_END, LOOP_END + prefetch(ahead))], GEMM_WGMMA_SOURCE)


def kernels_for(arch: str, ahead: int) -> variants.VariantKernels:
    return variants.VariantKernels(arch, GEMM_WGMMA_SOURCE, variant_text(ahead))


def check(device, stream, rng, opt: str, ahead: int) -> bool:
    """The variant leaves the product's bytes from the same start (the planned tile; wg256mc forced at edge shapes)."""
    ok = True
    for (M, N, K), config in (((1000, 776, 200), "wg256mc"), ((1000, 776, 4096), "wg256mc"),
                              ((4096, 4096, 4096), None)):
        with Arena() as arena:
            ws = arena.tensor("ws", (1 << 22,), np.float32)  # a planned split's
            tickets = arena.tensor("tickets", (1 << 14,), np.int32)
            (w,), optim = _run.operand_sets(arena, rng, opt, M, N, K, 1, 1e-2)  # allocates the arena
            before, outs, name = w.snapshot(), [], ""
            for kernels in (kernels_for(device.arch, 0), kernels_for(device.arch, ahead)):
                w.restore(before)
                plan, launch = _run.product_launch(kernels, device, opt, w, M, N, K, optim, ws, tickets, config,
                                                   1 if config else None)
                launch.run(stream)
                stream.synchronize()
                outs.append(w.snapshot())
                name = f"{plan.config.name}/{plan.splits}"
        diff, changed, good = _run.same_update(outs, before)
        print(f"check {opt} ahead {ahead} {M}x{N}x{K} ({name}): differing bytes vs the product's (w16, lo, states) "
              f"{diff}, {changed} lo changed {'ok' if good else 'FAIL'}", flush=True)
        ok &= good
    return ok


def timing(device, stream, rng, shapes, opt: str, aheads, trials: int, sustained: float) -> None:
    how = f"each after {sustained:g} s of its replays" if sustained else "bursts"
    print(f"# {device.name}: us per launch, median of {trials} graph replays ({how}); cuBLAS: plain fp16 x^T @ dy")
    states = 2 if opt == "adam" else 1
    for M, N, K in shapes:
        per_copy = 2 * (M + N) * K + M * N * (4 + 4 * states)
        copies = copies_for(per_copy, device.l2_bytes, cap=16)
        cells = []
        with Arena() as arena:
            ws = arena.tensor("ws", (1 << 22,), np.float32)  # a planned split's
            tickets = arena.tensor("tickets", (1 << 14,), np.int32)
            sets, optim = _run.operand_sets(arena, rng, opt, M, N, K, copies, 1e-6)  # allocates the arena
            for ahead in aheads:
                kernels, binds, plan = kernels_for(device.arch, ahead), [], None
                for w in sets:
                    plan, b = _run.product_launch(kernels, device, opt, w, M, N, K, optim, ws, tickets)
                    binds.append(b)
                if plan.splits > 1 or plan.config.name == G.PINGPONG_CONFIG:
                    cells.append(f"{plan.config.name}/{plan.splits}: not this experiment's tile (split or ping-pong)")
                    break
                us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(20)], 20, trials,
                                sustained)
                cells.append(f"{plan.config.name} ahead {ahead:3d} {us:8.2f}")
        cub = bench_torch("dw", M, N, K, 20, trials, device.l2_bytes, sustained)
        if cub is not None:
            cells.append(f"cuBLAS plain {cub:8.2f}")
        print(f"{opt} {M}x{N}x{K}: " + " | ".join(cells), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", metavar="MxNxK",
                   default=[(4096, 4096, 4096), (8192, 8192, 4096), (4096, 4096, 8192)])
    p.add_argument("--ahead", type=count(0), nargs="+", default=[0, 8, 16, 32], metavar="K_TILES")
    p.add_argument("--optimizer", choices=("sgd", "adam"), nargs="+", default=["sgd"])
    p.add_argument("--trials", type=count(1), default=20)
    p.add_argument("--sustained", type=argument_type("--sustained", Option(None, float, 0.0, 3600.0)), default=0.0,
                   metavar="S", help="replay each graph S seconds before timing it (default 0: bursts)")
    args = p.parse_args(argv)
    for M, N, K in args.shapes:
        if N % 8 or M % 8:
            p.error(f"{M}x{N}x{K}: M and N must be multiples of 8 (the copy engine's rows)")
    return run_cli(lambda: run(args), "wgmma prefetch")


def run(args) -> int:
    if (device := _run.hopper("wgmma prefetch")) is None:
        return 1
    stream, rng = driver.Stream(), np.random.default_rng(0)
    for opt in args.optimizer:
        if not all(check(device, stream, rng, opt, a) for a in args.ahead if a):
            print("wgmma prefetch: a check failed; no timing", file=sys.stderr)
            return 1
        timing(device, stream, rng, args.shapes, opt, args.ahead, args.trials, args.sustained)
    return 0


if __name__ == "__main__":
    sys.exit(main())
