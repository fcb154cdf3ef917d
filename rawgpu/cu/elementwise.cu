// Elementwise kernels: memory-bound grid-stride loops, 16-byte accesses where alignment allows, and the
// small per-parameter updates. No float atomics: every result is the same bits on every run.
#include "common.cuh"
#include "step_math.cuh"
#include "pdl.cuh"
#include "master.cuh"
#include "optim.cuh"

#ifndef EW_THREADS
#error "elementwise.cu is built with rawgpu/contract.py's defines (rawgpu/compiler.py passes them)"
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

// Bias gradient + the optimiser's update (optim.cuh). g[c] = sum over rows of dy[r, c], summed EXACTLY in 2^-24 fixed point
// (int64 holds 2^23 rows of any fp16) and rounded once to fp32. Block = (TX, TY): TX threads cover 8*TX
// columns (one 16-byte load per row when ld % 8 == 0 and dy is aligned), TY threads split the rows; the TY
// partials meet in shared memory. Grid over column tiles; blockDim.x * blockDim.y <= EW_THREADS (rawgpu/contract.py,
// a -D option: the launcher's block). m, v: the optimiser's state (null where it keeps none).
extern "C" __global__ void bias_update(const half_t* __restrict__ dy, int ld, int rows, int cols,
                                       float* __restrict__ bias, float* __restrict__ m, float* __restrict__ v,
                                       const Optim* __restrict__ opt) {
    __shared__ i64 part[EW_THREADS * 8];  // [TY][TX * 8]
    pdl_enter();
    const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
    const int tile = TX * 8;
    const int c0 = blockIdx.x * tile + tx * 8;
    const bool vec = (ld % 8 == 0) && ew_aligned16(dy);
    i64 acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0;
    if (c0 < cols) {
        for (int r = ty; r < rows; r += TY) {
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
    for (int t = ty * TX + tx; t < tile; t += TX * TY) {  // one thread per column of the tile finishes it
        const int c = blockIdx.x * tile + t;
        if (c >= cols) break;
        i64 sum = 0;
        for (int y = 0; y < TY; ++y) sum += part[y * tile + t];
        const float g = (float)((double)sum * (1.0 / 16777216.0));
        const Optim o = *opt;
        float mc = m != nullptr ? m[c] : 0.f, vc = v != nullptr ? v[c] : 0.f;
        bias[c] = optim_update(bias[c], g, mc, vc, o);
        if (m != nullptr) m[c] = mc;
        if (v != nullptr) v[c] = vc;
    }
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

// w[i] = ew_uniform (the biases).
extern "C" __global__ void init_uniform(float* __restrict__ w, i64 n, float bound, u64 seed) {
    const u64 key = ew_mix64(seed);
    GRID_STRIDE(i, n) w[i] = ew_uniform(key, i, bound);
}

// The master weights (hi, lo) of master.cuh from the same values.
extern "C" __global__ void init_uniform_master(half_t* __restrict__ hi, short* __restrict__ lo, i64 n, float bound,
                                               u64 seed) {
    const u64 key = ew_mix64(seed);
    GRID_STRIDE(i, n) {
        u32 h;
        int l;
        master_split(ew_uniform(key, i, bound), h, l);
        hi[i] = (half_t)h;
        lo[i] = (short)l;
    }
}

// Does nothing: a graph of these measures the launch floor (the cost of a dependent node) in the benchmark.
extern "C" __global__ void noop() {}
