// What every GEMM kernel shares: the operand layouts, the epilogues, the launch parameters and the per-pair
// epilogue code (gemm.cu's cp.async pipeline and gemm_tma.cu's tensor-copy pipeline end the same way).
#pragma once
#include "common.cuh"

enum Layout { ROW = 0, COL = 1 };
enum Epilogue {
    EPI_STORE = 0,      // C16 = acc
    EPI_BIAS = 1,       // C16 = acc + bias
    EPI_BIAS_RELU = 2,  // C16 = relu(acc + bias)
    EPI_DRELU = 3,      // C16 = acc * (act > 0): the backward of ReLU, act being the saved forward output
    EPI_SGD = 4,        // G = acc; [V = mu V + G;] W32 -= lr (V or G); W16 = fp16(W32). G never touches memory.
};

struct Params {
    const half_t* A; const half_t* B; void* out;
    int M, N, K, lda, ldb, ldc, k_chunk;
    const float* bias; const half_t* act; int ld_act;
    float* mom; half_t* w16; const float* lr; float mu;
    float* workspace; int* tickets;
};

// The epilogue for two horizontally adjacent outputs (row, col) and (row, col + 1); col is even. `x` and `y`
// were loaded beforehand: W32 and momentum (sgd), bias (bias), or the saved activation (drelu).
// The SGD rule for two adjacent weights w with gradient g: [v = mu v + g; step = v, else step = g;] w -= lr step.
RG_DEVICE void sgd_pair(float2& w, float2& v, float2 g, bool momentum, float mu, float lr) {
    if (momentum) {
        v.x = mu * v.x + g.x;
        v.y = mu * v.y + g.y;
        g = v;
    }
    w.x -= lr * g.x;
    w.y -= lr * g.y;
}

template <int EPI>
RG_DEVICE void epilogue_pair(const Params& p, float lr, int row, int col, float v0, float v1, float2 x, float2 y) {
    const i64 at = (i64)row * p.ldc + col;
    if (EPI == EPI_SGD) {
        sgd_pair(x, y, make_float2(v0, v1), p.mom != nullptr, p.mu, lr);
        if (p.mom != nullptr) *reinterpret_cast<float2*>(p.mom + at) = y;
        *reinterpret_cast<float2*>(reinterpret_cast<float*>(p.out) + at) = x;
        *reinterpret_cast<u32*>(p.w16 + at) = pack_f16x2(x.x, x.y);
        return;
    }
    if (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) {
        v0 += x.x;
        v1 += x.y;
    }
    if (EPI == EPI_BIAS_RELU) {
        v0 = fmaxf(v0, 0.f);
        v1 = fmaxf(v1, 0.f);
    }
    if (EPI == EPI_DRELU) {
        v0 = x.x > 0.f ? v0 : 0.f;
        v1 = x.y > 0.f ? v1 : 0.f;
    }
    *reinterpret_cast<u32*>(reinterpret_cast<half_t*>(p.out) + at) = pack_f16x2(v0, v1);
}

// Zero a warp's mma accumulators (fp32: 4 per 16x8 tile; fp16: 2 packed registers).
template <int M, int N>
RG_DEVICE void zero_fragments(float (&a)[M][N][4]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) a[i][j][0] = a[i][j][1] = a[i][j][2] = a[i][j][3] = 0.f;
}
template <int M, int N>
RG_DEVICE void zero_fragments(u32 (&a)[M][N][2]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) a[i][j][0] = a[i][j][1] = 0u;
}

// fp16 accumulators -> the fp32 ones, so every epilogue reads acc alone.
template <int M, int N>
RG_DEVICE void widen_fragments(float (&acc)[M][N][4], const u32 (&acc16)[M][N][2]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float2 lo = unpack_f16x2(acc16[i][j][0]), hi = unpack_f16x2(acc16[i][j][1]);
            acc[i][j][0] = lo.x; acc[i][j][1] = lo.y; acc[i][j][2] = hi.x; acc[i][j][3] = hi.y;
        }
}

// A warp's accumulators into a row-major fp32 tile s (ld floats per row): tile (i, j) covers rows 16 i .. 16 i + 15
// and columns 8 j .. 8 j + 7 of s. For sums across warps that meet in shared memory.
template <int M, int N>
RG_DEVICE void store_fragments(float* s, int ld, const float (&acc)[M][N][4]) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(s + (16 * i + g + 8 * h) * ld + 8 * j + 2 * t) =
                    make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
}

// Split-K with a deterministic sum, for kernels whose threads each own ITERS pairs of outputs (pair
// threadIdx.x + it * THREADS of the tile, PAIRS in all): every split writes its sums to the workspace
// (split z's pair i at ws[z * split_stride + i]), and the last split to take the tile's ticket returns true with
// `sum` = all splits' sums added in split order (each split's loads issued together), whatever order the splits
// finished in. The others return false. The ticket is left at zero for the next launch (graph replays included).
template <int ITERS, int THREADS, int PAIRS>
RG_DEVICE bool sum_splits_in_order(float2 (&sum)[ITERS], float2* ws, i64 split_stride, int* ticket) {
    __shared__ int taken;
    const int tid = threadIdx.x;
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
        if (tid + it * THREADS < PAIRS) ws[blockIdx.z * split_stride + tid + it * THREADS] = sum[it];
    __threadfence();
    __syncthreads();
    if (tid == 0) taken = atomicAdd(ticket, 1);
    __syncthreads();
    if (taken != (int)gridDim.z - 1) return false;
    __threadfence();
#pragma unroll
    for (int it = 0; it < ITERS; ++it) sum[it] = make_float2(0.f, 0.f);
    for (int z = 0; z < (int)gridDim.z; ++z) {
        float2 part[ITERS];
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
            part[it] = tid + it * THREADS < PAIRS ? load_cg_f2(reinterpret_cast<const float*>(ws + z * split_stride + tid + it * THREADS))
                                                   : make_float2(0.f, 0.f);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            sum[it].x += part[it].x;
            sum[it].y += part[it].y;
        }
    }
    if (tid == 0) *ticket = 0;
    return true;
}
