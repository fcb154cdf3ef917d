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

// The same gather for tables of your own (rawgpu/data/tables.py): rows of F features of type In (u8, scaled by
// 1/255 as gather_batch scales pixels, to the same bits; f16; f32), with STD each column standardized,
// (v - mean[c]) * inv_std[c] in fp32, into fp16 x_out[B, ld_out] (zero past F); the target of row i is a class
// label (int32, targets[src]) or, with VALUES, K float32 values (targets[src * K ..], y_out[i * K ..]). Thread t
// takes columns [8t, 8t + 8) and every 8 blockDim.x after; one block per output row as gather_batch, with the same
// early / optimiser / counter contract.
namespace gtab {
template <typename In> RG_DEVICE float scaled(In v) { return (float)v; }
template <> RG_DEVICE float scaled<u8>(u8 v) { return (float)v * (1.0f / 255.0f); }
template <> RG_DEVICE float scaled<half_t>(half_t v) { return f16_to_f32(v); }  // half_t: the fp16 bits

// 8 features of a row from column j0 as floats (0 past the row): one 8- to 32-byte load where the rows allow
template <typename In>
RG_DEVICE void load8(const In* in, int j0, int features, bool vec, float (&f)[8]) {
    if (vec && j0 + 8 <= features) {
        if constexpr (sizeof(In) == 1) {
            const uint2 w = *reinterpret_cast<const uint2*>(in + j0);
            const u32 words[2] = {w.x, w.y};
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = scaled<u8>((u8)(words[k >> 2] >> ((k & 3) * 8)));
        } else if constexpr (sizeof(In) == 2) {
            const uint4 w = load_16(in + j0);
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 v = unpack_f16x2(words[k]);
                f[2 * k] = v.x, f[2 * k + 1] = v.y;
            }
        } else {
            const float4 a = *reinterpret_cast<const float4*>(in + j0), b = *reinterpret_cast<const float4*>(in + j0 + 4);
            f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = j0 + k < features ? scaled<In>(in[j0 + k]) : 0.f;
}
}  // namespace gtab

template <typename In, bool STD, bool VALUES>
RG_DEVICE void gather_table_body(const In* __restrict__ x, const void* __restrict__ targets, int outputs,
                                 const int* __restrict__ perm, const i64* __restrict__ step, int batch,
                                 int steps_per_epoch, int features, int ld_out, const float* __restrict__ mean,
                                 const float* __restrict__ inv_std, half_t* __restrict__ x_out, void* __restrict__ y_out,
                                 Optim* __restrict__ opt, float lr0, float lr_min, i64 total_steps, i64 warmup_steps,
                                 int kind, int early) {
    bool waited = !early;
    if (!early) pdl_enter();
    const bool writes_optim = opt != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
    Optim o;
    if (writes_optim) o = *opt;
    const i64 s = *step;
    const i64 base = (s % steps_per_epoch) * (i64)batch;
    const bool vec = ((i64)features * (i64)sizeof(In)) % (8 * sizeof(In) < 16 ? 8 * sizeof(In) : 16) == 0 &&
                     ((u64)x & 15) == 0;
    for (int i = blockIdx.x; i < batch; i += gridDim.x) {
        const i64 src = perm[base + i];
        const In* in = x + src * features;
        for (int j0 = 8 * (int)threadIdx.x; j0 < ld_out; j0 += 8 * (int)blockDim.x) {
            float f[8];
            gtab::load8<In>(in, j0, features, vec, f);
            if constexpr (STD) {
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (j0 + k < features) f[k] = (f[k] - mean[j0 + k]) * inv_std[j0 + k];
            }
            if (!waited) {  // the kernel before may still read x, y and the optimiser's values
                pdl_enter();
                waited = true;
            }
            store_16(x_out + (i64)i * ld_out + j0, make_uint4(pack_f16x2(f[0], f[1]), pack_f16x2(f[2], f[3]),
                                                               pack_f16x2(f[4], f[5]), pack_f16x2(f[6], f[7])));
        }
        if (!waited) {
            pdl_enter();
            waited = true;
        }
        if (writes_optim && i == blockIdx.x) {
            optim_set_step(o, s, lr_at_step_d(s, lr0, lr_min, total_steps, warmup_steps, kind));
            opt->lr = o.lr;
            opt->step_size = o.step_size;
            opt->bias2 = o.bias2;
            opt->decay = o.decay;
        }
        if constexpr (VALUES) {
            for (int k = threadIdx.x; k < outputs; k += blockDim.x)
                static_cast<float*>(y_out)[(i64)i * outputs + k] = static_cast<const float*>(targets)[src * outputs + k];
        } else if (threadIdx.x == 0) {
            static_cast<int*>(y_out)[i] = static_cast<const int*>(targets)[src];
        }
    }
    if (!waited) pdl_enter();  // a block without rows
}

#define GATHER_TABLE(name, In, STD, VALUES)                                                                      \
    extern "C" __global__ void name(const In* __restrict__ x, const void* __restrict__ targets, int outputs,     \
                                    const int* __restrict__ perm, const i64* __restrict__ step, int batch,       \
                                    int steps_per_epoch, int features, int ld_out, const float* __restrict__ mean, \
                                    const float* __restrict__ inv_std, half_t* __restrict__ x_out,               \
                                    void* __restrict__ y_out, Optim* __restrict__ opt, float lr0, float lr_min,   \
                                    i64 total_steps, i64 warmup_steps, int kind, int early) {                    \
        gather_table_body<In, STD, VALUES>(x, targets, outputs, perm, step, batch, steps_per_epoch, features,    \
                                           ld_out, mean, inv_std, x_out, y_out, opt, lr0, lr_min, total_steps,   \
                                           warmup_steps, kind, early);                                           \
    }
#if !GATHER_MODELS
GATHER_TABLE(gather_table_u8_labels, u8, false, false)
GATHER_TABLE(gather_table_u8_labels_std, u8, true, false)
GATHER_TABLE(gather_table_u8_values, u8, false, true)
GATHER_TABLE(gather_table_u8_values_std, u8, true, true)
GATHER_TABLE(gather_table_f16_labels, half_t, false, false)
GATHER_TABLE(gather_table_f16_labels_std, half_t, true, false)
GATHER_TABLE(gather_table_f16_values, half_t, false, true)
GATHER_TABLE(gather_table_f16_values_std, half_t, true, true)
GATHER_TABLE(gather_table_f32_labels, float, false, false)
GATHER_TABLE(gather_table_f32_labels_std, float, true, false)
GATHER_TABLE(gather_table_f32_values, float, false, true)
GATHER_TABLE(gather_table_f32_values_std, float, true, true)
#endif

// The training step counter moves forward inside the graph.
extern "C" __global__ void step_increment(i64* step) {
    pdl_enter();
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}

// Set a device int64 (e.g. reset a step counter) from inside a graph.
extern "C" __global__ void set_i64(i64* p, i64 v) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *p = v;
}
