// Weight-streaming GEMM for batch-sized M on sm_90: C = A @ B with B a large weight, fed by the tensor copy engine
// (TMA).
//
// Why a second GEMM: at batch 32 the forward (x @ W) and dx (dy @ W^T) GEMMs are pure weight streams, 2 bytes per
// weight and 64 flops. gemm.cu's cp.async pipeline issues one 16-byte copy per thread per piece, and stayed well
// below the copy bandwidth whatever its depth or grid (dev/gemm_variants.py --variants stream tma). Here one thread
// per block issues one copy per 64x64 tile (8 KB), done on mbarriers; four consumer warps only run ldmatrix + mma.
//
//   Block: one producer warp (lane 0 issues every copy) + CONSUMERS warps. Tile BM rows of C by BN columns, K in
//   steps of BK = 64; STAGES tiles in flight. Two ways to share a k-tile among the consumer warps:
//   - BM = 32: warp w takes its 16-wide slice of K for the whole BM x BN tile, so no warp loads another's
//     fragments; their partial sums meet once, in shared memory, in warp order.
//   - BM > 32 (a batch of up to BM rows reads each weight tile once, not once per 32 rows): warp w takes rows
//     [w WM, (w + 1) WM) and the whole k-tile; the warps' rows are disjoint, so there is nothing to add up.
//   Shared tiles are 128-byte rows written with the 128-byte swizzle (common.cuh: swizzle_128b), so ldmatrix is
//   conflict-free with no padding. A is row-major [M, K]: rows m, K contiguous. B row-major [K, N] (x @ W) is
//   BN / 64 panels of 64 k-rows x 64 columns, one copy each; B column-major (W^T, stored [N, K]) is BN rows of 64
//   k, one copy.
//   Edges: the copy engine zero-fills outside the matrices, so any M, N, K works (K a multiple of 8: strides are
//   whole 16-byte units).
//   Split-K (gridDim.z > 1): as in gemm.cu, each split writes its tile sum to the workspace and the last split to
//   take the tile's ticket adds them in split order, so results are bitwise reproducible; launched as clusters of
//   1 x 1 x splits, the sums meet in distributed shared memory instead (finish_cluster_splits).
//   keep_b: the L2 policy of B's reads (ptx/l2.cuh), so the step can keep a weight in L2 for its backward.
// Needs sm_90; the instances build for every arch, with a trapping body below sm_90 (kernels/gemm.py never picks
// them there).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "tma.cuh"
#include "pdl.cuh"
#include "l2.cuh"

template <int BM_, int BN_, int STAGES_>
struct TmaConfig {
    static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, CONSUMERS = 4;
    static constexpr int THREADS = 32 * (CONSUMERS + 1);
    static constexpr bool ROW_WARPS = BM > 32;                   // warps split the rows, not K (above)
    static constexpr int WM = ROW_WARPS ? BM / CONSUMERS : BM;   // rows of C per consumer warp
    static constexpr int KS = ROW_WARPS ? BK / 16 : 1;           // k16 slices a consumer warp multiplies per k-tile
    static constexpr int SLABS = ROW_WARPS ? 1 : CONSUMERS;      // partial tiles that meet in shared memory
    static constexpr int MT = WM / 16, NT = BN / 8;              // mma tiles per consumer warp and k16 slice
    static constexpr int A_BYTES = BM * BK * 2, PANEL_BYTES = 64 * BK * 2, B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr u32 SMEM = STAGES * STAGE_BYTES + 1024;  // + slack to align the tiles to 1024 bytes
    // floats per row of the partial tiles; with row warps the one tile is also the cluster split's part, so its rows
    // are CLUSTER_PART_LD(BN) (gemm_epilogue.cuh) long
    static constexpr int RED_LD = ROW_WARPS ? BN + 8 : BN + 4;
    static_assert(BK / 16 == CONSUMERS || ROW_WARPS, "one k16 slice per consumer warp");
    static_assert(WM % 16 == 0 && (!ROW_WARPS || WM * CONSUMERS == BM), "whole mma tiles of rows per warp");
    static_assert(BN % 64 == 0 && STAGE_BYTES % 1024 == 0, "whole 1024-byte swizzle atoms per tile");
    static_assert(SLABS * BM * RED_LD * 4 <= STAGES * STAGE_BYTES, "the partial tiles reuse the pipeline");
};

// The end of a row-warp tile, whose sums sit in `tile` (BM rows of RED_LD floats; every thread has stored its
// fragments, no barrier since): straight into the epilogue; split-K in a cluster through finish_cluster_splits, the
// tile being the part it reads; split-K through the workspace as sum_splits_in_order does it (the same pair order,
// so the same bits), a pair at a time in place of its per-thread registers, which a 128-row tile would need too many
// of.
template <class Cfg, int EPI>
RG_DEVICE void finish_row_tile(const Params& p, const float* tile, int m0, int n0) {
#if __CUDA_ARCH__ >= 900
    constexpr int BN = Cfg::BN, PER_ROW = BN / 2, PAIRS = Cfg::BM * PER_ROW, LD = Cfg::RED_LD;
    static_assert(LD == CLUSTER_PART_LD(BN), "the tile is the cluster split's part");
    const Optim no_update = {};  // these epilogues update nothing
    if (gridDim.z > 1 && cluster_ctas() > 1) {
        finish_cluster_splits<EPI, Cfg::BM, BN, Cfg::THREADS>(p, no_update, tile, m0, n0);
        return;
    }
    __syncthreads();
    const int tid = threadIdx.x, splits = gridDim.z;
    const int tile_id = blockIdx.y * gridDim.x + blockIdx.x;
    const i64 stride = (i64)gridDim.x * gridDim.y * PAIRS;
    float2* ws = reinterpret_cast<float2*>(p.workspace) + (i64)tile_id * PAIRS;
    auto at = [&](int i) { return *reinterpret_cast<const float2*>(tile + (i / PER_ROW) * LD + (i % PER_ROW) * 2); };
    if (splits > 1) {
        for (int i = tid; i < PAIRS; i += Cfg::THREADS) ws[blockIdx.z * stride + i] = at(i);
        if (!last_to_take(p.tickets + tile_id)) return;
    }
    for (int i = tid; i < PAIRS; i += Cfg::THREADS) {
        const int row = m0 + i / PER_ROW, col = n0 + (i % PER_ROW) * 2;
        if (row >= p.M || col >= p.N) continue;
        float2 x, y, z, sum = make_float2(0.f, 0.f);
        epilogue_inputs<EPI>(p, row, col, x, y, z);
        if (splits > 1) {
            for (int k = 0; k < splits; ++k) {
                const float2 v = load_cg_f2(reinterpret_cast<const float*>(ws + k * stride + i));
                sum.x += v.x;
                sum.y += v.y;
            }
        } else {
            sum = at(i);
        }
        epilogue_pair<EPI>(p, no_update, row, col, sum.x, sum.y, x, y, z);
    }
    if (splits > 1 && tid == 0) p.tickets[tile_id] = 0;  // for the next launch (graph replays included)
#endif
}

template <class Cfg, int LB, int EPI, bool ACC16>
RG_DEVICE void gemm_tma(const TensorMap* mapA, const TensorMap* mapB, const Params& p, float keep_b) {
    static_assert(!EPI_UPDATES(EPI), "the weight update runs on gemm.cu's staged tile");
#if __CUDA_ARCH__ >= 900
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES, MT = Cfg::MT, NT = Cfg::NT;
    extern __shared__ __align__(1024) u8 smem_raw[];
    __shared__ u64 full[STAGES], empty[STAGES];
    if (dynamic_smem_bytes() < Cfg::SMEM) __trap();  // launcher/kernel mismatch
    u8* tiles = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int k_begin = blockIdx.z * p.k_chunk;
    const int k_end = min(p.K, k_begin + p.k_chunk);
    const int k_tiles = k_end > k_begin ? (k_end - k_begin + BK - 1) / BK : 0;

    if (warp == Cfg::CONSUMERS && lane == 0) {
        prefetch_tensor_map(mapA);
        prefetch_tensor_map(mapB);
    }
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);                 // the producer's arrival, plus the stage's bytes
            mbar_init(&empty[s], Cfg::CONSUMERS);  // one arrival per consumer warp
        }
        fence_proxy_async();
    }
    __syncthreads();
    // Launched overlapping the kernel before (pdl.cuh), the producer starts the weight stream (B, written a step
    // ago) at once and waits for that kernel only before the first copy of A, its output; the others wait now.
    if (!(warp == Cfg::CONSUMERS && lane == 0)) pdl_enter();

    const int row0 = Cfg::ROW_WARPS ? warp * Cfg::WM : 0;  // a row warp's first row of the tile
    float acc[MT][NT][4];
    u32 acc16[MT][NT][2];
    zero_fragments(acc);
    zero_fragments(acc16);

    if (warp == Cfg::CONSUMERS) {
        // Producer: the kt-th k-tile goes to stage kt % STAGES once the consumers have released that stage's last
        // use. (k_chunk is a whole number of BK, so splits never overlap.) With B = W^T each block streams its own
        // rows of W; they start at different k-tiles and wrap around, so at any moment the grid reads pieces at
        // many offsets, not one column of 128-byte pieces a row (16 KB at H = 8192) apart. (x @ W needs no stagger:
        // there the blocks side by side read one whole row of W.) The order is fixed per block: reproducible.
        if (lane == 0) {
            const L2Hint hint_b = l2_hint(keep_b);  // how long B (the weight) should stay in L2: kernels/l2.py
            const int first = LB == COL && k_tiles > 0 ? (blockIdx.y * 5) % k_tiles : 0;
            auto k_of = [&](int kt) { return k_begin + ((first + kt) % k_tiles) * BK; };
            auto load_b = [&](int kt) {
                const int s = kt % STAGES, k = k_of(kt);
                u8* b = tiles + s * Cfg::STAGE_BYTES + Cfg::A_BYTES;
                mbar_arrive_expect_tx(&full[s], Cfg::STAGE_BYTES);  // A's bytes too: the stage completes with both
                if (LB == ROW) {
#pragma unroll
                    for (int j = 0; j < BN / 64; ++j)
                        tma_load_2d_hinted(b + j * Cfg::PANEL_BYTES, mapB, n0 + 64 * j, k, &full[s], hint_b);
                } else {
                    tma_load_2d_hinted(b, mapB, k, n0, &full[s], hint_b);
                }
            };
            auto load_a = [&](int kt) {
                const int s = kt % STAGES;
                tma_load_2d(tiles + s * Cfg::STAGE_BYTES, mapA, k_of(kt), m0, &full[s]);
            };
            const int ahead = min(k_tiles, STAGES);
            for (int kt = 0; kt < ahead; ++kt) load_b(kt);
            pdl_enter();
            for (int kt = 0; kt < ahead; ++kt) load_a(kt);
            for (int kt = ahead; kt < k_tiles; ++kt) {
                mbar_wait(&empty[kt % STAGES], (kt / STAGES - 1) & 1);
                load_b(kt);
                load_a(kt);
            }
        }
    } else {
        // Consumers: warp w multiplies k rows [16 w, 16 w + 16) of every k-tile (BM = 32), or rows
        // [w WM, (w + 1) WM) of A with the whole k-tile (row warps). ldmatrix lane roles as in gemm.cu.
        const int r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(&full[s], (kt / STAGES) & 1);
            const u32 a = shared_address(tiles + s * Cfg::STAGE_BYTES), b = a + Cfg::A_BYTES;
#pragma unroll
            for (int kk = 0; kk < Cfg::KS; ++kk) {
                const int ks = Cfg::ROW_WARPS ? kk : warp, kc = 2 * ks;  // the k16 slice; its first 16-byte chunk
                u32 fa[MT][4], fb[NT][2];
#pragma unroll
                for (int i = 0; i < MT; ++i) ldmatrix_x4(fa[i], a + swizzle_128b(row0 + i * 16 + r8 + 8 * q1, kc + q2));
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    u32 r[4];
                    const int n = j * 8;
                    if (LB == ROW) ldmatrix_x4_trans(r, b + (n / 64) * Cfg::PANEL_BYTES + swizzle_128b(ks * 16 + r8 + 8 * q1, (n % 64) / 8 + q2));
                    else           ldmatrix_x4(r, b + swizzle_128b(n + r8 + 8 * q2, kc + q1));
                    fb[j][0] = r[0]; fb[j][1] = r[1]; fb[j + 1][0] = r[2]; fb[j + 1][1] = r[3];
                }
                if (kk == Cfg::KS - 1) {
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);  // the fragments are in registers: the stage may refill
                }
                mma_tiles<ACC16>(acc, acc16, fa, fb);
            }
        }
    }
    if constexpr (Cfg::ROW_WARPS) {
        __syncthreads();  // every stage consumed: the pipeline's memory now takes the tile
        float* tile = reinterpret_cast<float*>(tiles);  // [BM][RED_LD]
        if (ACC16) widen_fragments(acc, acc16);
        if (warp < Cfg::CONSUMERS) store_fragments(tile + row0 * Cfg::RED_LD, Cfg::RED_LD, acc);
        finish_row_tile<Cfg, EPI>(p, tile, m0, n0);
    } else {
        // Each thread owns ITERS pairs of adjacent outputs (r, c), (r, c + 1), pair i = tid + it * THREADS walking the
        // tile's rows, so a warp's loads and stores cover whole 128-byte row pieces. What the epilogue reads (bias,
        // saved activation) is fetched now, ahead of every store (which the compiler could not reorder it past), and
        // lands while the warps add up their partial sums.
        // Split within a cluster, finish_cluster_splits fetches the inputs of the pairs it finishes itself: none here.
        const bool cluster_split = gridDim.z > 1 && cluster_ctas() > 1;
        const Optim no_update = {};  // these epilogues update nothing
        constexpr int PAIRS_PER_ROW = BN / 2, PAIRS = BM * PAIRS_PER_ROW;
        constexpr int ITERS = (PAIRS + Cfg::THREADS - 1) / Cfg::THREADS;
        float2 aux[ITERS], sum[ITERS];
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int i = tid + it * Cfg::THREADS, row = m0 + i / PAIRS_PER_ROW, col = n0 + (i % PAIRS_PER_ROW) * 2;
            float2 unused, unused2;
            aux[it] = sum[it] = make_float2(0.f, 0.f);
            if (!cluster_split && i < PAIRS && row < p.M && col < p.N)
                epilogue_inputs<EPI>(p, row, col, aux[it], unused, unused2);
        }
        __syncthreads();  // every stage consumed: the pipeline's memory now takes the per-warp partial sums

        float* red = reinterpret_cast<float*>(tiles);  // [CONSUMERS][BM][RED_LD]
        if (ACC16) widen_fragments(acc, acc16);
        if (warp < Cfg::CONSUMERS) store_fragments(red + warp * BM * Cfg::RED_LD, Cfg::RED_LD, acc);
        __syncthreads();
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {  // warp order: the same bits whichever warp finished first
            const int i = tid + it * Cfg::THREADS;
            if (i >= PAIRS) continue;
#pragma unroll
            for (int w = 0; w < Cfg::CONSUMERS; ++w) {
                const float2 x = *reinterpret_cast<const float2*>(red + (w * BM + i / PAIRS_PER_ROW) * Cfg::RED_LD + (i % PAIRS_PER_ROW) * 2);
                sum[it].x += x.x;
                sum[it].y += x.y;
            }
        }

        if (cluster_split) {  // gemm_epilogue.cuh: finish_cluster_splits; the part follows the per-warp sums
            constexpr int LD = CLUSTER_PART_LD(BN);
            static_assert((Cfg::CONSUMERS + 1) * BM * LD * 4 <= STAGES * Cfg::STAGE_BYTES, "the part fits the pipeline");
            float* part = red + Cfg::CONSUMERS * BM * Cfg::RED_LD;
#pragma unroll
            for (int it = 0; it < ITERS; ++it) {
                const int i = tid + it * Cfg::THREADS;
                if (i < PAIRS) *reinterpret_cast<float2*>(part + (i / PAIRS_PER_ROW) * LD + (i % PAIRS_PER_ROW) * 2) = sum[it];
            }
            finish_cluster_splits<EPI, BM, BN, Cfg::THREADS>(p, no_update, part, m0, n0);
            return;
        }
        if (gridDim.z > 1) {
            const int tile = blockIdx.y * gridDim.x + blockIdx.x;
            float2* ws = reinterpret_cast<float2*>(p.workspace) + (i64)tile * PAIRS;
            if (!sum_splits_in_order<ITERS, Cfg::THREADS, PAIRS>(sum, ws, (i64)gridDim.x * gridDim.y * PAIRS, p.tickets + tile))
                return;
        }
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int i = tid + it * Cfg::THREADS, row = m0 + i / PAIRS_PER_ROW, col = n0 + (i % PAIRS_PER_ROW) * 2;
            if (i < PAIRS && row < p.M && col < p.N)
                epilogue_pair<EPI>(p, no_update, row, col, sum[it].x, sum[it].y, aux[it], aux[it], aux[it]);
        }
    }
#else
    __trap();  // the tensor copy engine is sm_90+
#endif
}

// ---- instances: gemm_<config>_<layout A><layout B>_<epilogue>_<accumulator>, as in gemm.cu --------------------
// The TmaConfig typedefs and the instance list are rawgpu/contract/gemm.py's table (CONFIGS, INSTANCES), generated into
// gemm_tma_instances.cuh.
#define TMA_INSTANCE(name, CFG, LB, EPI, ACC16) GEMM_TMA_INSTANCE(name, gemm_tma, CFG, LB, EPI, ACC16)

#define TMA_ACCS(name, CFG, LB, EPI)             \
    TMA_INSTANCE(name##_f32, CFG, LB, EPI, false) \
    TMA_INSTANCE(name##_f16, CFG, LB, EPI, true)

#include "gemm_tma_instances.cuh"  // generated: typedef TmaConfig<BN, STAGES> Cfg_<name>; TMA_ACCS per instance
