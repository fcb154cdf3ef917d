// Input pipeline and schedule kernels: everything that changes from step to step reads the device step
// counter, so one captured graph replays every step unchanged.
#include "common.cuh"
#include "step_math.cuh"
#include "optim.cuh"
#include "pdl.cuh"

// One block per output row (grid-stride over rows). Row i is dataset row perm[(step % steps_per_epoch) *
// batch + i]; thread c turns source bytes [16c, 16c + 16) into 16 fp16 (two 16-byte stores), so the launcher gives
// a block at least ld_out / 16 threads. Columns in [row_bytes, ld_out) are written as zero so the GEMM can read
// whole padded rows.
// opt (may be null): block 0 also writes the step's optimiser values there (optim.cuh: optim_set_step), from the
// learning rate of the schedule `kind` (step_math.cuh: lr_at_step_d, mirrored by kernels/gather.py:lr_at). The
// schedule rides on the gather because both read the step counter first: one dependent launch per step fewer than
// a kernel of its own.
// early: the counter was moved at least two launches back (the layered step moves it in the head kernel), so the
// counter, the permutation, the labels and the pixels are all final before this kernel's wait (pdl.cuh): the chain
// of dependent loads step -> perm -> image runs while the kernel before still ends, and only the stores (x, y and
// the optimiser's values, which that kernel may still read) wait for it.
//
// GATHER_MODELS (gather_models.cu sets it for the models step; 0 here): grid y is the model of a sweep; model m reads
// its order at perm + m z_perm, writes its rows at x_out + m z_x and y_out + m z_y and its optimiser row opt + m, with
// its own schedule: schedules[4 m ...] = lr0, lr_min, warmup_steps, kind (the arguments' values are unused).
#ifndef GATHER_MODELS
#define GATHER_MODELS 0
#endif
#if GATHER_MODELS
#define GATHER_MODEL_PARAMS , i64 z_perm, i64 z_x, i64 z_y, const double* __restrict__ schedules
#else
#define GATHER_MODEL_PARAMS
#endif
extern "C" __global__ void gather_batch(const u8* __restrict__ images, const u8* __restrict__ labels,
                                        const int* __restrict__ perm, const i64* __restrict__ step, int batch,
                                        int steps_per_epoch, int row_bytes, int ld_out, half_t* __restrict__ x_out,
                                        int* __restrict__ y_out, Optim* __restrict__ opt, float lr0, float lr_min,
                                        i64 total_steps, i64 warmup_steps, int kind, int early GATHER_MODEL_PARAMS) {
#if GATHER_MODELS
    {
        const i64 model = blockIdx.y;
        perm += model * z_perm;
        x_out += model * z_x;
        y_out += model * z_y;
        if (opt) opt += model;
        const double* sch = schedules + 4 * model;
        lr0 = (float)sch[0], lr_min = (float)sch[1], warmup_steps = (i64)sch[2], kind = (int)sch[3];
    }
#endif
    bool waited = !early;
    if (!early) pdl_enter();
    const bool writes_optim = opt != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
    Optim o;
    if (writes_optim) o = *opt;  // the hyperparameters never change: read before the wait, while the pixels load
    const i64 s = *step;
    const i64 base = (s % steps_per_epoch) * (i64)batch;
    const bool vec = (row_bytes % 16 == 0) && (((u64)images & 15) == 0);
    const int j0 = 16 * (int)threadIdx.x;
    if (j0 >= ld_out) {  // no column of its own
        if (!waited) pdl_enter();
        return;
    }
    for (int i = blockIdx.x; i < batch; i += gridDim.x) {
        const i64 src = perm[base + i];
        const u8* in = images + src * row_bytes;
        const int label = threadIdx.x == 0 ? (int)labels[src] : 0;
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
        if (!waited) {  // the kernel before may still read x, y and the optimiser's values
            pdl_enter();
            waited = true;
        }
        if (writes_optim && i == 0) {
            optim_set_step(o, s, lr_at_step_d(s, lr0, lr_min, total_steps, warmup_steps, kind));
            opt->lr = o.lr;
            opt->step_size = o.step_size;
            opt->bias2 = o.bias2;
            opt->decay = o.decay;
        }
        if (threadIdx.x == 0) y_out[i] = label;
        uint4 lo, hi;
        bytes16_to_f16(v, lo, hi);
        half_t* out = x_out + (i64)i * ld_out;
        store_16(out + j0, lo);  // j0 < ld_out, and ld_out % 8 == 0
        if (j0 + 8 < ld_out) store_16(out + j0 + 8, hi);
    }
    if (!waited) pdl_enter();  // a block without rows
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
