// Tensor-core GEMM: C = A @ B, fp16 in, fp32 (or fp16) accumulation, with the epilogues an MLP step needs.
//
//   A is M x K, B is K x N, each row- or column-major, so x @ W, dy @ W^T and x^T @ dy need no transposes.
//   Shared memory keeps each tile in its global layout (the contiguous dimension along a row), padded by
//   16 bytes per row so the 8 row addresses of every ldmatrix land in different banks; ldmatrix or
//   ldmatrix.trans then turns either layout into mma fragments.
//   A STAGES-deep cp.async pipeline keeps STAGES - 1 tiles in flight while the tensor cores work on one.
//   Edges are predicated by zero-filling copies (cp.async with 0 source bytes), so any M, N, K works;
//   the contiguous dimension of each operand and of C must be a multiple of 8 (the caller pads).
//   Split-K (gridDim.z > 1): every split writes its partial tile to a workspace, and the last split to
//   arrive (an atomic ticket per tile) sums all partials in split order and runs the epilogue. The sum
//   order never depends on timing, so results are bitwise reproducible; the ticket is reset for the
//   next launch (graph replays included). On sm_90, launched as clusters of 1 x 1 x splits, the splits meet
//   in distributed shared memory instead (finish_cluster_splits in gemm_epilogue.cuh): the same sums.
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "pdl.cuh"

// GEMM_MODELS (gemm_models.cu sets it for the models step; 0 here): one launch runs the GEMM of every model of a sweep,
// grid x the m tiles of model 0, then model 1's, ...; each operand of model i sits i strides after model 0's (z*:
// elements of A, B, bias, act, the weight-shaped state; bytes of out; Optim rows).
#ifndef GEMM_MODELS
#define GEMM_MODELS 0
#endif

// STAGED_: the epilogue goes through shared memory, so every global access is a whole 16-byte piece of a row
// (see staged_epilogue); for tiles whose epilogue moves far more bytes than the main loop (K = batch).
template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_, bool STAGED_ = false>
struct Config {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr bool STAGED = STAGED_;
    static constexpr int THREADS = WM * WN * 32;
    static constexpr int WTM = BM / WM, WTN = BN / WN;  // one warp's tile
    static constexpr int MT = WTM / 16, NT = WTN / 8;   // mma tiles per warp
    static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BK % 16 == 0, "warp tile must be whole mma tiles");
};

// Shared-memory tile of an operand: ROWS rows of COLS contiguous halves, each row padded by 8 halves.
template <int ROWS, int COLS>
struct Tile {
    static constexpr int LD = COLS + 8;
    static constexpr int SIZE = ROWS * LD;  // halves
};

template <class C, int LA> using TileA = Tile<LA == ROW ? C::BM : C::BK, LA == ROW ? C::BK : C::BM>;
template <class C, int LB> using TileB = Tile<LB == ROW ? C::BK : C::BN, LB == ROW ? C::BN : C::BK>;

// Start copying a ROWS x COLS tile whose top-left element is global (r0, c0); rows >= R or columns >= C
// are zero-filled. C is a multiple of 8, so each 16-byte chunk is wholly inside or wholly outside.
template <int ROWS, int COLS, int THREADS>
RG_DEVICE void load_tile(half_t* s, const half_t* g, int ld, int r0, int c0, int R, int C, int tid) {
    constexpr int PER_ROW = COLS / 8, CHUNKS = ROWS * PER_ROW;
#pragma unroll
    for (int it = 0; it < (CHUNKS + THREADS - 1) / THREADS; ++it) {
        const int i = it * THREADS + tid;
        if (CHUNKS % THREADS == 0 || i < CHUNKS) {
            const int r = i / PER_ROW, c = (i % PER_ROW) * 8;
            const bool valid = (r0 + r < R) && (c0 + c < C);
            const half_t* src = valid ? g + (i64)(r0 + r) * ld + (c0 + c) : g;
            cp_async_16(s + r * (COLS + 8) + c, src, valid);
        }
    }
}

// ---- staged epilogue (Cfg::STAGED) ----------------------------------------------------------------------------
// The update reads the master weights (W16 and lo, master.cuh) and the optimiser's state (momentum, or Adam's two
// moments), and writes them back: 8-24 bytes per output against the main loop's few. Written straight from mma fragments, each warp access touches 8 rows x
// 16 bytes, so the L2 sees many small requests. Staged, the weight/momentum tiles are fetched by cp.async when the
// block starts (they depend on nothing), updated in shared memory in fragment order, and written back in 16-byte
// pieces along rows: a warp covers 512 contiguous bytes of each.
template <class Cfg>
struct Staged {
    static constexpr int LD = Cfg::BN + 8;  // elements per row: 16-byte aligned rows, conflict-free pair access
    static constexpr int FLOATS = Cfg::BM * LD;  // a state tile; the W16 and lo tiles take as much together
};

// Copy the BM x BN tile of T at global (m0, n0) of a row-major matrix (stride ld) into s (Staged::LD elements per
// row); rows >= M and columns >= N are zero-filled (N is a multiple of 8, so a 16-byte piece is wholly in or out).
template <class Cfg, class T>
RG_DEVICE void load_update_tile(T* s, const T* g, int ld, int m0, int n0, int M, int N, int tid) {
    constexpr int PIECE = 16 / sizeof(T), PER_ROW = Cfg::BN / PIECE, CHUNKS = Cfg::BM * PER_ROW;
#pragma unroll
    for (int it = 0; it < (CHUNKS + Cfg::THREADS - 1) / Cfg::THREADS; ++it) {
        const int i = it * Cfg::THREADS + tid;
        if (CHUNKS % Cfg::THREADS == 0 || i < CHUNKS) {
            const int r = i / PER_ROW, c = (i % PER_ROW) * PIECE;
            const bool valid = m0 + r < M && n0 + c < N;
            cp_async_16(s + r * Staged<Cfg>::LD + c, valid ? g + (i64)(m0 + r) * ld + (n0 + c) : g, valid);
        }
    }
}

// Start copying one pipeline stage: A's BM x BK tile at (m0, k) and B's BK x BN tile at (k, n0), each in its own
// layout; K indices >= k_end are zero-filled (the end of this block's share of K).
template <class Cfg, int LA, int LB>
RG_DEVICE void load_operands(half_t* a, half_t* b, const Params& p, int m0, int n0, int k, int k_end, int tid) {
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
    if (LA == ROW) load_tile<BM, BK, Cfg::THREADS>(a, p.A, p.lda, m0, k, p.M, k_end, tid);
    else           load_tile<BK, BM, Cfg::THREADS>(a, p.A, p.lda, k, m0, k_end, p.M, tid);
    if (LB == ROW) load_tile<BK, BN, Cfg::THREADS>(b, p.B, p.ldb, k, n0, k_end, p.N, tid);
    else           load_tile<BN, BK, Cfg::THREADS>(b, p.B, p.ldb, n0, k, p.N, k_end, tid);
}

// ldmatrix lane roles (see ldmatrix.cuh): which row of which 8x8 matrix this lane addresses.
struct LaneRoles {
    int r8, q1, q2;
    RG_DEVICE explicit LaneRoles(int lane) : r8(lane % 8), q1((lane / 8) % 2), q2(lane / 16) {}
};

// One pipeline stage's share of the product: this warp's MT x NT mma tiles over the stage's BK columns of A (a) and
// rows of B (b), added into acc (or acc16).
template <class Cfg, int LA, int LB, bool ACC16>
RG_DEVICE void mma_stage(float (&acc)[Cfg::MT][Cfg::NT][4], u32 (&acc16)[Cfg::MT][Cfg::NT][2], const half_t* a,
                         const half_t* b, int wm, int wn, LaneRoles lr) {
    using TA = TileA<Cfg, LA>;
    using TB = TileB<Cfg, LB>;
    constexpr int MT = Cfg::MT, NT = Cfg::NT;
    const int r8 = lr.r8, q1 = lr.q1, q2 = lr.q2;
#pragma unroll
    for (int kk = 0; kk < Cfg::BK; kk += 16) {
        u32 fa[MT][4], fb[NT][2];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int m = wm * Cfg::WTM + i * 16;
            if (LA == ROW) ldmatrix_x4(fa[i], shared_address(a + (m + r8 + 8 * q1) * TA::LD + kk + 8 * q2));
            else           ldmatrix_x4_trans(fa[i], shared_address(a + (kk + r8 + 8 * q2) * TA::LD + m + 8 * q1));
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const int n = wn * Cfg::WTN + j * 8;
            u32 r[4];
            if (LB == COL) ldmatrix_x4(r, shared_address(b + (n + r8 + 8 * q2) * TB::LD + kk + 8 * q1));
            else           ldmatrix_x4_trans(r, shared_address(b + (kk + r8 + 8 * q1) * TB::LD + n + 8 * q2));
            fb[j][0] = r[0]; fb[j][1] = r[1]; fb[j + 1][0] = r[2]; fb[j + 1][1] = r[3];
        }
        mma_tiles<ACC16>(acc, acc16, fa, fb);
    }
}

// An fp16 output tile through shared memory (rows of BN + 8 halves), so its global writes are whole 16-byte pieces
// of rows: a warp covers 512 contiguous bytes. stage_fp16_tile puts this warp's accumulators there;
// store_fp16_tile (after a barrier) writes the BM x BN tile at (m0, n0), rows >= M and columns >= N left out.
template <class Cfg>
RG_DEVICE void stage_fp16_tile(half_t* sC, const float (&acc)[Cfg::MT][Cfg::NT][4], int wm, int wn) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < Cfg::MT; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm * Cfg::WTM + i * 16 + g + 8 * h, c = wn * Cfg::WTN + j * 8 + 2 * t;
                *reinterpret_cast<u32*>(sC + r * (Cfg::BN + 8) + c) = pack_f16x2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            }
}

template <class Cfg>
RG_DEVICE void store_fp16_tile(const Params& p, const half_t* sC, int m0, int n0) {
    constexpr int PER_ROW = Cfg::BN / 8, CHUNKS = Cfg::BM * PER_ROW;
#pragma unroll 4
    for (int i = threadIdx.x; i < CHUNKS; i += Cfg::THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * 8, row = m0 + r, col = n0 + c;
        if (row < p.M && col < p.N)
            store_16(reinterpret_cast<half_t*>(p.out) + (i64)row * p.ldc + col, load_16(sC + r * (Cfg::BN + 8) + c));
    }
}

template <class Cfg, int LA, int LB, int EPI, bool ACC16>
RG_DEVICE void gemm(const Params& p) {
    using TA = TileA<Cfg, LA>;
    using TB = TileB<Cfg, LB>;
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
    constexpr int MT = Cfg::MT, NT = Cfg::NT;
    extern __shared__ __align__(128) u8 smem_raw[];
    if (dynamic_smem_bytes() < (u32)(STAGES * (TA::SIZE + TB::SIZE) * 2)) __trap();  // launcher/kernel mismatch
    half_t* sA = reinterpret_cast<half_t*>(smem_raw);
    half_t* sB = sA + STAGES * TA::SIZE;

    pdl_enter();  // every operand may come from the kernel before (pdl.cuh)
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / Cfg::WN, wn = warp % Cfg::WN;
#if GEMM_MODELS
    const int m0 = (int)(blockIdx.x % ((p.M + BM - 1) / BM)) * BM, n0 = blockIdx.y * BN;
#else
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
#endif
    const int k_begin = blockIdx.z * p.k_chunk;
    const int k_end = min(p.K, k_begin + p.k_chunk);
    const int k_tiles = k_end > k_begin ? (k_end - k_begin + BK - 1) / BK : 0;

    auto load_stage = [&](int stage, int kt) {
        load_operands<Cfg, LA, LB>(sA + stage * TA::SIZE, sB + stage * TB::SIZE, p, m0, n0, k_begin + kt * BK, k_end, tid);
    };

    float acc[MT][NT][4];
    u32 acc16[MT][NT][2];
    zero_fragments(acc);
    zero_fragments(acc16);

    // Staged update: the weight and state tiles join the first copy group. With split-K only the last split updates,
    // so it fetches them after the fix-up instead. The state tiles follow the weight's: momentum or Adam's first
    // moment (sV), then its second (sV2).
    half_t* sHi = sB + STAGES * TB::SIZE;
    short* sLo = reinterpret_cast<short*>(sHi + Cfg::BM * Staged<Cfg>::LD);
    float* sV = reinterpret_cast<float*>(sLo + Cfg::BM * Staged<Cfg>::LD);
    float* sV2 = sV + Staged<Cfg>::FLOATS;  // Adam's second moment
    constexpr bool ADAM = EPI == EPI_ADAM;
    const bool has_mom = ADAM || p.mom != nullptr;
    auto load_update_tiles = [&]() {
        load_update_tile<Cfg>(sHi, p.w16, p.ldc, m0, n0, p.M, p.N, tid);
        load_update_tile<Cfg>(sLo, static_cast<const short*>(p.out), p.ldc, m0, n0, p.M, p.N, tid);
        if (has_mom) load_update_tile<Cfg>(sV, p.mom, p.ldc, m0, n0, p.M, p.N, tid);
        if (ADAM) load_update_tile<Cfg>(sV2, p.var, p.ldc, m0, n0, p.M, p.N, tid);
    };
    if (EPI_UPDATES(EPI) && Cfg::STAGED) {
        const int states = ADAM ? 2 : has_mom;
        const u32 need = (STAGES * (TA::SIZE + TB::SIZE) * 2) + (1 + states) * Staged<Cfg>::FLOATS * 4;
        if (dynamic_smem_bytes() < need) __trap();  // launcher/kernel mismatch
        if (gridDim.z == 1) load_update_tiles();
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();
    }

    const LaneRoles roles(lane);
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt has landed for everyone, and everyone is done with tile kt - 1's stage
        const int next = kt + STAGES - 1;
        if (next < k_tiles) load_stage(next % STAGES, next);
        cp_async_commit();

        mma_stage<Cfg, LA, LB, ACC16>(acc, acc16, sA + (kt % STAGES) * TA::SIZE, sB + (kt % STAGES) * TB::SIZE, wm, wn, roles);
    }
    cp_async_wait<0>();

    if (ACC16) widen_fragments(acc, acc16);

    Optim o = {};  // the optimiser with this step's values (the gather wrote them)
    if (EPI_UPDATES(EPI)) o = *p.opt;
    const int g = lane / 4, t = lane % 4;
    // acc[i][j][2h], acc[i][j][2h + 1] hold the outputs at (tile_row(i, h), tile_col(j)) and (.., tile_col(j) + 1)
    // of this block's tile, that is (row_of(i, h), col_of(j)) and (.., col_of(j) + 1) of C.
    auto tile_row = [&](int i, int h) { return wm * Cfg::WTM + i * 16 + g + 8 * h; };
    auto tile_col = [&](int j) { return wn * Cfg::WTN + j * 8 + 2 * t; };
    auto row_of = [&](int i, int h) { return m0 + tile_row(i, h); };
    auto col_of = [&](int j) { return n0 + tile_col(j); };

#if __CUDA_ARCH__ >= 900
    if (!Cfg::STAGED && gridDim.z > 1 && cluster_ctas() > 1) {  // split-K within a cluster (gemm_epilogue.cuh)
        constexpr int LD = CLUSTER_PART_LD(BN);
        if (dynamic_smem_bytes() < (u32)(BM * LD * 4)) __trap();  // launcher/kernel mismatch
        __syncthreads();  // every warp is done with the pipeline's shared memory, which now takes the partial tile
        float* part = reinterpret_cast<float*>(smem_raw);
        // store_fragments' loop, written out: called here it spills (gemm_outer64_cr_store_f16, sm_90)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<float2*>(part + tile_row(i, h) * LD + tile_col(j)) =
                        make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        finish_cluster_splits<EPI, BM, BN, Cfg::THREADS>(p, o, part, m0, n0);
        return;
    }
#endif
    if (gridDim.z > 1) {
        // Split-K fix-up. Partials live at workspace[split][tile][j][thread] (float4 j), so every access
        // is a coalesced 16-byte one; the last split to take a ticket reduces them in split order.
        constexpr int V4 = MT * NT;  // float4 per thread
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        const int tiles = gridDim.x * gridDim.y;
        float4* ws = reinterpret_cast<float4*>(p.workspace);
        auto slot = [&](int split, int j) { return ((i64)(split * tiles + tile) * V4 + j) * Cfg::THREADS + tid; };
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
                ws[slot(blockIdx.z, i * NT + j)] = make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]);
        __threadfence();
        __syncthreads();
        __shared__ int ticket;
        if (tid == 0) ticket = atomicAdd(p.tickets + tile, 1);
        __syncthreads();
        if (ticket != (int)gridDim.z - 1) return;
        __threadfence();
        // Sum in split order. All of one split's loads are issued before any is used, so the L2 round trips
        // overlap instead of queueing one behind another.
        zero_fragments(acc);
        for (int z = 0; z < (int)gridDim.z; ++z) {
            float4 v[MT * NT];
#pragma unroll
            for (int j = 0; j < MT * NT; ++j) v[j] = load_cg_f4(reinterpret_cast<const float*>(ws + slot(z, j)));
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float4 w = v[i * NT + j];
                    acc[i][j][0] += w.x; acc[i][j][1] += w.y; acc[i][j][2] += w.z; acc[i][j][3] += w.w;
                }
        }
        if (tid == 0) p.tickets[tile] = 0;  // ready for the next launch
    }

    if (Cfg::STAGED && (EPI_UPDATES(EPI) || EPI == EPI_STORE)) {  // the fp16 store only: store32 writes per pair
        constexpr int LD = Staged<Cfg>::LD;
        if (EPI_UPDATES(EPI)) {
            if (gridDim.z > 1) {
                load_update_tiles();
                cp_async_commit();
                cp_async_wait<0>();
            }
            __syncthreads();  // every thread's copies of the weight and state tiles have landed
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int at = tile_row(i, h) * LD + tile_col(j);
                        u32* hi2 = reinterpret_cast<u32*>(sHi + at);
                        u32* lo2 = reinterpret_cast<u32*>(sLo + at);
                        float2 w = master_join2(*hi2, *lo2);
                        float2 v = has_mom ? *reinterpret_cast<float2*>(sV + at) : make_float2(0.f, 0.f);
                        const float2 g = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                        if (ADAM) {
                            float2 v2 = *reinterpret_cast<float2*>(sV2 + at);
                            optim_adam2(w, g, v, v2, o);
                            *reinterpret_cast<float2*>(sV2 + at) = v2;
                        } else {
                            optim_sgd2(w, g, v, o);
                        }
                        u32 h2, l2;
                        master_split2(w, h2, l2);
                        *hi2 = h2;
                        *lo2 = l2;
                        if (has_mom) *reinterpret_cast<float2*>(sV + at) = v;
                    }
        } else {
            static_assert(BM * (BN + 8) <= STAGES * (TA::SIZE + TB::SIZE), "the fp16 tile must fit the pipeline's space");
            __syncthreads();  // everyone is done with the pipeline's shared memory, which now holds the fp16 tile
            stage_fp16_tile<Cfg>(reinterpret_cast<half_t*>(smem_raw), acc, wm, wn);
            __syncthreads();
            store_fp16_tile<Cfg>(p, reinterpret_cast<const half_t*>(smem_raw), m0, n0);
            return;
        }
        __syncthreads();
        // Write back along rows, 8 weights per thread and step: W16 and lo (and the state). One piece at a time:
        // 32-96 bytes each, more in flight spill on sm_80.
        constexpr int PER_ROW = BN / 8, CHUNKS = BM * PER_ROW;
#pragma unroll 1
        for (int i = tid; i < CHUNKS; i += Cfg::THREADS) {
            const int r = i / PER_ROW, c = (i % PER_ROW) * 8;
            const int row = m0 + r, col = n0 + c;
            if (row >= p.M || col >= p.N) continue;
            const i64 at = (i64)row * p.ldc + col;
            store_16(p.w16 + at, load_16(sHi + r * LD + c));
            store_16(static_cast<short*>(p.out) + at, load_16(sLo + r * LD + c));
            if (has_mom) {
                store_16(p.mom + at, load_16(sV + r * LD + c));
                store_16(p.mom + at + 4, load_16(sV + r * LD + c + 4));
            }
            if (ADAM) {
                store_16(p.var + at, load_16(sV2 + r * LD + c));
                store_16(p.var + at + 4, load_16(sV2 + r * LD + c + 4));
            }
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        // Everything this row group reads (weights, optimiser state, saved activation, bias) is loaded before the
        // first store: stores may alias those loads in the compiler's view, so it cannot batch them itself.
        float2 aux[NT][2], aux2[NT][2], aux3[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_of(i, h), col = col_of(j);
                aux[j][h] = aux2[j][h] = aux3[j][h] = make_float2(0.f, 0.f);
                if (row < p.M && col < p.N) epilogue_inputs<EPI>(p, row, col, aux[j][h], aux2[j][h], aux3[j][h]);
            }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_of(i, h), col = col_of(j);
                if (row < p.M && col < p.N)
                    epilogue_pair<EPI>(p, o, row, col, acc[i][j][2 * h], acc[i][j][2 * h + 1], aux[j][h], aux2[j][h],
                                       aux3[j][h]);
            }
    }
}

// ---- persistent plain outer product (x^T @ dy stored, K = batch) ---------------------------------------------
// A plain weight gradient moves 2 bytes per output against a few of input: it is a write stream. One block per
// tile (the staged tile above) runs load -> wait -> multiply -> store with nothing to cover the load's latency, at two
// blocks per SM (registers): about half the DRAM bandwidth (dev/gemm_variants.py --variants staged persist), where
// cuBLAS runs one resident block per SM looping over tiles. Here too a resident grid walks the tiles (tile t =
// blockIdx.x + i gridDim.x, rows of tiles in order, so the blocks at work write neighbouring columns of the same rows),
// one k-tile per pipeline stage across tile boundaries: the next tile's operands land while this one is multiplied.
template <class Cfg, int LA, int LB, bool ACC16>
RG_DEVICE void gemm_persistent_store(const Params& p) {
    using TA = TileA<Cfg, LA>;
    using TB = TileB<Cfg, LB>;
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
    extern __shared__ __align__(128) u8 smem_raw[];
    half_t* sA = reinterpret_cast<half_t*>(smem_raw);
    half_t* sB = sA + STAGES * TA::SIZE;
    half_t* sC = sB + STAGES * TB::SIZE;  // BM rows of BN + 8 halves
    if (dynamic_smem_bytes() < (u32)((STAGES * (TA::SIZE + TB::SIZE) + BM * (BN + 8)) * 2)) __trap();

    pdl_enter();
    const int tid = threadIdx.x, warp = tid / 32, wm = warp / Cfg::WN, wn = warp % Cfg::WN;
    const int tiles_n = (p.N + BN - 1) / BN, tiles = ((p.M + BM - 1) / BM) * tiles_n;
    const int k_tiles = (p.K + BK - 1) / BK;
    const int items = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int steps = items * k_tiles;  // (tile, k-tile) pairs this block runs, one pipeline stage each
    auto origin = [&](int q, int& m0, int& n0) {
        const int t = (int)blockIdx.x + (q / k_tiles) * (int)gridDim.x;
        m0 = (t / tiles_n) * BM;
        n0 = (t % tiles_n) * BN;
    };
    auto load_step = [&](int stage, int q) {
        int m0, n0;
        origin(q, m0, n0);
        load_operands<Cfg, LA, LB>(sA + stage * TA::SIZE, sB + stage * TB::SIZE, p, m0, n0, (q % k_tiles) * BK, p.K, tid);
    };

    float acc[Cfg::MT][Cfg::NT][4];
    u32 acc16[Cfg::MT][Cfg::NT][2];
    zero_fragments(acc);
    zero_fragments(acc16);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load_step(s, s);
        cp_async_commit();
    }
    const LaneRoles roles(tid % 32);
    for (int q = 0; q < steps; ++q) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // step q has landed; everyone is done with step q - 1's stage and with sC's last tile
        if (q + STAGES - 1 < steps) load_step((q + STAGES - 1) % STAGES, q + STAGES - 1);
        cp_async_commit();
        mma_stage<Cfg, LA, LB, ACC16>(acc, acc16, sA + (q % STAGES) * TA::SIZE, sB + (q % STAGES) * TB::SIZE, wm, wn, roles);
        if (q % k_tiles == k_tiles - 1) {  // the tile's last k-tile: write it out
            if (ACC16) widen_fragments(acc, acc16);
            stage_fp16_tile<Cfg>(sC, acc, wm, wn);
            __syncthreads();
            int m0, n0;
            origin(q, m0, n0);
            store_fp16_tile<Cfg>(p, sC, m0, n0);
            zero_fragments(acc);
            zero_fragments(acc16);
        }
    }
    cp_async_wait<0>();
}

// ---- instances: extern "C" so kernels keep readable names in graphs and profiles ----------------------------
// Name: gemm_<config>_<layout A><layout B>_<epilogue>_<accumulator>; r = row-major, c = column-major. The tile
// configs (Config typedefs) and the instance list are rawgpu/contract/gemm.py's table (CONFIGS, INSTANCES), generated
// into gemm_instances.cuh, which the launcher plans from. From the contract too, as -D options: STREAM_STAGES (the
// streaming tile's pipeline depth, as deep as the part's shared memory allows), PERSIST_BLOCKS_PER_SM (the
// persistent tile's resident blocks per SM, which the launcher sizes its grid for).
#if !defined(STREAM_STAGES) || !defined(PERSIST_BLOCKS_PER_SM)
#error "gemm.cu is built with rawgpu/contract/gemm.py's defines (rawgpu/runtime/compiler.py passes them)"
#endif

#define GEMM_PARAMS                                                                                             \
    const half_t *A, const half_t *B, void *out, int M, int N, int K, int lda, int ldb, int ldc, int k_chunk, \
        const float *bias, half_t *act, int ld_act, float *mom, float *var, half_t *w16, const Optim *opt, \
        float *workspace, int *tickets
#define GEMM_ARGS {A, B, out, M, N, K, lda, ldb, ldc, k_chunk, bias, act, ld_act, mom, var, w16, opt, workspace, tickets}

#if GEMM_MODELS
#define GEMM_MODEL_PARAMS , i64 zA, i64 zB, i64 zC_bytes, i64 zBias, i64 zAct, i64 zState, i64 zOpt
#define GEMM_MODEL_OFFSETS(CFG)                                                                   \
    {                                                                                             \
        const i64 model = blockIdx.x / ((M + CFG::BM - 1) / CFG::BM);                             \
        A += model * zA;                                                                          \
        B += model * zB;                                                                          \
        out = static_cast<u8*>(out) + model * zC_bytes;                                           \
        if (bias) bias += model * zBias;                                                          \
        if (act) act += model * zAct;                                                             \
        if (mom) mom += model * zState;                                                           \
        if (var) var += model * zState;                                                           \
        if (w16) w16 += model * zState;                                                           \
        if (opt) opt += model * zOpt;                                                             \
    }
#else
#define GEMM_MODEL_PARAMS
#define GEMM_MODEL_OFFSETS(CFG)
#endif

#define GEMM_INSTANCE(name, CFG, LA, LB, EPI, ACC16)                                                  \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS) name(GEMM_PARAMS GEMM_MODEL_PARAMS) {  \
        GEMM_MODEL_OFFSETS(CFG)                                                                        \
        const Params p = GEMM_ARGS;                                                                    \
        gemm<CFG, LA, LB, EPI, ACC16>(p);                                                              \
    }

#define GEMM_ACCS(name, CFG, LA, LB, EPI)                  \
    GEMM_INSTANCE(name##_f32, CFG, LA, LB, EPI, false)     \
    GEMM_INSTANCE(name##_f16, CFG, LA, LB, EPI, true)

#define PERSIST_INSTANCE(name, CFG, LA, LB, ACC16)                                                          \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, PERSIST_BLOCKS_PER_SM) name(GEMM_PARAMS) { \
        const Params p = GEMM_ARGS;                                                                          \
        gemm_persistent_store<CFG, LA, LB, ACC16>(p);                                                        \
    }

#define PERSIST_ACCS(name, CFG, LA, LB)              \
    PERSIST_INSTANCE(name##_f32, CFG, LA, LB, false) \
    PERSIST_INSTANCE(name##_f16, CFG, LA, LB, true)

#include "gemm_instances.cuh"  // generated: typedef Config<...> Cfg_<name>; GEMM_ACCS / PERSIST_ACCS per instance
