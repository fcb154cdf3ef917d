// The sm_90 tensor copy engine (TMA) and the shared-memory barriers (mbarrier) its copies complete on.
//
// A tensor map (built on the host by cuTensorMapEncodeTiled, 128 opaque bytes) describes a 2-D global matrix and
// a box; one instruction then copies a whole box into shared memory, zero-filling what lies outside the matrix,
// and counts its bytes against an mbarrier. One thread keeps a pipeline full, with no registers or address math
// per 16-byte piece: that is what lets one block per SM stream near DRAM speed.
// An mbarrier completes a phase when its expected arrivals have arrived and its expected bytes have landed;
// waiters name the phase by its parity (0, 1, 0, ...). Everything here needs sm_90: callers guard with
// `#if __CUDA_ARCH__ >= 900`.
#pragma once
#include "common.cuh"
#include "ldmatrix.cuh"
#include "l2.cuh"

// What cuTensorMapEncodeTiled fills in; passed to kernels by value as a `const __grid_constant__` parameter,
// so the copy engine reads it from the parameter space.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

RG_DEVICE void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// Order this thread's earlier shared-memory accesses (initialised barriers, reads of a buffer about to be
// refilled) before the copy engine's (the async proxy's) later ones.
RG_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One arrival that also tells the barrier to expect `bytes` more bytes of copies in this phase.
RG_DEVICE void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                 :: "r"(shared_address(bar)), "r"(bytes) : "memory");
}

RG_DEVICE void mbar_arrive(u64* bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" :: "r"(shared_address(bar)) : "memory");
}

// Block until the phase with this parity has completed.
RG_DEVICE void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT_%=:\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "  @!done bra WAIT_%=;\n"
        "}" :: "r"(shared_address(bar)), "r"(parity) : "memory");
}

// Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this CTA's shared memory
// with the bulk copy engine, counting them on `bar`: one instruction per contiguous row, whatever its length.
RG_DEVICE void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(dst)), "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
}

// Fetch a tensor map into the copy engine's cache ahead of the first copy that uses it.
RG_DEVICE void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

// Copy the box whose first element is (x = column along the contiguous dimension, y = row) into `dst`, counting its
// bytes on `bar`. dst must be 1024-byte aligned for the 128-byte swizzle.
RG_DEVICE void tma_load_2d(void* dst, const TensorMap* map, int x, int y, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        :: "r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(bar))
        : "memory");
}

// tma_load_2d into the same shared offset of every CTA of the cluster in `mask`, counting the bytes on each one's
// barrier at `bar`'s offset (sm_90 clusters), with the L2 hint where one is planned (l2.cuh).
RG_DEVICE void tma_load_2d_multicast(void* dst, const TensorMap* map, int x, int y, u64* bar, u16 mask, L2Hint hint) {
    if (hint.on)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
            ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;"
            :: "r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(bar)),
               "h"(mask), "l"(hint.policy)
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3}], [%4], %5;"
            :: "r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(bar)),
               "h"(mask)
            : "memory");
}

// tma_load_2d with the L2 hint where one is planned (l2.cuh).
RG_DEVICE void tma_load_2d_hinted(void* dst, const TensorMap* map, int x, int y, u64* bar, L2Hint hint) {
    if (!hint.on) return tma_load_2d(dst, map, x, y, bar);
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        :: "r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(shared_address(bar)),
           "l"(hint.policy)
        : "memory");
}
