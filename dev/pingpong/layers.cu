// Experiment (not the product; dev/pingpong/layers.py builds it appended to rawgpu/cu/gemm_wgmma.cu, whose helpers
// and contract it uses): the forward x @ W (+ bias and the activation) and the input gradient dy @ W^T (times
// act'(z)) on the ping-pong tile's persistent, warp-specialised grid, so that one warpgroup's epilogue runs under the
// other's multiply: issue 65's "every epilogue rawgpu has" (the product runs the updates there: gemm_pingpong).
//
// Why: gemm_wgmma.cu's one-CTA-a-tile kernels pay each CTA's start and its epilogue with the tensor cores idle, in
// waves; the ping-pong tile's multiply alone ran x^T @ dy at 4096^3 in 170 us against wg256mc's 204 plain and
// cuBLAS's 180 (docs/perf.md: Power). Its layouts here: A row-major (x, or dy: 128 rows of 64 k, one copy a k-tile),
// B row-major (W [K, N]: two panels of 64 k-rows x 64 columns, read with wgmma's transposed B) or column-major (W as
// W^T's rows for dy @ W^T: 128 rows of 64 k).
//
//   As gemm_pingpong (its walk and multiply: pingpong_k_tiles, pingpong_multiply): warpgroup 0's warp 0 copies the
//   k-tiles into a ring of STAGES; its warp 1 holds a ring of EBUFS 64 x 64 chunk buffers: for dact it first loads the
//   chunk's saved activation into the buffer (TMA), for the others it hands the buffer over once the stores before
//   have read it; the consumer warpgroup whose epilogue it is writes the chunk's fp16 outputs there (bias_act's
//   act'(z), where the build saves it, in a second plane), fences and arrives; warp 1 stores the chunk by TMA.
//   Warpgroups 1 and 2 own whole 128 x 128 tiles by turns, order barriers keeping their multiplies and their epilogues
//   in tile order.
// Sums in the order of gemm_wgmma.cu's 128-column tiles (K ascending, the same m64n128k16 steps): wg128's bits.

// A chunk's fp16 outputs from the accumulators of its 64 rows (d) and its half of their 128 columns, into the
// buffer's plane (128-byte swizzled rows, as the copy engine stores them): col0 the chunk's first column in C.
template <int EPI>
RG_DEVICE void layer_chunk(u8* buf, const float (&d)[64], int half, const float* bias, int col0, int N, bool save,
                           int warp, int lane) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        const int jd = 8 * half + jj, col = jj * 8 + 2 * (lane % 4);
        float2 x = make_float2(0.f, 0.f);
        if constexpr (EPI == EPI_BIAS_ACT)
            if (col0 + col < N) x = *reinterpret_cast<const float2*>(bias + col0 + col);  // N even: whole pairs
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + lane / 4 + 8 * h;
            u32* o = reinterpret_cast<u32*>(plane_at(buf, r, col * 2));
            if constexpr (EPI == EPI_DACT) x = unpack_f16x2(*o);  // the saved activation, loaded into the plane
            u32 slope = 0;
            *o = fp16_epilogue2<EPI>(d[4 * jd + 2 * h], d[4 * jd + 2 * h + 1], x, &slope);
            if (save) *reinterpret_cast<u32*>(plane_at(buf + 8192, r, col * 2)) = slope;
        }
    }
}

// mapA: A [M, K] (boxes of 128 rows x 64 k); mapB: B [K, N] (boxes of 64 x 64) or, LB == COL, B^T [N, K] (128 x 64);
// mapC: C [M, N] (64 x 64); mapAct: the saved activation [M, N] (64 x 64): dact's input, bias_act's slopes where
// `slopes` (and the build saves them). All 128-byte swizzled, zeros outside the matrices, stores clipped.
// CUT takes parts out, to tell their times apart: CUT_EPILOGUE the whole epilogue (the multiply alone: no chunk ring,
// no outputs), CUT_STORES the copy engine's stores (the chunks written and handed back), CUT_WRITES the consumer's
// chunk writes (buffers handed and stored, unwritten).
constexpr int CUT_EPILOGUE = 1, CUT_STORES = 2, CUT_WRITES = 4;
template <int LB, int EPI, int STAGES, int EBUFS, int CUT = 0>
RG_DEVICE void pingpong_layer(const TensorMap* mapA, const TensorMap* mapB, const TensorMap* mapC,
                              const TensorMap* mapAct, int M, int N, int K, const float* bias, int slopes) {
#if RG_WGMMA
    static_assert(EPI == EPI_STORE || EPI == EPI_BIAS_ACT || EPI == EPI_DACT, "the fp16 epilogues");
    static_assert(EPI != EPI_BIAS_ACT || LB == ROW, "bias_act is x @ W's");
    static_assert(EPI != EPI_DACT || LB == COL, "dact is dy @ W^T's");
    constexpr int BK = 64, STAGE = 32768, A_BYTES = 16384;
    constexpr int EBUF = EPI == EPI_BIAS_ACT ? 16384 : 8192;  // the outputs' plane (and the slopes')
    extern __shared__ __align__(1024) u8 smem_raw[];
    __shared__ u64 full[STAGES], empty[STAGES], efull[EBUFS], written[EBUFS], order[2], eorder[2];
    u8* stages = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
    u8* ebufs = stages + STAGES * STAGE;
    const int tiles_m = (M + 127) / 128, tiles = tiles_m * ((N + 127) / 128), k_tiles = (K + BK - 1) / BK;
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, warp = t / 32, lane = t % 32;
    const bool save = EPI == EPI_BIAS_ACT && ACT_SAVES_SLOPE && slopes;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 1);
        }
        for (int e = 0; e < EBUFS; ++e) {
            mbar_init(&efull[e], 1);
            mbar_init(&written[e], 4);  // each warp of the writing warpgroup
        }
        for (int c = 0; c < 2; ++c) {
            mbar_init(&order[c], 128);
            mbar_init(&eorder[c], 128);
        }
        fence_proxy_async();
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (tid == 0) {  // the k-tiles of this CTA's tiles, in tile order
            prefetch_tensor_map(mapA);
            prefetch_tensor_map(mapB);
            const auto load = [=](u8* a, u64* bar, int m0, int n0, int k) {  // gemm_wgmma.cu's walk calls it
                mbar_arrive_expect_tx(bar, STAGE);
                tma_load_2d(a, mapA, k, m0, bar);  // 128 rows of 64 k
                if (LB == ROW) {  // two panels of 64 k-rows x 64 columns
                    tma_load_2d(a + A_BYTES, mapB, n0, k, bar);
                    tma_load_2d(a + A_BYTES + 8192, mapB, n0 + 64, k, bar);
                } else {  // W^T: 128 rows of 64 k
                    tma_load_2d(a + A_BYTES, mapB, k, n0, bar);
                }
            };
            pingpong_k_tiles<STAGES>(stages, full, empty, tiles, tiles_m, k_tiles, load);
        } else if (tid == 32 && !(CUT & CUT_EPILOGUE)) {  // the chunk ring: dact's inputs in, every chunk's outputs out
            prefetch_tensor_map(mapC);
            if (EPI == EPI_DACT || save) prefetch_tensor_map(mapAct);
            const int chunks = 4 * ((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);
            auto corner = [&](int e, int& r0, int& c0) {  // chunk e: tile e / 4's quarter e % 4
                const int tile = blockIdx.x + e / 4 * gridDim.x, q = e % 4;
                r0 = tile % tiles_m * 128 + 64 * (q / 2);
                c0 = tile / tiles_m * 128 + 64 * (q % 2);
            };
            auto store = [&](int e) {
                const int b = e % EBUFS;
                int r0, c0;
                corner(e, r0, c0);
                u8* buf = ebufs + b * EBUF;
                mbar_wait(&written[b], (e / EBUFS) & 1);
                if (CUT & CUT_STORES) return;
                tma_store_2d(mapC, c0, r0, buf);
                if (save) tma_store_2d(mapAct, c0, r0, buf + 8192);
                bulk_commit();
            };
#pragma unroll 1
            for (int e = 0; e < chunks; ++e) {
                const int b = e % EBUFS;
                if (e >= EBUFS) {
                    store(e - EBUFS);
                    bulk_wait_read<0>();  // its buffer is read: it may be handed over again
                }
                if constexpr (EPI == EPI_DACT) {
                    int r0, c0;
                    corner(e, r0, c0);
                    mbar_arrive_expect_tx(&efull[b], 8192);
                    tma_load_2d(ebufs + b * EBUF, mapAct, c0, r0, &efull[b]);
                } else {
                    mbar_arrive(&efull[b]);
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
    int n = 0;
    for (int j = c, tile = blockIdx.x + c * gridDim.x; tile < tiles; j += 2, tile += 2 * gridDim.x, ++n) {
        if (c == 1 || n > 0) mbar_wait(&order[c], (c == 0 ? n - 1 : n) & 1);  // the other's multiply is issued
        float d0[64], d1[64];  // rows 0..63 and 64..127 of the tile
        pingpong_multiply<ROW, LB, STAGES>(d0, d1, stages, full, empty, j, k_tiles, t);  // gemm_wgmma.cu's
        mbar_arrive(&order[1 - c]);  // the other warpgroup may multiply
        wg_wait<0>();
        wg_hold(d0);
        wg_hold(d1);
        if (t == 0 && k_tiles > 0) mbar_arrive(&empty[(j * k_tiles + k_tiles - 1) % STAGES]);
        if (c == 1 || n > 0) mbar_wait(&eorder[c], (c == 0 ? n - 1 : n) & 1);  // the other's epilogue is done
        const int n0 = tile / tiles_m * 128;
#pragma unroll
        for (int q = 0; q < (CUT & CUT_EPILOGUE ? 0 : 4); ++q) {
            const int e = j * 4 + q, b = e % EBUFS;
            u8* buf = ebufs + b * EBUF;
            mbar_wait(&efull[b], (e / EBUFS) & 1);
            if (CUT & CUT_WRITES) {
            } else if (q < 2) layer_chunk<EPI>(buf, d0, q % 2, bias, n0 + 64 * (q % 2), N, save, warp, lane);
            else layer_chunk<EPI>(buf, d1, q % 2, bias, n0 + 64 * (q % 2), N, save, warp, lane);
            fence_proxy_async();  // this thread's writes, before the copy engine reads them
            __syncwarp();
            if (lane == 0) mbar_arrive(&written[b]);  // the loading warp stores the chunk
        }
        // A cut that reads no accumulator would let the compiler drop the multiply (a dummy HGMMA left): this
        // store, which never runs, keeps every wgmma of both chains.
        if ((CUT & (CUT_EPILOGUE | CUT_WRITES)) && K < 0) *reinterpret_cast<float*>(ebufs) = d0[0] + d1[0];
        mbar_arrive(&eorder[1 - c]);  // the other warpgroup may run its epilogue
    }
#else
    __trap();  // wgmma is sm_90a's
#endif
}

#define LAYER_PARAMS                                                                                               \
    const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB,                                 \
        const __grid_constant__ TensorMap mapC, const __grid_constant__ TensorMap mapAct, int M, int N, int K,     \
        const float *bias, int slopes
#define LAYER_INSTANCE(name, LB, EPI, STAGES, EBUFS, ...)                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1) name(LAYER_PARAMS) {                                     \
        pingpong_layer<LB, EPI, STAGES, EBUFS, ##__VA_ARGS__>(&mapA, &mapB, &mapC, &mapAct, M, N, K, bias, slopes); \
    }
// name: pp_<layout of A><layout of B>_<epilogue>[_s<stages>e<buffers>]; rings as layers.py's KERNELS lists them
LAYER_INSTANCE(pp_rr_store, ROW, EPI_STORE, 6, 4)
LAYER_INSTANCE(pp_rr_bias_act, ROW, EPI_BIAS_ACT, 5, 4)
LAYER_INSTANCE(pp_rc_store, COL, EPI_STORE, 6, 4)
LAYER_INSTANCE(pp_rc_dact, COL, EPI_DACT, 6, 4)
LAYER_INSTANCE(pp_rr_bias_act_s6e2, ROW, EPI_BIAS_ACT, 6, 2)
LAYER_INSTANCE(pp_rc_dact_s4e8, COL, EPI_DACT, 4, 8)
// parts taken out (CUT): timed, not checked
LAYER_INSTANCE(pp_rr_none, ROW, EPI_STORE, 6, 4, CUT_EPILOGUE)
LAYER_INSTANCE(pp_rc_none, COL, EPI_STORE, 6, 4, CUT_EPILOGUE)
LAYER_INSTANCE(pp_rr_nostores, ROW, EPI_STORE, 6, 4, CUT_STORES)
LAYER_INSTANCE(pp_rr_nowrites, ROW, EPI_STORE, 6, 4, CUT_WRITES)
LAYER_INSTANCE(pp_rr_store_s4e8, ROW, EPI_STORE, 4, 8)
