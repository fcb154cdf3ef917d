// Experiment (dev/logits_xent/run.py): the head's forward and its softmax cross-entropy in one launch, for the layered
// step's long form (batches above the head kernel's 256) at up to 16 classes, where today they are two launches (the
// forward GEMM with the bias epilogue, then softmax_xent), each 4-5 us of the step's chain at batch 1024.
//
// logits = fp16(h @ W + bias) as the GEMM's bias epilogue rounds them; then softmax_xent's math per row on those fp16
// logits (the same loss, hits and dlogits for the same logits): m = max, rest = sum of exp(z - m) over all but the
// first max, loss = log1p(rest) + m - z[label], dlogits = (softmax - onehot) * inv_batch, 0 in the padding columns.
// A block: 16 rows (one mma row tile) by the 16 padded classes; its 4 warps take K's 16-wide steps in turn (step s
// to warp s % 4), reading the rows straight into mma fragments and W's columns as pairs of fp16 (16 KB at K = 512:
// L1 and L2 keep it); the warps' partial tiles are summed in warp order through shared memory. A half-warp then
// takes a row, a lane a class. The blocks' loss and hits meet exactly (exact_sum.cuh: the loss in 2^-32 fixed point).
#include "common.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "exact_sum.cuh"

#define LX_ROWS 16
#define LX_COLS 16  // the padded classes, and the logits' leading dimension
#define LX_WARPS 4

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
#pragma unroll 4
    for (int k0 = warp * 16; k0 < K; k0 += LX_WARPS * 16) {
        const bool hi = k0 + 8 < K;  // K is a multiple of 8: the step's upper half may lie past it
        const int ka = (k0 + 2 * t) / 2, kb = (k0 + 8 + 2 * t) / 2;  // in u32 (fp16 pairs)
        u32 a[4];
        a[0] = va ? ha[ka] : 0u;
        a[1] = vb ? hb[ka] : 0u;
        a[2] = va && hi ? ha[kb] : 0u;
        a[3] = vb && hi ? hb[kb] : 0u;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            u32 b[2];
            b[0] = lx_pair(w, k0 + 2 * t, 8 * j + g);
            b[1] = hi ? lx_pair(w, k0 + 8 + 2 * t, 8 * j + g) : 0u;
            mma_m16n8k16_f32(acc[j], a, b);
        }
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
        float rest = c < classes && c != best_i ? expf(zc - m) : 0.0f;
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
            if (c < classes) gv = (expf(zc - m) * (1.0f / (1.0f + rest)) - (c == label ? 1.0f : 0.0f)) * inv_batch;
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
