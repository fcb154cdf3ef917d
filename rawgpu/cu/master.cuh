// The fp32 master weights, stored as two 16-bit halves: hi = fp16(w), which *is* the fp16 working copy the
// forward and dx GEMMs read, and lo = the rest, w - hi, as a signed integer count of u = ulp16(hi) / 2^15.
//
// Why: with a separate fp32 master and fp16 copy a step moves 12 bytes per weight (read the copy in the forward;
// read and write the master and write the copy in the update). Here the copy is half of the master, so the update
// reads and writes 4 + 4 bytes and a step moves 10; and the model takes 4 bytes per weight instead of 6.
//
// Exact. For every fp32 w with 2^-16 <= |w| < 65520, join(split(w)) == w bit for bit: w - hi is exact (Sterbenz),
// is a multiple of ulp32(w) >= u and |w - hi| <= ulp16(hi) / 2 = 2^14 u, so lo fits int16 with room to spare. So an
// update computed as w' = fp32(join - lr g) and split again gives the very bits an fp32 master would hold. Below
// 2^-16 (where hi is an fp16 subnormal and u = 2^-39), w is held to 2^-39 instead of to 24 bits: the only
// difference from a plain fp32 master, five orders of magnitude below any SGD step here. rawgpu/model/master.py is the
// same arithmetic in numpy, bit for bit (tests compare).
#pragma once
#include "common.cuh"

// The arithmetic avoids the conversion units (a quarter of the FMA rate on sm_80-90; an update would otherwise
// spend three conversions per weight): adding 1.5 * 2^23 to a float of magnitude below 2^22 leaves the nearest
// integer (ties to even) in its low mantissa bits, so int <-> float is an add, and u comes from h's exponent bits.
#define MASTER_MAGIC 12582912.0f  // 1.5 * 2^23
#define MASTER_MAGIC_BITS 0x4B400000

// u = ulp16(hi) / 2^15 = 2^(E - 25) for h = hi as fp32 with exponent E; 2^-39 when hi is subnormal or zero.
RG_DEVICE float master_unit(float h) {
    const int e = __float_as_int(h) & 0x7F800000;
    return __int_as_float(max(e - (25 << 23), (127 - 39) << 23));
}
// 1 / u, exactly (a power of two).
RG_DEVICE float master_unit_inverse(float h) {
    const u32 e = __float_as_uint(h) & 0x7F800000u;
    return __uint_as_float(min((279u << 23) - e, (127u + 39u) << 23));  // 2^(25 - E), at most 2^39
}

RG_DEVICE float master_join_f(float h, int lo) {
    const float l = __int_as_float(MASTER_MAGIC_BITS + lo) - MASTER_MAGIC;  // (float)lo, exactly
    return fmaf(l, master_unit(h), h);
}

// The rest w - h (exact) in units of u, rounded to the nearest integer (ties to even): rest / u is exact, so the
// one rounding of the fma is the rounding to an integer. NaN and infinities keep hi; lo is then meaningless.
RG_DEVICE int master_lo(float w, float h) {
    return __float_as_int(fmaf(w - h, master_unit_inverse(h), MASTER_MAGIC)) - MASTER_MAGIC_BITS;
}

// w -> (hi, lo).
RG_DEVICE void master_split(float w, u32& hi, int& lo) {
    hi = f32_to_f16(w);
    lo = master_lo(w, f16_to_f32((half_t)hi));
}

// The value the master holds for an fp32 w: w itself from 2^-16 up; below, where hi is an fp16 subnormal or zero
// and u = 2^-39, join(split(w)) is w rounded to a multiple of 2^-39 (ties to even), computed here without the split.
// For kernels that keep fp32 weights across steps (cluster_step.cu) and must round each update as the stored
// master would.
RG_DEVICE float master_round(float w) {
    const float r = rintf(w * 0x1p39f) * 0x1p-39f;
    return fabsf(w) < 0x1p-16f ? r : w;
}

// Two adjacent weights: hi2 holds two fp16 (the lower column in bits 0..15), lo2 two int16 the same way.
RG_DEVICE float2 master_join2(u32 hi2, u32 lo2) {
    const float2 h = unpack_f16x2(hi2);
    return make_float2(master_join_f(h.x, (int)(short)(lo2 & 0xFFFFu)), master_join_f(h.y, (int)lo2 >> 16));
}
RG_DEVICE void master_split2(float2 w, u32& hi2, u32& lo2) {
    hi2 = pack_f16x2(w.x, w.y);
    const float2 h = unpack_f16x2(hi2);
    lo2 = ((u32)master_lo(w.x, h.x) & 0xFFFFu) | ((u32)master_lo(w.y, h.y) << 16);
}
