// Experiment (not the product; dev/pingpong/run.py builds it appended to rawgpu/cu/gemm_wgmma.cu, whose helpers and
// contract it uses): the weight gradient x^T @ dy with its update fused, on a persistent, warp-specialised grid whose
// two consumer warpgroups take turns (ping-pong), so that one's epilogue runs under the other's multiply.
//
// Why: gemm_wgmma.cu's tiles run the update after the tile's last wgmma with nothing to overlap it, and where its
// planes do not fit (wg128x2, momentum) a pair of weights at a time, each a round trip to DRAM (issue 65; the
// numbers: docs/history.md).
//
//   Grid: one CTA an SM, walking the tiles (tile = blockIdx.x, + gridDim.x, ...). Warpgroup 0 produces: its warp 0
//   copies the A and B k-tiles into a ring of STAGES (TMA), its warp 1 copies each tile's master halves and optimiser
//   state, a 64 x 64 chunk at a time, into a ring of EBUFS epilogue buffers (TMA). Warpgroups 1 and 2 each own whole
//   128 x 128 tiles, the CTA's even and odd ones: two m64n128k16 per k16 step (128 accumulators a thread). An order
//   barrier lets a warpgroup start its multiply only once the other has issued all of its own, so the tensor cores
//   run one tile at a time while the other warpgroup updates; a second one keeps the epilogues in tile order. The update reads a chunk from its buffer, writes the
//   new values back in place and stores them with TMA (bulk stores, which release the buffer once read).
// Sums in the order of gemm_wgmma.cu's 128-column tiles (K ascending, the same m64n128k16 steps), so the bits are
// those of its unsplit wg128 / wg128x2 instances.

// mapW: the output (store) or the master's high half; mapLo its low half; mapMom, mapVar the fp32 states as pairs of
// 16-bit elements (boxes of 32 floats). All boxes 64 rows x 128 bytes, 128-byte swizzled.
template <int EPI, int STAGES, int EBUFS>
RG_DEVICE void pingpong_cr(const TensorMap* mapA, const TensorMap* mapB, const TensorMap* mapW, const TensorMap* mapLo,
                           const TensorMap* mapMom, const TensorMap* mapVar, int M, int N, int K, const Optim* opt,
                           int has_mom) {
#if RG_WGMMA
    constexpr int BK = 64, STAGE = 32768, A_BYTES = 16384;
    constexpr int STATES = EPI == EPI_ADAM ? 2 : EPI == EPI_SGD ? 1 : 0;
    constexpr int EBUF = EPI == EPI_STORE ? 8192 : 16384 + STATES * 16384;  // a 64 x 64 chunk of every array
    extern __shared__ __align__(1024) u8 smem_raw[];
    __shared__ u64 full[STAGES], empty[STAGES], efull[EBUFS], eempty[EBUFS], order[2], eorder[2];
    if (dynamic_smem_bytes() < STAGES * STAGE + EBUFS * EBUF + 1024) __trap();
    u8* stages = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
    u8* ebufs = stages + STAGES * STAGE;
    const int tiles_m = (M + 127) / 128, tiles = tiles_m * ((N + 127) / 128), k_tiles = (K + BK - 1) / BK;
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, warp = t / 32, lane = t % 32;
    const bool mom = EPI == EPI_ADAM || (EPI == EPI_SGD && has_mom);
    if (tid == 0) {
        prefetch_tensor_map(mapA);
        prefetch_tensor_map(mapB);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 1);
        }
        for (int e = 0; e < EBUFS; ++e) {
            mbar_init(&efull[e], 1);
            mbar_init(&eempty[e], 1);
        }
        mbar_init(&order[0], 128);
        mbar_init(&order[1], 128);
        mbar_init(&eorder[0], 128);
        mbar_init(&eorder[1], 128);
        fence_proxy_async();
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");  // the producers need few: the consumers take them
        if (tid == 0) {  // the k-tiles of every tile of this CTA, in tile order
            int idx = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int m0 = tile % tiles_m * 128, n0 = tile / tiles_m * 128;
                for (int kt = 0; kt < k_tiles; ++kt, ++idx) {
                    const int s = idx % STAGES, k = kt * BK;
                    if (idx >= STAGES) mbar_wait(&empty[s], (idx / STAGES - 1) & 1);
                    u8* a = stages + s * STAGE;
                    mbar_arrive_expect_tx(&full[s], STAGE);
                    tma_load_2d(a, mapA, m0, k, &full[s]);  // A^T: two panels of 64 k-rows x 64 m-columns
                    tma_load_2d(a + 8192, mapA, m0 + 64, k, &full[s]);
                    tma_load_2d(a + A_BYTES, mapB, n0, k, &full[s]);  // B: two panels of 64 k-rows x 64 columns
                    tma_load_2d(a + A_BYTES + 8192, mapB, n0 + 64, k, &full[s]);
                }
            }
        } else if (tid == 32) {  // the epilogue's inputs: chunk q of a tile is rows 64 (q / 2), columns 64 (q % 2)
            if (EPI != EPI_STORE) {
                prefetch_tensor_map(mapW);
                prefetch_tensor_map(mapLo);
                if (mom) prefetch_tensor_map(mapMom);
                if (EPI == EPI_ADAM) prefetch_tensor_map(mapVar);
            }
            int e = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int m0 = tile % tiles_m * 128, n0 = tile / tiles_m * 128;
                for (int q = 0; q < 4; ++q, ++e) {
                    const int b = e % EBUFS, r0 = m0 + 64 * (q / 2), c0 = n0 + 64 * (q % 2);
                    if (e >= EBUFS) mbar_wait(&eempty[b], (e / EBUFS - 1) & 1);
                    if (EPI == EPI_STORE) {
                        mbar_arrive(&efull[b]);
                        continue;
                    }
                    u8* buf = ebufs + b * EBUF;
                    mbar_arrive_expect_tx(&efull[b], 16384 + (mom ? 16384 : 0) + (EPI == EPI_ADAM ? 16384 : 0));
                    tma_load_2d(buf, mapW, c0, r0, &efull[b]);
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
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1;
    Optim o = {};
    if (EPI_UPDATES(EPI)) o = *opt;
    int n = 0;
    for (int j = c, tile = blockIdx.x + c * gridDim.x; tile < tiles; j += 2, tile += 2 * gridDim.x, ++n) {
        const int m0 = tile % tiles_m * 128, n0 = tile / tiles_m * 128;
        if (c == 1 || n > 0) mbar_wait(&order[c], (c == 0 ? n - 1 : n) & 1);  // the other's multiply is issued
        float d0[64], d1[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) d0[i] = d1[i] = 0.f;
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int idx = j * k_tiles + kt, s = idx % STAGES;
            mbar_wait(&full[s], (idx / STAGES) & 1);
            const u32 a = shared_address(stages + s * STAGE), b = a + A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const u64 db = smem_desc(b + kk * 2048, 8192, 1024);
                wgmma_n128<1, 1>(d0, smem_desc(a + kk * 2048, 8192, 1024), db);
                wgmma_n128<1, 1>(d1, smem_desc(a + 8192 + kk * 2048, 8192, 1024), db);
            }
            wg_commit();
            wg_wait<1>();
            if (kt > 0 && t == 0) mbar_arrive(&empty[(idx - 1) % STAGES]);
        }
        mbar_arrive(&order[1 - c]);  // the other warpgroup may multiply
        wg_wait<0>();
        wg_hold(d0);
        wg_hold(d1);
        if (t == 0 && k_tiles > 0) mbar_arrive(&empty[(j * k_tiles + k_tiles - 1) % STAGES]);
        // The epilogues run in tile order too: the buffers' ring is shared, and a barrier's parity names its phase
        // only while its waiter is at most one phase behind.
        if (c == 1 || n > 0) mbar_wait(&eorder[c], (c == 0 ? n - 1 : n) & 1);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int e = j * 4 + q, b = e % EBUFS;
            u8* buf = ebufs + b * EBUF;
            mbar_wait(&efull[b], (e / EBUFS) & 1);
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int jd = 8 * (q % 2) + jj, r = warp * 16 + lane / 4 + 8 * h, col = jj * 8 + 2 * (lane % 4);
                    const float g0 = q < 2 ? d0[4 * jd + 2 * h] : d1[4 * jd + 2 * h];
                    const float g1 = q < 2 ? d0[4 * jd + 2 * h + 1] : d1[4 * jd + 2 * h + 1];
                    u32* hi = reinterpret_cast<u32*>(plane_at(buf, r, col * 2));
                    if constexpr (EPI == EPI_STORE) {
                        *hi = pack_f16x2(g0, g1);
                    } else {
                        u32* lo = reinterpret_cast<u32*>(plane_at(buf + 8192, r, col * 2));
                        float2* m = reinterpret_cast<float2*>(plane_at(buf + 16384, r, col * 4));
                        float2* v = reinterpret_cast<float2*>(plane_at(buf + 32768, r, col * 4));
                        // gemm_wgmma.cu's update_pair, written out: as a call it changes the machine code of
                        // three of the SGD kernels timed here (their recorded numbers: docs/history.md)
                        float2 w = master_join2(*hi, *lo), y = mom ? *m : make_float2(0.f, 0.f);
                        const float2 g = make_float2(g0, g1);
                        if constexpr (EPI == EPI_SGD) {
                            optim_sgd2(w, g, y, o);
                        } else {
                            float2 z = *v;
                            optim_adam2(w, g, y, z, o);
                            *v = z;
                        }
                        if (mom) *m = y;
                        master_split2(w, *hi, *lo);
                        asm volatile("" ::: "memory");  // a pair at a time: fewer registers live
                    }
                }
            }
            fence_proxy_async();  // this thread's writes, before the copy engine reads them
            asm volatile("bar.sync %0, 128;" :: "r"(2 + c) : "memory");
            if (t == 0) {
                const int r0 = m0 + 64 * (q / 2), c0 = n0 + 64 * (q % 2);
                tma_store_2d(mapW, c0, r0, buf);
                if (EPI != EPI_STORE) {
                    tma_store_2d(mapLo, c0, r0, buf + 8192);
                    if (mom) {
                        tma_store_2d(mapMom, 2 * c0, r0, buf + 16384);
                        tma_store_2d(mapMom, 2 * c0 + 64, r0, buf + 24576);
                    }
                    if (EPI == EPI_ADAM) {
                        tma_store_2d(mapVar, 2 * c0, r0, buf + 32768);
                        tma_store_2d(mapVar, 2 * c0 + 64, r0, buf + 40960);
                    }
                }
                bulk_commit();
                if (q > 0) {  // the chunk before's stores have read their buffer: it may refill
                    bulk_wait_read<1>();
                    mbar_arrive(&eempty[(e - 1) % EBUFS]);
                }
                if (q == 3) {
                    bulk_wait_read<0>();
                    mbar_arrive(&eempty[b]);
                }
            }
        }
        mbar_arrive(&eorder[1 - c]);  // the other warpgroup may run its epilogue
    }
    if (t == 0) bulk_wait<0>();  // every store has landed before the grid ends
#else
    __trap();
#endif
}

#define PP_PARAMS                                                                                                  \
    const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB,                                 \
        const __grid_constant__ TensorMap mapW, const __grid_constant__ TensorMap mapLo,                           \
        const __grid_constant__ TensorMap mapMom, const __grid_constant__ TensorMap mapVar, int M, int N, int K,   \
        const Optim *opt, int has_mom
#define PP_INSTANCE(name, EPI, STAGES, EBUFS)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) name(PP_PARAMS) {                                        \
        pingpong_cr<EPI, STAGES, EBUFS>(&mapA, &mapB, &mapW, &mapLo, &mapMom, &mapVar, M, N, K, opt, has_mom);    \
    }
PP_INSTANCE(pp_cr_store, EPI_STORE, 6, 2)
PP_INSTANCE(pp_cr_sgd, EPI_SGD, 4, 2)
PP_INSTANCE(pp_cr_sgd_e3, EPI_SGD, 4, 3)
PP_INSTANCE(pp_cr_sgd_s5, EPI_SGD, 5, 2)
PP_INSTANCE(pp_cr_sgd_s3e4, EPI_SGD, 3, 4)
PP_INSTANCE(pp_cr_sgd_s2e5, EPI_SGD, 2, 5)
PP_INSTANCE(pp_cr_adam, EPI_ADAM, 4, 2)
PP_INSTANCE(pp_cr_adam_s2e3, EPI_ADAM, 2, 3)
