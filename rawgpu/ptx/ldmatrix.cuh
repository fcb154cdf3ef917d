// ldmatrix: a warp loads four 8x8 fp16 matrices from shared memory straight into mma fragment registers.
// Lane i gives the shared address of row (i % 8) of matrix (i / 8); register j receives matrix j, with
// lane l holding row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1. `.trans` transposes each 8x8 matrix on
// the way, which is how operands stored with the other dimension contiguous become fragments.
#pragma once
#include "common.cuh"

// The 32-bit shared-window address PTX wants, from a generic pointer into shared memory.
RG_DEVICE u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

RG_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

RG_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Two matrices (lanes 0-15 give the addresses): one k16 x n8 B fragment from a row-major k x n tile.
RG_DEVICE void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
