// Elementwise kernels: memory-bound grid-stride loops, 16-byte accesses where alignment allows, and the
// small per-parameter updates. No float atomics: every result is the same bits on every run.
#include "common.cuh"
#include "step_math.cuh"
#include "pdl.cuh"
#include "master.cuh"
#include "optim.cuh"
#include "gemm_epilogue.cuh"
#include "exact_sum.cuh"

#ifndef EW_THREADS
#error "elementwise.cu is built with rawgpu/contract/elementwise.py's defines (rawgpu/runtime/compiler.py passes them)"
#endif

RG_DEVICE bool ew_aligned16(const void* p) { return ((u64)p & 15) == 0; }

// y = a * x + b * y over n floats. The stack's smoke test: it exercises pointer, float and int64 arguments.
extern "C" __global__ void axpby_f32(float* __restrict__ y, const float* __restrict__ x, float a, float b, i64 n) {
    GRID_STRIDE(i, n) y[i] = a * x[i] + b * y[i];
}

// dst = src (n halves) when step is null or *step is odd, 16-byte pieces when aligned. The fused step keeps two
// fp16 working copies and the current one is copy (steps done) & 1 (fused_step.cu): this makes both equal to it.
extern "C" __global__ void copy_f16_if_odd(half_t* __restrict__ dst, const half_t* __restrict__ src, i64 n,
                                           const i64* __restrict__ step) {
    if (step != nullptr && (*step & 1) == 0) return;
    i64 done = 0;
    if (ew_aligned16(dst) && ew_aligned16(src)) {
        const i64 n8 = n >> 3;
        GRID_STRIDE(v, n8) reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
        done = n8 << 3;
    }
    GRID_STRIDE(j, n - done) dst[done + j] = src[done + j];
}

// Adds `by` to a device counter: the step counter that lets one captured graph replay every step unchanged.
extern "C" __global__ void increment_i64(i64* counter, int by) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *counter += by;
}

// p[0..n) = v, float4 stores when aligned.
extern "C" __global__ void fill_f32(float* __restrict__ p, i64 n, float v) {
    i64 done = 0;
    if (ew_aligned16(p)) {
        const i64 n4 = n >> 2;
        GRID_STRIDE(k, n4) reinterpret_cast<float4*>(p)[k] = make_float4(v, v, v, v);
        done = n4 << 2;
    }
    GRID_STRIDE(j, n - done) p[done + j] = v;
}

// Bias gradient + the optimiser's update (optim.cuh). g[c] = sum over rows of dy[r, c], summed EXACTLY in 2^-24 fixed
// point (int64 holds 2^23 rows of any fp16) and rounded once to fp32. Block = (TX, TY): TX threads cover 8*TX
// columns (one 16-byte load per row when ld % 8 == 0 and dy is aligned), TY threads split the rows; the TY
// partials meet in shared memory. Grid: column tiles x row ranges of split_rows rows; the ranges' sums meet in
// `scratch` (int64 per column, zero) and the last range of a tile (its `tickets` entry) finishes it, leaving both
// zero (exact_sum.cuh: integers, so the same bits in any order and for any split). blockDim.x * blockDim.y <=
// EW_THREADS (rawgpu/contract/elementwise.py, a -D option: the launcher's block). m, v: the optimiser's state (null
// where it keeps none). grad: where g goes instead of the update (data parallelism adds it up over the GPUs first:
// apply_update); null to update.
//
// BIAS_MODELS (elementwise_models.cu sets it for the models step; 0 here): grid z is the model of a sweep; model mo
// reads dy + mo z_dy, steps its bias, m and v at + mo z_bias with its optimiser row opt + mo, and sums through its
// own scratch + mo z_scratch and tickets + mo z_tickets.
#ifndef BIAS_MODELS
#define BIAS_MODELS 0
#endif
#if BIAS_MODELS
#define BIAS_MODEL_PARAMS , i64 z_dy, i64 z_bias, i64 z_scratch, i64 z_tickets
#else
#define BIAS_MODEL_PARAMS
#endif
extern "C" __global__ void bias_update(const half_t* __restrict__ dy, int ld, int rows, int cols,
                                       float* __restrict__ bias, float* __restrict__ m, float* __restrict__ v,
                                       const Optim* __restrict__ opt, float* __restrict__ grad, int split_rows,
                                       i64* scratch, int* tickets BIAS_MODEL_PARAMS) {
#if BIAS_MODELS
    {
        const i64 model = blockIdx.z;
        dy += model * z_dy;
        bias += model * z_bias;
        if (m) m += model * z_bias;
        if (v) v += model * z_bias;
        opt += model;
        if (grad) grad += model * z_bias;
        scratch += model * z_scratch;
        tickets += model * z_tickets;
    }
#endif
    __shared__ i64 part[EW_THREADS * 8];  // [TY][TX * 8]
    pdl_enter();
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const int tile = TX * 8;
    const int c0 = blockIdx.x * tile + tx * 8;
    const int r0 = blockIdx.y * split_rows, r1 = min(rows, r0 + split_rows);
    const bool vec = (ld % 8 == 0) && ew_aligned16(dy);
    i64 acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0;
    if (c0 < cols) {
        for (int r = r0 + ty; r < r1; r += TY) {
            const half_t* row = dy + (i64)r * ld + c0;
            if (vec) {  // c0 % 8 == 0 and c0 < cols <= ld: the 8 columns lie inside the row
                const uint4 v = load_16(row);
                const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    acc[2 * k] += f16_fixed24(w[k] & 0xFFFF);
                    acc[2 * k + 1] += f16_fixed24(w[k] >> 16);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (c0 + k < cols) acc[k] += f16_fixed24(row[k]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) part[ty * tile + tx * 8 + k] = acc[k];
    __syncthreads();
    auto finish = [&](int c, i64 sum) {
        const float g = (float)((double)sum * (1.0 / 16777216.0));
        if (grad != nullptr) grad[c] = g;
        else bias_step(c, g, bias, m, v, *opt);
    };
    const bool split = gridDim.y > 1;
    for (int t = ty * TX + tx; t < tile; t += TX * TY) {  // one thread per column of the tile sums its rows
        const int c = blockIdx.x * tile + t;
        if (c >= cols) break;
        i64 sum = 0;
        for (int y = 0; y < TY; ++y) sum += part[y * tile + t];
        if (split) exact_add(scratch + c, sum);
        else finish(c, sum);
    }
    if (!split || !last_of_blocks(tickets + blockIdx.x, gridDim.y)) return;
    for (int t = ty * TX + tx; t < tile; t += TX * TY) {  // the tile's last row range finishes it
        const int c = blockIdx.x * tile + t;
        if (c >= cols) break;
        finish(c, exact_take(scratch + c));
    }
}

// The weights' and the bias's step of one layer from gradients summed over the GPUs (data parallelism: the weight
// gradient from a store32 GEMM, the bias's from bias_update's grad): the weights through the GEMM's own update
// epilogue (gemm_epilogue.cuh: epilogue_inputs, epilogue_pair), the bias through bias_step, so with one GPU the bits
// of the fused updates. g: rows x cols fp32 (cols even), the master (w16, lo) and state (mom, var) of that shape;
// gb, bias, mb, vb: cols. A thread per pair of weights, then per bias.
template <int EPI>
RG_DEVICE void apply_update(const float* __restrict__ g, const float* __restrict__ gb, half_t* w16, short* lo,
                            float* mom, float* var, float* bias, float* mb, float* vb, const Optim* __restrict__ opt,
                            int rows, int cols) {
    pdl_enter();  // the gradients are the all-reduce's
    Params p{};
    p.out = lo;
    p.w16 = w16;
    p.mom = mom;
    p.var = var;
    p.ldc = cols;
    const Optim o = *opt;
    const i64 pairs = (i64)rows * (cols / 2);
    GRID_STRIDE(i, pairs + cols) {
        if (i < pairs) {
            const int row = (int)(i / (cols / 2)), col = (int)(i % (cols / 2)) * 2;
            const float2 s = *reinterpret_cast<const float2*>(g + (i64)row * cols + col);
            float2 x, y, z;
            epilogue_inputs<EPI>(p, row, col, x, y, z);
            epilogue_pair<EPI>(p, o, row, col, s.x, s.y, x, y, z);
        } else {
            const int c = (int)(i - pairs);
            bias_step(c, gb[c], bias, mb, vb, o);
        }
    }
}

// apply_update per optimiser family (kernels/elementwise.py picks apply_update_<family>).
extern "C" __global__ void apply_update_sgd(const float* __restrict__ g, const float* __restrict__ gb, half_t* w16,
                                            short* lo, float* mom, float* var, float* bias, float* mb, float* vb,
                                            const Optim* __restrict__ opt, int rows, int cols) {
    apply_update<EPI_SGD>(g, gb, w16, lo, mom, var, bias, mb, vb, opt, rows, cols);
}
extern "C" __global__ void apply_update_adam(const float* __restrict__ g, const float* __restrict__ gb, half_t* w16,
                                             short* lo, float* mom, float* var, float* bias, float* mb, float* vb,
                                             const Optim* __restrict__ opt, int rows, int cols) {
    apply_update<EPI_ADAM>(g, gb, w16, lo, mom, var, bias, mb, vb, opt, rows, cols);
}

// A tensor-parallel layer's GEMM epilogue, run once the GPUs have added up its store32 partial sums (the all-reduce,
// rawgpu/steps/split.py): out = the epilogue EPI of total, rows x cols fp32 (cols a multiple of 8, rows of both
// contiguous), by fp16_epilogue2 (gemm_epilogue.cuh), so with one partial sum the bits of the GEMM with that epilogue.
// bias: [>= cols] (bias, bias_act); act, rows x cols: what the backward reads (dact: the value the forward saved;
// bias_act: where act'(z) goes, for an activation whose backward reads it). 8 columns per thread, in
// 16-byte pieces (the launcher checks the alignment).
template <int EPI>
RG_DEVICE void finish_sum(const float* __restrict__ total, half_t* __restrict__ out, int rows, int cols,
                          const float* __restrict__ bias, half_t* __restrict__ act) {
    pdl_enter();  // total is the all-reduce's (or the GEMM's) output
    const int groups = cols / 8;
    GRID_STRIDE(i, (i64)rows * groups) {
        const i64 at = i * 8;
        const float4 t0 = *reinterpret_cast<const float4*>(total + at);
        const float4 t1 = *reinterpret_cast<const float4*>(total + at + 4);
        const float v[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
        float2 x[4];  // what the epilogue reads besides the sum, a pair per two columns
        if (EPI == EPI_DACT) {
            const uint4 a = load_16(act + at);
            const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) x[k] = unpack_f16x2(w[k]);
        } else {
            const float* b = bias + (i % groups) * 8;
            const float4 b0 = *reinterpret_cast<const float4*>(b), b1 = *reinterpret_cast<const float4*>(b + 4);
            x[0] = make_float2(b0.x, b0.y);
            x[1] = make_float2(b0.z, b0.w);
            x[2] = make_float2(b1.x, b1.y);
            x[3] = make_float2(b1.z, b1.w);
        }
        u32 h[4], slopes[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = fp16_epilogue2<EPI>(v[2 * k], v[2 * k + 1], x[k], &slopes[k]);
        store_16(out + at, make_uint4(h[0], h[1], h[2], h[3]));
        if (EPI == EPI_BIAS_ACT && ACT_SAVES_SLOPE && act != nullptr)
            store_16(act + at, make_uint4(slopes[0], slopes[1], slopes[2], slopes[3]));
    }
}

// finish_sum per epilogue (kernels/elementwise.py picks finish_sum_<epilogue>).
extern "C" __global__ void finish_sum_bias(const float* __restrict__ total, half_t* __restrict__ out, int rows,
                                           int cols, const float* __restrict__ bias, half_t* __restrict__ act) {
    finish_sum<EPI_BIAS>(total, out, rows, cols, bias, act);
}
extern "C" __global__ void finish_sum_bias_act(const float* __restrict__ total, half_t* __restrict__ out, int rows,
                                               int cols, const float* __restrict__ bias, half_t* __restrict__ act) {
    finish_sum<EPI_BIAS_ACT>(total, out, rows, cols, bias, act);
}
extern "C" __global__ void finish_sum_dact(const float* __restrict__ total, half_t* __restrict__ out, int rows,
                                           int cols, const float* __restrict__ bias, half_t* __restrict__ act) {
    finish_sum<EPI_DACT>(total, out, rows, cols, bias, act);
}

// splitmix64's finaliser: a bijective 64-bit mix (Steele, Lea, Flood 2014).
RG_DEVICE u64 ew_mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// uniform in [-bound, bound) from a counter-based hash of (seed, i): the same values for a seed on any grid.
// u = top 24 bits of mix(mix(seed) + i * golden); (u - 2^23) / 2^23 is exact in fp32, then one rounding multiply
// by bound. kernels/elementwise.py:init_uniform_reference computes the same bits.
RG_DEVICE float ew_uniform(u64 key, i64 i, float bound) {
    const u64 z = ew_mix64(key + (u64)i * 0x9E3779B97F4A7C15ull);
    return (float)((int)(z >> 40) - (1 << 23)) * (1.0f / 8388608.0f) * bound;
}

// A window [rows, cols] of a whole layer of ew_uniform values: element (r, c) is the whole layer's flat index
// first + r * stride + c, and 0 where r >= true_rows or c >= true_cols (the padding). A layer, its padded copy and
// one GPU's slice of it on several GPUs (steps/sharded.py) draw the same bits without the host (biases: rows = 1).
RG_DEVICE float ew_window(u64 key, i64 i, i64 cols, i64 true_rows, i64 true_cols, i64 first, i64 stride,
                          float bound) {
    const i64 r = i / cols, c = i - r * cols;
    return r < true_rows && c < true_cols ? ew_uniform(key, first + r * stride + c, bound) : 0.0f;
}

extern "C" __global__ void init_uniform(float* __restrict__ w, i64 rows, i64 cols, i64 true_rows, i64 true_cols,
                                        i64 first, i64 stride, float bound, u64 seed) {
    const u64 key = ew_mix64(seed);
    GRID_STRIDE(i, rows * cols) w[i] = ew_window(key, i, cols, true_rows, true_cols, first, stride, bound);
}

// The master weights (hi, lo) of master.cuh from the same values.
extern "C" __global__ void init_uniform_master(half_t* __restrict__ hi, short* __restrict__ lo, i64 rows, i64 cols,
                                               i64 true_rows, i64 true_cols, i64 first, i64 stride, float bound,
                                               u64 seed) {
    const u64 key = ew_mix64(seed);
    GRID_STRIDE(i, rows * cols) {
        u32 h;
        int l;
        master_split(ew_window(key, i, cols, true_rows, true_cols, first, stride, bound), h, l);
        hi[i] = (half_t)h;
        lo[i] = (short)l;
    }
}

// Does nothing: a graph of these measures the launch floor (the cost of a dependent node) in the benchmark.
extern "C" __global__ void noop() {}
