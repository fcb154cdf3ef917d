// Experiment (dev/transpose_upload/run.py): a table's float32 columns, uploaded as pyarrow holds them (column-major,
// column c of a chunk at cols + c * stride), turned into the rows the GPU trains on: fp16 [rows, ld] (ld >= features:
// the product keeps ld = features; padding columns zero), each value rounded to nearest even as the host's astype
// does. The host's check rides along: *bad = the lowest flat index (row * features + column, rows counted from
// row0) of a value fp16 cannot hold (inf or NaN after rounding). A block: TILE_ROWS rows x every column (features
// <= MAX_FEATURES), read a column at a time (coalesced), written as whole rows through shared memory (coalesced
// 16-byte stores).
#include "common.cuh"

#define TILE_ROWS 128
#define MAX_FEATURES 64

extern "C" __global__ void __launch_bounds__(256)
columns_to_rows(const float* __restrict__ cols, i64 stride, int rows, int features, int ld, i64 row0,
                half_t* __restrict__ out, unsigned long long* bad) {
    __shared__ __align__(16) half_t tile[TILE_ROWS * MAX_FEATURES];
    const int r_first = blockIdx.x * TILE_ROWS;
    const int n = min(TILE_ROWS, rows - r_first);
    unsigned long long first_bad = ~0ull;
    for (int i = threadIdx.x; i < TILE_ROWS * features; i += blockDim.x) {
        const int c = i / TILE_ROWS, r = i % TILE_ROWS;  // consecutive threads: consecutive rows of one column
        half_t h = 0;
        if (r < n) {
            h = f32_to_f16(cols[c * stride + r_first + r]);
            if ((h & 0x7c00) == 0x7c00)
                first_bad = min(first_bad, (unsigned long long)((row0 + r_first + r) * features + c));
        }
        tile[r * ld + c] = h;
    }
    for (int i = threadIdx.x; i < TILE_ROWS * (ld - features); i += blockDim.x) {  // the padding columns
        const int w = ld - features;
        tile[(i / w) * ld + features + i % w] = 0;
    }
    __syncthreads();
    // the tile's rows are contiguous in `out`: n * ld halves from a 16-byte boundary (TILE_ROWS * ld * 2 is a
    // multiple of 16, and so must `out` be), as 16-byte vectors and the last few halves one at a time
    const uint4* src = reinterpret_cast<const uint4*>(tile);
    half_t* base = out + (i64)r_first * ld;
    uint4* dst = reinterpret_cast<uint4*>(base);
    const int halves = n * ld, vectors = halves / 8;
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) dst[v] = src[v];
    for (int h = vectors * 8 + threadIdx.x; h < halves; h += blockDim.x) base[h] = tile[h];
    if (first_bad != ~0ull) atomicMin(bad, first_bad);
}
