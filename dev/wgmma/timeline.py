"""Where the time of a warpgroup-MMA tile goes (gemm_wgmma.cu's gemm_wgmma, the tiles one CTA each: wg128, wg256,
wg256mc, ...): the planned (or named) x^T @ dy with its update, built with every CTA's first consumer warpgroup
stamping %globaltimer and its SM clock at its start, its first k-tile landed, the end of its multiply and of its
epilogue, and summing its waits on k-tiles. The stamped build is checked bit for bit against the product's first.

    PYTHONPATH=.:scripts:dev python dev/wgmma/timeline.py [--shapes 4096x4096x4096 ...] [--optimizer sgd adam]
                                                          [--config wg256mc] [--trials 10]

Per shape: the product's and the stamped build's us per launch; the CTAs' starts on the global clock (how many
waves); a CTA's medians, thousands of cycles: its start to its first k-tile, its multiply (and of it the waits on
k-tiles), its epilogue; the multiply's rate while it runs (all SMs at that rate); the grid's end after the median
CTA's. The ping-pong tile has its own timeline (dev/pingpong/limits.py --timeline). Not part of the product
(dev/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

import variants  # dev/variants.py: run with PYTHONPATH=.:scripts:dev
from benchmarks.gemm import gemm_shape
from benchmarks.timing import copies_for, time_graph
from rawgpu.cli.common import count
from rawgpu.contract.gemm import CONFIGS, GEMM_WGMMA_SOURCE
from rawgpu.kernels import gemm as G
from rawgpu.runtime import driver
from rawgpu.runtime.compiler import unit_of
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

_spec = importlib.util.spec_from_file_location("pingpong_run", Path(__file__).parent.parent / "pingpong" / "run.py")
_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_run)  # dev/pingpong/run.py: the operands of x^T @ dy with its update, the sm_90 check
Weights = _run.Weights

MAX_CTAS, FIELDS = 8192, 8  # CTAs stamped (by linear index), words each: FIELD's names
FIELD = {"start_ns": 0, "start": 1, "first": 2, "waits": 3, "multiplied": 4, "end": 5, "end_ns": 6, "sm": 7}
STAMP_DEFS = """__device__ unsigned long long rg_gt[%d * %d];  // dev/wgmma/timeline.py: stamps of each CTA
RG_DEVICE unsigned long long rg_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t));
    return t;
}
""" % (MAX_CTAS, FIELDS)
STAMPER = """\
        const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned long long* rg_rec = rg_gt + cta * %d;
        const bool rg_stamp = wg != Cfg::PRODUCER && consumer == 0 && t == 0 && cta < %d;
        unsigned long long rg_waits = 0;
        if (rg_stamp) {
            unsigned sm;
            asm volatile("mov.u32 %%0, %%%%smid;" : "=r"(sm));
            rg_rec[7] = sm;
            rg_rec[1] = clock64();
            rg_rec[0] = rg_now_ns();
        }
""" % (FIELDS, MAX_CTAS)


def end(indent: int) -> str:
    """The epilogue's last stamps, at an exit of gemm_wgmma indented so."""
    pad = " " * indent
    return (f"{pad}if (rg_stamp) {{\n{pad}    rg_rec[5] = clock64();\n{pad}    rg_rec[6] = rg_now_ns();\n{pad}}}\n")


EDITS = {1: [
    ("template <class Cfg, int LA, int LB, int EPI, bool ACC16>\nRG_DEVICE void gemm_wgmma(",
     STAMP_DEFS + "template <class Cfg, int LA, int LB, int EPI, bool ACC16>\nRG_DEVICE void gemm_wgmma("),
    ("        pdl_enter();  // A (and the epilogue's inputs) may come from the kernel before (pdl.cuh)\n",
     "        pdl_enter();  // A (and the epilogue's inputs) may come from the kernel before (pdl.cuh)\n" + STAMPER),
    ("            mbar_wait(&full[s], (kt / STAGES) & 1);\n",
     "            const unsigned long long rg_t0 = clock64();\n"
     "            mbar_wait(&full[s], (kt / STAGES) & 1);\n"
     "            if (rg_stamp) {\n"
     "                const unsigned long long rg_t1 = clock64();\n"
     "                if (kt == 0) rg_rec[2] = rg_t1;\n"
     "                rg_waits += rg_t1 - rg_t0;\n"
     "            }\n"),
    ("        wg_wait<0>();\n        wg_hold(d);  // no read of the sums above the wait\n",
     "        wg_wait<0>();\n        wg_hold(d);  // no read of the sums above the wait\n"
     "        if (rg_stamp) {\n            rg_rec[3] = rg_waits;\n            rg_rec[4] = clock64();\n        }\n"),
    ("                staged_epilogue<Cfg, EPI>(p, tiles, bias_tile, d, consumer, warp, lane, m0 + rows, n0);\n",
     "                staged_epilogue<Cfg, EPI>(p, tiles, bias_tile, d, consumer, warp, lane, m0 + rows, n0);\n" + end(16)),
    ("                staged_update<Cfg, EPI>(p, o, tiles, d, consumer, warp, lane, m0 + rows, n0);\n",
     "                staged_update<Cfg, EPI>(p, o, tiles, d, consumer, warp, lane, m0 + rows, n0);\n" + end(16)),
    ("                    epilogue_pair<EPI>(p, o, row, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], x, y, z);\n"
     "                }\n            }\n        }\n",
     "                    epilogue_pair<EPI>(p, o, row, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], x, y, z);\n"
     "                }\n            }\n        }\n" + end(8))]}
CONFIG_CHOICES = sorted(c for c in CONFIGS if CONFIGS[c].wgmma and not CONFIGS[c].pingpong)


def stamped_text() -> str:
    return variants.masked(GEMM_WGMMA_SOURCE, EDITS, 1)


def bind(kernels, device, opt: str, w: Weights, M: int, N: int, K: int, optim, config: str | None):
    states = len(w.states)
    plan = G.plan_gemm(M, N, K, "cr", opt, "f32", sm_count=device.sm_count, arch=device.arch, states=states,
                       config=config, capacity=G.cluster_capacity(kernels))
    launch = G.gemm(kernels, plan, w.A, w.B, w.lo, mom=w.states[0], var=w.states[1] if states > 1 else None,
                    w16=w.w16, optim=optim)
    return plan, launch


def shape(device, stream, rng, M: int, N: int, K: int, opt: str, config: str | None, trials: int) -> bool:
    states = 2 if opt == "adam" else 1
    kernels = {"product": variants.VariantKernels(device.arch, GEMM_WGMMA_SOURCE, None),
               "stamped": variants.VariantKernels(device.arch, GEMM_WGMMA_SOURCE, stamped_text())}
    with Arena() as arena:
        (w,), optim = _run.operand_sets(arena, rng, opt, M, N, K, 1, 1e-2)
        before, outs = w.snapshot(), {}
        for side, k in kernels.items():
            w.restore(before)
            plan, launch = bind(k, device, opt, w, M, N, K, optim, config)
            if plan.config.pingpong:
                print(f"{opt} {M}x{N}x{K}: planned on the ping-pong tile; its timeline: dev/pingpong/limits.py "
                      f"--timeline, or pass --config")
                return True
            launch.run(stream)
            stream.synchronize()
            outs[side] = w.snapshot()
        diff = [int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8))) for a, b in zip(outs["product"],
                                                                                           outs["stamped"])]
        if any(diff):
            print(f"{opt} {M}x{N}x{K}: the stamped build's bytes differ from the product's {diff}: no timeline")
            return False
    per_copy = 2 * (M + N) * K + M * N * (4 + 4 * states)
    copies = copies_for(per_copy, device.l2_bytes, cap=16)
    us = {}
    with Arena() as arena:
        sets, optim = _run.operand_sets(arena, rng, opt, M, N, K, copies, 1e-6)
        for side, k in kernels.items():
            binds = [bind(k, device, opt, w, M, N, K, optim, config)[1] for w in sets]
            us[side] = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(20)], 20, trials)
        module = kernels["stamped"].modules[unit_of(GEMM_WGMMA_SOURCE, binds[0].kernel.name)]
        address, nbytes = module.global_address("rg_gt")
        driver.copy_host_to_device(address, np.zeros(nbytes // 8, np.uint64))
        binds[0].run(stream)
        stream.synchronize()
        host = np.zeros(nbytes // 8, np.uint64)
        driver.copy_device_to_host(host, address)
    rec = host.astype(np.int64).reshape(MAX_CTAS, FIELDS)
    rec = rec[rec[:, FIELD["start_ns"]] > 0]
    report(opt, M, N, K, plan, us, rec, device.sm_count)
    return True


def report(opt, M, N, K, plan, us, rec, sm_count) -> None:
    f = {name: rec[:, i] for name, i in FIELD.items()}
    t0 = f["start_ns"].min()
    starts, ends = (f["start_ns"] - t0) / 1e3, (f["end_ns"] - t0) / 1e3  # us from the first CTA's start
    ghz = np.median((f["end"] - f["start"]) / np.maximum(f["end_ns"] - f["start_ns"], 1))
    first_end = ends.min()
    concurrent = int((starts < first_end).sum())
    k = lambda v: f"{np.median(v) / 1e3:.1f}"  # noqa: E731
    multiply = f["multiplied"] - f["first"]
    busy = f["multiplied"] - f["start"] - f["waits"]  # the multiply less its waits on k-tiles
    flops = 2 * plan.config.bm * plan.config.bn * min(K, plan.k_chunk)  # a CTA's (a split's K)
    rate = flops / (np.median(busy) / ghz) * 1e-3 * sm_count  # TFLOP/s if all SMs ran at it
    print(f"{opt} {M}x{N}x{K} on {plan.config.name} (split {plan.splits}): product {us['product']:.1f} us, "
          f"stamped {us['stamped']:.1f}; {len(rec)} CTAs, {concurrent} at once (waves {len(rec) / concurrent:.2f}); "
          f"starts at {', '.join(f'{q:.1f}' for q in np.quantile(starts, [0, .25, .5, .75, 1]))} us "
          f"(quartiles); SM clock {ghz:.2f} GHz")
    print(f"  a CTA, kcycles (medians): start to its first k-tile {k(f['first'] - f['start'])}, multiply "
          f"{k(multiply)} (waits on k-tiles {k(f['waits'])}), epilogue {k(f['end'] - f['multiplied'])}; the "
          f"multiply less its waits at {rate:.0f} TFLOP/s over {sm_count} SMs; the grid ends "
          f"{ends.max() - np.median(ends):.1f} us after the median CTA", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", metavar="MxNxK", default=[(4096, 4096, 4096)])
    p.add_argument("--optimizer", nargs="+", choices=("sgd", "adam"), default=["sgd"])
    p.add_argument("--config", choices=CONFIG_CHOICES, help="a tile instead of the planned one")
    p.add_argument("--trials", type=count(1), default=10)
    args = p.parse_args(argv)
    for M, N, K in args.shapes:
        if M % 8 or N % 8:
            p.error(f"{M}x{N}x{K}: M and N must be multiples of 8 (the copy engine's rows)")
    stamped_text()  # the edits still find their places (a moved piece: one line)
    return run_cli(lambda: run(args), "wgmma timeline")


def run(args) -> int:
    if (device := _run.hopper("wgmma timeline")) is None:
        return 1
    stream = driver.Stream()
    rng = np.random.default_rng(0)
    ok = True
    for M, N, K in args.shapes:
        for opt in args.optimizer:
            ok &= shape(device, stream, rng, M, N, K, opt, args.config, args.trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
