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

RG_DEVICE void cluster_store_16(u32 address, uint4 v) {
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

RG_DEVICE void cluster_store_f2(u32 address, float a, float b) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" :: "r"(address), "f"(a), "f"(b) : "memory");
}

// Every thread of every CTA in the cluster arrives (release) and waits (acquire): a cluster-wide __syncthreads.
RG_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
