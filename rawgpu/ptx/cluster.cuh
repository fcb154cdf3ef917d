// Thread-block clusters (sm_90+): a CTA's rank in its cluster, stores into another CTA's shared memory
// (distributed shared memory), and the hardware cluster barrier. Callers compile these only for sm_90+.
//
// Ordering: barrier.cluster.arrive.release orders every shared-memory write the thread made before it (local or
// remote) before the barrier; barrier.cluster.wait.acquire makes every write released by the other CTAs' arrivals
// visible after it. So "write remote slices, then cluster_sync()" publishes them, like __syncthreads() for one CTA.
#pragma once
#include "common.cuh"

RG_DEVICE u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

RG_DEVICE u32 cluster_ctas() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// The address, in the cluster's shared window, of this CTA's shared address `local` inside CTA `rank`.
RG_DEVICE u32 cluster_address(u32 local, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}

// Every thread of every CTA in the cluster arrives (release) and waits (acquire): a cluster-wide __syncthreads.
RG_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}


// A float2 from the shared memory of another CTA of the cluster (`address` from cluster_address).
RG_DEVICE float2 cluster_load_f2(u32 address) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address) : "memory");
    return v;
}

// The sum, from 0 in rank order, of the float2 at this CTA's shared address `local` in cluster ranks 0 .. n - 1
// (n <= N). Every load is issued before the first add, so the n round trips overlap instead of queueing.
template <int N>
RG_DEVICE float2 cluster_sum_f2(u32 local, int n) {
    float2 v[N];
#pragma unroll
    for (int z = 0; z < N; ++z)
        if (z < n) v[z] = cluster_load_f2(cluster_address(local, (u32)z));
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll
    for (int z = 0; z < N; ++z)
        if (z < n) {
            sum.x += v[z].x;
            sum.y += v[z].y;
        }
    return sum;
}

// Stores that count their bytes on the receiving CTA's mbarrier (st.async; `bar` is a cluster address in the same
// CTA as `address`). The receiver waits on its own barrier for the bytes it expects (cluster_wait_phase); the
// sender waits for nothing: no release fence drains its stores, as before a barrier.cluster.arrive.release.
RG_DEVICE void cluster_store_async_16(u32 address, uint4 v, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar) : "memory");
}

RG_DEVICE void cluster_store_async_u32(u32 address, u32 v, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" :: "r"(address), "r"(v),
                 "r"(bar) : "memory");
}

RG_DEVICE void cluster_store_async_f2(u32 address, float a, float b, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 :: "r"(address), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(bar) : "memory");
}

// One arrival on the mbarrier at cluster address `bar` (cluster_address), in any CTA: the default .release.cta, for
// releasing shared memory this thread's reads have finished with (wgmma.wait_group); .release.cluster would compile
// to a GPU-wide memory barrier before every arrival.
RG_DEVICE void cluster_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(bar) : "memory");
}

// cluster_sync for threads that need not arrive together (no .aligned: any subset of a warp may execute it).
RG_DEVICE void cluster_sync_any() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// Initialised mbarriers become visible to the other CTAs' st.async (before the cluster_sync that follows).
RG_DEVICE void fence_mbarrier_init_cluster() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Block until the phase of this CTA's mbarrier with this parity has completed, acquiring at cluster scope what the
// other CTAs' st.async wrote.
RG_DEVICE void cluster_wait_phase(u32 bar, u32 parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT_%=:\n"
        "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "  @!done bra WAIT_%=;\n"
        "}" :: "r"(bar), "r"(parity) : "memory");
}
