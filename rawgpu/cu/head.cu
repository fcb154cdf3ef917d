// The classifier head's whole step in one kernel (sm_90): logits = h W + b, softmax cross-entropy, the metrics,
// dh = (dlogits W^T) * relu'(h) for the layer below, and the SGD update of W (the master's two halves, master.cuh)
// and b.
//
// Why: in the layered step the head was four kernels (a split-K GEMM, softmax_xent, dx_sgd, bias_update) around a
// 10-column weight of only H x 16, each a dependent launch that costs its latency however little it does. Here one cluster of C
// CTAs does all of it, and the only exchange is the partial logits, through distributed shared memory.
//
//   CTA r owns rows [r kc, (r + 1) kc) of W (and the same columns of h). It loads its rows of W (before waiting for
//   the prior kernel: they were written a step ago) and its columns of h, multiplies them into a 32 x 16 partial
//   of the logits, and after one cluster barrier every CTA adds up all C partials in CTA order (the same bits in
//   each), adds b, rounds to fp16 as the stored logits, and runs the softmax cross-entropy (step_math.cuh, 8 lanes
//   per row). Then each CTA computes its columns of dh from the old W and updates its rows of W, with no further
//   exchange. CTA 0 alone writes the logits, their gradient, the metrics (summed over rows in order) and b
//   (bias_update's exact fixed-point column sums). Every sum has a fixed order: bitwise reproducible.
// Needs batch <= 32, plain SGD and the classes padded to 16; kernels/head.py checks. Builds for every arch with a
// trapping body below sm_90.
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "master.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "cluster.cuh"
#include "pdl.cuh"
#include "step_math.cuh"

// From rawgpu/contract.py, as -D options (`python -m rawgpu.contract head.cu` prints them): HEAD_THREADS, HEAD_ROWS
// (batch rows), HEAD_CLASSES (padded), and the launch's shared memory for kc rows of W, HEAD_SMEM_PER_ROW kc +
// HEAD_SMEM_FIXED (the launcher's number, asserted below to be carve's).
#if !defined(HEAD_THREADS) || !defined(HEAD_ROWS) || !defined(HEAD_CLASSES) || !defined(HEAD_SMEM_PER_ROW) || \
    !defined(HEAD_SMEM_FIXED)
#error "head.cu is built with rawgpu/contract.py's defines (rawgpu/compiler.py passes them)"
#endif

namespace head {
constexpr int THREADS = HEAD_THREADS, WARPS = THREADS / 32, ROWS = HEAD_ROWS, CLASSES = HEAD_CLASSES;
constexpr int LDW = CLASSES + 8;  // halves per row of W (and lo) in shared memory: conflict-free fragment loads
constexpr int LDD = CLASSES + 8;  // halves per row of dlogits
constexpr int RED_LD = CLASSES + 4;

// Shared memory for kc rows of W per CTA: what carve() lays out.
struct Smem {
    half_t* w; short* lo; half_t* h; float* red; float* part; float* z; half_t* d; int* labels; float* loss; int* hit;
    int ldh;
};
RG_DEVICE constexpr u32 smem_bytes(int kc) {
    return (u32)(2 * kc * LDW * 2 + ROWS * (kc + 8) * 2 + WARPS * ROWS * RED_LD * 4 + 2 * ROWS * CLASSES * 4 +
                 ROWS * LDD * 2 + 3 * ROWS * 4);
}
// Both are linear in kc, so agreeing at two points they agree at every one.
static_assert(smem_bytes(0) == HEAD_SMEM_FIXED && smem_bytes(16) == HEAD_SMEM_PER_ROW * 16 + HEAD_SMEM_FIXED,
              "rawgpu/contract.py's head_smem_bytes must be this layout's size");
RG_DEVICE Smem carve(u8* s, int kc) {
    Smem m;
    m.ldh = kc + 8;
    m.w = reinterpret_cast<half_t*>(s);                  s += kc * LDW * 2;
    m.lo = reinterpret_cast<short*>(s);                  s += kc * LDW * 2;
    m.h = reinterpret_cast<half_t*>(s);                  s += ROWS * m.ldh * 2;
    m.red = reinterpret_cast<float*>(s);                 s += WARPS * ROWS * RED_LD * 4;
    m.part = reinterpret_cast<float*>(s);                s += ROWS * CLASSES * 4;
    m.z = reinterpret_cast<float*>(s);                   s += ROWS * CLASSES * 4;
    m.d = reinterpret_cast<half_t*>(s);                  s += ROWS * LDD * 2;
    m.labels = reinterpret_cast<int*>(s);                s += ROWS * 4;
    m.loss = reinterpret_cast<float*>(s);                s += ROWS * 4;
    m.hit = reinterpret_cast<int*>(s);
    return m;
}
}  // namespace head

// h [B, K] (ld ldh): the top hidden layer's output; W as wlo / w16 [K, 16]; bias [16]; logits, dlogits [B, 16];
// dh [B, K] (ld lddh). kc: rows of W per CTA (a multiple of 16, C kc >= K). scale: the loss scale over the batch.
// step (may be null): the training step counter, moved forward by one here. In the layered step only the gather (and
// the lr it writes) reads it, and that kernel has finished once this one's wait returns (pdl.cuh), so the counter
// needs no launch of its own.
extern "C" __global__ void __launch_bounds__(head::THREADS, 1)
head_step(const half_t* h, int ldh, const int* labels, short* wlo, half_t* w16, float* bias, const float* lr,
          half_t* logits, half_t* dlogits, half_t* dh, int lddh, double* loss_sum, int* correct, int B, int K,
          int kc, int classes, float scale, i64* step) {
#if __CUDA_ARCH__ >= 900
    using namespace head;
    extern __shared__ __align__(128) u8 smem_raw[];
    if (dynamic_smem_bytes() < smem_bytes(kc)) __trap();  // launcher/kernel mismatch
    const Smem S = carve(smem_raw, kc);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4, r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
    const int rank = (int)cluster_rank(), C = (int)cluster_ctas(), k0 = rank * kc;

    // This CTA's rows of W and the bias (written by this kernel a step ago), the labels (by the gather, which has
    // finished: pdl.cuh) before waiting for the prior kernel; its columns of h, that kernel's output, after.
    for (int i = tid; i < 2 * kc; i += THREADS) {
        const int row = i / 2, c = (i % 2) * 8;
        const bool valid = k0 + row < K;
        const i64 at = valid ? (i64)(k0 + row) * CLASSES + c : 0;
        cp_async_16(S.w + row * LDW + c, w16 + at, valid);
        cp_async_16(S.lo + row * LDW + c, wlo + at, valid);
    }
    const int pr = 2 * tid / CLASSES, pc = 2 * tid % CLASSES;  // this thread's pair of logits: row pr, classes pc, +1
    const float2 b = *reinterpret_cast<const float2*>(bias + pc);
    if (tid < ROWS) S.labels[tid] = tid < B ? labels[tid] : -1;
    pdl_enter();
    if (step != nullptr && rank == 0 && tid == 0) *step += 1;
    const int pieces = kc / 8;
    for (int i = tid; i < ROWS * pieces; i += THREADS) {
        const int r = i / pieces, c = (i % pieces) * 8;
        const bool valid = r < B && k0 + c < K;
        cp_async_16(S.h + r * S.ldh + c, valid ? h + (i64)r * ldh + k0 + c : h, valid);
    }
    cp_async_commit();
    const float rate = *lr;
    cp_async_wait<0>();
    __syncthreads();

    // Partial logits h[:, rows] @ W[rows, :]: warp w takes the k16 steps w, w + 8, ...; the warps' sums meet in
    // shared memory in warp order.
    {
        float acc[2][2][4];
        zero_fragments(acc);
        for (int ks = warp; ks < kc / 16; ks += WARPS) {
            u32 a[2][4], r[4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldmatrix_x4(a[mt], shared_address(S.h + (16 * mt + r8 + 8 * q1) * S.ldh + 16 * ks + 8 * q2));
            ldmatrix_x4_trans(r, shared_address(S.w + (16 * ks + r8 + 8 * q1) * LDW + 8 * q2));
            const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma_m16n8k16_f32(acc[mt][0], a[mt], b0);
                mma_m16n8k16_f32(acc[mt][1], a[mt], b1);
            }
        }
        store_fragments(S.red + warp * ROWS * RED_LD, RED_LD, acc);
    }
    __syncthreads();
    {
        float2 s = make_float2(0.f, 0.f);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float2 v = *reinterpret_cast<const float2*>(S.red + (w * ROWS + pr) * RED_LD + pc);
            s.x += v.x;
            s.y += v.y;
        }
        *reinterpret_cast<float2*>(S.part + pr * CLASSES + pc) = s;
    }
    cluster_sync();  // every CTA's partial logits are in its shared memory

    // The logits: all partials in CTA order, + b, rounded to fp16 (the value a stored logit holds).
    {
        const u32 at = shared_address(S.part + pr * CLASSES + pc);
        float2 s = make_float2(0.f, 0.f);
        for (int z = 0; z < C; ++z) {
            const float2 v = cluster_load_f2(cluster_address(at, (u32)z));
            s.x += v.x;
            s.y += v.y;
        }
        const u32 z16 = pack_f16x2(s.x + b.x, s.y + b.y);
        *reinterpret_cast<float2*>(S.z + pr * CLASSES + pc) = unpack_f16x2(z16);
        if (rank == 0 && pr < B) *reinterpret_cast<u32*>(logits + pr * CLASSES + pc) = z16;
    }
    cluster_arrive_relaxed();  // done with the other CTAs' memory; they wait for this before they leave
    __syncthreads();

    // Softmax cross-entropy, 8 lanes per row and 4 rows per warp: every row at once, in every CTA alike.
    {
        const int row = warp * 4 + lane / 8, q = lane % 8;
        const float z[2] = {S.z[row * CLASSES + q], S.z[row * CLASSES + q + 8]};
        const XentRow<2> x = softmax_xent_row<8, 2>(z, classes, S.labels[row], scale);
        const bool live = row < B;
        S.d[row * LDD + q] = f32_to_f16(live ? x.grad[0] : 0.f);
        S.d[row * LDD + q + 8] = f32_to_f16(live ? x.grad[1] : 0.f);
        if (q == 0) {
            S.loss[row] = live ? x.loss : 0.f;
            S.hit[row] = live && x.hit;
        }
    }
    __syncthreads();
    if (rank == 0) {  // the logits' gradient, the bias update and the metrics, rows in order
        if (pr < B) *reinterpret_cast<u32*>(dlogits + pr * CLASSES + pc) = *reinterpret_cast<const u32*>(S.d + pr * LDD + pc);
        if (tid < CLASSES) {
            i64 sum = 0;
            for (int r = 0; r < B; ++r) sum += f16_fixed24(S.d[r * LDD + tid]);
            bias[tid] -= rate * (float)((double)sum * (1.0 / 16777216.0));
        } else if (tid == CLASSES) {
            double total = 0.0;
            int hits = 0;
            for (int r = 0; r < B; ++r) total += (double)S.loss[r], hits += S.hit[r];
            *loss_sum += total;
            *correct += hits;
        }
    }

    // dh[:, rows] = dlogits @ W[rows, :]^T, masked by relu'(h) (h > 0): warp w takes the 8-row tiles w, w + 8, ...
    {
        u32 fa[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(fa[mt], shared_address(S.d + (16 * mt + r8 + 8 * q1) * LDD + 8 * q2));
        for (int j = warp; j < kc / 8; j += WARPS) {
            const half_t* wr = S.w + (8 * j + g) * LDW + 2 * t;
            const u32 fb[2] = {*reinterpret_cast<const u32*>(wr), *reinterpret_cast<const u32*>(wr + 8)};
            const int col = 8 * j + 2 * t;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                mma_m16n8k16_f32(c, fa[mt], fb);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = 16 * mt + g + 8 * hh;
                    if (row >= B || k0 + col >= K) continue;
                    const float2 x = unpack_f16x2(*reinterpret_cast<const u32*>(S.h + row * S.ldh + col));
                    *reinterpret_cast<u32*>(dh + (i64)row * lddh + k0 + col) =
                        pack_f16x2(x.x > 0.f ? c[2 * hh] : 0.f, x.y > 0.f ? c[2 * hh + 1] : 0.f);
                }
            }
        }
    }
    __syncthreads();  // every warp has read the old weights

    // W[rows, :] -= lr h[:, rows]^T @ dlogits on the joined master: warp w takes the 16-row tiles w, w + 8, ...
    {
        u32 fd[2][2][2];  // dlogits as B: [k16 step over the batch][class tile]
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            u32 r[4];
            ldmatrix_x4_trans(r, shared_address(S.d + (16 * kk + r8 + 8 * q1) * LDD + 8 * q2));
            fd[kk][0][0] = r[0]; fd[kk][0][1] = r[1]; fd[kk][1][0] = r[2]; fd[kk][1][1] = r[3];
        }
        for (int m = warp; m < kc / 16; m += WARPS) {
            float gacc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                u32 a[4];
                ldmatrix_x4_trans(a, shared_address(S.h + (16 * kk + r8 + 8 * q2) * S.ldh + 16 * m + 8 * q1));
                mma_m16n8k16_f32(gacc[0], a, fd[kk][0]);
                mma_m16n8k16_f32(gacc[1], a, fd[kk][1]);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int at = (16 * m + g + 8 * hh) * LDW + 8 * n + 2 * t;
                    u32& hi2 = *reinterpret_cast<u32*>(S.w + at);
                    u32& lo2 = *reinterpret_cast<u32*>(S.lo + at);
                    float2 v = master_join2(hi2, lo2), unused = make_float2(0.f, 0.f);
                    sgd_pair(v, unused, make_float2(gacc[n][2 * hh], gacc[n][2 * hh + 1]), false, 0.f, rate);
                    master_split2(v, hi2, lo2);
                }
        }
    }
    __syncthreads();
    for (int i = tid; i < 2 * kc; i += THREADS) {
        const int row = i / 2, c = (i % 2) * 8;
        if (k0 + row >= K) continue;
        const i64 at = (i64)(k0 + row) * CLASSES + c;
        store_16(w16 + at, load_16(S.w + row * LDW + c));
        store_16(wlo + at, load_16(S.lo + row * LDW + c));
    }
    cluster_wait();  // the others have read this CTA's partial logits
#else
    __trap();  // thread-block clusters are sm_90+
#endif
}
