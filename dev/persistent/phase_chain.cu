// Experiment: what one dependent phase costs in a persistent step whose CTAs keep their weights on chip
// (docs/perf.md, "What is next", item 1: the column-slice design for hidden 128-1024 at batch 128).
//
// C CTAs, all resident, run `layers` forward layers h_{l+1} = relu(h_l W) of a 128-row batch, W one H x H fp16
// matrix (the same for every layer: only the phase's latency is measured here, not how many layers fit). CTA c
// holds columns [c n, (c + 1) n) of W in shared memory, loaded once per launch. Per layer it
//   1. each warp waits until all C x 8 warps have published the layer below (one counter per layer in global
//      memory, released by each warp's lane 0 after its stores; the counter only grows, so a ticket names the
//      launch);
//   2. the warp copies its 16 rows of the 128 x H input from L2 into shared memory (cp.async, in K chunks so the
//      mma of chunk 0 starts while later chunks land);
//   3. multiplies them by the CTA's column slice on the tensor cores and stores its 16 x n outputs, relu'd, fp16.
// So a phase is: counter release -> acquire (L2 round trips), the input's copy (128 H 2 bytes per CTA through
// L2), the mma chain over K = H, the stores. run.py checks it against float64.
#include "common.cuh"
#include "ldmatrix.cuh"
#include "mma.cuh"
#include "cp_async.cuh"
#include "grid_sync.cuh"

namespace chain {
constexpr int THREADS = 256, ROWS = 128;
// mode bits, to take a phase apart: one arrival per CTA (after a CTA barrier) instead of one per warp; no input
// copy; no mma (the stores and the counters stay, so the chain of dependencies is the same).
constexpr int CTA_ARRIVALS = 1, NO_LOAD = 2, NO_MMA = 4;

// Shared memory: the input (ROWS x ld halves), the weight slice (n x ld halves, row j = column c n + j of W,
// contiguous along k: ldmatrix without .trans gives the mma's B fragment). Each warp works alone on its 16 rows:
// it waits for the layer below, loads its rows of the input, multiplies, stores and arrives, with no CTA barrier.
template <int NT>
RG_DEVICE void run(const half_t* __restrict__ x, const half_t* __restrict__ w, half_t* __restrict__ act,
                   u64* __restrict__ flags, int H, int layers, int chunks, int mode) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 smem[];
    constexpr int N = 8 * NT, WARPS = THREADS / 32;
    const int ld = H + 8, kc = H / chunks;
    half_t* in = reinterpret_cast<half_t*>(smem);
    half_t* ws = in + ROWS * ld;
    const int c = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = 16 * warp;
    const bool per_cta = mode & CTA_ARRIVALS, load = !(mode & NO_LOAD), multiply = !(mode & NO_MMA);
    const u64 arrivals = (u64)gridDim.x * (per_cta ? 1 : WARPS);
    for (int i = threadIdx.x; i < H * N; i += THREADS) {  // ws[j][k] = W[k][c N + j]
        const int k = i / N, j = i % N;
        ws[j * ld + k] = w[(i64)k * H + c * N + j];
    }
    __syncthreads();
    u64 target = 0;
    const u32 a_addr = shared_address(in + (r0 + (lane % 8) + ((lane / 8) & 1) * 8) * ld + (lane / 16) * 8);
    const u32 b_addr = shared_address(ws + (lane % 8) * ld + (lane / 8) * 8);
    for (int l = 0; l < layers; ++l) {
        const half_t* src = l == 0 ? x : act + (i64)(l - 1) * ROWS * H;
        half_t* dst = act + (i64)l * ROWS * H;
        if (l > 0 && (per_cta ? threadIdx.x == 0 : lane == 0))
            while (load_acquire_gpu(&flags[l - 1]) < target) {
            }
        if (per_cta) __syncthreads();
        __syncwarp();
        const int pieces = kc / 8;  // 16-byte pieces per row and chunk
        for (int i = 0; i < chunks && load; ++i) {
            for (int p = lane; p < 16 * pieces; p += 32) {
                const int r = r0 + p / pieces, k = i * kc + 8 * (p % pieces);
                cp_async_16(in + r * ld + k, src + (i64)r * H + k, true);
            }
            cp_async_commit();
        }
        float acc[NT][4] = {};
        for (int i = 0; i < chunks && multiply; ++i) {
            switch (chunks - 1 - i) {  // this warp's chunk i has landed
                case 0: cp_async_wait<0>(); break;
                case 1: cp_async_wait<1>(); break;
                case 2: cp_async_wait<2>(); break;
                default: cp_async_wait<3>(); break;
            }
            __syncwarp();
            for (int k = i * kc; k < (i + 1) * kc; k += 32) {
                u32 a0[4], a1[4];
                ldmatrix_x4(a0, a_addr + k * 2);
                ldmatrix_x4(a1, a_addr + (k + 16) * 2);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    u32 b[4];
                    ldmatrix_x4(b, b_addr + (t * 8 * ld + k) * 2);
                    const u32 b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    mma_m16n8k16_f32(acc[t], a0, b0);
                    mma_m16n8k16_f32(acc[t], a1, b1);
                }
            }
        }
        const int g = lane / 4, q = lane % 4;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int col = c * N + t * 8 + 2 * q;
            *reinterpret_cast<u32*>(dst + (i64)(r0 + g) * H + col) =
                pack_f16x2(fmaxf(acc[t][0], 0.f), fmaxf(acc[t][1], 0.f));
            *reinterpret_cast<u32*>(dst + (i64)(r0 + g + 8) * H + col) =
                pack_f16x2(fmaxf(acc[t][2], 0.f), fmaxf(acc[t][3], 0.f));
        }
        __syncwarp();  // the warp's stores (and its reads of its rows of `in`) before its release
        if (per_cta) __syncthreads();
        if (per_cta ? threadIdx.x == 0 : lane == 0) target = (atomic_add_release_gpu(&flags[l], 1) / arrivals + 1) * arrivals;
    }
#endif
}
}  // namespace chain

#define CHAIN_KERNEL(NT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(chain::THREADS) phase_chain_n##NT(                           \
        const half_t* x, const half_t* w, half_t* act, u64* flags, int H, int layers, int chunks, int mode) {\
        chain::run<NT>(x, w, act, flags, H, layers, chunks, mode);                                           \
    }
CHAIN_KERNEL(1)
CHAIN_KERNEL(2)
CHAIN_KERNEL(4)
