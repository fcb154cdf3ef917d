// Experiment: the smallest chain of programmatic dependent launches that keeps ptx/pdl.cuh's contract, to run as
// many processes at once on one GPU (dev/concurrency/pdl_chain.py). Each link does some independent work, waits for
// the link before it, lets the next one start, then moves a counter without an atomic: the counter ends at the
// number of links only if every link really ran after the one before.
//
// mode bits: 1 a cluster barrier before the wait (as cu/head.cu: its CTAs meet while the prior grid still runs),
//            2 no explicit trigger (the next link starts when every CTA has exited),
//            4 the trigger before the wait (breaks pdl.cuh's "at most two grids" rule: a third may start early).
#include "common.cuh"
#include "pdl.cuh"
#if __CUDA_ARCH__ >= 900
#include "cluster.cuh"
#endif

RG_DEVICE u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Bounded busy work: the timer moves on while the context is switched out, so this always ends.
RG_DEVICE void busy(int ns) {
    const u64 end = global_ns() + (u64)ns;
    while (global_ns() < end) {
    }
}

extern "C" __global__ void pdl_link(u64* counter, int before_ns, int after_ns, int mode) {
    busy(before_ns);
#if __CUDA_ARCH__ >= 900
    if (mode & 1) cluster_sync();
#endif
    if (mode & 4) allow_dependents();
    wait_for_prior_grid();
    if (!(mode & 6)) allow_dependents();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 c = *(volatile u64*)counter;
        *(volatile u64*)counter = c + 1;
    }
    busy(after_ns);
}

// The hand-off a step relies on: link k reads what link k - 1 wrote (every element k - 1) and writes k, counting
// any element it finds stale. mode 1: each thread also reads its elements before the wait, while the prior link
// is still writing them (a kernel of the product never reads what the kernel before writes that early; this asks
// whether the wait still makes the prior link's writes visible to a reader that cached them); mode 2: write k only
// (the graph's first link, which starts the count again).
extern "C" __global__ void pdl_handoff(u32* data, int n, u32 k, u32* stale, int mode) {
    const int stride = gridDim.x * blockDim.x;
    u32 early = 0;
    if (mode & 1)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) early += data[i];
    wait_for_prior_grid();
    allow_dependents();
    u32 bad = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (!(mode & 2)) bad += data[i] != k - 1;
        data[i] = k;
    }
    if (bad) atomicAdd(stale, bad);
    if (early == 0xFFFFFFFFu) atomicAdd(stale + 1, 1u);  // keeps the early reads
}
