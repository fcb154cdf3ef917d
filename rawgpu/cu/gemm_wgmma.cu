// Large-M GEMM on sm_90a: C = A @ B on Hopper's warpgroup MMA (wgmma), fed by the tensor copy engine.
//
// Why a third GEMM: above batch 256 the forward (x @ W) and dx (dy @ W^T) GEMMs are arithmetic, and gemm.cu's
// mma.sync tiles run them at 130-165 TFLOP/s on an H100 where wgmma, which reads both operands straight from the
// swizzled shared tiles the copy engine writes and runs asynchronously, reaches cuBLAS's 350-420 (docs/perf.md:
// Batches above 256).
//
//   Block: three warpgroups. Warpgroup 0 produces (one thread issues every copy: the 128 x 64 A tile and B's 64 k
//   rows, as gemm_tma.cu loads them, 128-byte swizzled), warpgroups 1 and 2 each multiply 64 rows of the 128-row
//   tile by BN columns, four m64nBNk16 wgmma per 64-wide k-tile. A stage is released once the wgmma that read it has
//   completed (wgmma.wait_group 1: the k-tile before the current one). B row-major ([K, N], x @ W) is BN / 64 panels
//   of 64 k-rows x 64 columns, read with wgmma's transposed B; B column-major (W^T stored [N, K], dy @ W^T) is BN
//   rows of 64 k. Edges: the copy engine zero-fills outside the matrices; the epilogue writes only inside.
//   The sums of a tile are in one order (K ascending), so results are bitwise reproducible. No split-K: the planner
//   gives these tiles only shapes with enough tiles.
//   Epilogues: gemm_epilogue.cuh's, per pair of outputs (no weight updates: those run on gemm.cu's staged tile).
// Built for sm_90a only (compiler.py: contract.nvrtc_arch); every other build's body traps (kernels/gemm.py never
// picks these tiles there), as does the fp16-accumulating twin of each instance (fp16 accumulation runs on gemm.cu).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "tma.cuh"
#include "pdl.cuh"
#include "l2.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RG_WGMMA 1
#else
#define RG_WGMMA 0
#endif

template <int BN_, int STAGES_>
struct WgConfig {
    static constexpr int BM = 128, BN = BN_, BK = 64, STAGES = STAGES_, THREADS = 384;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr u32 SMEM = STAGES * STAGE_BYTES + 1024;  // + slack to align the tiles to 1024 bytes
    static_assert(BN == 128 || BN == 256, "m64n128k16 or m64n256k16");
};

#if RG_WGMMA
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

#endif  // RG_WGMMA

template <class Cfg, int LB, int EPI, bool ACC16>
RG_DEVICE void gemm_wgmma(const TensorMap* mapA, const TensorMap* mapB, const Params& p, float keep_b) {
    static_assert(!EPI_UPDATES(EPI), "the weight update runs on gemm.cu's staged tile");
#if RG_WGMMA
    if constexpr (ACC16) {
        __trap();  // fp16 accumulation runs on gemm.cu's tiles
    } else {
        constexpr int BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
        extern __shared__ __align__(1024) u8 smem_raw[];
        __shared__ u64 full[STAGES], empty[STAGES];
        if (dynamic_smem_bytes() < Cfg::SMEM) __trap();  // launcher/kernel mismatch
        u8* tiles = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
        const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
        const int m0 = blockIdx.x * Cfg::BM, n0 = blockIdx.y * BN, k_tiles = (p.K + BK - 1) / BK;
        if (tid == 0) {
            prefetch_tensor_map(mapA);
            prefetch_tensor_map(mapB);
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(&full[s], 1);   // the producer's arrival, plus the stage's bytes
                mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
            }
            fence_proxy_async();
        }
        __syncthreads();
        pdl_enter();  // A (and the epilogue's inputs) may come from the kernel before (pdl.cuh)
        if (wg == 0) {
            if (t == 0) {
                const u64 policy_b = l2_policy(keep_b);  // kernels/l2.py
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int s = kt % STAGES;
                    if (kt >= STAGES) mbar_wait(&empty[s], (kt / STAGES - 1) & 1);
                    u8* a = tiles + s * Cfg::STAGE_BYTES;
                    mbar_arrive_expect_tx(&full[s], Cfg::STAGE_BYTES);
                    tma_load_2d(a, mapA, kt * BK, m0, &full[s]);
                    if (LB == ROW) {
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j)
                            tma_load_2d_policy(a + Cfg::A_BYTES + j * 8192, mapB, n0 + 64 * j, kt * BK, &full[s],
                                               policy_b);
                    } else {
                        tma_load_2d_policy(a + Cfg::A_BYTES, mapB, kt * BK, n0, &full[s], policy_b);
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
            const u32 a = shared_address(tiles + s * Cfg::STAGE_BYTES) + rows * 128, b = a - rows * 128 + Cfg::A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                // A: K-major 128-byte rows, 8-row groups 1024 bytes apart; a k16 step is 32 bytes along the row.
                // B row-major: 64-column panels 8 KB apart, 8 k-rows 1024 bytes apart, a k16 step 16 rows.
                const u64 da = smem_desc(a + kk * 32, 16, 1024);
                const u64 db = LB == ROW ? smem_desc(b + kk * 2048, 8192, 1024) : smem_desc(b + kk * 32, 16, 1024);
                Wg<BN>::template mma<LB == ROW ? 1 : 0>(d, da, db);
            }
            wg_commit();
            wg_wait<1>();  // the k-tile before this one has been multiplied: its stage may refill
            if (kt > 0 && t == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
        }
        wg_wait<0>();
        // Warp w of the warpgroup holds rows 16 w .. 16 w + 15; per 8 columns j: (row, 2 columns) and (row + 8, ...).
        const Optim no_update = {};  // these epilogues update nothing
        const int warp = t / 32, lane = t % 32, r0 = m0 + rows + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = n0 + j * 8 + 2 * (lane % 4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + 8 * h;
                if (row < p.M && col < p.N) {
                    float2 x, y, z;
                    epilogue_inputs<EPI>(p, row, col, x, y, z);
                    epilogue_pair<EPI>(p, no_update, row, col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], x, y, z);
                }
            }
        }
    }
#else
    __trap();  // wgmma is sm_90a's
#endif
}

// ---- instances: gemm_<config>_<layout A><layout B>_<epilogue>_<accumulator>, with gemm_tma.cu's parameters -----
// The WgConfig typedefs and the instance list are rawgpu/contract.py's table (CONFIGS, INSTANCES), generated into
// gemm_wgmma_instances.cuh.
#define WG_PARAMS                                                                                                 \
    const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB, void *out, int M, int N, int K, \
        int ldc, int k_chunk, const float *bias, const half_t *act, int ld_act, float *workspace, int *tickets, \
        float keep_b
#define WG_ARGS {nullptr, nullptr, out, M, N, K, 0, 0, ldc, k_chunk, bias, act, ld_act, nullptr, nullptr, nullptr, \
                 nullptr, workspace, tickets}

#define WG_INSTANCE(name, CFG, LB, EPI, ACC16)                                       \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1) name(WG_PARAMS) { \
        const Params p = WG_ARGS;                                                     \
        gemm_wgmma<CFG, LB, EPI, ACC16>(&mapA, &mapB, p, keep_b);                    \
    }

#define WG_ACCS(name, CFG, LB, EPI)             \
    WG_INSTANCE(name##_f32, CFG, LB, EPI, false) \
    WG_INSTANCE(name##_f16, CFG, LB, EPI, true)

#include "gemm_wgmma_instances.cuh"  // generated: typedef WgConfig<BN, STAGES> Cfg_<name>; WG_ACCS per instance
