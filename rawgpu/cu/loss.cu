// Softmax cross-entropy: loss, accuracy and the logits gradient in one pass. Every run gives the same bits: a batch
// that fits one block sums its metrics in a fixed order there; a larger one is dealt out in blocks of block_rows rows,
// whose sums meet exactly (exact_sum.cuh: the loss in 2^-32 fixed point).
#include "common.cuh"
#include "pdl.cuh"
#include "exact_sum.cuh"
#include "regression.cuh"
#include "mma.cuh"

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
// One class's gradient of a row's softmax cross-entropy, (exp(z - m) * inv_se - [label]) * inv_batch, each step
// rounded as written (no contraction into FMAs, which the compiler would choose per kernel): every kernel that takes
// it (softmax_xent, logits_xent) gives the same bits for the same logits. Their sums of exp(z - m) add with __fadd_rn
// for the same reason.
RG_DEVICE float xent_dlogit(float z, float m, float inv_se, bool is_label, float inv_batch) {
    return __fmul_rn(__fsub_rn(__fmul_rn(expf(z - m), inv_se), is_label ? 1.0f : 0.0f), inv_batch);
}

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
            if (c != best_i) rest = __fadd_rn(rest, expf(f16_to_f32(z[c]) - m));
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
                if (c < classes) g = xent_dlogit(f16_to_f32(z[c]), m, inv_se, c == label, inv_batch);
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

// The head's forward and its softmax cross-entropy in one launch (the layered and data-parallel steps' long form at
// up to 16 classes, where they were a GEMM with the bias epilogue and softmax_xent, each a launch of the step's
// chain). logits = fp16(h @ W + bias), rounded as the GEMM's bias epilogue rounds them; then softmax_xent's math per
// row on those logits (the same loss, hits and dlogits for the same logits). A block: LX_ROWS rows (one mma row
// tile) by the LX_COLS padded classes; its LX_WARPS warps take K's 16-wide steps in turn (step s to warp s %
// LX_WARPS), reading the rows straight into mma fragments and W's columns as pairs of fp16 (16 KB at K = 512: L1 and
// L2 keep it), LX_DEPTH steps' loads at a time; the warps' partial tiles are summed in warp order through shared
// memory. A half-warp then takes a row, a lane a class. The blocks' loss and hits meet exactly as softmax_xent's
// (scratch 2 int64, ticket). No model axis (loss_models.cu builds softmax_xent alone).
#if !XENT_MODELS
#if LX_COLS != 16 || LX_ROWS != 16 || LX_WARPS * 2 < LX_ROWS
#error "logits_xent is one mma row tile of 16 rows by two 8-column tiles, a half-warp a row (rawgpu/contract/loss.py)"
#endif
RG_DEVICE u32 lx_pair(const half_t* w, int k, int col) {  // W[k][col] and W[k + 1][col], packed as mma's B wants
    return (u32)w[(i64)k * LX_COLS + col] | ((u32)w[(i64)(k + 1) * LX_COLS + col] << 16);
}

extern "C" __global__ void __launch_bounds__(LX_WARPS * 32)
logits_xent(const half_t* __restrict__ h, int ldh, int K, const half_t* __restrict__ w, const float* __restrict__ bias,
            const int* __restrict__ labels, int batch, int classes, float inv_batch, half_t* __restrict__ logits,
            half_t* __restrict__ dlogits, double* loss_sum, int* correct, i64* scratch, int* ticket) {
    __shared__ float s_part[LX_WARPS][LX_ROWS][LX_COLS];
    __shared__ float s_z[LX_ROWS][LX_COLS];
    __shared__ double s_loss[LX_WARPS * 2];
    __shared__ int s_hits[LX_WARPS * 2];
    pdl_enter();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * LX_ROWS;
    const bool va = r0 + g < batch, vb = r0 + g + 8 < batch;  // this lane's two rows of the A fragment
    const u32* ha = reinterpret_cast<const u32*>(h + (i64)(va ? r0 + g : 0) * ldh);
    const u32* hb = reinterpret_cast<const u32*>(h + (i64)(vb ? r0 + g + 8 : 0) * ldh);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    constexpr int STEP = LX_WARPS * 16;  // the K a block's warps take at once, 16 each
    for (int base = warp * 16; base < K; base += STEP * LX_DEPTH) {
        // every load of LX_DEPTH steps before their first mma: one round trip to L2 for them all
        u32 a[LX_DEPTH][4], b[LX_DEPTH][2][2];
#pragma unroll
        for (int s = 0; s < LX_DEPTH; ++s) {
            const int k0 = base + s * STEP;
            const bool lo = k0 < K, hi = k0 + 8 < K;  // K is a multiple of 8: a step may lie past it, or half of it
            const int ka = (k0 + 2 * t) / 2, kb = ka + 4;  // in u32 (fp16 pairs)
            a[s][0] = va && lo ? ha[ka] : 0u;
            a[s][1] = vb && lo ? hb[ka] : 0u;
            a[s][2] = va && hi ? ha[kb] : 0u;
            a[s][3] = vb && hi ? hb[kb] : 0u;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                b[s][j][0] = lo ? lx_pair(w, k0 + 2 * t, 8 * j + g) : 0u;
                b[s][j][1] = hi ? lx_pair(w, k0 + 8 + 2 * t, 8 * j + g) : 0u;
            }
        }
#pragma unroll
        for (int s = 0; s < LX_DEPTH; ++s)
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_m16n8k16_f32(acc[j], a[s], b[s][j]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        s_part[warp][g][8 * j + 2 * t] = acc[j][0];
        s_part[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        s_part[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        s_part[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    __syncthreads();
    for (int e = tid; e < LX_ROWS * LX_COLS; e += LX_WARPS * 32) {
        const int r = e / LX_COLS, c = e % LX_COLS;
        float v = s_part[0][r][c];
#pragma unroll
        for (int q = 1; q < LX_WARPS; ++q) v += s_part[q][r][c];
        const half_t z = f32_to_f16(v + bias[c]);
        s_z[r][c] = f16_to_f32(z);
        if (r0 + r < batch) logits[(i64)(r0 + r) * LX_COLS + c] = z;
    }
    __syncthreads();

    // a half-warp per row (rows rr, rr + 8), a lane per class; every lane runs the shuffles (full-warp masks)
    const int half = lane >> 4, c = lane & 15, group = warp * 2 + half;
    double loss_acc = 0.0;  // the group's lane 0: its rows in ascending order
    int hits = 0;
    for (int rr = group; rr < LX_ROWS; rr += LX_WARPS * 2) {
        const int r = r0 + rr;
        const float zc = s_z[rr][c];
        float best = c < classes ? zc : -__int_as_float(0x7f800000);
        int best_i = c < classes ? c : 0x7fffffff;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {  // argmax across the half-warp, ties to the lower index
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
        }
        const float m = best;
        float rest = 0.0f;
        if (c < classes && c != best_i) rest = __fadd_rn(rest, expf(zc - m));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) rest += __shfl_xor_sync(0xffffffffu, rest, o);
        if (r < batch) {
            const int label = labels[r];
            const bool valid = label >= 0 && label < classes;
            const float z_label = valid ? s_z[rr][label] : __int_as_float(0x7fffffff);  // bad label: NaN loss
            if (c == 0) {
                loss_acc += (double)(log1pf(rest) + (m - z_label));
                hits += (valid && best_i == label) ? 1 : 0;
            }
            float gv = 0.0f;
            if (c < classes) gv = xent_dlogit(zc, m, 1.0f / (1.0f + rest), c == label, inv_batch);
            dlogits[(i64)r * LX_COLS + c] = f32_to_f16(gv);
        }
    }
    if (c == 0) s_loss[group] = loss_acc, s_hits[group] = hits;
    __syncthreads();
    double total = 0.0;
    int total_hits = 0;
    if (tid == 0) {
        for (int q = 0; q < LX_WARPS * 2; ++q) total += s_loss[q], total_hits += s_hits[q];
        if (gridDim.x > 1) {
            exact_add(scratch, isfinite(total) ? __double2ll_rn(total * 4294967296.0) : 0);
            exact_add(scratch + 1, total_hits);
            if (!isfinite(total)) *loss_sum = total;  // a NaN or infinite loss stays so
        }
    }
    if (gridDim.x > 1) {
        if (!last_of_blocks(ticket, gridDim.x)) return;
        if (tid != 0) return;
        total = (double)exact_take(scratch) * (1.0 / 4294967296.0);
        total_hits = (int)exact_take(scratch + 1);
    }
    if (tid == 0) {
        *loss_sum += total;
        *correct += total_hits;
    }
}
#endif
