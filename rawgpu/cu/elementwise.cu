// Elementwise kernels: simple, memory-bound, grid-stride loops.
#include "common.cuh"

// y = a * x + b * y over n floats. The stack's smoke test: it exercises pointer, float and int64 arguments.
extern "C" __global__ void axpby_f32(float* __restrict__ y, const float* __restrict__ x, float a, float b, i64 n) {
    GRID_STRIDE(i, n) y[i] = a * x[i] + b * y[i];
}

// fp32 master weights -> fp16 working copy.
extern "C" __global__ void cast_f32_f16(half_t* __restrict__ out, const float* __restrict__ in, i64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_f16(in[i]);
}

// Adds 1 to a device counter: the step counter that lets one captured graph replay every step unchanged.
extern "C" __global__ void increment_i64(i64* counter, int by) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *counter += by;
}
