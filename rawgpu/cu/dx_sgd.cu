// One pass over a layer's weights for its whole backward at batch size: dx = (dy @ W^T) * act'(x) (or, for a
// column-split layer, dy @ W^T as fp32 partial sums: one_pass.cuh), and the SGD update W -= lr * x^T @ dy of the
// master weights (W16, lo), master.cuh.
//
// Why: at batch 32 both backward GEMMs are weight streams. Run apart, dx reads W16 (2 bytes per weight) and the
// update reads and writes W16 and lo (8 bytes). But the update fetches W16 anyway, so dx is computed from the same
// tile: 8 bytes per weight instead of 10, and one launch instead of two. With the forward's 2, a step moves 10
// bytes per weight (docs/design.md's first floor of 12 assumed an fp32 master beside the fp16 copy; master.cuh says why not).
//
//   Block: BM = 64 rows of W (input features) and a range of its columns, walked in chunks of BN = 128 through a
//   STAGES-deep cp.async pipeline of [W16 chunk | lo chunk | dy chunk]. Per chunk:
//     dx:  8 warps, warp w takes the chunk's 16 columns [16 w, 16 w + 16) as its k-slice: dx[32 x 64] +=
//          dy[:, slice] @ W16[rows, slice]^T;
//     G:   x^T[64 x 32] @ dy[32 x 128] on a 2 x 4 warp grid (x^T's fragments loaded once per block);
//     then W -= lr G on the joined master in shared memory, split again and written back along rows in 16-byte
//     pieces.
//   dx's 8 warp partials meet in shared memory in warp order; with several column ranges per row band (gridDim.z)
//   the blocks' sums are added in range order, in a cluster or through the workspace (one_pass.cuh).
//   act'(x) comes from the x tile already in shared memory (or the slope the forward saved). Every sum has a fixed
//   order: bitwise reproducible.
// bias != nullptr: the blocks also update the bias, b -= lr colsum(dy), with bias_update's exact fixed-point
// column sums (the same bits), so the layer's backward needs no second kernel. Chunk c of a column range is summed by
// row band c % bands: one band doing them all would be the grid's critical path.
// dx == nullptr: the update alone (the first layer, whose input needs no gradient), still one pass at 8 bytes per
// weight where the dW + SGD GEMM's staged tile needs two waves of blocks.
// gridDim.y == 2 (kernels/dx_sgd.py: OnePassPlan.roles): the blocks at y = 0 compute dx alone and those at y = 1 the
// update alone, side by side, each pair a cluster whose update waits for the dx block to hold a chunk before
// overwriting it (as in dx_update.cu; one_pass.cuh: apart_*): the same sums in the same order.
// Needs batch <= 32 and plain SGD (no momentum: its tile would not fit the pipeline); kernels/dx_sgd.py checks.
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "master.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "pdl.cuh"
#include "step_math.cuh"
#include "l2.cuh"
#include "one_pass.cuh"

// From rawgpu/contract/dx_sgd.py, as -D options (`python -m rawgpu.contract dx_sgd.cu` prints them): the tile
// (DX_SGD_BM rows of W, DX_SGD_BN columns per chunk, DX_SGD_BB batch rows), DX_SGD_THREADS, DX_SGD_STAGES (the
// pipeline depth that fits the part's shared memory), DX_SGD_SMEM_BYTES (the launch's dynamic shared memory) and
// its layout: the row strides DX_SGD_LD*, a stage's DX_SGD_STAGE_BYTES with its lo and dy chunks at DX_SGD_LO_AT and
// DX_SGD_DY_AT (W16's at 0), the x tile at DX_SGD_X_AT, after the stages.
#if !defined(DX_SGD_BM) || !defined(DX_SGD_BN) || !defined(DX_SGD_BB) || !defined(DX_SGD_THREADS) || \
    !defined(DX_SGD_STAGES) || !defined(DX_SGD_SMEM_BYTES) || !defined(DX_SGD_STAGE_BYTES)
#error "dx_sgd.cu is built with rawgpu/contract/dx_sgd.py's defines (rawgpu/runtime/compiler.py passes them)"
#endif

namespace dxsgd {
constexpr int BM = DX_SGD_BM, BN = DX_SGD_BN, BB = DX_SGD_BB, THREADS = DX_SGD_THREADS, WARPS = THREADS / 32;
constexpr int STAGES = DX_SGD_STAGES;
constexpr int LDW = DX_SGD_LDW, LDY = DX_SGD_LDY, LDX = DX_SGD_LDX;  // halves per row of W16 (and lo), dy, x
constexpr int STAGE_BYTES = DX_SGD_STAGE_BYTES;
constexpr int RED_LD = BM + 4;  // floats per row of the cross-warp dx sums
constexpr u32 SMEM = DX_SGD_SMEM_BYTES;
static_assert(WARPS * BB * RED_LD * 4 <= STAGES * STAGE_BYTES, "the dx sums reuse the pipeline");
static_assert(BN == 16 * WARPS, "one 16-column k-slice per warp");
}  // namespace dxsgd

struct DxSgdParams {
    const half_t* x; const half_t* dy; short* wlo; half_t* w16; half_t* dx; const float* lr;
    int B, IN, N, ldx, lddy, ldw, lddx, n_chunk;
    float* workspace; int* tickets;
};

// dx: fp16, times act', or with dx_f32 fp32, the raw sums (one_pass.cuh: store_dx_pair, which reads `slope`).
extern "C" __global__ void __launch_bounds__(dxsgd::THREADS)
dx_sgd(const half_t* x, const half_t* dy, short* wlo, half_t* w16, void* dx, const float* lr_ptr, int B, int IN,
       int N, int ldx, int lddy, int ldw, int lddx, int dx_f32, int n_chunk, float* workspace, int* tickets,
       float keep_read, float keep_hi, float keep_lo, float* bias, const half_t* slope) {
    using namespace dxsgd;
    extern __shared__ __align__(128) u8 smem_raw[];
    if (dynamic_smem_bytes() < SMEM) __trap();  // launcher/kernel mismatch
    half_t* sX = reinterpret_cast<half_t*>(smem_raw + DX_SGD_X_AT);
    auto sW = [&](int s) { return reinterpret_cast<half_t*>(smem_raw + s * STAGE_BYTES); };
    auto sL = [&](int s) { return reinterpret_cast<short*>(smem_raw + s * STAGE_BYTES + DX_SGD_LO_AT); };
    auto sY = [&](int s) { return reinterpret_cast<half_t*>(smem_raw + s * STAGE_BYTES + DX_SGD_DY_AT); };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4, r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
    const int i0 = blockIdx.x * BM;
    const int n_begin = blockIdx.z * n_chunk, n_end = min(N, n_begin + n_chunk);
    const int chunks = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
    const bool do_dx = dx != nullptr && (gridDim.y == 1 || blockIdx.y == 0);  // uniform in the block
    const bool do_update = gridDim.y == 1 || blockIdx.y == 1;
    __shared__ u32 apart_held;  // dx and the update apart: the chunks the dx block holds (one_pass.cuh)
    apart_begin(&apart_held);

    // L2 policies (l2.cuh, planned by kernels/l2.py): for reading both halves, and for writing each back.
    const u64 read_policy = l2_policy(keep_read), hi_policy = l2_policy(keep_hi), lo_policy = l2_policy(keep_lo);
    const u64 normal = l2_policy(0.f);
    auto load_weights = [&](int stage, int c) {
        const int n = n_begin + c * BN;
        load_rows<half_t, BM, BN, LDW, THREADS>(sW(stage), w16, ldw, i0, n, IN, n_end, tid, read_policy);
        if (do_update) load_rows<short, BM, BN, LDW, THREADS>(sL(stage), wlo, ldw, i0, n, IN, n_end, tid, read_policy);
    };
    auto load_chunk = [&](int stage, int c) {
        load_weights(stage, c);
        load_rows<half_t, BB, BN, LDY, THREADS>(sY(stage), dy, lddy, 0, n_begin + c * BN, B, n_end, tid, normal);
    };
    // Launched overlapping the kernel before (pdl.cuh): the first chunks of the weights (this layer's own, written
    // a step ago) are fetched at once; x and dy only once that kernel has finished. All of them join chunk 0's
    // copy group, which completes first, so chunk c's group still means chunk c has landed.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < chunks) load_weights(s, s);
    pdl_enter();
    load_rows<half_t, BB, BM, LDX, THREADS>(sX, x, ldx, 0, i0, B, IN, tid, normal);
    constexpr int PAIRS = BB * BM / 2, ITERS = PAIRS / THREADS;  // dx pair i: row i / 32, columns 2 (i % 32) + {0, 1}
    u32 slopes[ITERS];
    load_band_slopes<ITERS, THREADS, BM>(slopes, slope, lddx, do_dx && dx_f32 == 0, B, IN, i0);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < chunks) load_rows<half_t, BB, BN, LDY, THREADS>(sY(s), dy, lddy, 0, n_begin + s * BN, B, n_end, tid, normal);
        cp_async_commit();
    }

    const int wm = warp / 4, wn = warp % 4;  // G's warp grid: rows [32 wm, +32), columns [32 wn, +32)
    float dxacc[2][8][4];
    zero_fragments(dxacc);
    u32 fx[2][2][4];  // x^T fragments: [m16 tile][k16 step]
    const float lr = *lr_ptr;

    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // chunk c has landed for everyone; chunk c - 1's stage is written back
        apart_report(&apart_held, c);
        if (c == 0 && do_update) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    ldmatrix_x4_trans(fx[mt][kk], shared_address(sX + (16 * kk + r8 + 8 * q2) * LDX + 32 * wm + 16 * mt + 8 * q1));
        }
        const int next = c + STAGES - 1;
        if (next < chunks) load_chunk(next % STAGES, next);
        cp_async_commit();
        half_t* w = sW(c % STAGES);
        short* wl = sL(c % STAGES);
        const half_t* y = sY(c % STAGES);
        if (do_update && bias != nullptr && c % gridDim.x == blockIdx.x && tid < BN && n_begin + c * BN + tid < n_end) {
            i64 sum = 0;  // rows past the batch are zero-filled
#pragma unroll 8
            for (int r = 0; r < BB; ++r) sum += f16_fixed24(y[r * LDY + tid]);
            bias[n_begin + c * BN + tid] -= lr * (float)((double)sum * (1.0 / 16777216.0));
        }

        // dx += dy[:, slice] @ W[:, slice]^T with the old weights (before this chunk's update)
        if (do_dx) {
            u32 fa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldmatrix_x4(fa[mt], shared_address(y + (16 * mt + r8 + 8 * q1) * LDY + 16 * warp + 8 * q2));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const half_t* row = w + (8 * j + g) * LDW + 16 * warp + 2 * t;
                const u32 fb[2] = {*reinterpret_cast<const u32*>(row), *reinterpret_cast<const u32*>(row + 8)};
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_m16n8k16_f32(dxacc[mt][j], fa[mt], fb);
            }
        }
        if (!do_update) continue;  // the next chunk's top barrier keeps its stage until every warp has read it
        // G = x^T @ dy for this warp's 32 x 32 of the chunk
        float gacc[2][4][4];
        zero_fragments(gacc);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            u32 fb[4][2];
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                u32 r[4];
                ldmatrix_x4_trans(r, shared_address(y + (16 * kk + r8 + 8 * q1) * LDY + 32 * wn + 16 * jj + 8 * q2));
                fb[2 * jj][0] = r[0]; fb[2 * jj][1] = r[1]; fb[2 * jj + 1][0] = r[2]; fb[2 * jj + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_m16n8k16_f32(gacc[mt][j], fx[mt][kk], fb[j]);
        }
        __syncthreads();  // every warp has read the old weights
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int at = (32 * wm + 16 * mt + g + 8 * h) * LDW + 32 * wn + 8 * j + 2 * t;
                    u32& hi2 = *reinterpret_cast<u32*>(w + at);
                    u32& lo2 = *reinterpret_cast<u32*>(wl + at);
                    float2 v = master_join2(hi2, lo2), unused = make_float2(0.f, 0.f);
                    sgd_pair(v, unused, make_float2(gacc[mt][j][2 * h], gacc[mt][j][2 * h + 1]), false, 0.f, lr);
                    master_split2(v, hi2, lo2);
                }
        apart_wait(&apart_held, c);  // the old weights of chunk c are no longer read elsewhere
        __syncthreads();
        // Write back along rows: 8 weights (16 bytes of W16, 16 of lo) per thread and step.
        const int n = n_begin + c * BN;
#pragma unroll 4
        for (int i = tid; i < BM * BN / 8; i += THREADS) {
            const int r = i / (BN / 8), col = (i % (BN / 8)) * 8;
            if (i0 + r >= IN || n + col >= n_end) continue;
            const i64 at = (i64)(i0 + r) * ldw + n + col;
            store_16_policy(w16 + at, load_16(w + r * LDW + col), hi_policy);
            store_16_policy(wlo + at, load_16(wl + r * LDW + col), lo_policy);
        }
    }
    cp_async_wait<0>();
    if (!do_dx) return;
    __syncthreads();  // the pipeline's memory now takes the warps' dx partials

    float* red = reinterpret_cast<float*>(smem_raw);  // [WARPS][BB][RED_LD]
    store_fragments(red + warp * BB * RED_LD, RED_LD, dxacc);
    __syncthreads();
    float2 sum[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int i = tid + it * THREADS, r = i / (BM / 2), col = (i % (BM / 2)) * 2;
        sum[it] = make_float2(0.f, 0.f);
#pragma unroll
        for (int v = 0; v < WARPS; ++v) {
            const float2 s = *reinterpret_cast<const float2*>(red + (v * BB + r) * RED_LD + col);
            sum[it].x += s.x;
            sum[it].y += s.y;
        }
    }
    static_assert(PAIRS % THREADS == 0, "whole pairs per thread");
    store_dx_band<ITERS, THREADS, BM, LDX>(sum, sX, slopes, dx, lddx, dx_f32 != 0, B, IN, i0, workspace, tickets,
                                           reinterpret_cast<float2*>(smem_raw));
}
