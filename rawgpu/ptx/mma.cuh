// Tensor-core matrix multiply-accumulate: mma.sync.aligned.m16n8k16, fp16 inputs (sm_80+).
//
// Fragment layouts (lane = 0..31, g = lane / 4, t = lane % 4), every register holds two fp16 or one f32:
//   A (16x16, row): a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..]   a[2] = A[g][2t+8..]   a[3] = A[g+8][2t+8..]
//   B (16x8, col):  b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   C/D f32 (16x8): d[0], d[1] = C[g][2t], C[g][2t+1];  d[2], d[3] = C[g+8][2t], C[g+8][2t+1]
//   C/D f16 (16x8): d[0] = C[g][2t..2t+1] packed;       d[1] = C[g+8][2t..2t+1] packed
#pragma once
#include "common.cuh"

// d += a * b with fp32 accumulators.
RG_DEVICE void mma_m16n8k16_f32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a * b with fp16 accumulators (half the register file; twice the rate on GeForce Ampere).
RG_DEVICE void mma_m16n8k16_f16(u32 (&d)[2], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 "
        "{%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%0, %1};\n"
        : "+r"(d[0]), "+r"(d[1])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A warp's whole MT x NT grid of 16x8 tiles: acc[i][j] += a[i] * b[j], into the fp32 or the fp16 accumulators.
template <bool ACC16, int MT, int NT>
RG_DEVICE void mma_tiles(float (&acc)[MT][NT][4], u32 (&acc16)[MT][NT][2], const u32 (&a)[MT][4], const u32 (&b)[NT][2]) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (ACC16) mma_m16n8k16_f16(acc16[i][j], a[i], b[j]);
            else       mma_m16n8k16_f32(acc[i][j], a[i], b[j]);
        }
}
