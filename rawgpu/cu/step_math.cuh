// Small pieces of a training step shared by the per-kernel step (gather.cu, elementwise.cu) and the persistent
// ones (fused_step.cu, cluster_step.cu), so all compute the same bits.
#pragma once
#include "common.cuh"

// 16 bytes -> 16 halves of byte/255. x * (1/255) rounds to the same fp16 as the exact k/255 for every byte
// value (checked exhaustively on the host), so the result equals numpy's (images / 255).astype(float16).
RG_DEVICE void bytes16_to_f16(const uint4 v, uint4& lo, uint4& hi) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 word = w[k >> 1] >> ((k & 1) * 16);
        h[k] = pack_f16x2((float)(word & 0xFF) * (1.0f / 255.0f), (float)((word >> 8) & 0xFF) * (1.0f / 255.0f));
    }
    lo = make_uint4(h[0], h[1], h[2], h[3]);
    hi = make_uint4(h[4], h[5], h[6], h[7]);
}

// The schedule codes `kind` takes, rawgpu/contract/optim.py's SCHEDULES (-D options: rawgpu/runtime/compiler.py passes them).
#if !defined(SCHEDULE_CONSTANT) || !defined(SCHEDULE_COSINE) || !defined(SCHEDULE_LINEAR)
#error "step_math.cuh needs rawgpu/contract/optim.py's SCHEDULE_* codes (rawgpu/runtime/compiler.py passes them)"
#endif

// lr at step s, in double. SCHEDULE_CONSTANT: lr0. SCHEDULE_COSINE: linear warmup then cosine to lr_min.
// SCHEDULE_LINEAR: linear warmup then linear decay to lr_min. Mirrors kernels/gather.py:lr_at.
RG_DEVICE double lr_at_step_d(i64 s, double lr0, double lr_min, i64 total_steps, i64 warmup_steps, int kind) {
    double out = lr0;
    if (kind != SCHEDULE_CONSTANT) {
        if (s < warmup_steps) {
            out = lr0 * (double)(s + 1) / (double)warmup_steps;
        } else {
            const i64 span = total_steps - warmup_steps > 1 ? total_steps - warmup_steps : 1;
            double t = (double)(s - warmup_steps) / (double)span;
            t = t < 1.0 ? t : 1.0;
            out = kind == SCHEDULE_COSINE ? lr_min + 0.5 * (lr0 - lr_min) * (1.0 + cos(3.141592653589793 * t))
                                          : lr0 + (lr_min - lr0) * t;
        }
    }
    return out;
}

// The same, rounded once to fp32.
RG_DEVICE float lr_at_step(i64 s, double lr0, double lr_min, i64 total_steps, i64 warmup_steps, int kind) {
    return (float)lr_at_step_d(s, lr0, lr_min, total_steps, warmup_steps, kind);
}

// An fp16 bit pattern as an exact integer multiple of 2^-24 (every finite fp16 is one, |x| * 2^24 < 2^40),
// so column sums are exact integer adds: no rounding, and the same bits in any order or geometry.
RG_DEVICE i64 f16_fixed24(u32 h) {
    const u32 e = (h >> 10) & 31, m = h & 1023;
    const i64 mag = e ? (i64)(m | 1024) << (e - 1) : (i64)m;
    return (h & 0x8000) ? -mag : mag;
}

// relu'(x) from the fp16 bits of x the forward stored: whether x > 0 (sign clear, not zero).
RG_DEVICE bool positive_f16(u32 h) { return (h & 0x8000u) == 0 && (h & 0x7FFFu) != 0; }

// Softmax cross-entropy of one row by a group of LANES aligned lanes (LANES a power of two <= 32): lane q of the
// group holds the logits of classes q + LANES p, p < PER (-inf past `classes`). Every lane gets the row's loss (NaN
// for a label outside 0..classes-1) and hit, and d(loss)/d(z) times `scale` for its classes. The argmax breaks ties
// to the lower index; the loss is log(1 + sum of the other exponentials) + (max - z_label). A warp per row
// (LANES 32, PER 1) in the fused step; 8 lanes per row, 4 rows per warp at once in the cluster step.
template <int PER>
struct XentRow {
    float loss, grad[PER];
    bool hit;
};

template <int LANES, int PER>
RG_DEVICE XentRow<PER> softmax_xent_row(const float (&z)[PER], int classes, int label, float scale) {
    const int q = threadIdx.x % LANES;
    float best = -__int_as_float(0x7f800000);
    int best_i = 0x7fffffff;
#pragma unroll
    for (int p = 0; p < PER; ++p) {  // ascending class order: a strict > keeps the lower index
        const int c = q + LANES * p;
        if (c < classes && (z[p] > best || best_i == 0x7fffffff)) best = z[p], best_i = c;
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) best = ob, best_i = oi;
    }
    float e[PER], rest = 0.f;  // rest: the exponentials other than the largest
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const int c = q + LANES * p;
        e[p] = c < classes ? expf(z[p] - best) : 0.f;
        rest += c != best_i ? e[p] : 0.f;
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) rest += __shfl_xor_sync(0xffffffffu, rest, o);
    const bool valid = label >= 0 && label < classes;
    const int lab = valid ? label : 0;
    float z_label = 0.f;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const float v = __shfl_sync(0xffffffffu, z[p], lab % LANES, LANES);
        if (p == lab / LANES) z_label = v;
    }
    XentRow<PER> out;
    out.loss = valid ? log1pf(rest) + (best - z_label) : __int_as_float(0x7fffffff);
    out.hit = valid && best_i == label;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const int c = q + LANES * p;
        out.grad[p] = c < classes ? (e[p] * (1.0f / (1.0f + rest)) - (c == label ? 1.0f : 0.0f)) * scale : 0.f;
    }
    return out;
}
