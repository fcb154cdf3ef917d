"""What limits the product's ping-pong tile (gemm_wgmma.cu's gemm_pingpong, "wgpp": x^T @ dy with its update): the
planned kernel timed with parts taken out, each a variant of gemm_wgmma.cu built here (dev/variants.py; its results
are then wrong):

    1 the multiply (the consumers' wgmma)   2 the update's arithmetic   4 the update's TMA stores
    8 the update's TMA loads (master halves and state)   16 the k-tiles' TMA loads (A and B; Adam's build then
      spills 4 bytes)
    16384 B's second 64-column panel of each k-tile (the multiply reads what the stage held): the k-tiles' bytes
       through each SM's copy engine less a quarter, what a pair of CTAs sharing B by multicast would save
    32768 the multiply of the tile's second 64 rows (half the tensor cores' work and their reads of shared
       memory): whether the update's chain slows beside a multiply for its reads
    131072, 262144 the update's stores' or loads' DRAM traffic: each CTA stores to (loads from) its first chunk's
       place, in L2, every time (the copy engine's operations stay): whether the memory or the engine delays the
       k-tiles
    32, 64, 128 (changes, not cuts): the update's compiler barrier after every 2 pairs, every 4, or none (the
       product's: after each pair, so that few registers live beside the 128 accumulators); the same arithmetic
    256, 512, 1024 (changes: L2 hints, the same results): the update's TMA loads evict first (not with 8), its TMA
       stores evict first (not with 4), A's and B's k-tiles evict last (not with 16): the update's 268 MB at 4096 x
       4096 stream through an L2 that should keep the 16 MB of A and B every tile re-reads
    8192 (a change, the same results): the update's loads by the loading warp's 32 lanes with cp.async (16-byte
       pieces into the same swizzled planes, zeros past the edges) instead of the copy engine, which keeps the
       k-tiles and the stores (within the loading warp's 24 registers it spills 4-16 bytes, reloaded once a chunk)
    65536 (a change, the same results): each pair's update with the next pair's operands already loaded (4-6
       registers more), so that their shared-memory latency passes under this pair's arithmetic
    524288, 1048576 (changes, the same results): the loading warp prefetches into L2 (the copy engine's bulk
       prefetch, nothing lands in shared memory) the update's operands of the chunk 4 (a tile) or 8 (two tiles)
       after the one it loads: whether the k-tiles come late behind the update loads' misses to DRAM
    4096 (stamps, the same results): each consumer warpgroup of block 0 stamps its SM clock at each tile's waits,
       multiply, epilogue and chunks; --timeline prints them for each of --masks' builds (cycles, medians of 5
       launches; SGD: Adam's build spills 16-76 bytes with them)

    PYTHONPATH=.:scripts:dev python dev/pingpong/limits.py [--shapes 4096x4096x1024 ...] [--optimizer sgd adam]
                                                          [--masks 0 1 17 14 2 4 8 12] [--timeline]
                                                          [--buffers STAGES EBUFS]

--buffers sizes SGD's two rings instead of the product's (contract/gemm.py: the wgpp config's stages and
PINGPONG_BUFFERS): k-tile stages of 32 KB and epilogue buffers of 32 KB, within one block's shared memory.

Each line: us per launch and the % of copy bandwidth the update's bytes (16 a weight with momentum, 24 with Adam)
reach in that time. 17 (no k-tiles, no multiply) is the epilogue alone, 14 (no update traffic or arithmetic) the
multiply alone: if the whole kernel takes about their sum, the update does not hide under the multiply; if the
epilogue alone is already far from the copy rate, its own chain (a chunk's wait, update and fence) is the limit, not
the overlap.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

import variants  # dev/variants.py: run with PYTHONPATH=.:scripts:dev
from benchmarks.gemm import gemm_shape
from benchmarks.timing import copies_for, copy_bandwidth, time_graph
from rawgpu.cli.common import count
from rawgpu.contract import gemm as contract_gemm
from rawgpu.contract.arch import STATIC_RESERVE, block_smem_limit
from rawgpu.contract.gemm import GEMM_WGMMA_SOURCE
from rawgpu.kernels import gemm as G
from rawgpu.runtime import driver
from rawgpu.runtime.compiler import unit_of
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

_spec = importlib.util.spec_from_file_location("pingpong_run", Path(__file__).with_name("run.py"))
_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_run)  # dev/pingpong/run.py, the experiment's operands however this file is loaded
Weights = _run.Weights

TIMELINE = 4096
TILES_STAMPED, STAMPS = 32, 16  # a warpgroup's first tiles, the stamps of each (STAMP_NAMES: where, by index)
STAMP_NAMES = {0: "before the multiply's turn", 1: "multiply issued from", 2: "multiply done",
               3: "epilogue's turn", **{4 + 2 * q: f"chunk {q} loaded" for q in range(4)},
               **{5 + 2 * q: f"chunk {q} updated" for q in range(4)}, 12: "epilogue done"}
STAMP_DEFS = """__device__ unsigned long long rg_pp[2 * %d * %d];  // dev/pingpong/limits.py: SM clock stamps
#define PP_STAMP(n, k)                                                                    \\
    do {                                                                                  \\
        if (t == 0 && blockIdx.x == 0 && (n) < %d) rg_pp[(c * %d + (n)) * %d + (k)] = clock64(); \\
    } while (0)
""" % (TILES_STAMPED, STAMPS, TILES_STAMPED, TILES_STAMPED, STAMPS)

PARTS = {1: "multiply", 2: "update arithmetic", 4: "update stores", 8: "update loads", 16: "k-tile loads",
         16384: "B's second k-tile panel", 32768: "the multiply's second 64 rows",
         131072: "update stores' DRAM traffic", 262144: "update loads' DRAM traffic"}
CHANGES = {32: "barrier every 2 pairs", 64: "barrier every 4 pairs", 128: "no barrier between pairs"}
HINTS = {256: "update loads evict first", 512: "update stores evict first", 1024: "k-tiles evict last",
         TIMELINE: "stamped", 8192: "update loads by cp.async", 65536: "the next pair's operands ahead",
         524288: "update operands into L2 a tile ahead", 1048576: "update operands into L2 two tiles ahead"}
PREFETCH_AHEAD = {524288: 4, 1048576: 8}  # chunks
UPDATE_LOADS = ("                    tma_load_2d(buf, mapW16, c0, r0, &efull[b]);\n"
                "                    tma_load_2d(buf + 8192, mapLo, c0, r0, &efull[b]);\n"
                "                    if (mom) {\n"
                "                        tma_load_2d(buf + 16384, mapMom, 2 * c0, r0, &efull[b]);\n"
                "                        tma_load_2d(buf + 24576, mapMom, 2 * c0 + 64, r0, &efull[b]);\n"
                "                    }\n"
                "                    if (EPI == EPI_ADAM) {\n"
                "                        tma_load_2d(buf + 32768, mapVar, 2 * c0, r0, &efull[b]);\n"
                "                        tma_load_2d(buf + 40960, mapVar, 2 * c0 + 64, r0, &efull[b]);\n"
                "                    }\n")
UPDATE_STORES = ("                    tma_store_2d(mapW16, c0, r0, buf);\n"
                 "                    tma_store_2d(mapLo, c0, r0, buf + 8192);\n"
                 "                    if (mom) {\n"
                 "                        tma_store_2d(mapMom, 2 * c0, r0, buf + 16384);\n"
                 "                        tma_store_2d(mapMom, 2 * c0 + 64, r0, buf + 24576);\n"
                 "                    }\n"
                 "                    if (EPI == EPI_ADAM) {\n"
                 "                        tma_store_2d(mapVar, 2 * c0, r0, buf + 32768);\n"
                 "                        tma_store_2d(mapVar, 2 * c0 + 64, r0, buf + 40960);\n"
                 "                    }\n")
K_TILE_LOADS = ("                    tma_load_2d(a, mapA, m0, k, bar);  // A^T: two panels of 64 k-rows x 64 "
                "m-columns\n"
                "                    tma_load_2d(a + 8192, mapA, m0 + 64, k, bar);\n")
TMA_PREFETCH = """RG_DEVICE void tma_prefetch_2d(const TensorMap* map, int x, int y) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y) : "memory");
}
"""


def prefetch_loads(ahead: int) -> str:
    """UPDATE_LOADS, then the update's operands of the chunk `ahead` after this one into L2."""
    return UPDATE_LOADS + (f"""\
                    if (e + {ahead} < chunks) {{  // the chunk {ahead} ahead: into L2, nothing waits for it
                        corner(e + {ahead}, r0, c0);
                        tma_prefetch_2d(mapW16, c0, r0);
                        tma_prefetch_2d(mapLo, c0, r0);
                        if (mom) {{
                            tma_prefetch_2d(mapMom, 2 * c0, r0);
                            tma_prefetch_2d(mapMom, 2 * c0 + 64, r0);
                        }}
                        if (EPI == EPI_ADAM) {{
                            tma_prefetch_2d(mapVar, 2 * c0, r0);
                            tma_prefetch_2d(mapVar, 2 * c0 + 64, r0);
                        }}
                    }}
""")


HINTED_STORE = """RG_DEVICE void tma_store_2d_policy(const TensorMap* map, int x, int y, const void* src, u64 policy) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(src)), "l"(policy)
                 : "memory");
}
"""
CP_ASYNC_LOADS = """\
                    const int planes = 2 + (mom ? 2 : 0) + (EPI == EPI_ADAM ? 2 : 0);
#pragma unroll 1
                    for (int i = lane; i < planes * 512; i += 32) {  // 16-byte pieces, 8 a row, 64 rows a plane
                        const int a = i / 512, r = i % 512 / 8, piece = i % 8, row = r0 + r;
                        const bool wide = a >= 2;  // the fp32 planes: 32 columns each
                        const int col = wide ? c0 + a % 2 * 32 + piece * 4 : c0 + piece * 8;
                        const u8* base = a == 0 ? reinterpret_cast<const u8*>(p.w16)
                                       : a == 1 ? static_cast<const u8*>(p.out)
                                       : reinterpret_cast<const u8*>(a < 4 ? p.mom : p.var);
                        const bool valid = row < p.M && col < p.N;  // the copy engine's zeros past the edges
                        const u8* src = base + ((i64)(valid ? row : 0) * p.ldc + (valid ? col : 0)) * (wide ? 4 : 2);
                        cp_async_16(buf + a * 8192 + swizzle_128b(r, piece), src, valid);
                    }
                    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];"
                                 :: "r"(shared_address(&efull[b])) : "memory");
"""
PAIR_AHEAD = """\
    const auto at = [&](int k, int plane, int bytes) {  // pair k's two elements in a plane
        const int r = warp * 16 + lane / 4 + 8 * (k % 2), col = k / 2 * 8 + 2 * (lane % 4);
        return plane_at(buf + plane, r, col * bytes);
    };
    u32 hi = *reinterpret_cast<u32*>(at(0, 0, 2)), lo = *reinterpret_cast<u32*>(at(0, 8192, 2));
    float2 m = mom ? *reinterpret_cast<float2*>(at(0, 16384, 4)) : make_float2(0.f, 0.f);
    float2 v = EPI == EPI_ADAM ? *reinterpret_cast<float2*>(at(0, 32768, 4)) : make_float2(0.f, 0.f);
#pragma unroll
    for (int k = 0; k < 16; ++k) {  // pair k: columns 8 (k / 2) on, rows 8 (k % 2) on; its next one's operands ahead
        u32 hi_n = 0, lo_n = 0;
        float2 m_n = make_float2(0.f, 0.f), v_n = make_float2(0.f, 0.f);
        if (k + 1 < 16) {
            hi_n = *reinterpret_cast<u32*>(at(k + 1, 0, 2));
            lo_n = *reinterpret_cast<u32*>(at(k + 1, 8192, 2));
            if (mom) m_n = *reinterpret_cast<float2*>(at(k + 1, 16384, 4));
            if (EPI == EPI_ADAM) v_n = *reinterpret_cast<float2*>(at(k + 1, 32768, 4));
        }
        const int jd = 8 * half + k / 2, h = k % 2;
        float2 w = master_join2(hi, lo), y = m;
        const float2 g = make_float2(d[4 * jd + 2 * h], d[4 * jd + 2 * h + 1]);
        if constexpr (EPI == EPI_SGD) {
            optim_sgd2(w, g, y, o);
        } else {
            float2 z = v;
            optim_adam2(w, g, y, z, o);
            *reinterpret_cast<float2*>(at(k, 32768, 4)) = z;
        }
        if (mom) *reinterpret_cast<float2*>(at(k, 16384, 4)) = y;
        master_split2(w, *reinterpret_cast<u32*>(at(k, 0, 2)), *reinterpret_cast<u32*>(at(k, 8192, 2)));
        asm volatile("" ::: "memory");  // a pair at a time, the next one's loads already issued
        hi = hi_n, lo = lo_n, m = m_n, v = v_n;
    }
}
"""
PAIR_UPDATE = """\
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int jd = 8 * half + jj, r = warp * 16 + lane / 4 + 8 * h, col = jj * 8 + 2 * (lane % 4);
            update_pair<EPI>(reinterpret_cast<u32*>(plane_at(buf, r, col * 2)),
                             reinterpret_cast<u32*>(plane_at(buf + 8192, r, col * 2)),
                             reinterpret_cast<float2*>(plane_at(buf + 16384, r, col * 4)),
                             reinterpret_cast<float2*>(plane_at(buf + 32768, r, col * 4)),
                             make_float2(d[4 * jd + 2 * h], d[4 * jd + 2 * h + 1]), o, mom);
            asm volatile("" ::: "memory");  // a pair at a time: fewer registers live
        }
    }
}
"""
PAIR_BARRIER = ('            asm volatile("" ::: "memory");  // a pair at a time: fewer registers live\n'
                "        }\n    }\n}\n")
EDITS = {
    1: [("            wgmma_n128<TB, TA>(d0, desc_a(a), db);\n"
         "            wgmma_n128<TB, TA>(d1, desc_a(a + 8192), db);\n",
         "            (void)db, (void)desc_a;  // taken out\n")],
    # a store that never runs keeps the multiply: with no accumulator read the compiler drops every wgmma
    2: [("                if (q < 2) pingpong_update<EPI>(buf, d0, q % 2, o, mom, warp, lane);\n"
         "                else pingpong_update<EPI>(buf, d1, q % 2, o, mom, warp, lane);\n",
         "                if (k_tiles < 0) *reinterpret_cast<float*>(buf) = (q < 2 ? d0 : d1)[q];  // taken out\n")],
    4: [(UPDATE_STORES, "                    (void)buf;  // taken out\n")],
    8: [("                    mbar_arrive_expect_tx(&efull[b], 16384 + (mom ? 16384 : 0) + (EPI == EPI_ADAM ? 16384 : "
         "0));\n" + UPDATE_LOADS,
         "                    mbar_arrive(&efull[b]);  // taken out\n"
         "                    (void)buf, (void)r0, (void)c0;\n")],
    16: [("                    mbar_arrive_expect_tx(bar, STAGE);\n" + K_TILE_LOADS +
          "                    tma_load_2d_hinted(a + A_BYTES, mapB, n0, k, bar, hint_b);  // B: two such panels\n"
          "                    tma_load_2d_hinted(a + A_BYTES + 8192, mapB, n0 + 64, k, bar, hint_b);\n",
          "                    mbar_arrive(bar);  // taken out\n")],
    32: [(PAIR_BARRIER, '        }\n        asm volatile("" ::: "memory");\n    }\n}\n')],
    64: [(PAIR_BARRIER, '        }\n        if (jj % 2 == 1) asm volatile("" ::: "memory");\n    }\n}\n')],
    128: [(PAIR_BARRIER, "        }\n    }\n}\n")],
    256: [("                const int chunks = 4 * ((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);\n",
           "                const int chunks = 4 * ((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);\n"
           "                const L2Hint once = l2_hint(-1.f);\n"),
          (UPDATE_LOADS, UPDATE_LOADS.replace("tma_load_2d(", "tma_load_2d_hinted(").replace("]);", "], once);"))],
    512: [("RG_DEVICE void bulk_commit()", HINTED_STORE + "RG_DEVICE void bulk_commit()"),
          (UPDATE_STORES, "                    const u64 once = l2_policy(-1.f);  // made here: no register held\n"
           + UPDATE_STORES.replace("tma_store_2d(", "tma_store_2d_policy(").replace(");", ", once);"))],
    1024: [("                prefetch_tensor_map(mapB);\n                const L2Hint hint_b = l2_hint(keep_b);",
            "                prefetch_tensor_map(mapB);\n                const L2Hint hint_b = l2_hint(1.f);"),
           (K_TILE_LOADS,
            K_TILE_LOADS.replace("tma_load_2d(", "tma_load_2d_hinted(").replace("bar);", "bar, hint_b);"))],
    8192: [("                mbar_init(&efull[e], 1);\n",
             "                mbar_init(&efull[e], 32);  // each lane of the loading warp, its copies landed\n"),
           ("            } else if (tid == 32) {", "            } else if (warp == 1) {"),
           ("                        store(e - EBUFS);\n                        bulk_wait_read<0>();  // its buffer is read: "
            "it may refill\n",
            "                        if (lane == 0) {\n                            store(e - EBUFS);\n"
            "                            bulk_wait_read<0>();\n                        }\n"
            "                        __syncwarp();  // the buffer is read: the lanes may refill it\n"),
           ("                    mbar_arrive_expect_tx(&efull[b], 16384 + (mom ? 16384 : 0) + (EPI == EPI_ADAM ? 16384 : "
            "0));\n" + UPDATE_LOADS, CP_ASYNC_LOADS),
           ("                for (int e = max(0, chunks - EBUFS); e < chunks; ++e) store(e);\n"
            "                bulk_wait<0>();  // every store has landed before the grid ends\n",
            "                for (int e = max(0, chunks - EBUFS); e < chunks; ++e)\n"
            "                    if (lane == 0) store(e);\n"
            "                if (lane == 0) bulk_wait<0>();\n")],
    16384: [("                    mbar_arrive_expect_tx(bar, STAGE);\n",
              "                    mbar_arrive_expect_tx(bar, STAGE - 8192);  // B's second panel taken out\n"),
            ("                    tma_load_2d_hinted(a + A_BYTES + 8192, mapB, n0 + 64, k, bar, hint_b);\n", "")],
    32768: [("            wgmma_n128<TB, TA>(d1, desc_a(a + 8192), db);\n", "")],
    65536: [(PAIR_UPDATE, PAIR_AHEAD)],
    131072: [("                    corner(e, r0, c0);  // the copy engine clips at the edges\n",
              "                    corner(0, r0, c0);  // taken out: every store to this CTA's first chunk (L2)\n")],
    262144: [("                    int r0, c0;\n                    corner(e, r0, c0);\n",
              "                    int r0, c0;\n                    corner(0, r0, c0);  // taken out: from this CTA's first "
              "chunk (L2)\n")],
    **{bit: [("RG_DEVICE void bulk_commit()", TMA_PREFETCH + "RG_DEVICE void bulk_commit()"),
             (UPDATE_LOADS, prefetch_loads(ahead))] for bit, ahead in PREFETCH_AHEAD.items()},
    TIMELINE: [
        ("template <class Cfg, int EPI, bool ACC16>\nRG_DEVICE void gemm_pingpong(",
         STAMP_DEFS + "template <class Cfg, int EPI, bool ACC16>\nRG_DEVICE void gemm_pingpong("),
        ("            if (c == 1 || n > 0) mbar_wait(&order[c], (c == 0 ? n - 1 : n) & 1);  // the other's multiply is "
         "issued\n",
         "            PP_STAMP(n, 0);\n"
         "            if (c == 1 || n > 0) mbar_wait(&order[c], (c == 0 ? n - 1 : n) & 1);\n"
         "            PP_STAMP(n, 1);\n"),
        ("            wg_hold(d1);\n", "            wg_hold(d1);\n            PP_STAMP(n, 2);\n"),
        ("            if (c == 1 || n > 0) mbar_wait(&eorder[c], (c == 0 ? n - 1 : n) & 1);  // the other's epilogue is "
         "done\n",
         "            if (c == 1 || n > 0) mbar_wait(&eorder[c], (c == 0 ? n - 1 : n) & 1);\n"
         "            PP_STAMP(n, 3);\n"),
        ("                mbar_wait(&efull[b], (e / EBUFS) & 1);\n",
         "                mbar_wait(&efull[b], (e / EBUFS) & 1);\n                PP_STAMP(n, 4 + 2 * q);\n"),
        ("                fence_proxy_async();  // this thread's writes, before the copy engine reads them\n",
         "                PP_STAMP(n, 5 + 2 * q);\n                fence_proxy_async();\n"),
        ("            mbar_arrive(&eorder[1 - c]);  // the other warpgroup may run its epilogue\n",
         "            PP_STAMP(n, 12);\n            mbar_arrive(&eorder[1 - c]);\n")],
}


def describe(mask: int) -> str:
    cut = ", ".join(name for bit, name in PARTS.items() if mask & bit)
    how = ", ".join(name for bit, name in {**CHANGES, **HINTS}.items() if mask & bit)
    return ", ".join(filter(None, (how, "no " + cut if cut else ""))) or "whole"


def variant_kernels(arch: str, mask: int) -> variants.VariantKernels:
    """The package's kernels with the ping-pong tile's parts of `mask` taken out (mask 0: the product's own build)."""
    text = variants.masked(GEMM_WGMMA_SOURCE, EDITS, mask) if mask else None
    return variants.VariantKernels(arch, GEMM_WGMMA_SOURCE, text)


def bind(kernels, device, opt: str, w: Weights, M: int, N: int, K: int, optim):
    """The planned-as-wgpp tile of `kernels` on one set of operands."""
    states = len(w.states)
    plan = G.plan_gemm(M, N, K, "cr", opt, "f32", sm_count=device.sm_count, arch=device.arch, states=states,
                       config="wgpp", splits=1, capacity=G.cluster_capacity(kernels))
    return G.gemm(kernels, plan, w.A, w.B, w.lo, mom=w.states[0], var=w.states[1] if states > 1 else None, w16=w.w16,
                  optim=optim)


def one_set(arena, rng, opt: str, M: int, N: int, K: int, lr: float):
    """A fresh set of operands and the optimiser's values at learning rate `lr`, in `arena` (allocated here)."""
    (w,), optim = _run.operand_sets(arena, rng, opt, M, N, K, 1, lr)
    return w, optim


def check_change(device, stream, rng, opt: str, mask: int) -> bool:
    """Whether a mask that only changes (no part taken out) leaves the product's bytes, from the same start, at a
    few shapes (edge tiles included); printed either way."""
    ok = True
    for M, N, K in ((1000, 776, 200), (4096, 4096, 1024)):
        with Arena() as arena:
            w, optim = one_set(arena, rng, opt, M, N, K, 1e-2)
            before = w.snapshot()
            outs = []
            for kernels in (variant_kernels(device.arch, 0), variant_kernels(device.arch, mask)):
                w.restore(before)
                bind(kernels, device, opt, w, M, N, K, optim).run(stream)
                stream.synchronize()
                outs.append(w.snapshot())
        diff, changed, good = _run.same_update(outs, before)
        print(f"check {opt} mask {mask} {M}x{N}x{K}: differing bytes vs the product's (w16, lo, states) {diff}, "
              f"{changed} lo changed {'ok' if good else 'FAIL'}", flush=True)
        ok &= good
    return ok


def timeline(device, stream, rng, M: int, N: int, K: int, opt: str, mask: int = 0, runs: int = 5) -> None:
    """Block 0's consumer warpgroups through their tiles (mask's build, stamped): per tile, thousands of SM cycles
    from the first stamp, then each wait and part, medians of `runs` launches."""
    kernels = variant_kernels(device.arch, mask | TIMELINE)
    with Arena() as arena:
        w, optim = one_set(arena, rng, opt, M, N, K, 1e-6)
        launch = bind(kernels, device, opt, w, M, N, K, optim)
        launch.run(stream)  # built, loaded and warm
        stream.synchronize()
        module = kernels.modules[unit_of(GEMM_WGMMA_SOURCE, launch.kernel.name)]  # the stamped build
        address, nbytes = module.global_address("rg_pp")
        rows = []
        for _ in range(runs):
            driver.copy_host_to_device(address, np.zeros(nbytes // 8, np.uint64))
            launch.run(stream)
            stream.synchronize()
            host = np.zeros(nbytes // 8, np.uint64)
            driver.copy_device_to_host(host, address)
            stamps = host.astype(np.int64).reshape(2, TILES_STAMPED, STAMPS)
            rows.append(np.where(stamps > 0, stamps - stamps[stamps > 0].min(), -1))
    st = np.median(np.stack(rows), axis=0)
    k = lambda v: f"{v / 1e3:6.1f}"  # noqa: E731
    print(f"# {opt} {M}x{N}x{K}, mask {mask} ({describe(mask)}), block 0, kcycles: start, waits for the multiply's "
          f"turn, multiply, waits for the epilogue's turn; each chunk: from the one before (its fence and arrival) to its loads landed / its "
          f"update; the epilogue whole")
    for n in range(TILES_STAMPED):
        for c in range(2):
            r = st[c, n]
            if (r[:13] < 0).any():
                continue
            chunks = " ".join(f"{k(r[4 + 2 * q] - r[3 + 2 * q if q else 3])}/{k(r[5 + 2 * q] - r[4 + 2 * q])}"
                              for q in range(4))
            print(f"  tile {n:2d} wg {c}  at {k(r[0])}  turn {k(r[1] - r[0])}  multiply {k(r[2] - r[1])}  turn "
                  f"{k(r[3] - r[2])}  chunks {chunks}  epilogue {k(r[12] - r[3])}", flush=True)


def time_shape(device, stream, rng, M: int, N: int, K: int, opt: str, masks, trials: int, bw: float) -> None:
    states = 2 if opt == "adam" else 1
    per_copy = 2 * (M + N) * K + M * N * (4 + 4 * states)
    copies = copies_for(per_copy, device.l2_bytes, cap=16)
    weight_bytes = M * N * (8 + 8 * states)  # halves and states, read and written
    with Arena() as arena:
        sets, optim = _run.operand_sets(arena, rng, opt, M, N, K, copies, 1e-6)
        for mask in masks:
            kernels = variant_kernels(device.arch, mask)
            binds = [bind(kernels, device, opt, w, M, N, K, optim) for w in sets]
            launches = 20
            us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(launches)], launches,
                            trials)
            print(f"{opt:>4} {M}x{N}x{K:<6} mask {mask:4d} {describe(mask):<64} {us:8.2f} us "
                  f"({100 * weight_bytes / (us * 1e3) / bw:3.0f}%)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", metavar="MxNxK", default=[(4096, 4096, 1024)])
    p.add_argument("--optimizer", nargs="+", choices=("sgd", "adam"), default=["sgd"])
    p.add_argument("--masks", type=int, nargs="+", default=[0, 1, 17, 14, 2, 4, 8, 12])
    p.add_argument("--trials", type=count(1), default=20)
    p.add_argument("--timeline", action="store_true",
                   help="also print block 0's tiles through time in each mask's build, stamped (SGD only: Adam's "
                        "spills)")
    p.add_argument("--buffers", type=count(1), nargs=2, metavar=("STAGES", "EBUFS"),
                   help="SGD's rings instead of the product's: k-tile stages, epilogue buffers (--optimizer sgd)")
    args = p.parse_args(argv)
    if args.buffers:
        if args.optimizer != ["sgd"]:
            p.error("--buffers sizes SGD's rings: pass --optimizer sgd")
        stages, ebufs = args.buffers
        cfg = replace(contract_gemm.CONFIGS["wgpp"], stages=stages)
        smem = stages * (cfg.bm + cfg.bn) * cfg.bk * 2 + ebufs * contract_gemm.PINGPONG_BUFFERS["sgd"][1] + 1024
        if smem > block_smem_limit("sm_90") - STATIC_RESERVE:
            p.error(f"--buffers {stages} {ebufs}: {smem} bytes of shared memory, more than a block of sm_90 has")
        contract_gemm.CONFIGS["wgpp"] = cfg  # the planner and the generated header both read these
        contract_gemm.PINGPONG_BUFFERS["sgd"] = (ebufs, contract_gemm.PINGPONG_BUFFERS["sgd"][1])
    for mask in args.masks:
        if mask < 0 or mask & ~(sum(PARTS) | sum(CHANGES) | sum(HINTS)) or bin(mask >> 5 & 7).count("1") > 1:
            p.error(f"--masks: {mask} is not a sum of {sorted(PARTS)}, {sorted(HINTS)} and at most one of "
                    f"{sorted(CHANGES)}")
        if mask & 8 and mask & 256 or mask & 4 and mask & 512 or mask & 16 and mask & 1024:
            p.error(f"--masks: {mask} hints what it takes out (8 with 256, 4 with 512, 16 with 1024)")
        if mask & 65536 and mask & (32 | 64 | 128):
            p.error(f"--masks: {mask} changes the pairs' update twice (65536 with 32, 64 or 128)")
        if mask & 131072 and mask & (4 | 512) or mask & 262144 and mask & (8 | 256 | 8192):
            p.error(f"--masks: {mask} moves update traffic it takes out or changes (131072 with 4 or 512, 262144 with "
                    "8, 256 or 8192)")
        if mask & 524288 and mask & 1048576 or mask & (524288 | 1048576) and mask & (8 | 8192 | 262144):
            p.error(f"--masks: {mask} prefetches twice or prefetches loads it takes out, moves or changes (524288 or "
                    "1048576 with each other, 8, 8192 or 262144)")
        if mask & 32768 and mask & 1:
            p.error(f"--masks: {mask} takes out half of the multiply it takes out (32768 with 1)")
        if mask & 16384 and mask & 16:
            p.error(f"--masks: {mask} takes out part of the k-tiles it takes out (16384 with 16)")
        if mask & 8192 and mask & (8 | 256):
            p.error(f"--masks: {mask} changes the update's loads it takes out or hints (8192 with 8 or 256)")
    for M, N, K in args.shapes:
        if M % 8 or N % 8:
            p.error(f"{M}x{N}x{K}: M and N must be multiples of 8 (the copy engine's rows)")
    for mask in set(args.masks) - {0}:  # every variant's text before the GPU (a moved piece: one line)
        variants.masked(GEMM_WGMMA_SOURCE, EDITS, mask)
    return run_cli(lambda: run(args), "pingpong limits")


def run(args) -> int:
    if (device := _run.hopper("pingpong limits")) is None:
        return 1
    stream = driver.Stream()
    bw = copy_bandwidth(stream)
    rings = contract_gemm.CONFIGS["wgpp"].stages, contract_gemm.PINGPONG_BUFFERS["sgd"][0]
    print(f"# {device.name}; copy {bw:.0f} GB/s; the planned wgpp tile (SGD's rings: {rings[0]} stages, {rings[1]} "
          f"epilogue buffers), us per launch (% of copy at the update's bytes)")
    rng = np.random.default_rng(0)
    changes = [m for m in dict.fromkeys(args.masks) if m and not m & sum(PARTS)]  # results must stay the product's
    if not all([check_change(device, stream, rng, opt, m) for opt in args.optimizer for m in changes]):
        print("pingpong limits: a change altered the results; no timing", file=sys.stderr)
        return 1
    for M, N, K in args.shapes:
        for opt in args.optimizer:
            time_shape(device, stream, rng, M, N, K, opt, args.masks, args.trials, bw)
            if args.timeline and opt == "sgd":
                for mask in dict.fromkeys(m & ~TIMELINE for m in args.masks):
                    timeline(device, stream, rng, M, N, K, opt, mask)
    return 0


if __name__ == "__main__":
    sys.exit(main())
