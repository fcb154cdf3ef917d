// L2 eviction priorities (sm_80+): a cache policy says how long the lines an access brings in (or writes) should
// stay in L2, so that a weight read by one kernel is still there when a later kernel of the step reads it again,
// while the bytes streamed past it in between are dropped first.
//
// A policy is made from one float, `keep`, the way the launchers plan it (kernels/l2.py):
//   keep > 0   that fraction of the lines (by address) evict last, the rest evict first;
//   keep == 0  normal priority: what an access without a hint gets;
//   keep < 0   evict first: bytes read or written once, which should not push anything else out.
// An access re-marks a line it hits, so a kept line is released by the next access with another policy.
#pragma once
#include "common.cuh"
#include "ldmatrix.cuh"

RG_DEVICE u64 l2_policy(float keep) {
    u64 policy;
    if (keep > 0.f)
        asm volatile("createpolicy.fractional.L2::evict_last.L2::evict_first.b64 %0, %1;" : "=l"(policy) : "f"(fminf(keep, 1.f)));
    else if (keep < 0.f)
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    else
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// A planned hint for the copy engine's loads (tma.cuh): keep == 0 goes without one, since an evict-normal hint on
// every load of a tile's B ran slower than none (docs/history.md: "No hint where none is planned").
struct L2Hint {
    u64 policy;
    bool on;
};
RG_DEVICE L2Hint l2_hint(float keep) { return keep != 0.f ? L2Hint{l2_policy(keep), true} : L2Hint{0, false}; }

// cp.async.cg of 16 bytes (cp_async.cuh) with a cache policy; `valid` false zero-fills and reads nothing.
RG_DEVICE void cp_async_16_policy(void* smem, const void* gmem, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(shared_address(smem)), "l"(gmem), "r"(valid ? 16 : 0), "l"(policy));
}

// Where element (r, col) of a shared tile sits: rows of LD elements, or (SW128) rows of 128 bytes whose 16-byte
// pieces are 128-byte swizzled (common.cuh: swizzle_128b), the layout warpgroup MMA and the copy engine read; such a
// tile starts on a 1024-byte boundary (the swizzle's period).
template <class T, int LD, bool SW128>
RG_DEVICE int tile_index(int r, int col) {
    constexpr int PIECE = 16 / sizeof(T);
    static_assert(!SW128 || LD * sizeof(T) == 128, "a swizzled tile's rows are 128 bytes");
    return SW128 ? int(swizzle_128b(r, col / PIECE)) / int(sizeof(T)) + col % PIECE : r * LD + col;
}

// A block's THREADS copy ROWS x COLS elements of T (16-byte pieces) at global (r0, c0) of g (row stride ld) into s
// (laid out as tile_index<T, LD, SW128> says), with a cache policy; rows >= R and columns >= C are zero-filled (C is
// a multiple of the piece). ROLLED keeps the loop a loop: for callers whose live registers leave no room for every
// copy's address at once.
template <class T, int ROWS, int COLS, int LD, int THREADS, bool SW128 = false, bool ROLLED = false>
RG_DEVICE void load_rows(T* s, const T* g, int ld, int r0, int c0, int R, int C, int tid, u64 policy) {
    constexpr int PIECE = 16 / sizeof(T), PER_ROW = COLS / PIECE, CHUNKS = ROWS * PER_ROW;
    constexpr int ITERATIONS = (CHUNKS + THREADS - 1) / THREADS;
    static_assert(!SW128 || COLS == LD, "a swizzled tile is loaded whole rows at a time");
#pragma unroll(ROLLED ? 1 : ITERATIONS)
    for (int it = 0; it < ITERATIONS; ++it) {
        const int i = it * THREADS + tid;
        if (CHUNKS % THREADS == 0 || i < CHUNKS) {
            const int r = i / PER_ROW, c = (i % PER_ROW) * PIECE;
            const bool valid = r0 + r < R && c0 + c < C;
            T* to = s + r * LD + c;
            if constexpr (SW128) to = s + tile_index<T, LD, true>(r, c);
            cp_async_16_policy(to, valid ? g + (i64)(r0 + r) * ld + (c0 + c) : g, valid, policy);
        }
    }
}

// A 16-byte store with a cache policy.
RG_DEVICE void store_16_policy(void* p, uint4 v, u64 policy) {
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
}
