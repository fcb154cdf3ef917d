// Experiment (not the product): the one-pass backward's weight bytes as a plain stream. Every weight's master
// (W16, lo), its momentum m (and with STATES 2 Adam's v) read and written back in place, 16-byte pieces, a
// grid-stride loop with UNROLL pieces of each array in flight per thread: the same 16 (24) bytes per weight as
// dx_update.cu moves, in the order a copy moves them. What this reaches is the most any structure of that kernel
// could (dev/backward/limits.py --stream).
#include "common.cuh"

// n: weights, a multiple of 8; a piece is 8 weights: 16 bytes of W16 and of lo, 32 of each state.
template <int STATES, int UNROLL>
RG_DEVICE void stream_update(half_t* w16, short* lo, float* m, float* v, i64 n) {
    const i64 pieces = n / 8, stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = blockIdx.x * (i64)blockDim.x + threadIdx.x; base < pieces; base += stride * UNROLL) {
        uint4 a[UNROLL], b[UNROLL], c[UNROLL][2], d[UNROLL][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const i64 i = base + u * stride;
            if (i >= pieces) continue;
            a[u] = load_16(w16 + 8 * i);
            b[u] = load_16(lo + 8 * i);
            c[u][0] = load_16(m + 8 * i);
            c[u][1] = load_16(m + 8 * i + 4);
            if (STATES == 2) {
                d[u][0] = load_16(v + 8 * i);
                d[u][1] = load_16(v + 8 * i + 4);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const i64 i = base + u * stride;
            if (i >= pieces) continue;
            a[u].x ^= 1u;  // a change the compiler cannot drop: the stores write what was read, altered
            b[u].y ^= 1u;
            c[u][0].z ^= 1u;
            *reinterpret_cast<uint4*>(w16 + 8 * i) = a[u];
            *reinterpret_cast<uint4*>(lo + 8 * i) = b[u];
            *reinterpret_cast<uint4*>(m + 8 * i) = c[u][0];
            *reinterpret_cast<uint4*>(m + 8 * i + 4) = c[u][1];
            if (STATES == 2) {
                *reinterpret_cast<uint4*>(v + 8 * i) = d[u][0];
                *reinterpret_cast<uint4*>(v + 8 * i + 4) = d[u][1];
            }
        }
    }
}

#define STREAM_INSTANCE(STATES, UNROLL)                                                                              \
    extern "C" __global__ void stream_s##STATES##_u##UNROLL(half_t* w16, short* lo, float* m, float* v, i64 n) {  \
        stream_update<STATES, UNROLL>(w16, lo, m, v, n);                                                            \
    }
STREAM_INSTANCE(1, 1)
STREAM_INSTANCE(1, 2)
STREAM_INSTANCE(1, 4)
STREAM_INSTANCE(2, 1)
STREAM_INSTANCE(2, 2)
STREAM_INSTANCE(2, 4)
