// Shared basics for every kernel. NVRTC ships no CUDA headers (no cuda_fp16.h), so we declare what we
// use ourselves: fixed-width types, fp16 as raw 16-bit storage, conversions through inline PTX.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef u16 half_t;  // IEEE fp16 bits; arithmetic happens in fp32 or inside the tensor cores

#define RG_DEVICE __device__ __forceinline__

// Grid-stride loop over [0, n): the kernels stay correct for any grid size.
#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

RG_DEVICE half_t f32_to_f16(float f) {  // round to nearest even
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

RG_DEVICE float f16_to_f32(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Two floats -> one register of two fp16 (lo in bits 0..15, hi in 16..31), one instruction on sm_80+.
RG_DEVICE u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

RG_DEVICE float2 unpack_f16x2(u32 v) {
    return make_float2(f16_to_f32((half_t)(v & 0xFFFF)), f16_to_f32((half_t)(v >> 16)));
}

// 16-byte vector access (the address must be 16-byte aligned).
RG_DEVICE uint4 load_16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
RG_DEVICE void store_16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a tile of 128-byte rows written with the 128-byte
// swizzle: the chunk index is XORed with the row's position in its 8-row (1024-byte) group, so the 8 rows an
// ldmatrix reads at one column sit in 8 different bank groups. The one rule for the layout that TMA writes, warpgroup
// MMA reads and our own copies (l2.cuh: load_rows) write.
RG_DEVICE u32 swizzle_128b(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// Loads that skip L1 (L2 is the coherence point between blocks of one launch): for data other blocks of the
// same launch write. Vector forms need their natural alignment.
RG_DEVICE float4 load_cg_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
RG_DEVICE float2 load_cg_f2(const float* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}
RG_DEVICE float load_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
RG_DEVICE double load_cg_f64(const double* p) {
    double v;
    asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(v) : "l"(p));
    return v;
}
RG_DEVICE uint4 load_cg_16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
RG_DEVICE u32 load_cg_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Warp-wide sums in a fixed butterfly order: deterministic, every lane gets the result.
RG_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

RG_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

RG_DEVICE u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
