// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-serialization attribute
// (driver.Launch.overlapping) may start while the kernel before it in the stream still runs, so its blocks are
// resident and set up when that kernel ends, instead of the launch starting only then.
//
// The contract every kernel of the layered step keeps. Its prior grids are the kernel before it in its stream and,
// where a side stream forks or joins (driver.SideStream), the last kernel of the stream it follows:
//   - before wait_for_prior_grid(), it touches shared memory only, or reads global data that its prior grids do
//     not write (a weight that layer's update wrote a step ago);
//   - after it, every prior grid has finished and its writes are visible;
//   - only then does it let its own dependents start (allow_dependents). So every kernel before its prior grids
//     has finished: the early reads above cannot see stale data.
// Below sm_90, and for launches without the attribute, both are no-ops.
#pragma once
#include "common.cuh"

RG_DEVICE void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

RG_DEVICE void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual entry: wait for the prior grid, then let the next one start setting up.
RG_DEVICE void pdl_enter() {
    wait_for_prior_grid();
    allow_dependents();
}
