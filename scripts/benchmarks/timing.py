"""Timing on the GPU: CUDA events around replays of a captured graph, the median over trials, per launch; and the
floors a time is judged against (device-to-device copy bandwidth, empty launches)."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from rawgpu.runtime import driver as drv
from rawgpu.runtime.graph import capture
from rawgpu.runtime.memory import Arena


def time_graph(stream, launch_fn, launches: int, trials: int, sustained: float = 0.0) -> float:
    """Median microseconds per launch over `trials` replays of a graph of `launches` launches, after `sustained`
    seconds of replays (0: a burst, before the GPU's power controller acts; docs/perf.md: Power)."""
    graph = capture(stream, launch_fn)
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    settle(lambda: graph.launch(stream), stream.synchronize, sustained)
    times = []
    for _ in range(trials):
        start, end = drv.Event().record(stream), None
        graph.launch(stream)
        end = drv.Event().record(stream)
        times.append(start.elapsed_ms(end) * 1e3 / launches)
        start.close()
        end.close()
    graph.close()
    return statistics.median(times)


def settle(replay, wait, seconds: float) -> None:
    """`replay()` over and over for `seconds` (waiting every 10 replays), so that what is timed next runs at the clock
    the GPU holds under this work, as a training run does."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        for _ in range(10):
            replay()
        wait()


def copy_bandwidth(stream, nbytes: int = 1 << 30, trials: int = 20) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    with Arena() as arena:
        src, dst = arena.tensor("src", nbytes, np.uint8), arena.tensor("dst", nbytes, np.uint8)
        arena.allocate()
        times = []
        for i in range(trials + 3):
            start = drv.Event().record(stream)
            drv.copy_device_to_device_async(dst.ptr, src.ptr, nbytes, stream)
            end = drv.Event().record(stream)
            if i >= 3:
                times.append(start.elapsed_ms(end))
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def copies_for(nbytes: int, l2: int, cap: int = 64) -> int:
    """How many copies of `nbytes` of operands to rotate over so that together they exceed twice the L2 (`l2` bytes),
    at most `cap`: each launch then reads its operands from DRAM, as the training step does."""
    return max(1, min(cap, math.ceil(2 * l2 / max(nbytes, 1))))


def launch_floor(stream, kernels, nodes: int, trials: int = 30) -> float:
    """Microseconds per replay of a graph of `nodes` dependent empty kernels: the cost of launching our step's
    node count, whatever the kernels do."""
    noop = kernels.get("elementwise.cu", "noop").bind(1, 32, 0)
    return time_graph(stream, lambda: [noop.run(stream) for _ in range(nodes)], 1, trials)
