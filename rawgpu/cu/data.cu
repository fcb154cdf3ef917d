// Input pipeline and schedule kernels: everything that changes from step to step reads the device step
// counter, so one captured graph replays every step unchanged.
#include "common.cuh"
#include "step_math.cuh"
#include "pdl.cuh"

// One block per output row (grid-stride over rows). Row i is dataset row perm[(step % steps_per_epoch) *
// batch + i]; each thread turns 16 source bytes into 16 fp16 (two 16-byte stores). Columns in
// [row_bytes, ld_out) are written as zero so the GEMM can read whole padded rows.
extern "C" __global__ void gather_batch(const u8* __restrict__ images, const u8* __restrict__ labels,
                                        const int* __restrict__ perm, const i64* __restrict__ step, int batch,
                                        int steps_per_epoch, int row_bytes, int ld_out, half_t* __restrict__ x_out,
                                        int* __restrict__ y_out) {
    pdl_enter();
    const i64 base = (*step % steps_per_epoch) * (i64)batch;
    const bool vec = (row_bytes % 16 == 0) && (((u64)images & 15) == 0);
    const int chunks = (ld_out + 15) / 16;
    for (int i = blockIdx.x; i < batch; i += gridDim.x) {
        const i64 src = perm[base + i];
        const u8* in = images + src * row_bytes;
        half_t* out = x_out + (i64)i * ld_out;
        if (threadIdx.x == 0) y_out[i] = labels[src];
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            const int j0 = c * 16;
            uint4 v;
            if (vec && j0 + 16 <= row_bytes) {
                v = load_16(in + j0);
            } else {  // the row's tail, a misaligned dataset, or padding: byte by byte, zero past the row
                u32 w[4] = {0, 0, 0, 0};
#pragma unroll
                for (int k = 0; k < 16; ++k)
                    if (j0 + k < row_bytes) w[k >> 2] |= (u32)in[j0 + k] << ((k & 3) * 8);
                v = make_uint4(w[0], w[1], w[2], w[3]);
            }
            uint4 lo, hi;
            bytes16_to_f16(v, lo, hi);
            store_16(out + j0, lo);  // j0 < ld_out, and ld_out % 8 == 0
            if (j0 + 8 < ld_out) store_16(out + j0 + 8, hi);
        }
    }
}

// The training step counter moves forward inside the graph.
extern "C" __global__ void step_increment(i64* step) {
    pdl_enter();
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}

// Set a device int64 (e.g. reset a step counter) from inside a graph.
extern "C" __global__ void set_i64(i64* p, i64 v) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *p = v;
}

// lr for the current step, in double, rounded once to fp32. kind 0: constant lr0. kind 1: linear warmup then
// cosine to lr_min. kind 2: linear warmup then linear decay to lr_min. Mirrors kernels/data.py:lr_at.
extern "C" __global__ void lr_schedule(const i64* __restrict__ step, float* __restrict__ lr, float lr0, float lr_min,
                                       i64 total_steps, i64 warmup_steps, int kind) {
    pdl_enter();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *lr = lr_at_step(*step, lr0, lr_min, total_steps, warmup_steps, kind);
}
