// A barrier across every CTA of one launch, for persistent kernels whose CTAs are all resident at once
// (a cooperative launch guarantees it). One 64-bit counter that only grows: the k-th barrier's G arrivals
// (G = gridDim.x) get old values in [k G, (k + 1) G), because no CTA can arrive at barrier k + 1 before all
// have arrived at k. So each CTA derives its target from its own ticket: no reset, no sense flag, no second
// counter. The counter must be a multiple of G when a launch starts: zero it once, and launch with one grid
// size per counter.
#pragma once
#include "common.cuh"

RG_DEVICE u64 atomic_add_release_gpu(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.add.release.gpu.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

RG_DEVICE u64 load_acquire_gpu(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Every write any thread of the grid made before the barrier is visible to every thread after it: the CTA
// barrier orders the block's writes before thread 0's release (release is cumulative), and thread 0's acquire
// before the second CTA barrier orders the other blocks' writes before everything the block does next. Reads of such data must bypass L1 (ld.global.cg or
// cp.async.cg): L1 is not coherent across SMs.
RG_DEVICE void grid_barrier(u64* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 blocks = gridDim.x;
        const u64 target = (atomic_add_release_gpu(counter, 1) / blocks + 1) * blocks;
        while (load_acquire_gpu(counter) < target) {
        }
    }
    __syncthreads();
}
