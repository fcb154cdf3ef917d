// Experiment (not the product): an sm_90a GEMM on Hopper's warpgroup MMA (wgmma), to measure what it gives over
// gemm.cu's mma.sync tiles at large M (docs/perf.md: Batches above 256). C[M, N] fp16 = A[M, K] @ B, A row-major
// (K contiguous) or, with COLA, column-major (At [K, M], M contiguous: x^T @ dy, the weight gradient, with wgmma's
// transposed A: two panels of 64 k-rows x 64 m-columns per stage, one per consumer warpgroup); B either column-major
// (Bt [N, K], K contiguous: dy @ W^T) or row-major ([K, N], N contiguous: x @ W, wgmma's transposed B). Block:
// warpgroup 0 produces (one thread issues the tensor copies), warpgroups 1 and 2 each multiply 64 rows of the 128-row
// tile; BN columns; K in 64-wide stages of 128-byte swizzled rows, as gemm_tma.cu loads them.
#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"  // the product's wrappers (rawgpu/ptx)

// ROWB: B row-major [K, N] (BN / 64 panels of 64 k-rows x 64 columns); else Bt [N, K] (BN rows of 64 k).
// SWAP: the row-major B's descriptor with its two byte offsets the other way round (which one wgmma wants is what
// the experiment finds out).
template <int BN, int STAGES, bool ROWB, bool SWAP, bool COLA = false>
RG_DEVICE void gemm_wgmma(const TensorMap* mapA, const TensorMap* mapB, half_t* C, int M, int N, int K) {
#if __CUDA_ARCH__ >= 900
    constexpr int BM = 128, BK = 64, A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) u8 smem_raw[];
    __shared__ u64 full[STAGES], empty[STAGES];
    u8* tiles = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, k_tiles = (K + BK - 1) / BK;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 2);
        }
        fence_proxy_async();
    }
    __syncthreads();
    if (wg == 0) {
        if (t == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(&empty[s], (kt / STAGES - 1) & 1);
                u8* a = tiles + s * STAGE;
                mbar_arrive_expect_tx(&full[s], STAGE);
                if (COLA) {
                    tma_load_2d(a, mapA, m0, kt * BK, &full[s]);
                    tma_load_2d(a + 8192, mapA, m0 + 64, kt * BK, &full[s]);
                } else {
                    tma_load_2d(a, mapA, kt * BK, m0, &full[s]);
                }
                if (ROWB) {
#pragma unroll
                    for (int j = 0; j < BN / 64; ++j)
                        tma_load_2d(a + A_BYTES + j * 8192, mapB, n0 + 64 * j, kt * BK, &full[s]);
                } else {
                    tma_load_2d(a + A_BYTES, mapB, kt * BK, n0, &full[s]);
                }
            }
        }
        return;
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    const int rows = (wg - 1) * 64;  // this warpgroup's rows of the tile
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(&full[s], (kt / STAGES) & 1);
        // this warpgroup's part of A: 64 rows of 128 bytes, or (COLA) its 64 x 64 panel, the same 8 KB further on
        const u32 a = shared_address(tiles + s * STAGE) + rows * 128, b = shared_address(tiles + s * STAGE) + A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // A column-major as B row-major: a k16 step is 16 k-rows of 128 bytes
            const u64 da = COLA ? smem_desc(a + kk * 2048, 8192, 1024) : smem_desc(a + kk * 32, 16, 1024);
            const u64 db = ROWB ? (SWAP ? smem_desc(b + kk * 2048, 1024, 8192) : smem_desc(b + kk * 2048, 8192, 1024))
                                : smem_desc(b + kk * 32, 16, 1024);
            Wg<BN>::template mma<ROWB ? 1 : 0, COLA ? 1 : 0>(d, da, db);
        }
        wg_commit();
        wg_wait<1>();  // the k-tile before this one is done: its stage may refill
        if (kt > 0 && t == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
    }
    wg_wait<0>();
    // D fragments: warp w of the warpgroup holds rows 16 w .. 16 w + 15; per 8 columns j, (row, 2 cols) and (row + 8).
    const int warp = t / 32, lane = t % 32;
    const int r = m0 + rows + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = n0 + j * 8 + 2 * (lane % 4);
        if (c < N) {
            if (r < M) *reinterpret_cast<u32*>(C + (i64)r * N + c) = pack_f16x2(d[4 * j], d[4 * j + 1]);
            if (r + 8 < M) *reinterpret_cast<u32*>(C + (i64)(r + 8) * N + c) = pack_f16x2(d[4 * j + 2], d[4 * j + 3]);
        }
    }
#endif
}

#define WG_INSTANCE(name, BN, STAGES, ROWB, SWAP, COLA)                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                             \
        name(const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB, half_t* C, int M, int N, \
             int K) {                                                                                                 \
        gemm_wgmma<BN, STAGES, ROWB, SWAP, COLA>(&mapA, &mapB, C, M, N, K);                                          \
    }
WG_INSTANCE(wg_rc_128, 128, 6, false, false, false)
WG_INSTANCE(wg_rc_256, 256, 4, false, false, false)
WG_INSTANCE(wg_rr_128, 128, 6, true, false, false)
WG_INSTANCE(wg_rr_128_swap, 128, 6, true, true, false)
WG_INSTANCE(wg_rr_256, 256, 4, true, false, false)
WG_INSTANCE(wg_rr_256_swap, 256, 4, true, true, false)
WG_INSTANCE(wg_cr_128, 128, 6, true, false, true)
WG_INSTANCE(wg_cr_256, 256, 4, true, false, true)
