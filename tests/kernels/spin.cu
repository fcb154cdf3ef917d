// The tests' stand-in for a GPU that never finishes: one thread busy for `ns` nanoseconds of the GPU's timer
// (tests/hung_gpu.py). Bounded, so a failing test cannot keep the GPU busy for long.
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
