// Rows of a table of your own (rawgpu/data/tables.py) as the table gathers (gather.cu, gather_forward.cu) and the
// standardization's sums read them: 8 features of type In at a time (u8 scaled by 1/255 as the image gather scales
// pixels, to the same bits; f16; f32) and the fp16 entries the gathers write. rows_vectorized and copy_target are
// gather_forward's: gather.cu keeps its own lines for them, which compile to other (measured) machine code there.
#pragma once
#include "common.cuh"

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

// Row entries [j0, j0 + 8) as the table gathers write them, before their one rounding to fp16 (pack8): with STD each
// column standardized, (v - mean[c]) * inv_std[c] in fp32; zero past the row.
template <typename In, bool STD>
RG_DEVICE void row8(const In* in, int j0, int features, bool vec, const float* __restrict__ mean,
                    const float* __restrict__ inv_std, float (&f)[8]) {
    load8<In>(in, j0, features, vec, f);
    if constexpr (STD) {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (j0 + k < features) f[k] = (f[k] - mean[j0 + k]) * inv_std[j0 + k];
    }
}

RG_DEVICE uint4 pack8(const float (&f)[8]) {
    return make_uint4(pack_f16x2(f[0], f[1]), pack_f16x2(f[2], f[3]), pack_f16x2(f[4], f[5]), pack_f16x2(f[6], f[7]));
}

// row8 rounded to fp16: the entries as the gathers store them
template <typename In, bool STD>
RG_DEVICE uint4 row8_f16(const In* in, int j0, int features, bool vec, const float* __restrict__ mean,
                         const float* __restrict__ inv_std) {
    float f[8];
    row8<In, STD>(in, j0, features, vec, mean, inv_std, f);
    return pack8(f);
}

// Whether rows of `features` values of type In starting at x take load8's vector loads.
template <typename In>
RG_DEVICE bool rows_vectorized(const In* x, int features) {
    return ((i64)features * (i64)sizeof(In)) % (8 * sizeof(In) < 16 ? 8 * sizeof(In) : 16) == 0 && ((u64)x & 15) == 0;
}

// Row src's target into batch row i: a class label (int32), or with VALUES `outputs` float32 values, thread t of
// `threads` taking every threads-th value (a label: thread 0).
template <bool VALUES>
RG_DEVICE void copy_target(const void* __restrict__ targets, int outputs, i64 src, void* __restrict__ y_out, int i,
                           int t, int threads) {
    if constexpr (VALUES) {
        for (int k = t; k < outputs; k += threads)
            static_cast<float*>(y_out)[(i64)i * outputs + k] = static_cast<const float*>(targets)[src * outputs + k];
    } else if (t == 0) {
        static_cast<int*>(y_out)[i] = static_cast<const int*>(targets)[src];
    }
}
}  // namespace gtab
