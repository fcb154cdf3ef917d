// Large-M GEMM on sm_90a: C = A @ B on Hopper's warpgroup MMA (wgmma), fed by the tensor copy engine.
//
// Why a third GEMM: above batch 256 the forward (x @ W) and dx (dy @ W^T) GEMMs are arithmetic, and gemm.cu's
// mma.sync tiles run them well below the tensor cores' rate, where wgmma, which reads both operands straight from
// the swizzled shared tiles the copy engine writes and runs asynchronously, reaches cuBLAS's (docs/perf.md: Batches
// above 256).
//
//   Block: three warpgroups (two CTAs an SM: two and a warp). Warpgroup 0 (the warp after them) produces (one thread
//   issues every copy: the 128 x 64 A tile and B's 64 k rows, as gemm_tma.cu loads them, 128-byte swizzled), the two
//   consumer warpgroups each multiply 64 rows of the 128-row tile by BN columns (64, 128 or 256: the 64-column tile
//   gives a small GEMM one wave of twice the CTAs), four m64nBNk16 wgmma per 64-wide k-tile. A stage is released once
//   the wgmma that read it has completed (wgmma.wait_group 1: the k-tile before the current one). B row-major ([K, N],
//   x @ W) is BN / 64 panels of 64 k-rows x 64 columns, read with wgmma's transposed B; B column-major (W^T stored
//   [N, K], dy @ W^T) is BN rows of 64 k. A column-major (x stored [K, M]: the weight gradient x^T @ dy) is two such
//   panels, one per consumer warpgroup, read with wgmma's transposed A. Edges: the copy engine zero-fills outside the
//   matrices; the epilogue writes only inside. The sums of a tile are in one order (K ascending), so results are
//   bitwise reproducible. Split-K for one layout of A per config, within a cluster of 1 x 1 x splits: the 128-column
//   weight gradient (few tiles, a long batch) and the 64-column x @ W of a batch of at most 256 rows (16 tiles at
//   H = 1024: without splits most SMs idle). Each split leaves its partial tile in its own pipeline's shared memory, and
//   finish_cluster_splits adds them in split order and runs the epilogue, spread over the cluster. Only the configs the
//   table marks (SPLIT_A, rawgpu/contract/gemm.py) compile that path: it slowed the unsplit 256-column one
//   (dev/gemm_variants.py). Epilogues: gemm_epilogue.cuh's, through the pipeline's shared memory once the tile's last wgmma
//   are done, so that global memory sees whole 16-byte pieces of rows: staged_epilogue (fp16 and store32; the bias
//   staged under the main loop), staged_update (the weight updates, sgd and adam); per pair of outputs where the planes
//   do not fit (wg128x2's updates) and for a split tile.
// Built for sm_90a only (compiler.py: contract.nvrtc_arch); every other build's body traps (kernels/gemm.py never
// picks these tiles there), as does the fp16-accumulating twin of each instance (fp16 accumulation runs on gemm.cu).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "tma.cuh"
#include "pdl.cuh"
#include "l2.cuh"
#include "cp_async.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RG_WGMMA 1
#include "wgmma.cuh"
#else
#define RG_WGMMA 0
#endif

// CTAS: the CTAs an SM runs at once. With one, warpgroup 0 produces; with two (half the registers a thread), a
// single warp after the two consumer warpgroups does. SPLIT_A: the layout of A (ROW: x @ W, COL: x^T @ dy) whose K may
// split over a cluster, or NO_SPLIT. MC: clusters
// of MC CTAs along M, which share B's k-tiles: each loads every MC-th 64-column panel of a row-major B, or its MC-th
// of a column-major B's rows, into all of them (TMA multicast); a stage refills once the consumers of all of them have
// released it.
constexpr int NO_SPLIT = -1;
template <int BN_, int STAGES_, int CTAS_, int SPLIT_A_, int MC_ = 1>
struct WgConfig {
    static constexpr int BM = 128, BN = BN_, BK = 64, STAGES = STAGES_, CTAS = CTAS_, MC = MC_, SPLIT_A = SPLIT_A_;
    static constexpr bool SPLIT_K = SPLIT_A != NO_SPLIT;
    static_assert(MC == 1 || (CTAS == 1 && !SPLIT_K && (BN / 64) % MC == 0), "multicast: one CTA an SM, whole tiles");
    static constexpr int THREADS = CTAS == 1 ? 384 : 288, PRODUCER = CTAS == 1 ? 0 : 2;  // the producer's warpgroup
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr u32 SMEM = STAGES * STAGE_BYTES + 1024;  // + slack to align the tiles to 1024 bytes
    static_assert(BN == 64 || BN == 128 || BN == 256, "m64n64k16, m64n128k16 or m64n256k16");
};

// Byte b of row r (of a warpgroup's 64) in a plane of its outputs in shared memory: 128-byte chunks of 64 rows, their
// 16-byte pieces swizzled by row.
RG_DEVICE u8* plane_at(u8* plane, int r, int b) {
    return plane + (b / 128) * 8192 + swizzle_128b(r, b % 128 / 16) + b % 16;
}

// The epilogues that write fp16 (store, bias, bias_act, dact) or store32's fp32, after both consumer warpgroups'
// last wgmma (the pipeline's memory is free): each warpgroup writes its 64 x BN outputs into shared memory, 128-byte
// swizzled chunks of 64 rows (a warp's fragment stores then fall in distinct bank groups), and copies them out in
// 16-byte pieces, a warp a row of the tile at a time, so that global memory sees whole lines, not the fragments'
// 16 bytes a row. dact's saved activation comes in by cp.async, into the outputs' place; bias_act's act'(z) (where
// the backward reads it) goes out through a second plane. C's and act's rows are whole 16-byte pieces (N and the
// strides multiples of 8, 16-byte aligned: kernels/gemm.py checks), so a piece is inside or outside whole.
template <class Cfg, int EPI>
RG_DEVICE void staged_epilogue(const Params& p, u8* tiles, const float* bias_tile, const float (&d)[Cfg::BN / 2],
                               int consumer, int warp, int lane, int row0, int n0) {
    constexpr int BN = Cfg::BN, E = EPI == EPI_STORE32 ? 4 : 2, ROW_BYTES = BN * E, PIECES = ROW_BYTES / 16;
    constexpr int PLANE = 64 * ROW_BYTES;  // one warpgroup's outputs
    static_assert((EPI == EPI_BIAS_ACT ? 4 : 2) * PLANE <= Cfg::STAGES * Cfg::STAGE_BYTES, "the planes fit");
    const bool slopes = EPI == EPI_BIAS_ACT && ACT_SAVES_SLOPE && p.act != nullptr;
    u8* out_plane = tiles + consumer * PLANE;
    u8* slope_plane = tiles + (2 + consumer) * PLANE;
    const int t = warp * 32 + lane;
    if constexpr (EPI == EPI_DACT) {  // every piece in flight at once (cp.async), zeros outside the matrix
        const u64 normal = l2_policy(0.f);
#pragma unroll
        for (int c = 0; c < BN / 64; ++c)  // a 128-byte chunk of the rows at a time
            load_rows<half_t, 64, 64, 64, 128, true, true>(reinterpret_cast<half_t*>(out_plane + c * 8192), p.act,
                                                           p.ld_act, row0, n0 + c * 64, p.M, p.N, t, normal);
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("bar.sync %0, 128;" :: "r"(2 + consumer) : "memory");  // this warpgroup's pieces are in
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = j * 8 + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + lane / 4 + 8 * h;
            const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
            u8* o = plane_at(out_plane, r, c * E);
            if constexpr (EPI == EPI_STORE32) {
                *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
            } else {
                float2 x = make_float2(0.f, 0.f);
                if constexpr (EPI == EPI_BIAS || EPI == EPI_BIAS_ACT)
                    x = *reinterpret_cast<const float2*>(bias_tile + c);
                if constexpr (EPI == EPI_DACT) x = unpack_f16x2(*reinterpret_cast<const u32*>(o));
                u32 slope = 0;
                *reinterpret_cast<u32*>(o) = fp16_epilogue2<EPI>(v0, v1, x, &slope);
                if (slopes) *reinterpret_cast<u32*>(plane_at(slope_plane, r, c * E)) = slope;
            }
        }
    }
    asm volatile("bar.sync %0, 128;" :: "r"(2 + consumer) : "memory");  // the warpgroup's outputs are in
    u8* out = static_cast<u8*>(p.out);
    for (int i = t; i < 64 * PIECES; i += 128) {
        const int r = i / PIECES, q = i % PIECES, row = row0 + r, col = n0 + q * (16 / E);
        if (row < p.M && col < p.N) {
            store_16(out + ((i64)row * p.ldc + col) * E, load_16(plane_at(out_plane, r, q * 16)));
            if (slopes) store_16(p.act + (i64)row * p.ld_act + col, load_16(plane_at(slope_plane, r, q * 16)));
        }
    }
}

// One pair of weights' update in shared memory: the master's halves (hi, lo) joined, the optimiser's step with
// gradient g (its states m, v where it keeps them), split back in place. staged_update's and the ping-pong tile's.
template <int EPI>
RG_DEVICE void update_pair(u32* hi, u32* lo, float2* m, float2* v, float2 g, const Optim& o, bool mom) {
    float2 w = master_join2(*hi, *lo), y = mom ? *m : make_float2(0.f, 0.f);
    if constexpr (EPI == EPI_SGD) {
        optim_sgd2(w, g, y, o);
    } else {
        float2 z = *v;
        optim_adam2(w, g, y, z, o);
        *v = z;
    }
    if (mom) *m = y;
    master_split2(w, *hi, *lo);
}

// The weight updates (sgd, adam), the same way, 64 columns at a time: each warpgroup copies the chunk's master halves
// and optimiser state into shared memory (cp.async, 16-byte pieces, the next chunk's in flight during this one's
// arithmetic), updates them there from its accumulators, and writes them back in 16-byte pieces. Where the two
// buffers of both warpgroups do not fit the pipeline's memory (UpdatePlanes::STAGED false), it runs per pair.
template <class Cfg, int EPI>
struct UpdatePlanes {
    static constexpr int STATES = EPI == EPI_ADAM ? 2 : 1;  // fp32 planes: momentum (if any), Adam's second moment
    static constexpr int BUF = 2 * 8192 + STATES * 16384;    // w16 and lo (64 x 64 fp16), the states (64 x 64 fp32)
    static constexpr bool STAGED = 4 * BUF <= Cfg::STAGES * Cfg::STAGE_BYTES;
};

template <class Cfg, int EPI>
RG_DEVICE void staged_update(const Params& p, const Optim& o, u8* tiles, const float (&d)[Cfg::BN / 2], int consumer,
                             int warp, int lane, int row0, int n0) {
    using P = UpdatePlanes<Cfg, EPI>;
    const int t = warp * 32 + lane;
    const bool mom = EPI == EPI_ADAM || p.mom != nullptr;
    const int count = EPI == EPI_ADAM ? 4 : mom ? 3 : 2;
    auto array = [&](int a) -> u8* {  // w16, lo, then the fp32 states (selected, not indexed: no local memory)
        return a == 0 ? reinterpret_cast<u8*>(p.w16) : a == 1 ? static_cast<u8*>(p.out)
             : a == 2 ? reinterpret_cast<u8*>(p.mom) : reinterpret_cast<u8*>(p.var);
    };
    auto size = [](int a) { return a < 2 ? 2 : 4; };
    auto plane = [&](int buf, int a) {  // array a's 64 x 64 in buffer buf: w16, lo, then the fp32 states
        return tiles + (consumer * 2 + buf) * P::BUF + (a < 2 ? a * 8192 : 16384 + (a - 2) * 16384);
    };
    // every 16-byte piece of array a's 64 rows x 64 columns from column c0: fn(row in the plane, byte, global address)
    auto pieces = [&](int a, int c0, auto fn) {
        const int per_row = 64 * size(a) / 16;
#pragma unroll 1
        for (int i = t; i < 64 * per_row; i += 128) {
            const int r = i / per_row, q = i % per_row, row = row0 + r, col = c0 + q * 16 / size(a);
            if (row < p.M && col < p.N) fn(r, q * 16, array(a) + ((i64)row * p.ldc + col) * size(a));
        }
    };
    auto load = [&](int chunk) {  // l2.cuh's rows, a 128-byte chunk at a time: 64 columns of 16 bits or 32 of fp32
        const u64 normal = l2_policy(0.f);
#pragma unroll 1
        for (int a = 0; a < count; ++a)
#pragma unroll 1
            for (int h = 0; h < size(a) / 2; ++h) {
                u8* s = plane(chunk % 2, a) + h * 8192;
                const int c0 = n0 + chunk * 64 + h * 32;
                if (a < 2)
                    load_rows<half_t, 64, 64, 64, 128, true, true>(reinterpret_cast<half_t*>(s),
                        reinterpret_cast<const half_t*>(array(a)), p.ldc, row0, c0, p.M, p.N, t, normal);
                else
                    load_rows<float, 64, 32, 32, 128, true, true>(reinterpret_cast<float*>(s),
                        reinterpret_cast<const float*>(array(a)), p.ldc, row0, c0, p.M, p.N, t, normal);
            }
        cp_async_commit();
    };
    load(0);
#pragma unroll  // whole: the accumulators are indexed by constants alone, so they stay in registers
    for (int chunk = 0; chunk < Cfg::BN / 64; ++chunk) {
        if (chunk + 1 < Cfg::BN / 64) {
            load(chunk + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        asm volatile("bar.sync %0, 128;" :: "r"(2 + consumer) : "memory");  // the chunk's pieces are in
        const int buf = chunk % 2;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = chunk * 8 + jj, r = warp * 16 + lane / 4 + 8 * h, c = jj * 8 + 2 * (lane % 4);
                update_pair<EPI>(reinterpret_cast<u32*>(plane_at(plane(buf, 0), r, c * 2)),
                                 reinterpret_cast<u32*>(plane_at(plane(buf, 1), r, c * 2)),
                                 reinterpret_cast<float2*>(plane_at(plane(buf, 2), r, c * 4)),
                                 reinterpret_cast<float2*>(plane_at(plane(buf, 3), r, c * 4)),
                                 make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]), o, mom);
                asm volatile("" ::: "memory");  // a pair at a time: no next pair's loads hoisted, fewer registers live
            }
        }
        asm volatile("bar.sync %0, 128;" :: "r"(2 + consumer) : "memory");  // the chunk's results are in
#pragma unroll
        for (int a = 0; a < 4; ++a)
            if (a < count)
                pieces(a, n0 + chunk * 64,
                       [&](int r, int b, u8* g) { store_16(g, load_16(plane_at(plane(buf, a), r, b))); });
        asm volatile("bar.sync %0, 128;" :: "r"(2 + consumer) : "memory");  // read out before the buffer refills
    }
}

template <class Cfg, int LA, int LB, int EPI, bool ACC16>
RG_DEVICE void gemm_wgmma(const TensorMap* mapA, const TensorMap* mapB, const Params& p, float keep_b) {
    static_assert(LA == ROW || LB == ROW, "A column-major comes with B row-major (x^T @ dy)");
#if RG_WGMMA
    if constexpr (ACC16) {
        __trap();  // fp16 accumulation runs on gemm.cu's tiles
    } else {
        constexpr int BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES, MC = Cfg::MC;
        extern __shared__ __align__(1024) u8 smem_raw[];
        __shared__ u64 full[STAGES], empty[STAGES];
        if (dynamic_smem_bytes() < Cfg::SMEM) __trap();  // launcher/kernel mismatch
        u8* tiles = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
        const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, consumer = Cfg::PRODUCER == 0 ? wg - 1 : wg;
        const int m0 = blockIdx.x * Cfg::BM, n0 = blockIdx.y * BN;
        constexpr bool SPLITS = LA == Cfg::SPLIT_A;  // the instances kernels/gemm.py may split
        const int k_begin = SPLITS ? blockIdx.z * p.k_chunk : 0;
        const int k_tiles = (min(p.K, k_begin + p.k_chunk) - k_begin + BK - 1) / BK;
        const bool split = SPLITS && gridDim.z > 1;
        if (gridDim.z > 1 && (!SPLITS || cluster_ctas() != gridDim.z)) __trap();  // splits meet only in a cluster
        if (tid == 0) {
            prefetch_tensor_map(mapA);
            prefetch_tensor_map(mapB);
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(&full[s], 1);        // the producer's arrival, plus the stage's bytes
                mbar_init(&empty[s], 2 * MC);  // one arrival per consumer warpgroup (of every CTA sharing the stage)
            }
            fence_proxy_async();
            if constexpr (MC > 1) fence_mbarrier_init_cluster();
        }
        if constexpr (MC > 1) {
            cluster_sync();  // every CTA's barriers are initialised before any copy or arrival reaches them
        } else {
            __syncthreads();
        }
        pdl_enter();  // A (and the epilogue's inputs) may come from the kernel before (pdl.cuh)
        // The bias of the tile's columns, for the epilogue: loaded under the main loop
        __shared__ __align__(16) float bias_tile[EPI == EPI_BIAS || EPI == EPI_BIAS_ACT ? BN : 1];
        if ((EPI == EPI_BIAS || EPI == EPI_BIAS_ACT) && wg != Cfg::PRODUCER)
            for (int i = consumer * 128 + t; i < BN; i += 256) bias_tile[i] = n0 + i < p.N ? p.bias[n0 + i] : 0.f;
        if (wg == Cfg::PRODUCER) {
            if (t == 0) {
                const L2Hint hint_b = l2_hint(keep_b);  // kernels/l2.py
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int s = kt % STAGES;
                    if (kt >= STAGES) mbar_wait(&empty[s], (kt / STAGES - 1) & 1);
                    u8* a = tiles + s * Cfg::STAGE_BYTES;
                    const int k = k_begin + kt * BK;
                    mbar_arrive_expect_tx(&full[s], Cfg::STAGE_BYTES);
                    if (LA == ROW) {
                        tma_load_2d(a, mapA, k, m0, &full[s]);
                    } else {  // two panels of 64 k-rows x 64 m-columns
                        tma_load_2d(a, mapA, m0, k, &full[s]);
                        tma_load_2d(a + 8192, mapA, m0 + 64, k, &full[s]);
                    }
                    if (LB == ROW && MC > 1) {  // this CTA's share of the panels, into every CTA of the cluster
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j)
                            if (j % MC == (int)cluster_rank())
                                tma_load_2d_multicast(a + Cfg::A_BYTES + j * 8192, mapB, n0 + 64 * j, k, &full[s],
                                                      (u16)((1 << MC) - 1), hint_b);
                    } else if (LB == ROW) {
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j)
                            tma_load_2d_hinted(a + Cfg::A_BYTES + j * 8192, mapB, n0 + 64 * j, k, &full[s], hint_b);
                    } else if (MC > 1) {  // BN / MC of B's rows (the map's box), into every CTA of the cluster
                        const int part = (int)cluster_rank() * (BN / MC);
                        tma_load_2d_multicast(a + Cfg::A_BYTES + part * 128, mapB, k, n0 + part, &full[s],
                                              (u16)((1 << MC) - 1), hint_b);
                    } else {
                        tma_load_2d_hinted(a + Cfg::A_BYTES, mapB, k, n0, &full[s], hint_b);
                    }
                }
            }
            if constexpr (MC > 1) {
                cluster_sync_any();  // no CTA leaves while another may still copy into it or arrive on its barriers
                return;
            }
            if (!split) return;  // else the producers' threads help finish the cluster's tile below
        }
        float d[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
        const int rows = consumer * 64;  // this warpgroup's rows of the tile
        for (int kt = 0; kt < k_tiles && (!SPLITS || wg != Cfg::PRODUCER); ++kt) {
            const int s = kt % STAGES;
            mbar_wait(&full[s], (kt / STAGES) & 1);
            // this warpgroup's A: its 64 rows of 128 bytes, or (column-major) its panel, the same 8 KB further on
            const u32 a = shared_address(tiles + s * Cfg::STAGE_BYTES) + rows * 128, b = a - rows * 128 + Cfg::A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                // Row-major A: K-major 128-byte rows, 8-row groups 1024 bytes apart; a k16 step is 32 bytes along the
                // row. B row-major (and A column-major): 64-column panels 8 KB apart, 8 k-rows 1024 bytes apart, a
                // k16 step 16 rows.
                const u64 da = LA == ROW ? smem_desc(a + kk * 32, 16, 1024) : smem_desc(a + kk * 2048, 8192, 1024);
                const u64 db = LB == ROW ? smem_desc(b + kk * 2048, 8192, 1024) : smem_desc(b + kk * 32, 16, 1024);
                Wg<BN>::template mma<LB == ROW ? 1 : 0, LA == COL ? 1 : 0>(d, da, db);
            }
            wg_commit();
            wg_wait<1>();  // the k-tile before this one has been multiplied: its stage may refill
            if (kt > 0 && t == 0) {
                if constexpr (MC > 1) {  // in every CTA of the cluster: each one's producer writes into this stage
                    const u32 bar = shared_address(&empty[(kt - 1) % STAGES]);
#pragma unroll
                    for (int r = 0; r < MC; ++r) cluster_mbar_arrive(cluster_address(bar, (u32)r));
                } else {
                    mbar_arrive(&empty[(kt - 1) % STAGES]);
                }
            }
        }
        wg_wait<0>();
        wg_hold(d);  // no read of the sums above the wait
        const int warp = t / 32, lane = t % 32;
        if constexpr (!EPI_UPDATES(EPI)) {
            if (!(SPLITS && split)) {
                asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmma are done (and the bias is in)
                staged_epilogue<Cfg, EPI>(p, tiles, bias_tile, d, consumer, warp, lane, m0 + rows, n0);
                if constexpr (MC > 1) cluster_sync_any();  // as the producer's, above
                return;
            }
        }
        Optim o = {};  // the optimiser with this step's values (the gather wrote them before pdl_enter returned)
        if (EPI_UPDATES(EPI)) o = *p.opt;
        if constexpr (EPI_UPDATES(EPI) && UpdatePlanes<Cfg, EPI>::STAGED) {
            if (!(SPLITS && split)) {
                asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmma are done
                staged_update<Cfg, EPI>(p, o, tiles, d, consumer, warp, lane, m0 + rows, n0);
                if constexpr (MC > 1) cluster_sync_any();  // as the producer's, above
                return;
            }
        }
        // Otherwise (and a split tile) a pair of outputs at a time, each thread its own accumulators'.
        const int r0 = m0 + rows + warp * 16 + lane / 4;
        if (SPLITS && split) {  // the partial tile into the pipeline's memory once every wgmma has read it; the fix-up
            constexpr int LD = CLUSTER_PART_LD(BN);
            __syncthreads();
            static_assert(Cfg::BM * LD * 4 <= STAGES * Cfg::STAGE_BYTES, "the partial tile fits the pipeline");
            float* part = reinterpret_cast<float*>(tiles);
            if (wg != Cfg::PRODUCER) {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *reinterpret_cast<float2*>(part + (r0 - m0 + 8 * h) * LD + j * 8 + 2 * (lane % 4)) =
                            make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            }
            finish_cluster_splits<EPI, Cfg::BM, BN, Cfg::THREADS>(p, o, part, m0, n0);
            return;
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = n0 + j * 8 + 2 * (lane % 4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + 8 * h;
                if (row < p.M && col < p.N) {
                    float2 x, y, z;
                    epilogue_inputs<EPI>(p, row, col, x, y, z);
                    epilogue_pair<EPI>(p, o, row, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], x, y, z);
                }
            }
        }
        if constexpr (MC > 1) cluster_sync_any();  // as the producer's, above
    }
#else
    __trap();  // wgmma is sm_90a's
#endif
}

// ---- the persistent ping-pong tile (wgpp): x^T @ dy with its update, the update under the next tile's multiply ----
// Above, a tile's update runs after its last wgmma with nothing to overlap it, and where its planes do not fit
// (wg128x2, momentum) a pair of weights at a time, each a round trip to DRAM. Here one CTA an SM walks the tiles
// (blockIdx.x, + gridDim.x, ...). Warpgroup 0 produces: its warp 0 copies A's and B's k-tiles into a ring of STAGES,
// its warp 1 each tile's master halves and optimiser state, a 64 x 64 chunk at a time, into a ring of EBUFS epilogue
// buffers (both by TMA), and stores each chunk back (TMA) once its warpgroup has updated it, so that no consumer
// waits on a store. Warpgroups 1 and 2 own the CTA's even and odd tiles, whole 128 x 128 ones: two m64n128k16 per
// k16 step (128 accumulators a thread, from the producers' registers: setmaxnreg). Two order barriers keep the
// consumers' multiplies, and their epilogues, in tile order: while one warpgroup updates, the other multiplies, and a
// ring's barrier is waited on at most one phase behind (its parity then names the phase). The update rewrites a chunk
// in its buffer; the buffer refills once the chunk's stores have read it. The sums are those of the
// 128-column tiles above (K ascending, the same m64n128k16 steps), so the bits are wg128's.
// The fp32 states' maps name pairs of 16-bit elements (boxes of 32 floats, 128 bytes): the copy engine moves bytes.
template <int STAGES_, int EBUFS_SGD_, int EBUFS_ADAM_>
struct PpConfig {
    static constexpr int BM = 128, BN = 128, BK = 64, STAGES = STAGES_, THREADS = 384, STAGE_BYTES = 32768;
    static constexpr int ebufs(int epi) { return epi == EPI_ADAM ? EBUFS_ADAM_ : EBUFS_SGD_; }
    static constexpr int ebuf_bytes(int epi) { return epi == EPI_ADAM ? 49152 : 32768; }  // a chunk of every array
    static constexpr u32 smem(int epi) { return STAGES * STAGE_BYTES + ebufs(epi) * ebuf_bytes(epi) + 1024; }
};

#if RG_WGMMA
RG_DEVICE void tma_store_2d(const TensorMap* map, int x, int y, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(src)) : "memory");
}
RG_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> RG_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory"); }
template <int N> RG_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory"); }
#endif

// The update of one 64 x 64 chunk in its buffer (W16, lo, then the fp32 states; planes of 128-byte swizzled rows),
// a pair at a time (update_pair), from the accumulators of the chunk's 64 rows (d) and its half of their 128 columns.
template <int EPI>
RG_DEVICE void pingpong_update(u8* buf, const float (&d)[64], int half, const Optim& o, bool mom, int warp, int lane) {
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

// One consumer warpgroup's multiply of the CTA's j-th tile from a ring of STAGES k-tiles (32 KB: A's 16, then B's):
// rows 0..63 into d0 and 64..127 into d1, two m64n128k16 per k16 step, K ascending, as gemm_wgmma's 128-column tiles
// (the same sums, its descriptors); a stage released once the wgmma after it has been issued. LA, LB as gemm_wgmma's
// (A column-major: two panels of 64 k-rows x 64 m-columns; row-major: 128 rows of 64 k; B as there).
#if RG_WGMMA
template <int LA, int LB, int STAGES>
RG_DEVICE void pingpong_multiply(float (&d0)[64], float (&d1)[64], u8* stages, u64* full, u64* empty, int j,
                                 int k_tiles, int t) {
    constexpr int BK = 64, STAGE = 32768, A_BYTES = 16384;
    constexpr int TB = LB == ROW ? 1 : 0, TA = LA == COL ? 1 : 0;  // wgmma's transposed operands
#pragma unroll
    for (int i = 0; i < 64; ++i) d0[i] = d1[i] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int idx = j * k_tiles + kt, s = idx % STAGES;
        mbar_wait(&full[s], (idx / STAGES) & 1);
        const u32 a = shared_address(stages + s * STAGE), b = a + A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const auto desc_a = [&](u32 rows) {  // the 64 rows from `rows` (their panel, column-major)
                return LA == ROW ? smem_desc(rows + kk * 32, 16, 1024) : smem_desc(rows + kk * 2048, 8192, 1024);
            };
            const u64 db = LB == ROW ? smem_desc(b + kk * 2048, 8192, 1024) : smem_desc(b + kk * 32, 16, 1024);
            wgmma_n128<TB, TA>(d0, desc_a(a), db);
            wgmma_n128<TB, TA>(d1, desc_a(a + 8192), db);
        }
        wg_commit();
        wg_wait<1>();  // the k-tile before this one has been multiplied: its stage may refill
        if (kt > 0 && t == 0) mbar_arrive(&empty[(idx - 1) % STAGES]);
    }
}

// The loading warp's walk over the CTA's tiles (blockIdx.x, + gridDim.x, ...), k-tile by k-tile into the same ring:
// each stage once its last reader has released it; load(stage, its barrier, m0, n0, k) announces and copies it.
template <int STAGES, class Load>
RG_DEVICE void pingpong_k_tiles(u8* stages, u64* full, u64* empty, int tiles, int tiles_m, int k_tiles, Load load) {
    int idx = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int m0 = tile % tiles_m * 128, n0 = tile / tiles_m * 128;
#pragma unroll 1
        for (int kt = 0; kt < k_tiles; ++kt, ++idx) {
            const int s = idx % STAGES, k = kt * 64;
            if (idx >= STAGES) mbar_wait(&empty[s], (idx / STAGES - 1) & 1);
            u8* a = stages + s * 32768;
            load(a, &full[s], m0, n0, k);
        }
    }
}
#endif

template <class Cfg, int EPI, bool ACC16>
RG_DEVICE void gemm_pingpong(const TensorMap* mapA, const TensorMap* mapB, const TensorMap* mapW16,
                             const TensorMap* mapLo, const TensorMap* mapMom, const TensorMap* mapVar, const Params& p,
                             float keep_b) {
    static_assert(EPI_UPDATES(EPI), "the ping-pong tile runs the weight updates");
#if RG_WGMMA
    if constexpr (ACC16) {
        __trap();  // fp16 accumulation runs on gemm.cu's tiles
    } else {
        constexpr int BK = Cfg::BK, STAGES = Cfg::STAGES, STAGE = Cfg::STAGE_BYTES, A_BYTES = 16384;
        constexpr int EBUFS = Cfg::ebufs(EPI), EBUF = Cfg::ebuf_bytes(EPI);
        extern __shared__ __align__(1024) u8 smem_raw[];
        __shared__ u64 full[STAGES], empty[STAGES], efull[EBUFS], written[EBUFS], order[2], eorder[2];
        if (dynamic_smem_bytes() < Cfg::smem(EPI) || gridDim.y * gridDim.z != 1) __trap();  // launcher mismatch
        u8* stages = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
        u8* ebufs = stages + STAGES * STAGE;
        const int tiles_m = (p.M + 127) / 128, tiles = tiles_m * ((p.N + 127) / 128), k_tiles = (p.K + BK - 1) / BK;
        const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, warp = t / 32, lane = t % 32;
        const bool mom = EPI == EPI_ADAM || p.mom != nullptr;
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(&full[s], 1);   // the producer's arrival, plus the stage's bytes
                mbar_init(&empty[s], 1);  // the consuming warpgroup's
            }
            for (int e = 0; e < EBUFS; ++e) {
                mbar_init(&efull[e], 1);
                mbar_init(&written[e], 4);  // each warp of the updating warpgroup
            }
            for (int c = 0; c < 2; ++c) {
                mbar_init(&order[c], 128);   // every thread of the other warpgroup, its multiply issued
                mbar_init(&eorder[c], 128);  // the same, its epilogue done
            }
            fence_proxy_async();
        }
        __syncthreads();
        pdl_enter();  // A and B come from the kernels before (pdl.cuh)
        if (wg == 0) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");  // the producers need few: the consumers take them
            if (tid == 0) {  // the k-tiles of this CTA's tiles, in tile order
                prefetch_tensor_map(mapA);
                prefetch_tensor_map(mapB);
                const L2Hint hint_b = l2_hint(keep_b);  // kernels/l2.py
                const auto load = [=](u8* a, u64* bar, int m0, int n0, int k) {  // a k-tile of A and B into stage a
                    mbar_arrive_expect_tx(bar, STAGE);
                    tma_load_2d(a, mapA, m0, k, bar);  // A^T: two panels of 64 k-rows x 64 m-columns
                    tma_load_2d(a + 8192, mapA, m0 + 64, k, bar);
                    tma_load_2d_hinted(a + A_BYTES, mapB, n0, k, bar, hint_b);  // B: two such panels
                    tma_load_2d_hinted(a + A_BYTES + 8192, mapB, n0 + 64, k, bar, hint_b);
                };
                pingpong_k_tiles<STAGES>(stages, full, empty, tiles, tiles_m, k_tiles, load);
            } else if (tid == 32) {  // the update's inputs and results, a chunk at a time
                prefetch_tensor_map(mapW16);
                prefetch_tensor_map(mapLo);
                if (mom) prefetch_tensor_map(mapMom);
                if (EPI == EPI_ADAM) prefetch_tensor_map(mapVar);
                const int chunks = 4 * ((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);
                // chunk e: the CTA's tile e / 4, its rows from 64 (q / 2) and columns from 64 (q % 2), q = e % 4
                auto corner = [&](int e, int& r0, int& c0) {
                    const int tile = blockIdx.x + e / 4 * gridDim.x, q = e % 4;
                    r0 = tile % tiles_m * 128 + 64 * (q / 2);
                    c0 = tile / tiles_m * 128 + 64 * (q % 2);
                };
                auto store = [&](int e) {  // chunk e's results, once its warpgroup has written them
                    const int b = e % EBUFS;
                    int r0, c0;
                    corner(e, r0, c0);  // the copy engine clips at the edges
                    u8* buf = ebufs + b * EBUF;
                    mbar_wait(&written[b], (e / EBUFS) & 1);
                    tma_store_2d(mapW16, c0, r0, buf);
                    tma_store_2d(mapLo, c0, r0, buf + 8192);
                    if (mom) {
                        tma_store_2d(mapMom, 2 * c0, r0, buf + 16384);
                        tma_store_2d(mapMom, 2 * c0 + 64, r0, buf + 24576);
                    }
                    if (EPI == EPI_ADAM) {
                        tma_store_2d(mapVar, 2 * c0, r0, buf + 32768);
                        tma_store_2d(mapVar, 2 * c0 + 64, r0, buf + 40960);
                    }
                    bulk_commit();
                };
#pragma unroll 1  // the producers' registers are few
                for (int e = 0; e < chunks; ++e) {
                    const int b = e % EBUFS;
                    if (e >= EBUFS) {
                        store(e - EBUFS);
                        bulk_wait_read<0>();  // its buffer is read: it may refill
                    }
                    int r0, c0;
                    corner(e, r0, c0);
                    u8* buf = ebufs + b * EBUF;
                    mbar_arrive_expect_tx(&efull[b], 16384 + (mom ? 16384 : 0) + (EPI == EPI_ADAM ? 16384 : 0));
                    tma_load_2d(buf, mapW16, c0, r0, &efull[b]);
                    tma_load_2d(buf + 8192, mapLo, c0, r0, &efull[b]);
                    if (mom) {
                        tma_load_2d(buf + 16384, mapMom, 2 * c0, r0, &efull[b]);
                        tma_load_2d(buf + 24576, mapMom, 2 * c0 + 64, r0, &efull[b]);
                    }
                    if (EPI == EPI_ADAM) {
                        tma_load_2d(buf + 32768, mapVar, 2 * c0, r0, &efull[b]);
                        tma_load_2d(buf + 40960, mapVar, 2 * c0 + 64, r0, &efull[b]);
                    }
                }
#pragma unroll 1
                for (int e = max(0, chunks - EBUFS); e < chunks; ++e) store(e);
                bulk_wait<0>();  // every store has landed before the grid ends
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
        const int c = wg - 1;
        const Optim o = *p.opt;  // this step's values (the gather wrote them before pdl_enter returned)
        int n = 0;
        for (int j = c, tile = blockIdx.x + c * gridDim.x; tile < tiles; j += 2, tile += 2 * gridDim.x, ++n) {
            if (c == 1 || n > 0) mbar_wait(&order[c], (c == 0 ? n - 1 : n) & 1);  // the other's multiply is issued
            float d0[64], d1[64];  // rows 0..63 and 64..127 of the tile
            pingpong_multiply<COL, ROW, STAGES>(d0, d1, stages, full, empty, j, k_tiles, t);
            mbar_arrive(&order[1 - c]);  // the other warpgroup may multiply
            wg_wait<0>();
            wg_hold(d0);
            wg_hold(d1);
            if (t == 0 && k_tiles > 0) mbar_arrive(&empty[(j * k_tiles + k_tiles - 1) % STAGES]);
            if (c == 1 || n > 0) mbar_wait(&eorder[c], (c == 0 ? n - 1 : n) & 1);  // the other's epilogue is done
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int e = j * 4 + q, b = e % EBUFS;
                u8* buf = ebufs + b * EBUF;
                mbar_wait(&efull[b], (e / EBUFS) & 1);
                if (q < 2) pingpong_update<EPI>(buf, d0, q % 2, o, mom, warp, lane);
                else pingpong_update<EPI>(buf, d1, q % 2, o, mom, warp, lane);
                fence_proxy_async();  // this thread's writes, before the copy engine reads them
                __syncwarp();
                if (lane == 0) mbar_arrive(&written[b]);  // the loading warp stores the chunk
            }
            mbar_arrive(&eorder[1 - c]);  // the other warpgroup may run its epilogue
        }
    }
#else
    __trap();  // wgmma is sm_90a's
#endif
}

// ---- instances: gemm_<config>_<layout A><layout B>_<epilogue>_<accumulator>, with gemm_tma.cu's parameters -------
// The WgConfig typedefs and the instance list are rawgpu/contract/gemm.py's table (CONFIGS, INSTANCES), generated into
// gemm_wgmma_instances.cuh. Unlike gemm_tma.cu's, A may be column-major (the weight gradient).
#define WG_INSTANCE(name, CFG, LA, LB, EPI, ACC16)                                                \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, CFG::CTAS) name(GEMM_TMA_PARAMS) { \
        const Params p = GEMM_TMA_ARGS;                                                           \
        gemm_wgmma<CFG, LA, LB, EPI, ACC16>(&mapA, &mapB, p, keep_b);                             \
    }

#define WG_ACCS(name, CFG, LA, LB, EPI)             \
    WG_INSTANCE(name##_f32, CFG, LA, LB, EPI, false) \
    WG_INSTANCE(name##_f16, CFG, LA, LB, EPI, true)

// The ping-pong tile's: gemm_tma.cu's parameters, then the maps of the master's halves and the optimiser's states.
#define WGPP_INSTANCE(name, CFG, EPI, ACC16)                                                                         \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1) name(                                            \
        GEMM_TMA_PARAMS, const __grid_constant__ TensorMap mapW16, const __grid_constant__ TensorMap mapLo,        \
        const __grid_constant__ TensorMap mapMom, const __grid_constant__ TensorMap mapVar) {                      \
        const Params p = GEMM_TMA_ARGS;                                                                            \
        gemm_pingpong<CFG, EPI, ACC16>(&mapA, &mapB, &mapW16, &mapLo, &mapMom, &mapVar, p, keep_b);                \
    }

#define WGPP_ACCS(name, CFG, EPI)                \
    WGPP_INSTANCE(name##_f32, CFG, EPI, false) \
    WGPP_INSTANCE(name##_f16, CFG, EPI, true)

#include "gemm_wgmma_instances.cuh"  // generated: typedef WgConfig<...> / PpConfig<...> Cfg_<name>; WG_ACCS, WGPP_ACCS
