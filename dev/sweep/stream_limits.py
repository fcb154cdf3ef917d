"""What limits the models step's streamed first-layer update (cu/dx_update.cu's update_stream_body): the kernel timed
over N models' 784 x H first layer with parts of its chunk loop taken out, each a variant built here
(dev/variants.py; its results are then wrong):

    1 the gradient (G = x^T @ dy)   2 the optimiser's arithmetic   4 the write-back   8 the weights' and state's loads
    16 the barrier before the write-back   64 the bias's sums and step   128 the x and dy tiles' loads
    32 (a change, not a cut; alone or with 1, 8, 64 or 128) the write-back by the bulk copy engine, a row of each
       array a copy (cp.async.bulk from shared memory), instead of the block's threads: the same results
    256 (a change, as 32) each thread's stepped pairs stored from its registers straight to global memory: no
       round trip through shared memory, no barrier before the write-back; the same results

    PYTHONPATH=.:scripts:dev python dev/sweep/stream_limits.py [--models 32 128 8] [--hidden 256 128 1024]
                                                             [--optimizer sgd adam] [--masks 0 1 2 3 4 16 19 12 32]

Each line: us per launch, and the % of copy bandwidth the whole kernel's bytes (16 a weight with momentum, 24 with
Adam) would reach in that time. On an H200 (docs/history.md, 2026-11-29) the write-back by the block's threads is
the largest part, and with no weight traffic at all (12) a chunk still takes 2.3 us against the 2.0 its share of
DRAM takes whole: 64 and 128 split that rest between the bias, the x and dy loads and the chain itself.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import variants  # dev/variants.py: run with PYTHONPATH=.:scripts:dev
from benchmarks.timing import copy_bandwidth, time_graph
from rawgpu.cli.common import count
from rawgpu.contract import DX_UPDATE_MODELS_SOURCE, OPTIM_WORDS
from rawgpu.kernels import dx_update as U
from rawgpu.kernels import model_axis as km
from rawgpu.model import master, optimizer
from rawgpu.model.recipe import Recipe
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

INPUTS = 784  # the models step's first layer: MNIST's pixels
PARTS = {1: "gradient", 2: "update", 4: "write-back", 8: "weight loads", 16: "write-back barrier", 64: "bias",
         128: "x and dy loads"}
BULK = 32  # the write-back by the bulk copy engine (EDITS[BULK]); it rewrites what 2, 4 and 16 cut
DIRECT = 256  # the write-back from the update's registers (EDITS[DIRECT]); the same pieces as BULK
CHANGES = {BULK: "bulk write-back", DIRECT: "write-back from registers"}  # bits that change, not cut: checked first
# update_chunk's step, each pair stored where it lives in global memory (rows from i0, columns from n; none at or past
# IN, N) instead of back into the stage
DIRECT_BODY = """template <bool ADAM, int GF, class Row, class Col>
RG_DEVICE void update_chunk_direct(const float (&gacc)[GF][4], const half_t* w, const short* wl, const float* ms,
                                   const float* vs, bool has_m, const Optim& o, Row g_row, Col g_col, int g, int t,
                                   half_t* w16, short* wlo, float* mw, float* vw, int ldw, int i0, int n, int IN,
                                   int N) {
    using namespace dxu;
#pragma unroll
    for (int f = 0; f < GF; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = g_row(f) + g + 8 * h, col = g_col(f) + 2 * t;
            if (i0 + r >= IN || n + col >= N) continue;
            u32 hi2 = *reinterpret_cast<const u32*>(w + r * LDW + col);
            u32 lo2 = *reinterpret_cast<const u32*>(wl + r * LDW + col);
            float2 wv = master_join2(hi2, lo2);
            const float2 grad = make_float2(gacc[f][2 * h], gacc[f][2 * h + 1]);
            const i64 at = (i64)(i0 + r) * ldw + n + col;
            float2 m = has_m ? *reinterpret_cast<const float2*>(ms + r * LDS + col) : make_float2(0.f, 0.f);
            if (ADAM) {
                float2 v = *reinterpret_cast<const float2*>(vs + r * LDS + col);
                optim_adam2(wv, grad, m, v, o);
                *reinterpret_cast<float2*>(vw + at) = v;
            } else {
                optim_sgd2(wv, grad, m, o);
            }
            if (has_m) *reinterpret_cast<float2*>(mw + at) = m;
            master_split2(wv, hi2, lo2);
            *reinterpret_cast<u32*>(w16 + at) = hi2;
            *reinterpret_cast<u32*>(wlo + at) = lo2;
        }
}

"""
# bit -> the pieces of update_stream_body it changes (variants.patch: each must occur in cu/dx_update.cu once)
EDITS = {
    1: [("            issue_gradient_wgmma<BB, GN>(gacc, sx, y, wn);\n", ""),
        ("if constexpr (!SW) gradient_mma<BB, GMT, LDX, LDY>(gacc, sx, y, wm, wn, r8, q1, q2);", "")],
    2: [("        update_chunk<ADAM>(gacc, w, wl, ms, vs, has_m, o, g_row, g_col, g, t);\n        __syncthreads();\n"
         "        const i64 z = k.model * zW;",
         # the gradient kept: its accumulators read in a store that never runs
         variants.keep_gradient("ms", "        ") + "        __syncthreads();\n        const i64 z = k.model * zW;")],
    4: [("        store_chunk<ADAM, THREADS>(w, wl, ms, vs, has_m, w16 + z,",
         "        if (false) store_chunk<ADAM, THREADS>(w, wl, ms, vs, has_m, w16 + z,")],
    8: [("    auto load_weights = [&](int s, const Chunk& k) {\n",
         "    auto load_weights = [&](int s, const Chunk& k) {\n        return;  // taken out\n")],
    16: [("        __syncthreads();\n        const i64 z = k.model * zW;", "        const i64 z = k.model * zW;")],
    64: [("        const bool bias_here = bias != nullptr && k.n / BN * bands / per_band == k.band;\n",
          "        const bool bias_here = false;  // taken out\n")],
    128: [("    auto load_inputs = [&](int s, const Chunk& k) {  // written by the kernels before: after pdl_enter\n",
           "    auto load_inputs = [&](int s, const Chunk& k) {  // written by the kernels before: after pdl_enter\n"
           "        return;  // taken out\n")],
    BULK: [("    for (int c = 0; c < count; ++c) {\n        cp_async_wait<STAGES - 2>();\n",
            "    for (int c = 0; c < count; ++c) {\n"
            "        if (tid < BM) asm volatile(\"cp.async.bulk.wait_group.read 0;\" ::: \"memory\");  // c - 1 read\n"
            "        cp_async_wait<STAGES - 2>();\n"),
           ("        update_chunk<ADAM>(gacc, w, wl, ms, vs, has_m, o, g_row, g_col, g, t);\n        __syncthreads();\n"
            "        const i64 z = k.model * zW;\n"
            "        store_chunk<ADAM, THREADS>(w, wl, ms, vs, has_m, w16 + z, wlo + z, mw ? mw + z : mw, vw ? vw + z : vw, "
            "ldw,\n"
            "                                   k.band * BM, k.n, IN, N, tid, hi_policy, lo_policy);\n    }\n"
            "    cp_async_wait<0>();\n}",
            "        update_chunk<ADAM>(gacc, w, wl, ms, vs, has_m, o, g_row, g_col, g, t);\n"
            "        fence_proxy_async();  // the update's writes, before the copy engine reads them\n"
            "        __syncthreads();\n"
            "        const i64 z = k.model * zW;\n"
            "        if (tid < BM && k.band * BM + tid < IN) {  // row tid of the chunk, by the bulk copy engine\n"
            "            const int cols = min(BN, N - k.n);\n"
            "            const i64 at = z + (i64)(k.band * BM + tid) * ldw + k.n;\n"
            "            auto put = [&](const void* to, const void* from, int bytes) {\n"
            "                asm volatile(\"cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\"\n"
            "                             :: \"l\"(to), \"r\"(shared_address(from)), \"r\"(bytes) : \"memory\");\n"
            "            };\n"
            "            put(w16 + at, w + tid * LDW, 2 * cols);\n"
            "            put(wlo + at, wl + tid * LDW, 2 * cols);\n"
            "            if (has_m) put(mw + at, ms + tid * LDS, 4 * cols);\n"
            "            if (ADAM) put(vw + at, vs + tid * LDS, 4 * cols);\n"
            "            asm volatile(\"cp.async.bulk.commit_group;\" ::: \"memory\");\n"
            "        }\n    }\n"
            "    cp_async_wait<0>();\n"
            "    if (tid < BM) asm volatile(\"cp.async.bulk.wait_group 0;\" ::: \"memory\");"
            "  // stored before the end\n}")],
    DIRECT: [("// DXU_MODELS (dx_update_models.cu sets it", DIRECT_BODY + "// DXU_MODELS (dx_update_models.cu sets it"),
             ("        update_chunk<ADAM>(gacc, w, wl, ms, vs, has_m, o, g_row, g_col, g, t);\n        __syncthreads();\n"
              "        const i64 z = k.model * zW;\n"
              "        store_chunk<ADAM, THREADS>(w, wl, ms, vs, has_m, w16 + z, wlo + z, mw ? mw + z : mw, vw ? vw + z : vw, "
              "ldw,\n"
              "                                   k.band * BM, k.n, IN, N, tid, hi_policy, lo_policy);\n",
              "        const i64 z = k.model * zW;\n"
              "        update_chunk_direct<ADAM>(gacc, w, wl, ms, vs, has_m, o, g_row, g_col, g, t, w16 + z, wlo + z,\n"
              "                                  mw ? mw + z : mw, vw ? vw + z : vw, ldw, k.band * BM, k.n, IN, N);\n")],
}


def ablated(mask: int) -> str:
    """dx_update_models.cu's text (the model axis over dx_update.cu) with the parts of `mask` taken out."""
    return "#define DXU_MODELS 1\n" + variants.masked(U.SOURCE, EDITS, mask)


def ablated_kernels(arch: str, mask: int):
    """The package's kernels with the streamed update's parts of `mask` taken out (its own builds untouched)."""
    return variants.VariantKernels(arch, DX_UPDATE_MODELS_SOURCE, ablated(mask) if mask else None)


def describe(mask: int) -> str:
    parts = [name for bit, name in PARTS.items() if mask & bit]
    how = ", ".join(name for bit, name in CHANGES.items() if mask & bit)
    cut = "no " + ", ".join(parts) if parts else ""
    return ", ".join(filter(None, (how, cut))) or "whole"


def time_masks(device, stream, rng, n: int, h: int, opt: str, masks, batch: int, launches: int, trials: int):
    """(mask, us per launch) of the streamed update of n models' INPUTS x h layer, one block an SM."""
    recipe = Recipe(optimizer="adam") if opt == "adam" else Recipe(momentum=0.9)
    plan = U.plan_dx_update(batch, INPUTS, h, recipe.optimizer, device.arch, splits=1, cluster=False, dx=False,
                            roles=1)
    out = []
    with Arena() as arena:
        x = arena.tensor("x", (n * batch, INPUTS), np.float16)
        dy = arena.tensor("dy", (n * batch, h), np.float16)
        w16, wlo = arena.tensor("w16", (n * INPUTS, h), np.float16), arena.tensor("wlo", (n * INPUTS, h), np.int16)
        states = [arena.tensor(f"s{i}", (n * INPUTS, h), np.float32) for i in range(recipe._state_tensors)]
        bias = arena.tensor("b", (n * h,), np.float32)
        bstates = [arena.tensor(f"sb{i}", (n * h,), np.float32) for i in range(recipe._state_tensors)]
        optim = arena.tensor("optim", (n, OPTIM_WORDS), np.float32)
        arena.allocate()
        arena.zero()
        bias.upload(rng.standard_normal(n * h).astype(np.float32) * 0.1)
        x.upload((rng.standard_normal((n * batch, INPUTS)) * 0.5).astype(np.float16))
        dy.upload((rng.standard_normal((n * batch, h)) * 0.5).astype(np.float16))
        hi, lo = master.split((rng.standard_normal((n * INPUTS, h)) * 0.05).astype(np.float32))
        w16.upload(hi)
        wlo.upload(lo)
        words = optimizer.words(optimizer.step_values(optimizer.hyperparameters(recipe), 3, 1e-2))
        optim.upload(np.tile(words, (n, 1)))
        mw, vw = (states + [None, None])[:2]
        mb, vb = (bstates + [None, None])[:2]
        arrays = [w16, wlo, bias, *states, *bstates]
        def launch_of(mask: int):
            return km.update_stream(ablated_kernels(device.arch, mask), n, plan, x, dy, wlo, w16, mw, vw, optim, bias,
                                    mb, vb, device.sm_count)

        same = {bit: check_change(stream, arrays, launch_of, bit) for bit in CHANGES if any(m & bit for m in masks)}
        for mask in masks:
            if not all(same[bit] for bit in CHANGES if mask & bit):
                continue
            launch = launch_of(mask)
            out.append((mask, time_graph(stream, lambda: [launch.run(stream) for _ in range(launches)], launches,
                                         trials)))
    return out


def check_change(stream, arrays, launch_of, bit: int) -> bool:
    """Whether the change `bit` (CHANGES) leaves every array the bytes the product's kernel leaves, from the same
    start; printed either way."""
    before = [t.download().copy() for t in arrays]
    results = []
    for mask in (0, bit):
        for t, v in zip(arrays, before):
            t.upload(v)
        launch_of(mask).run(stream)
        stream.synchronize()
        results.append([t.download().copy() for t in arrays])
    for t, v in zip(arrays, before):
        t.upload(v)
    diff = [int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8))) for a, b in zip(*results)]
    moved = int(np.count_nonzero(results[0][1] != before[1]))
    good = not any(diff) and moved > 0
    print(f"check {CHANGES[bit]}: differing bytes vs the product's (w16, lo, bias, states) {diff}, {moved} lo "
          f"changed {'ok' if good else 'FAIL: not timed'}", flush=True)
    return good


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=count(1), nargs="+", default=[32, 128, 8])
    p.add_argument("--hidden", type=count(8), nargs="+", default=[256, 128, 1024],
                   help="the layer's width, one per --models (zipped: 32 x 256, 128 x 128, 8 x 1024)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), nargs="+", default=["sgd"])
    p.add_argument("--masks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 16, 19, 12, 32],
                   help="bit sets of the parts taken out (1-16, 64, 128) and the changes (32: the bulk write-back, 256:"
                        " the write-back from registers); 0: the whole kernel")
    p.add_argument("--batch", type=count(1), default=128)
    p.add_argument("--launches", type=count(1), default=10)
    p.add_argument("--trials", type=count(1), default=15)
    args = p.parse_args(argv)
    if len(args.models) != len(args.hidden):
        p.error("--models and --hidden pair up: give as many of each")
    if any(h % 8 for h in args.hidden):
        p.error("--hidden must be multiples of 8 (the copy engine's rows)")
    if any(not 0 <= m < 512 for m in args.masks):
        p.error("--masks are bit sets of 1, 2, 4, 8, 16, 32, 64, 128 and 256 (0..511)")
    rewritten = {BULK: 2 | 4 | 16 | DIRECT, DIRECT: 2 | 4 | 16 | BULK}  # a change, and the bits that edit its text
    if any(m & bit and m & others for bit, others in rewritten.items() for m in args.masks):
        p.error("--masks: 32 and 256 (the write-back changed) combine with 1, 8, 64 and 128 only, not each other")
    if args.batch > U.MAX_BATCH:
        p.error(f"--batch must be <= {U.MAX_BATCH} (the one-pass backward's largest batch tile)")
    return run_cli(lambda: run(args), "stream_limits")


def run(args) -> int:
    from rawgpu.runtime.driver import Device, Stream

    device, stream = Device(0), Stream()
    bw = copy_bandwidth(stream)
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}; one block an SM; us per launch "
          "(% of copy at the whole kernel's bytes)")
    for opt in args.optimizer:
        per_weight = {"sgd": 16, "adam": 24}[opt]
        for n, h in zip(args.models, args.hidden):
            if not km.streams_update(device.arch, args.batch, opt):
                print(f"stream_limits: {device.arch} builds no streamed update for this tile", file=sys.stderr)
                return 1
            for mask, us in time_masks(device, stream, np.random.default_rng(0), n, h, opt, args.masks, args.batch,
                                       args.launches, args.trials):
                pct = 100 * per_weight * n * INPUTS * h / (us * 1e3) / bw
                print(f"{opt:>4} {n:>4} x {INPUTS} x {h:<5} mask {mask:>2} {describe(mask):<52} {us:8.2f} us "
                      f"({pct:3.0f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
