// cp.async (sm_80+): global -> shared copies that bypass registers and run in the background, grouped so a
// multi-stage pipeline can wait for "all but the newest N groups".
#pragma once
#include "common.cuh"
#include "ldmatrix.cuh"

// Copy 16 bytes global -> shared through L2 only (.cg). When `valid` is false nothing is read and the 16
// shared bytes are zero-filled: that is how tile edges are predicated without branches around the copy.
RG_DEVICE void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(shared_address(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}

RG_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
RG_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
