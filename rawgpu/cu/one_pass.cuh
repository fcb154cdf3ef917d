// What the one-pass backward kernels share (dx_sgd.cu, dx_update.cu): the end of a row band's dx.
#pragma once
#include "common.cuh"
#include "gemm_epilogue.cuh"

// A block's dx for its band of BM input features, as ITERS pairs per thread (pair i = threadIdx.x + it THREADS:
// batch row i / (BM / 2), features i0 + 2 (i % (BM / 2)) + {0, 1}): with several column ranges (gridDim.z) the
// ranges' sums meet in the workspace, added in range order by the last block to take the band's ticket (the others
// return); then masked by relu'(x), x the band's input tile in shared memory (rows of LDX halves), and stored.
template <int ITERS, int THREADS, int BM, int LDX>
RG_DEVICE void store_dx_band(float2 (&sum)[ITERS], const half_t* sX, half_t* dx, int lddx, int B, int IN, int i0,
                             float* workspace, int* tickets) {
    constexpr int PAIRS = ITERS * THREADS;
    if (gridDim.z > 1) {
        float2* ws = reinterpret_cast<float2*>(workspace) + (i64)blockIdx.x * PAIRS;
        if (!sum_splits_in_order<ITERS, THREADS, PAIRS>(sum, ws, (i64)gridDim.x * PAIRS, tickets + blockIdx.x)) return;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int i = threadIdx.x + it * THREADS, r = i / (BM / 2), col = (i % (BM / 2)) * 2;
        if (r >= B || i0 + col >= IN) continue;
        const float2 a = unpack_f16x2(*reinterpret_cast<const u32*>(sX + r * LDX + col));  // x: this layer's input
        const float v0 = a.x > 0.f ? sum[it].x : 0.f, v1 = a.y > 0.f ? sum[it].y : 0.f;
        *reinterpret_cast<u32*>(dx + (i64)r * lddx + i0 + col) = pack_f16x2(v0, v1);
    }
}
