"""CUDA graphs: capture whatever a function launches on a stream, then replay it with one driver call.

A training step is dozens of small kernels; as a graph it costs one `cuGraphLaunch` instead of one launch
each. `nodes()` and `edges()` read the captured graph back for inspection; `to_dot()` uses the driver's printer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import driver as drv
from .driver import Stream
from .errors import CudaError, GraphCaptureError


@dataclass(frozen=True)
class Node:
    """One graph node, as the driver reports it (kernel fields are empty for other node types)."""

    index: int
    type: str
    kernel: str = ""
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    shared_bytes: int = 0


class Graph:
    """A captured graph and its executable instance."""

    def __init__(self, graph: Any):
        self.graph = graph
        self.exec = drv.graph_instantiate(graph)
        self._handles = self._topological(drv.graph_nodes(graph))

    def launch(self, stream: Stream) -> None:
        drv.graph_launch(self.exec, stream)

    def upload(self, stream: Stream) -> None:
        """Move the executable's launch resources to the device now, not during the first timed launch."""
        drv.graph_upload(self.exec, stream)

    def _topological(self, handles: list[Any]) -> list[Any]:
        """Order nodes so that each comes after everything it depends on (Kahn's algorithm, stable)."""
        key = {int(h): i for i, h in enumerate(handles)}
        deps = {i: 0 for i in range(len(handles))}
        succ: dict[int, list[int]] = {i: [] for i in range(len(handles))}
        for a, b, _ in drv.graph_edges(self.graph):
            succ[key[int(a)]].append(key[int(b)])
            deps[key[int(b)]] += 1
        ready = [i for i in range(len(handles)) if deps[i] == 0]
        order: list[int] = []
        while ready:
            i = ready.pop(0)
            order.append(i)
            for j in succ[i]:
                deps[j] -= 1
                if deps[j] == 0:
                    ready.append(j)
        return [handles[i] for i in order]

    def nodes(self) -> list[Node]:
        """Every node in execution (topological) order, with kernel name, grid, block and shared bytes."""
        out = []
        for i, h in enumerate(self._handles):
            type_name = drv.graph_node_type(h)
            if type_name == "kernel":
                out.append(Node(i, type_name, *drv.graph_kernel_node(h)))
            else:
                out.append(Node(i, type_name))
        return out

    def edges(self) -> list[tuple[int, int]]:
        """Dependencies as (from, to) indices into nodes()."""
        return [(a, b) for a, b, _ in self.typed_edges()]

    def typed_edges(self) -> list[tuple[int, int, str]]:
        """Dependencies as (from, to, kind): kind "programmatic" where `to` may start while `from` still runs and
        waits for it inside the kernel (programmatic dependent launch), "default" where it starts after."""
        index = {int(h): i for i, h in enumerate(self._handles)}
        return [(index[int(a)], index[int(b)], kind) for a, b, kind in drv.graph_edges(self.graph)]

    def to_dot(self, path: str | Path, verbose: bool = True) -> Path:
        """Write the driver's own DOT description (every parameter of every node) to `path`."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")  # the driver writes the file itself: rename it when whole
        try:
            drv.graph_debug_dot(self.graph, str(tmp), verbose)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def close(self) -> None:
        if self.exec is not None:
            drv.graph_exec_destroy(self.exec)
            self.exec = None
        if self.graph is not None:
            drv.graph_destroy(self.graph)
            self.graph = None


def capture(stream: Stream, fn: Callable[[], Any]) -> Graph:
    """Run `fn()` with `stream` in capture mode and return the instantiated graph of what it launched.

    If `fn` raises or does something capture forbids (a synchronize, a blocking copy), capture is ended, the
    partial graph destroyed and GraphCaptureError raised; the stream is usable again afterwards.
    """
    drv.begin_capture(stream)
    failure: BaseException | None = None
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - always end the capture, then re-raise below
        failure = exc
    try:
        graph = drv.end_capture(stream, discard=failure is not None)
    except CudaError as exc:
        if failure is None:
            raise GraphCaptureError(f"graph capture failed: cuStreamEndCapture: {exc.name} (an operation inside the "
                                    "captured function is not allowed during capture, e.g. a synchronize)") from None
        # else the function's own failure, reported below, says more than the broken capture it caused
    if failure is None:
        return Graph(graph)
    if isinstance(failure, KeyboardInterrupt):
        raise failure
    why = str(failure) if isinstance(failure, CudaError) else f"{failure.__class__.__name__}: {failure}"
    if isinstance(failure, CudaError) and "CAPTURE" in failure.name:
        why += " -- that call is not allowed while a stream is being captured"
    raise GraphCaptureError(f"graph capture failed: {why}") from failure
