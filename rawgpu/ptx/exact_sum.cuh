// Sums over the blocks of a grid that are the same bits whatever order the blocks finish in: each block adds its
// part to a 64-bit integer (integer addition is exact, so the order cannot matter), and the last block to take the
// ticket reads the total and leaves the integer and the ticket at zero for the next launch (graph replays included).
#pragma once
#include "common.cuh"

RG_DEVICE void exact_add(i64* total, i64 part) {
    atomicAdd(reinterpret_cast<unsigned long long*>(total), (unsigned long long)part);
}

// After every thread of the block has added its parts: whether this block is the last of `blocks` to get here (it
// then sees every block's parts). The last one also resets the ticket.
RG_DEVICE bool last_of_blocks(int* ticket, int blocks) {
    __shared__ int taken;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        taken = atomicAdd(ticket, 1);
        if (taken == blocks - 1) *ticket = 0;
    }
    __syncthreads();
    if (taken != blocks - 1) return false;
    __threadfence();
    return true;
}

// The total, read once by the last block, which leaves it at zero.
RG_DEVICE i64 exact_take(i64* total) {
    return (i64)atomicExch(reinterpret_cast<unsigned long long*>(total), 0ull);
}
