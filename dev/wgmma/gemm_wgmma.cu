// Experiment (not the product): an sm_90a GEMM on Hopper's warpgroup MMA (wgmma), to measure what it gives over
// gemm.cu's mma.sync tiles at large M (docs/perf.md: Batches above 256). C[M, N] fp16 = A[M, K] @ B, A row-major; B
// either column-major (Bt [N, K], K contiguous: dy @ W^T) or row-major ([K, N], N contiguous: x @ W, wgmma's
// transposed B). Block: warpgroup 0 produces (one thread issues the tensor copies), warpgroups 1 and 2 each multiply
// 64 rows of the 128-row tile; BN columns; K in 64-wide stages of 128-byte swizzled rows, as gemm_tma.cu loads them.
#include "common.cuh"
#include "tma.cuh"

// A shared-memory matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle.
RG_DEVICE u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32)
           | ((u64)1 << 62);
}
RG_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
RG_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> RG_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], both from shared memory descriptors; TRANS_B: B is N-contiguous.
template <int TRANS_B>
RG_DEVICE void wgmma_n128(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, %66;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TRANS_B));
}
// D[64 x 256] (+)= A[64 x 16] B[16 x 256], both from shared memory descriptors; TRANS_B: B is N-contiguous.
template <int TRANS_B>
RG_DEVICE void wgmma_n256(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, 1, 1, 1, 0, %130;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "n"(TRANS_B));
}

template <int BN> struct Wg;
template <> struct Wg<128> {
    template <int T> static RG_DEVICE void mma(float (&d)[64], u64 a, u64 b) { wgmma_n128<T>(d, a, b); }
};
template <> struct Wg<256> {
    template <int T> static RG_DEVICE void mma(float (&d)[128], u64 a, u64 b) { wgmma_n256<T>(d, a, b); }
};

// ROWB: B row-major [K, N] (BN / 64 panels of 64 k-rows x 64 columns); else Bt [N, K] (BN rows of 64 k).
// SWAP: the row-major B's descriptor with its two byte offsets the other way round (which one wgmma wants is what
// the experiment finds out).
template <int BN, int STAGES, bool ROWB, bool SWAP>
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
                tma_load_2d(a, mapA, kt * BK, m0, &full[s]);
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
        const u32 a = shared_address(tiles + s * STAGE) + rows * 128, b = shared_address(tiles + s * STAGE) + A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const u64 da = smem_desc(a + kk * 32, 16, 1024);
            const u64 db = ROWB ? (SWAP ? smem_desc(b + kk * 2048, 1024, 8192) : smem_desc(b + kk * 2048, 8192, 1024))
                                : smem_desc(b + kk * 32, 16, 1024);
            Wg<BN>::template mma<ROWB ? 1 : 0>(d, da, db);
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

#define WG_INSTANCE(name, BN, STAGES, ROWB, SWAP)                                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                             \
        name(const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB, half_t* C, int M, int N, \
             int K) {                                                                                                 \
        gemm_wgmma<BN, STAGES, ROWB, SWAP>(&mapA, &mapB, C, M, N, K);                                                \
    }
WG_INSTANCE(wg_rc_128, 128, 6, false, false)
WG_INSTANCE(wg_rc_256, 256, 4, false, false)
WG_INSTANCE(wg_rr_128, 128, 6, true, false)
WG_INSTANCE(wg_rr_128_swap, 128, 6, true, true)
WG_INSTANCE(wg_rr_256, 256, 4, true, false)
WG_INSTANCE(wg_rr_256_swap, 256, 4, true, true)
