"""CUDA graphs: capture whatever a function launches on a stream, then replay it with one driver call.

A training step is dozens of small kernels; as a graph it costs one `cuGraphLaunch` instead of one launch
each. `nodes()` and `edges()` read the captured graph back for inspection; `to_dot()` uses the driver's printer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import driver as drv
from .driver import Stream, call, check
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
        cu = drv._cu()
        self.graph = graph
        self.exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self._handles = self._node_handles()

    def launch(self, stream: Stream) -> None:
        check(drv._cu().cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def upload(self, stream: Stream) -> None:
        """Move the executable's launch resources to the device now, not during the first timed launch."""
        check(drv._cu().cuGraphUpload(self.exec, stream.handle), "cuGraphUpload")

    def _node_handles(self) -> list[Any]:
        cu = drv._cu()
        _, count = check(cu.cuGraphGetNodes(self.graph, 0), "cuGraphGetNodes")
        handles, _ = check(cu.cuGraphGetNodes(self.graph, count), "cuGraphGetNodes")
        return self._topological(list(handles[:count]))

    def _raw_edges(self) -> list[tuple[Any, Any, str]]:
        """(from, to, kind) handles; kind "programmatic" where the later kernel may start while the earlier one
        runs (a launch with programmatic stream serialization captured), else "default"."""
        cu = drv._cu()
        # CUDA 12 bindings keep the edge data in the _v2 call; CUDA 13's cuGraphGetEdges returns it itself
        get = getattr(cu, "cuGraphGetEdges_v2", cu.cuGraphGetEdges)
        res = check(get(self.graph, 0), "cuGraphGetEdges")
        count = res[-1]
        if count == 0:
            return []
        res = check(get(self.graph, count), "cuGraphGetEdges")
        data = res[2] if len(res) > 3 else [None] * count
        programmatic = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        kinds = ["programmatic" if d is not None and int(d.type) == programmatic else "default" for d in data[:count]]
        return list(zip(res[0][:count], res[1][:count], kinds))

    def _topological(self, handles: list[Any]) -> list[Any]:
        """Order nodes so that each comes after everything it depends on (Kahn's algorithm, stable)."""
        key = {int(h): i for i, h in enumerate(handles)}
        deps = {i: 0 for i in range(len(handles))}
        succ: dict[int, list[int]] = {i: [] for i in range(len(handles))}
        for a, b, _ in self._raw_edges():
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
        cu = drv._cu()
        out = []
        for i, h in enumerate(self._handles):
            kind = check(cu.cuGraphNodeGetType(h), "cuGraphNodeGetType")
            type_name = kind.name.replace("CU_GRAPH_NODE_TYPE_", "").lower()
            if type_name == "kernel":
                p = check(cu.cuGraphKernelNodeGetParams(h), "cuGraphKernelNodeGetParams")
                name = check(cu.cuFuncGetName(p.func), "cuFuncGetName")
                name = name.decode() if isinstance(name, bytes) else str(name)
                out.append(Node(i, type_name, name, (p.gridDimX, p.gridDimY, p.gridDimZ),
                                (p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes))
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
        return [(index[int(a)], index[int(b)], kind) for a, b, kind in self._raw_edges()]

    def to_dot(self, path: str | Path, verbose: bool = True) -> Path:
        """Write the driver's own DOT description (every parameter of every node) to `path`."""
        cu = drv._cu()
        flags = cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE if verbose else 0
        path = Path(path)
        call(cu.cuGraphDebugDotPrint, self.graph, str(path).encode(), int(flags))
        return path

    def close(self) -> None:
        cu = drv._cu()
        if self.exec is not None:
            check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = None
        if self.graph is not None:
            check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.graph = None


def capture(stream: Stream, fn: Callable[[], Any]) -> Graph:
    """Run `fn()` with `stream` in capture mode and return the instantiated graph of what it launched.

    If `fn` raises or does something capture forbids (a synchronize, a blocking copy), capture is ended, the
    partial graph destroyed and GraphCaptureError raised; the stream is usable again afterwards.
    """
    cu = drv._cu()
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    call(cu.cuStreamBeginCapture, stream.handle, mode)
    failure: BaseException | None = None
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - always end the capture, then re-raise below
        failure = exc
    result = cu.cuStreamEndCapture(stream.handle)
    err, graph = result[0], result[1]
    ok = int(err) == 0 and failure is None
    if not ok:
        if graph is not None and int(graph) != 0:
            cu.cuGraphDestroy(graph)
        if isinstance(failure, KeyboardInterrupt):
            raise failure
        if failure is not None:
            why = str(failure) if isinstance(failure, CudaError) else f"{failure.__class__.__name__}: {failure}"
            if isinstance(failure, CudaError) and "CAPTURE" in failure.name:
                why += " -- that call is not allowed while a stream is being captured"
            raise GraphCaptureError(f"graph capture failed: {why}") from failure
        name, _ = drv.error_text(err)
        raise GraphCaptureError(f"graph capture failed: cuStreamEndCapture: {name} (an operation inside the "
                                "captured function is not allowed during capture, e.g. a synchronize)")
    return Graph(graph)
