// The hidden layers' activation, forward and backward, for the epilogues that apply it (gemm_epilogue.cuh, the
// one-pass backward's dx, the head's dh). A build applies one (ACTIVATION, rawgpu/contract/activation.py).
//   relu       max(z, 0)                          backward from the output h: h > 0
//   gelu       z Phi(z), torch's erf form         backward from the slope the forward saved: Phi(z) + z phi(z)
//   gelu_tanh  torch's approximate="tanh"         backward from the saved slope
//   silu       z sigmoid(z)                       backward from the saved slope: s (1 + z (1 - s))
//   tanh       tanh(z)                            backward from the output h: 1 - h^2
// Where act' needs z, the forward epilogue computes it beside act(z) (sharing erf, tanh or the sigmoid) and stores
// it (fp16, beside h): the backward multiplies, in kernels that run on few SMs (the head, a one pass's dx), and no
// kernel evaluates the function twice. The exponentials are the hardware's (__expf: a few ulp, far below the fp16
// the results are stored in); erff is exact to 2 ulp.
#pragma once
#include "common.cuh"

// ACT_SAVES_SLOPE: whether the forward saves act'(z) for the backward (else the backward reads the output h, which
// the next layer reads anyway).
#if !defined(ACTIVATION) || !defined(ACT_SAVES_SLOPE) || !defined(ACT_RELU) || !defined(ACT_GELU) || \
    !defined(ACT_GELU_TANH) || !defined(ACT_SILU) || !defined(ACT_TANH)
#error "activation.cuh needs rawgpu/contract/activation.py's ACT_* codes (rawgpu/runtime/compiler.py passes them)"
#endif

constexpr float ACT_SQRT_HALF = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float ACT_INV_SQRT_2PI = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float ACT_SQRT_2_OVER_PI = 0.79788456080286536f;
constexpr float ACT_GELU_CUBIC = 0.044715f;

// act(z), and act'(z) into `slope` where the forward saves it (ACT_SAVES_SLOPE; untouched otherwise).
RG_DEVICE float act_forward(float z, float& slope) {
#if ACTIVATION == ACT_RELU
    return fmaxf(z, 0.f);
#elif ACTIVATION == ACT_GELU
    const float phi = 0.5f * (1.f + erff(z * ACT_SQRT_HALF));
    slope = phi + z * ACT_INV_SQRT_2PI * __expf(-0.5f * z * z);
    return z * phi;
#elif ACTIVATION == ACT_GELU_TANH
    const float t = tanhf(ACT_SQRT_2_OVER_PI * (z + ACT_GELU_CUBIC * z * z * z));
    const float dt = (1.f - t * t) * ACT_SQRT_2_OVER_PI * (1.f + 3.f * ACT_GELU_CUBIC * z * z);  // d(tanh)/dz
    slope = 0.5f * (1.f + t) + 0.5f * z * dt;
    return 0.5f * z * (1.f + t);
#elif ACTIVATION == ACT_SILU
    const float s = __fdividef(1.f, 1.f + __expf(-z));  // 0 where exp(-z) overflows (z < -88), as the limit is
    slope = s * (1.f + z * (1.f - s));
    return z * s;
#else
    return tanhf(z);
#endif
}

RG_DEVICE float act_forward(float z) {
    float unused;
    return act_forward(z, unused);
}

// dy * act'(z), from what the forward saved for the backward: h for relu and tanh, act'(z) for the others.
RG_DEVICE float act_backward(float dy, float saved) {
#if ACTIVATION == ACT_RELU
    return saved > 0.f ? dy : 0.f;  // a select, not a product: relu'(z) dy is 0 where z <= 0, whatever dy is
#elif ACT_SAVES_SLOPE
    return dy * saved;
#else
    return dy * (1.f - saved * saved);
#endif
}
