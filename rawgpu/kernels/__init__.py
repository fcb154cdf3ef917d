"""Python launchers for our CUDA kernels, one module per kernel family (gemm, elementwise, loss, data).

Each launcher checks its tensors and returns a bound `Launch` (geometry + arguments packed once), so a
training step is just a list of launches that runs eagerly or is captured into a graph unchanged.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..compiler import SOURCE_DIR, CompiledModule, all_sources, compile_source
from ..driver import Kernel, Module

if TYPE_CHECKING:
    from ..memory import Tensor


class Kernels:
    """Every kernel source compiled (through the cache) for one GPU arch and loaded into the current context."""

    def __init__(self, arch: str):
        self.arch = arch
        self.compiled: dict[str, CompiledModule] = {}
        self.modules: dict[str, Module] = {}
        self.facts: dict[str, object] = {}  # what launchers ask the driver about this GPU once (gemm.cluster_capacity)

    def module(self, source: str) -> Module:
        if source not in self.modules:
            self._load(source, compile_source(source, self.arch))
        return self.modules[source]

    def _load(self, source: str, compiled: CompiledModule) -> None:
        self.compiled[source] = compiled
        self.modules[source] = Module(compiled.cubin, compiled.resources)

    def load_all(self, sources: list[str] | None = None) -> None:
        """Every source (default: all of rawgpu/cu) compiled through the cache and loaded. NVRTC releases the GIL,
        so a first run's builds go on threads, the largest source first: the longest build (gemm.cu) sets the time
        instead of the sum. Modules are loaded here, in the thread whose context is current."""
        todo = sorted((s for s in (sources or all_sources()) if s not in self.modules),
                      key=lambda s: -(SOURCE_DIR / s).stat().st_size)
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            built = list(pool.map(lambda s: compile_source(s, self.arch), todo))  # the first error is raised here
        for source, compiled in zip(todo, built):
            self._load(source, compiled)

    def get(self, source: str, name: str, signature: str) -> Kernel:
        return self.module(source).kernel(name, signature)

    def resources(self, name: str):
        """ptxas report of a kernel by name (any loaded module), or None."""
        for compiled in self.compiled.values():
            if name in compiled.resources:
                return compiled.resources[name]
        return None


def require(t: "Tensor", dtype, shape: tuple[int, ...] | None = None, what: str = "") -> None:
    """Launchers call this so a wrong buffer fails in Python, with names, instead of corrupting memory."""
    import numpy as np

    label = what or t.name
    if t.dtype != np.dtype(dtype):
        raise TypeError(f"{label}: expected dtype {np.dtype(dtype)}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{label}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def require_split_scratch(splits: int, workspace: "Tensor | None", tickets: "Tensor | None", floats: int,
                          count: int, what: str) -> None:
    """A launch whose output tiles are summed over `splits` blocks needs the fp32 workspace and int32 tickets the
    plan sized (`what` names the splitting in the error)."""
    import numpy as np

    if splits <= 1:
        return
    if workspace is None or tickets is None:
        raise ValueError(f"{what} needs a workspace ({floats} floats) and tickets")
    require(workspace, np.float32, what="workspace")
    require(tickets, np.int32, what="tickets")
    if workspace.size < floats or tickets.size < count:
        raise ValueError(f"{what}: workspace too small: need {floats} floats and {count} tickets")


def blocks_for(n: int, threads: int, per_thread: int = 1, max_blocks: int = 65535 * 8) -> int:
    """Grid size for a grid-stride loop over n items, `per_thread` items per thread."""
    return max(1, min(max_blocks, -(-n // (threads * per_thread))))
