// Softmax cross-entropy: loss, accuracy and the logits gradient in one pass. Every run gives the same bits: a batch
// that fits one block sums its metrics in a fixed order there; a larger one is dealt out in blocks of block_rows rows,
// whose sums meet exactly (exact_sum.cuh: the loss in 2^-32 fixed point).
#include "common.cuh"
#include "pdl.cuh"
#include "exact_sum.cuh"
#include "regression.cuh"

// XENT_MAX_WARPS: the warps of the largest block the launcher gives (rawgpu/contract/loss.py: XENT_MAX_THREADS), a -D
// option.
#ifndef XENT_MAX_WARPS
#error "loss.cu is built with rawgpu/contract/loss.py's defines (rawgpu/runtime/compiler.py passes them)"
#endif

// A warp per row (the block's rows strided by its warp count), fp32 math. Per row: m = max z, loss = log(sum exp(z -
// m)) + m - z[label], prediction = the first index of the max. dlogits[r, c] = (softmax_c - [c == label]) * inv_batch
// for c < classes, 0 for the padding columns up to ld; dlogits == nullptr: evaluation, metrics only.
// Then *loss_sum += sum of losses and *correct += hits (read-modify-write by one thread: they accumulate over
// launches until zero_metrics). Block b takes rows [b block_rows, (b + 1) block_rows); with more than one block,
// scratch (2 int64, zero) and ticket (zero) carry the blocks' sums to the last, which leaves them zero.
//
// XENT_MODELS (loss_models.cu sets it for the models step; 0 here): grid y is the model of a sweep; model m reads its
// logits at logits + m z_logits and labels + m z_labels (0: shared labels), writes dlogits + m z_logits and its own
// loss_sum[m], correct[m], scratch[2 m ...] and ticket[m].
#ifndef XENT_MODELS
#define XENT_MODELS 0
#endif
#if XENT_MODELS
#define XENT_MODEL_PARAMS , i64 z_logits, i64 z_labels
#else
#define XENT_MODEL_PARAMS
#endif
extern "C" __global__ void __launch_bounds__(XENT_MAX_WARPS * 32)
softmax_xent(const half_t* __restrict__ logits, int ld, const int* __restrict__ labels, int batch, int classes,
             float inv_batch, half_t* __restrict__ dlogits, double* loss_sum, int* correct, int block_rows,
             i64* scratch, int* ticket XENT_MODEL_PARAMS) {
#if XENT_MODELS
    {
        const i64 model = blockIdx.y;
        logits += model * z_logits;
        labels += model * z_labels;
        if (dlogits) dlogits += model * z_logits;
        loss_sum += model, correct += model, scratch += 2 * model, ticket += model;
    }
#endif
    __shared__ double s_loss[XENT_MAX_WARPS];
    __shared__ int s_hits[XENT_MAX_WARPS];
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int first = blockIdx.x * block_rows, end = min(batch, first + block_rows);
    double loss_acc = 0.0;  // lane 0's running sum, rows in ascending order
    int hits = 0;
    for (int r = first + warp; r < end; r += warps) {
        const half_t* z = logits + (i64)r * ld;
        const int label = labels[r];
        float best = -__int_as_float(0x7f800000);
        int best_i = 0x7fffffff;
        for (int c = lane; c < classes; c += 32) {
            const float v = f16_to_f32(z[c]);
            if (v > best) best = v, best_i = c;  // strict: the first max of this lane's columns
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {  // argmax across lanes, ties to the lower index
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
        }
        const float m = best;  // every lane: the row max and its first index
        // rest = sum of exp(z - m) over all but the first max (whose term is exactly 1), so that
        // loss = log1p(rest) + (m - z[label]) adds two non-negative terms: accurate even when loss -> 0.
        float rest = 0.0f;
        for (int c = lane; c < classes; c += 32)
            if (c != best_i) rest += expf(f16_to_f32(z[c]) - m);
        rest = warp_sum(rest);
        const bool valid = label >= 0 && label < classes;
        const float z_label = valid ? f16_to_f32(z[label]) : __int_as_float(0x7fffffff);  // bad label: NaN loss
        if (lane == 0) {
            loss_acc += (double)(log1pf(rest) + (m - z_label));
            hits += (valid && best_i == label) ? 1 : 0;
        }
        if (dlogits != nullptr) {
            const float inv_se = 1.0f / (1.0f + rest);
            half_t* d = dlogits + (i64)r * ld;
            for (int c = lane; c < ld; c += 32) {
                float g = 0.0f;
                if (c < classes) g = (expf(f16_to_f32(z[c]) - m) * inv_se - (c == label ? 1.0f : 0.0f)) * inv_batch;
                d[c] = f32_to_f16(g);
            }
        }
    }
    if (lane == 0) s_loss[warp] = loss_acc, s_hits[warp] = hits;
    __syncthreads();
    double total = 0.0;
    int total_hits = 0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < warps; ++w) total += s_loss[w], total_hits += s_hits[w];
        if (gridDim.x > 1) {
            exact_add(scratch, isfinite(total) ? __double2ll_rn(total * 4294967296.0) : 0);
            exact_add(scratch + 1, total_hits);
            if (!isfinite(total)) *loss_sum = total;  // a NaN or infinite loss (a bad label, divergence) stays so
        }
    }
    if (gridDim.x > 1) {
        if (!last_of_blocks(ticket, gridDim.x)) return;
        if (threadIdx.x != 0) return;
        total = (double)exact_take(scratch) * (1.0 / 4294967296.0);
        total_hits = (int)exact_take(scratch + 1);
    }
    if (threadIdx.x == 0) {
        *loss_sum += total;
        *correct += total_hits;
    }
}

// Regression: a warp per row as softmax_xent, lanes over the row's K outputs (K <= 64). Per row, with e = pred - y:
// the loss (1/K) sum of l(e) (regression.cuh: e^2, |e| or Huber's by `kind`), and
// for the metrics sum e^2 and sum |e|; dpred[r, k] = l'(e) * grad_scale (the launcher folds the loss scale, 1 / rows
// and 1 / K into it), 0 for the padding columns up to ld; dpred == nullptr: evaluation, metrics only.
// sums[0..2] += loss, squared, absolute (exact across blocks as softmax_xent's: scratch 3 int64, ticket).
#if !XENT_MODELS  // regression has no model axis yet: loss_models.cu builds the classifier's loss alone
extern "C" __global__ void __launch_bounds__(XENT_MAX_WARPS * 32)
regression_loss(const half_t* __restrict__ pred, int ld, const float* __restrict__ targets, int batch, int outputs,
                int kind, float grad_scale, half_t* __restrict__ dpred, double* sums, int block_rows, i64* scratch,
                int* ticket) {
    __shared__ double s_sum[3][XENT_MAX_WARPS];
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int first = blockIdx.x * block_rows, end = min(batch, first + block_rows);
    double acc_loss = 0.0, acc_sq = 0.0, acc_abs = 0.0;  // lane 0's running sums, rows in ascending order
    const float inv_k = 1.0f / (float)outputs;
    for (int r = first + warp; r < end; r += warps) {
        const half_t* z = pred + (i64)r * ld;
        const float* y = targets + (i64)r * outputs;
        float loss = 0.f, sq = 0.f, ab = 0.f;
        for (int k = lane; k < outputs; k += 32) {
            const float e = f16_to_f32(z[k]) - y[k];
            sq += e * e, ab += fabsf(e), loss += regression_loss_of(e, kind);
        }
        loss = warp_sum(loss), sq = warp_sum(sq), ab = warp_sum(ab);
        if (lane == 0) acc_loss += (double)(loss * inv_k), acc_sq += (double)sq, acc_abs += (double)ab;
        if (dpred != nullptr) {
            half_t* d = dpred + (i64)r * ld;
            for (int k = lane; k < ld; k += 32) {
                float g = 0.f;
                if (k < outputs) g = regression_grad_of(f16_to_f32(z[k]) - y[k], kind) * grad_scale;
                d[k] = f32_to_f16(g);
            }
        }
    }
    if (lane == 0) s_sum[0][warp] = acc_loss, s_sum[1][warp] = acc_sq, s_sum[2][warp] = acc_abs;
    __syncthreads();
    if (threadIdx.x < 3) {  // thread i: sum i over the warps, then over the blocks
        const int i = threadIdx.x;
        double total = 0.0;
        for (int w = 0; w < warps; ++w) total += s_sum[i][w];
        if (gridDim.x > 1) {
            exact_add(scratch + i, isfinite(total) ? __double2ll_rn(total * 4294967296.0) : 0);
            if (!isfinite(total)) sums[i] = total;  // a NaN or infinite sum (divergence) stays so
        }
        s_sum[i][0] = total;
    }
    if (gridDim.x > 1) {
        if (!last_of_blocks(ticket, gridDim.x)) return;
        if (threadIdx.x < 3) s_sum[threadIdx.x][0] = (double)exact_take(scratch + threadIdx.x) * (1.0 / 4294967296.0);
    }
    if (threadIdx.x < 3) sums[threadIdx.x] += s_sum[threadIdx.x][0];
}

// Reset the regression metrics (three doubles).
extern "C" __global__ void zero_sums(double* sums, int n) {
    if (blockIdx.x == 0 && threadIdx.x < n) sums[threadIdx.x] = 0.0;
}
#endif

// Reset the accumulated metrics; a kernel (not a memset) so the reset can sit inside a captured graph.
extern "C" __global__ void zero_metrics(double* loss_sum, int* correct) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *loss_sum = 0.0, *correct = 0;
}
