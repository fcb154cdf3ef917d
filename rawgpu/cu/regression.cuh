// A regression's loss of one error e = prediction - target and its derivative, shared by the separate loss kernel
// (loss.cu: regression_loss) and the head's one-cluster step (head.cu), so both compute the same bits.
// kind: rawgpu/contract/loss.py's REGRESSION_LOSSES, as -D options (REG_MSE: e^2; REG_L1: |e|; REG_HUBER: delta 1,
// e^2 / 2 within 1, |e| - 1/2 past it).
#pragma once
#include "common.cuh"

#if !defined(REG_MSE) || !defined(REG_L1) || !defined(REG_HUBER)
#error "regression.cuh needs rawgpu/contract/loss.py's REG_* codes (rawgpu/runtime/compiler.py passes them)"
#endif

RG_DEVICE float regression_loss_of(float e, int kind) {
    const float a = fabsf(e);
    return kind == REG_MSE ? e * e : kind == REG_L1 ? a : (a <= 1.f ? 0.5f * e * e : a - 0.5f);
}

RG_DEVICE float regression_grad_of(float e, int kind) {
    return kind == REG_MSE ? 2.f * e : kind == REG_L1 ? (float)((e > 0.f) - (e < 0.f)) : fminf(1.f, fmaxf(-1.f, e));
}

// One row of a regression by a group of LANES aligned lanes (as softmax_xent_row, step_math.cuh): lane q holds the
// predictions and targets of outputs q + LANES p, p < PER. Every lane gets the row's loss (the mean of l(e) over the
// outputs), squared and absolute error sums; grad[p] = l'(e) * scale, 0 past `outputs`.
template <int PER>
struct RegressionRow {
    float loss, squared, absolute, grad[PER];
};

template <int LANES, int PER>
RG_DEVICE RegressionRow<PER> regression_row(const float (&z)[PER], const float (&y)[PER], int outputs, int kind,
                                            float scale) {
    const int q = threadIdx.x % LANES;
    RegressionRow<PER> out;
    float loss = 0.f, sq = 0.f, ab = 0.f;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const bool in = q + LANES * p < outputs;
        const float e = in ? z[p] - y[p] : 0.f;
        sq += e * e, ab += fabsf(e), loss += regression_loss_of(e, kind);
        out.grad[p] = in ? regression_grad_of(e, kind) * scale : 0.f;
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
        loss += __shfl_xor_sync(0xffffffffu, loss, o);
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        ab += __shfl_xor_sync(0xffffffffu, ab, o);
    }
    out.loss = loss * (1.0f / (float)outputs), out.squared = sq, out.absolute = ab;
    return out;
}
