// What the one-pass backward kernels share (dx_sgd.cu, dx_update.cu): the end of a row band's dx.
#pragma once
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "cluster.cuh"
#include "ldmatrix.cuh"  // shared_address
#include "l2.cuh"        // tile_index

// Pair i of a band's dx: batch row i / (BM / 2), features i0 + 2 (i % (BM / 2)) + {0, 1}. fp16 (dx_f32 false):
// times act' (activation.cuh) and rounded, act' from the layer's input x (the band's tile in shared memory, rows of
// LDX halves, swizzled where SW128: l2.cuh's tile_index) or, for an activation whose forward saved it, from
// `slope`, act' at the pair (load_band_slopes).
// fp32: the raw sum (lddx in floats), a partial sum other GPUs add to; elementwise.cu's finish_sum_dact applies act'
// and rounds their total by the same fp16_epilogue2 (steps/sharded.py). The flag is the launch's: a uniform
// branch, at the store only.
template <int BM, int LDX, bool SW128 = false>
RG_DEVICE void store_dx_pair(int i, float2 v, const half_t* sX, u32 slope, void* dx, int lddx, bool dx_f32, int B,
                             int IN, int i0) {
    const int r = i / (BM / 2), col = (i % (BM / 2)) * 2;
    if (r >= B || i0 + col >= IN) return;
    if (dx_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(dx) + (i64)r * lddx + i0 + col) = v;
        return;
    }
    const half_t* xp = sX + tile_index<half_t, LDX, SW128>(r, col);
    const float2 a = unpack_f16x2(ACT_SAVES_SLOPE ? slope : *reinterpret_cast<const u32*>(xp));
    *reinterpret_cast<u32*>(static_cast<half_t*>(dx) + (i64)r * lddx + i0 + col) =
        fp16_epilogue2<EPI_DACT>(v.x, v.y, a);
}


#if __CUDA_ARCH__ >= 900
// Whether the band's column ranges add their dx in a cluster (launched as one cluster of gridDim.z ranges).
RG_DEVICE bool ranges_in_cluster() { return gridDim.z > 1 && gridDim.y == 1 && cluster_ctas() == gridDim.z; }
#else
RG_DEVICE bool ranges_in_cluster() { return false; }
#endif

// The pairs of a band's dx this thread stores (store_dx_band): first + k THREADS for k < ITERS, those below end.
// In a cluster block z stores the z-th share of the pairs (a share holds at most ITERS per thread); else every pair.
template <int ITERS, int THREADS>
RG_DEVICE void stored_pairs(int& first, int& end) {
    constexpr int PAIRS = ITERS * THREADS;
    first = (int)threadIdx.x, end = PAIRS;
    if (ranges_in_cluster()) {
        const int share = (PAIRS + (int)gridDim.z - 1) / (int)gridDim.z;
        first += (int)blockIdx.z * share;
        end = min(PAIRS, (int)(blockIdx.z + 1) * share);
    }
}

// act' at the pairs this thread stores, for store_dx_band, from `slope` (what the forward saved of the layer's input,
// dx's layout), where the backward reads it and this block stores dx in fp16 (`fp16_dx`); zeros otherwise. Loaded
// by the kernel right after it may read this step's activations (pdl_enter): the latency passes under its loop.
template <int ITERS, int THREADS, int BM>
RG_DEVICE void load_band_slopes(u32 (&z)[ITERS], const half_t* slope, int lddx, bool fp16_dx, int B, int IN,
                                int i0) {
    int first, end;
    stored_pairs<ITERS, THREADS>(first, end);
#pragma unroll
    for (int k = 0; k < ITERS; ++k) {
        const int i = first + k * THREADS, r = i / (BM / 2), col = (i % (BM / 2)) * 2;
        const bool in = ACT_SAVES_SLOPE && fp16_dx && i < end && r < B && i0 + col < IN;
        z[k] = in ? *reinterpret_cast<const u32*>(slope + (i64)r * lddx + i0 + col) : 0u;
    }
}

// A block's dx for its band of BM input features, as ITERS pairs per thread (pair i = threadIdx.x + it THREADS),
// stored (store_dx_pair; z: act' at the pairs this thread stores, load_band_slopes). With several column ranges
// (gridDim.z) their sums are added in range order, from 0:
//   - launched as clusters of the band's ranges (sm_90, kernels/dx_sgd.py: reduce_in_cluster), through distributed
//     shared memory: each block puts its sums in `scratch` (PAIRS float2, free once every thread has its sums), and
//     block z of the cluster adds up and stores the z-th share of the pairs;
//   - otherwise in the workspace, by the last block to take the band's ticket (the others return).
// Both add the same values in the same order: the same bits.
template <int ITERS, int THREADS, int BM, int LDX, bool SW128 = false>
RG_DEVICE void store_dx_band(float2 (&sum)[ITERS], const half_t* sX, const u32 (&z)[ITERS], void* dx, int lddx,
                             bool dx_f32, int B, int IN, int i0, float* workspace, int* tickets, float2* scratch) {
    constexpr int PAIRS = ITERS * THREADS;
    int first, end;
    stored_pairs<ITERS, THREADS>(first, end);
#if __CUDA_ARCH__ >= 900
    if (ranges_in_cluster()) {
        __syncthreads();  // every thread has read its sums from the memory `scratch` reuses
#pragma unroll
        for (int it = 0; it < ITERS; ++it) scratch[threadIdx.x + it * THREADS] = sum[it];
        cluster_sync();
        const u32 base = shared_address(scratch);
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
            const int i = first + k * THREADS;
            if (i < end)
                store_dx_pair<BM, LDX, SW128>(i, cluster_sum_f2<MAX_CLUSTER_SPLITS>(base + 8u * (u32)i, (int)gridDim.z),
                                              sX, z[k], dx, lddx, dx_f32, B, IN, i0);
        }
        cluster_sync();  // the other blocks have read this one's sums before it leaves
        return;
    }
#endif
    if (gridDim.z > 1) {
        float2* ws = reinterpret_cast<float2*>(workspace) + (i64)blockIdx.x * PAIRS;
        if (!sum_splits_in_order<ITERS, THREADS, PAIRS>(sum, ws, (i64)gridDim.x * PAIRS, tickets + blockIdx.x)) return;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
        store_dx_pair<BM, LDX, SW128>(threadIdx.x + it * THREADS, sum[it], sX, z[it], dx, lddx, dx_f32, B, IN, i0);
}

// dx and the update apart (gridDim.y == 2, kernels/dx_sgd.py: apart): the block at y = 0 reads the old W16 for dx
// while the block at y = 1 writes the new W16, chunk by chunk, over the same rows and columns. The two are one
// cluster, so both are resident together; the dx block reports each chunk it holds in shared memory, and the
// update block writes a chunk back only once its partner holds it. Without this a dx block that runs late (its
// context switched out and back, another kernel's blocks in the way) reads weights already updated. `held` is a __shared__ counter of the kernel's, in the update block: the chunks its partner holds.
RG_DEVICE void apart_begin(u32* held) {
    if (gridDim.y != 2) return;
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) *held = 0;
    cluster_sync();  // the counter is 0 before the partner's first report
#else
    __trap();  // no clusters to pair the two: the planners keep dx and the update in one block here
#endif
}

// The dx block, once chunk c of W16 has landed in its shared memory for every thread (after that barrier).
RG_DEVICE void apart_report(u32* held, int c) {
#if __CUDA_ARCH__ >= 900
    if (gridDim.y == 2 && blockIdx.y == 0 && threadIdx.x == 0) {
        const u32 remote = cluster_address(shared_address(held), 1);  // the update block: rank 1 of the pair
        asm volatile("st.release.cluster.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"((u32)c + 1) : "memory");
    }
#endif
}

// The update block, before it writes chunk c back: thread 0 waits until the partner holds chunk c; the caller's
// next barrier holds the other threads. The partner never waits for this block, so the wait ends.
RG_DEVICE void apart_wait(const u32* held, int c) {
#if __CUDA_ARCH__ >= 900
    if (gridDim.y == 2 && blockIdx.y == 1 && threadIdx.x == 0) {
        u32 got;
        do {
            asm volatile("ld.acquire.cluster.shared::cta.u32 %0, [%1];" : "=r"(got) : "r"(shared_address(held)) : "memory");
        } while (got < (u32)c + 1);
    }
#endif
}
