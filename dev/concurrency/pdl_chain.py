"""Experiment: one process replaying a graph of programmatic dependent launches (pdl_chain.cu) for a while.

    python dev/concurrency/pdl_chain.py --variant plain|serial|cluster2|cluster16|one_per_sm|wide|exit_trigger|
                                        early_trigger [--seconds S] [--links N] [--no-graph]

Run several at once with dev/concurrency/many.py to see which launch pattern survives other contexts on the GPU.
Prints one line: the links run, the time per link, and whether the counter saw every link in order (exit 0), or
why not (exit 1). It waits by polling the stream, so a signal always reaches it (unless the driver itself hangs).
Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from rawgpu.runtime import compiler, driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.graph import capture
from rawgpu.runtime.memory import Arena

# name: (cluster CTAs, CTAs per SM as the grid's size, dynamic shared bytes, mode bits of pdl_chain.cu, programmatic)
VARIANTS = {
    "serial": (1, 1, 0, 0, False),         # the control: ordinary launches
    "plain": (1, 1, 0, 0, True),           # one CTA per SM's worth of small CTAs, trigger after the wait
    "wide": (1, 8, 0, 0, True),            # more CTAs than fit at once beside the next link
    "one_per_sm": (1, 1, 200 * 1024, 0, True),  # each CTA fills an SM: the next link cannot be resident early
    "cluster2": (2, 1, 0, 1, True),        # clusters meeting at a cluster barrier before the wait (cu/head.cu)
    "cluster16": (16, 1, 0, 1, True),
    "exit_trigger": (1, 1, 0, 2, True),    # no explicit trigger
    "early_trigger": (1, 1, 0, 4, True),   # the trigger before the wait
    "handoff": (1, 1, 0, 0, True),         # pdl_handoff: each link checks every element the link before wrote
    "handoff_early": (1, 1, 0, 1, True),   # the same, each element also read before the wait
    "handoff_serial": (1, 1, 0, 0, False),  # the control
}
HANDOFF_ELEMENTS = 1 << 22  # 16 MB: each link a few microseconds of DRAM traffic, much of it left in L2


def wait(stream: driver.Stream, seconds: float) -> bool:
    """Poll until the stream is idle; False after `seconds`."""
    end = time.monotonic() + seconds
    while not stream.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="plain")
    p.add_argument("--seconds", type=float, default=3.0, help="how long to keep replaying")
    p.add_argument("--links", type=int, default=64, help="launches per graph")
    p.add_argument("--before-ns", type=int, default=2000, help="busy work before each link's wait")
    p.add_argument("--after-ns", type=int, default=4000, help="busy work after it")
    p.add_argument("--no-graph", action="store_true", help="launch one by one instead of replaying a graph")
    args = p.parse_args(argv)
    return run_cli(lambda: run(args), "pdl_chain")


def run(args: argparse.Namespace) -> int:
    cluster, per_sm, shared, mode, programmatic = VARIANTS[args.variant]
    device = driver.Device(0)
    if device.compute_capability < (9, 0):
        print(f"pdl_chain: {device.name} is {device.arch}; programmatic dependent launch needs sm_90", file=sys.stderr)
        return 1
    module = driver.Module(compiler.compile_file(Path(__file__).with_name("pdl_chain.cu"), device.arch).cubin)
    handoff = args.variant.startswith("handoff")
    grid = device.sm_count * per_sm // cluster * cluster
    stream = driver.Stream()
    with Arena() as arena:
        counter = arena.tensor("counter", (1,), np.uint64)
        stale = arena.tensor("stale", (2,), np.uint32)
        data = arena.tensor("data", (HANDOFF_ELEMENTS,), np.uint32)
        arena.allocate()
        arena.zero()
        if handoff:  # the first link writes 0 everywhere, link k checks k - 1 and writes k
            kernel = module.kernel("pdl_handoff", "piipi")
            launches = [kernel.bind(grid, 256, 0, data, HANDOFF_ELEMENTS, k, stale, mode if k else 2)
                        for k in range(args.links)]
        else:
            kernel = module.kernel("pdl_link", "piii")
            link = kernel.bind(grid, 128, shared, counter, args.before_ns, args.after_ns, mode, cluster=cluster)
            launches = [link] * args.links
        launches = [launch.overlapping() for launch in launches] if programmatic else launches

        def run_all() -> None:
            for launch in launches:
                launch.run(stream)

        graph = None if args.no_graph else capture(stream, run_all)
        t0, rounds = time.monotonic(), 0
        while time.monotonic() - t0 < args.seconds:
            for _ in range(10):
                graph.launch(stream) if graph is not None else run_all()
            rounds += 10
            if not wait(stream, 60.0):
                print(f"pdl_chain {args.variant}: HUNG: the stream did not finish in 60 s after {rounds} rounds")
                return 1
        elapsed = time.monotonic() - t0
        got, want = int(counter.download()[0]), rounds * args.links
        if handoff:  # no counter: the elements found stale are the result
            bad = int(stale.download()[0])
            got = want if bad == 0 else -bad
        if graph is not None:
            graph.close()
    status = ("ok" if got == want else f"WRONG: {-got} elements read stale" if handoff
              else f"WRONG: counter {got}, expected {want}")
    print(f"pdl_chain {args.variant}: {status}; {want} links in {elapsed:.2f} s ({elapsed / want * 1e6:.2f} us each)")
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
