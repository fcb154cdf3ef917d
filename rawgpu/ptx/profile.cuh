// Profiling builds only (dev/kernel_phases.py): the thread for which `who` holds stamps its SM clock into buf[i] at
// mark i, and the %globaltimer at the first and last marks into buf[RG_PROFILE_MARKS] and buf[RG_PROFILE_MARKS + 1]
// (the clock rate). buf: a __device__ array of RG_PROFILE_MARKS + 2 the script reads back.
#pragma once
#include "common.cuh"

#define RG_PROFILE_MARKS 16
#define RG_PROFILE_STAMP(buf, who, i)                                                  \
    do {                                                                               \
        if (who) {                                                                     \
            (buf)[i] = clock64();                                                      \
            if ((i) == 0 || (i) == RG_PROFILE_MARKS - 1) {                             \
                unsigned long long now;                                                \
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                \
                (buf)[RG_PROFILE_MARKS + ((i) != 0)] = now;                            \
            }                                                                          \
        }                                                                              \
    } while (0)
