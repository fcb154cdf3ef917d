// What every GEMM kernel shares: the operand layouts, the epilogues, the launch parameters and the per-pair
// epilogue code (gemm.cu's cp.async pipeline and gemm_tma.cu's tensor-copy pipeline end the same way).
#pragma once
#include "common.cuh"
#include "cluster.cuh"
#include "ldmatrix.cuh"
#include "master.cuh"
#include "optim.cuh"
#include "activation.cuh"

enum Layout { ROW = 0, COL = 1 };
enum Epilogue {
    EPI_STORE = 0,      // C16 = acc
    EPI_BIAS = 1,       // C16 = acc + bias
    EPI_BIAS_ACT = 2,   // C16 = act(acc + bias) (activation.cuh); where the backward reads it, act'(acc + bias)
                        // (fp16) to `act` too, when given (training: evaluation passes none)
    EPI_DACT = 3,       // C16 = acc * act'(z), from the value the forward saved for it in `act` (activation.cuh)
    EPI_SGD = 4,        // G = acc; SGD's step (optim.cuh: momentum `mom`, Nesterov, L2) on the master (W16, lo) of
                        // master.cuh, `out` being lo. G never touches memory.
    EPI_ADAM = 5,       // the same with Adam's or AdamW's step, its moments in `mom` and `var`.
    EPI_STORE32 = 6,    // C32 = acc: a partial sum other GPUs add to (rawgpu/steps/split.py)
};

struct Params {
    const half_t* A; const half_t* B; void* out;
    int M, N, K, lda, ldb, ldc, k_chunk;
    const float* bias; half_t* act; int ld_act;
    float* mom; float* var; half_t* w16; const Optim* opt;
    float* workspace; int* tickets;
};

// The parameters of the kernels fed by the tensor copy engine (gemm_tma.cu, gemm_wgmma.cu: kernels/gemm.py binds
// both alike, TMA_SIGNATURE) and the Params they make of them: the maps take A's and B's places. The optimiser's
// pointers serve gemm_wgmma.cu's weight updates; the others' get nulls.
#define GEMM_TMA_PARAMS                                                                                              \
    const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB, void *out, int M, int N, int K,  \
        int ldc, int k_chunk, const float *bias, half_t *act, int ld_act, float *mom, float *var, half_t *w16,       \
        const Optim *opt, float *workspace, int *tickets, float keep_b
#define GEMM_TMA_ARGS {nullptr, nullptr, out, M, N, K, 0, 0, ldc, k_chunk, bias, act, ld_act, mom, var, w16, opt,    \
                       workspace, tickets}
// One such kernel: extern "C" name(GEMM_TMA_PARAMS), running the device function FN<CFG, LB, EPI, ACC16>.
#define GEMM_TMA_INSTANCE(name, FN, CFG, LB, EPI, ACC16)                                  \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1) name(GEMM_TMA_PARAMS) { \
        const Params p = GEMM_TMA_ARGS;                                                   \
        FN<CFG, LB, EPI, ACC16>(&mapA, &mapB, p, keep_b);                                 \
    }

// The epilogues that update a weight, one per optimiser family: compiled apart, so that SGD's stays as small as it
// was before Adam existed (a branch on the family inside a kernel made SGD's updates 8% slower at hidden 4096).
#define EPI_UPDATES(EPI) ((EPI) == EPI_SGD || (EPI) == EPI_ADAM)

// Plain SGD (or with momentum) for two adjacent weights w with gradient g: [v = mu v + g; step = v, else step = g;]
// w -= lr step. dx_sgd.cu's update (plain SGD); every other update is optim.cuh's.
RG_DEVICE void sgd_pair(float2& w, float2& v, float2 g, bool momentum, float mu, float lr) {
    if (momentum) {
        v.x = mu * v.x + g.x;
        v.y = mu * v.y + g.y;
        g = v;
    }
    w.x -= lr * g.x;
    w.y -= lr * g.y;
}

// What the epilogue of pair (row, col) reads besides the sum, for epilogue_pair: the master weights (joined) and
// the optimiser's state (sgd, adam: x, y[, z]), the bias (bias, bias_act), the saved activation (dact); zeros
// otherwise.
template <int EPI>
RG_DEVICE void epilogue_inputs(const Params& p, int row, int col, float2& x, float2& y, float2& z) {
    const i64 at = (i64)row * p.ldc + col;
    x = y = z = make_float2(0.f, 0.f);
    if (EPI_UPDATES(EPI)) {
        const short* lo = static_cast<const short*>(p.out);
        x = master_join2(*reinterpret_cast<const u32*>(p.w16 + at), *reinterpret_cast<const u32*>(lo + at));
        if (EPI == EPI_ADAM || p.mom != nullptr) y = *reinterpret_cast<const float2*>(p.mom + at);
        if (EPI == EPI_ADAM) z = *reinterpret_cast<const float2*>(p.var + at);
    } else if (EPI == EPI_BIAS || EPI == EPI_BIAS_ACT) {
        x = *reinterpret_cast<const float2*>(p.bias + col);
    } else if (EPI == EPI_DACT) {
        x = unpack_f16x2(*reinterpret_cast<const u32*>(p.act + (i64)row * p.ld_act + col));
    }
}

// The fp16 epilogues (store, bias, bias_act, dact) on two adjacent sums: the fp16 pair to write. x is the bias pair
// (bias, bias_act) or the saved activation's (dact). Also elementwise.cu's finish_sum, which runs it on store32's
// sums once the GPUs have added them up: with one partial sum, the bits this GEMM epilogue gives. slopes:
// bias_act's fp16 pair of act'(z), for a backward that reads it (ACT_SAVES_SLOPE); untouched otherwise.
template <int EPI>
RG_DEVICE u32 fp16_epilogue2(float v0, float v1, float2 x, u32* slopes = nullptr) {
    if (EPI == EPI_BIAS || EPI == EPI_BIAS_ACT) {
        v0 += x.x;
        v1 += x.y;
    }
    if (EPI == EPI_BIAS_ACT) {
        float d0 = 0.f, d1 = 0.f;
        v0 = act_forward(v0, d0);
        v1 = act_forward(v1, d1);
        if (ACT_SAVES_SLOPE && slopes != nullptr) *slopes = pack_f16x2(d0, d1);
    }
    if (EPI == EPI_DACT) {
        v0 = act_backward(v0, x.x);
        v1 = act_backward(v1, x.y);
    }
    return pack_f16x2(v0, v1);
}

// The epilogue for two horizontally adjacent outputs (row, col) and (row, col + 1); col is even. `x`, `y` and `z`
// were loaded beforehand by epilogue_inputs; `o` is the optimiser (update only). Every GEMM output is written here
// but those of gemm.cu's staged and persistent tiles, which have no store32 instance: the one place store32 writes.
template <int EPI>
RG_DEVICE void epilogue_pair(const Params& p, const Optim& o, int row, int col, float v0, float v1, float2 x, float2 y,
                             float2 z) {
    const i64 at = (i64)row * p.ldc + col;
    if (EPI == EPI_STORE32) {  // the sum as it is: the epilogue runs after the all-reduce (elementwise.cu: finish_sum)
        *reinterpret_cast<float2*>(static_cast<float*>(p.out) + at) = make_float2(v0, v1);
        return;
    }
    if (EPI_UPDATES(EPI)) {
        if (EPI == EPI_SGD) optim_sgd2(x, make_float2(v0, v1), y, o);
        else optim_adam2(x, make_float2(v0, v1), y, z, o);
        if (EPI == EPI_ADAM || p.mom != nullptr) *reinterpret_cast<float2*>(p.mom + at) = y;
        if (EPI == EPI_ADAM) *reinterpret_cast<float2*>(p.var + at) = z;
        u32 hi2, lo2;
        master_split2(x, hi2, lo2);
        *reinterpret_cast<u32*>(p.w16 + at) = hi2;
        *reinterpret_cast<u32*>(static_cast<short*>(p.out) + at) = lo2;
        return;
    }
    if (EPI == EPI_BIAS_ACT && ACT_SAVES_SLOPE && p.act != nullptr) {
        u32 slopes;
        *reinterpret_cast<u32*>(reinterpret_cast<half_t*>(p.out) + at) = fp16_epilogue2<EPI>(v0, v1, x, &slopes);
        *reinterpret_cast<u32*>(p.act + (i64)row * p.ld_act + col) = slopes;
        return;
    }
    *reinterpret_cast<u32*>(reinterpret_cast<half_t*>(p.out) + at) = fp16_epilogue2<EPI>(v0, v1, x);
}

// Zero a warp's mma accumulators (fp32: 4 per 16x8 tile; fp16: 2 packed registers).
template <int M, int N>
RG_DEVICE void zero_fragments(float (&a)[M][N][4]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) a[i][j][0] = a[i][j][1] = a[i][j][2] = a[i][j][3] = 0.f;
}
template <int N>
RG_DEVICE void zero_fragments(float (&a)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j) a[j][0] = a[j][1] = a[j][2] = a[j][3] = 0.f;
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
// The ticket itself: after every thread of the block wrote its split's sums, whether this block is the tile's last
// split to finish (it then sees every split's sums).
RG_DEVICE bool last_to_take(int* ticket) {
    __shared__ int taken;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) taken = atomicAdd(ticket, 1);
    __syncthreads();
    if (taken != (int)gridDim.z - 1) return false;
    __threadfence();
    return true;
}

template <int ITERS, int THREADS, int PAIRS>
RG_DEVICE bool sum_splits_in_order(float2 (&sum)[ITERS], float2* ws, i64 split_stride, int* ticket) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
        if (tid + it * THREADS < PAIRS) ws[blockIdx.z * split_stride + tid + it * THREADS] = sum[it];
    if (!last_to_take(ticket)) return false;
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

#if __CUDA_ARCH__ >= 900
// Split-K inside a thread-block cluster (sm_90): the splits of one output tile are the CTAs of one cluster (cluster
// dims 1 x 1 x splits, so a CTA's rank is its split). Each CTA has left its partial BM x BN tile in its own shared
// memory (`part`, rows of CLUSTER_PART_LD(BN) floats). After one cluster barrier, CTA r takes its 1/splits share
// of the tile's pairs, adds them up over every CTA's part in split order (the same additions, so the same bits, as
// the workspace fix-up) and runs the epilogue on them; a second barrier keeps each CTA's shared memory alive until
// the others have read it. Against the workspace fix-up: no trip through L2 and back, no ticket, and the epilogue
// is spread over all the splits' SMs instead of run by the last one.
#define CLUSTER_PART_LD(BN) ((BN) + 8)  // floats: rows stay 16-byte aligned, fragment stores spread over the banks
#ifndef GEMM_MAX_CLUSTER_SPLITS
#error "gemm_epilogue.cuh needs rawgpu/contract/gemm.py's GEMM_MAX_CLUSTER_SPLITS (rawgpu/runtime/compiler.py passes it)"
#endif
constexpr int MAX_CLUSTER_SPLITS = GEMM_MAX_CLUSTER_SPLITS;  // the most splits the launcher puts in one cluster

template <int EPI, int BM, int BN, int THREADS>
RG_DEVICE void finish_cluster_splits(const Params& p, const Optim& o, const float* part, int m0, int n0) {
    constexpr int LD = CLUSTER_PART_LD(BN), PER_ROW = BN / 2, PAIRS = BM * PER_ROW;
    cluster_sync();  // every split's partial tile is in its shared memory
    const int splits = (int)cluster_ctas(), rank = (int)cluster_rank();
    const int share = (PAIRS + splits - 1) / splits, end = min(PAIRS, (rank + 1) * share);
    for (int i = rank * share + (int)threadIdx.x; i < end; i += THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * 2, row = m0 + r, col = n0 + c;
        const bool in = row < p.M && col < p.N;
        float2 x = make_float2(0.f, 0.f), y = x, z = x;
        if (in) epilogue_inputs<EPI>(p, row, col, x, y, z);
        // cluster_sum_f2 (cluster.cuh) written out: through the helper, gemm_outer64 spills (tests/test_compiler.py)
        const u32 at = shared_address(part + r * LD + c);
        float2 v[MAX_CLUSTER_SPLITS];
#pragma unroll
        for (int z = 0; z < MAX_CLUSTER_SPLITS; ++z)
            if (z < splits) v[z] = cluster_load_f2(cluster_address(at, z));
        float2 sum = make_float2(0.f, 0.f);
#pragma unroll
        for (int z = 0; z < MAX_CLUSTER_SPLITS; ++z)
            if (z < splits) {
                sum.x += v[z].x;
                sum.y += v[z].y;
            }
        if (in) epilogue_pair<EPI>(p, o, row, col, sum.x, sum.y, x, y, z);
    }
    cluster_sync();  // nobody leaves while another CTA may still read its part
}
#endif
