"""Python launchers for our CUDA kernels, one module per kernel family, named as its cu/ source (gemm, elementwise,
loss, gather, ...).

Each launcher checks its tensors and returns a bound `Launch` (geometry + arguments, packed by the parameters the
kernel's build read from it), so a training step is just a list of launches that runs eagerly or is captured into a
graph unchanged.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterable

from ..runtime.compiler import SOURCE_DIR, CompiledModule, Unit, all_sources, compile_source, unit_of
from ..runtime.driver import Kernel, Module
from ..contract.activation import DEFAULT_ACTIVATION
from ..contract.arch import PLANNING_ARCH, PLANNING_SM_COUNT  # noqa: F401 - the planners' default GPU


if TYPE_CHECKING:
    from ..runtime.memory import Tensor

Progress = Callable[[int, int], None]  # (units built, units asked for)


class Kernels:
    """The kernels of one GPU arch, compiled (through the cache) as they are asked for and loaded into the current
    context.

    A unit of compilation is a whole small source or one template instance of a large one (compiler.unit_of), so a
    session builds only what its step launches. `prefetch` starts units on threads (NVRTC releases the GIL);
    `get` returns a Kernel at once, starting its unit if nobody has, and the kernel's module is loaded, in the
    asking thread (whose context is current), when the driver first needs the function. activation: the one the
    kernels that apply one are built for (a model's recipe.activation)."""

    def __init__(self, arch: str, on_progress: Progress | None = None, activation: str = DEFAULT_ACTIVATION):
        self.arch, self.activation = arch, activation
        self.compiled: dict[Unit, CompiledModule] = {}
        self.modules: dict[Unit, Module] = {}
        self.facts: dict[str, object] = {}  # what launchers ask the driver about this GPU once (gemm.cluster_capacity)
        self.on_progress = on_progress
        self._builds: dict[Unit, Future] = {}
        self._kernels: dict[tuple[Unit, str], Kernel] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._done = 0

    def check_serves(self, arch: str, activation: str, what: str) -> None:
        """ValueError unless these kernels are built for `arch` and apply `activation`, as `what` (a model, a stack)
        was planned."""
        if self.arch != arch:
            raise ValueError(f"{what} was planned for {arch}, the kernels are {self.arch}'s")
        if self.activation != activation:
            raise ValueError(f"{what} applies {activation}, the kernels were built for {self.activation}")

    # --- building --------------------------------------------------------------------------------------------

    def prefetch(self, units: Iterable[Unit]) -> None:
        """Start building `units` on threads, the largest sources first (the longest builds set the time)."""
        todo = sorted({u for u in units if u not in self._builds and u not in self.modules},
                      key=lambda u: (-(SOURCE_DIR / u[0]).stat().st_size, u[0], u[1] or ""))
        for unit in todo:
            self._start(unit)

    def _start(self, unit: Unit) -> Future:
        if unit not in self._builds:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="nvrtc")
            with self._lock:
                self._builds[unit] = self._pool.submit(self._build, unit)
                self._report()
        return self._builds[unit]

    def _build(self, unit: Unit) -> CompiledModule:
        try:
            return compile_source(unit[0], self.arch, kernel=unit[1], activation=self.activation)
        finally:
            with self._lock:
                self._done += 1
                self._report()

    def _report(self) -> None:
        """Progress to on_progress, one call at a time (the caller holds the lock)."""
        if self.on_progress is not None:
            self.on_progress(self._done, len(self._builds))

    def wait(self) -> None:
        """Every unit started so far built and loaded (the first build error is raised here). On an error or Ctrl-C
        the builds not yet begun are dropped, so the process ends once the running ones finish."""
        try:
            for unit in list(self._builds):
                self._loaded(unit)
        except BaseException:
            self.close()
            raise
        self.close()

    def close(self) -> None:
        """Stop taking builds: queued ones are cancelled, running ones finish (NVRTC cannot be interrupted)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _loaded(self, unit: Unit) -> Module:
        if unit not in self.modules:
            compiled = self._start(unit).result()
            self.compiled[unit] = compiled
            self.modules[unit] = Module.of(compiled)
        return self.modules[unit]

    # --- kernels ---------------------------------------------------------------------------------------------

    def module(self, source: str) -> Module:
        """The whole of `source`, every instance in one module (tests, tools)."""
        return self._loaded((source, None))

    def load_all(self, sources: list[str] | None = None) -> None:
        """Every source (default: all of rawgpu/cu) built whole, on threads, and loaded."""
        self.prefetch((s, None) for s in (sources or all_sources()))
        self.wait()

    def get(self, source: str, name: str) -> Kernel:
        """Kernel `name` of `source`: from the whole source when that is loaded, else from its own unit. Its
        parameters are what its build reads from it (compiler.entry_signatures); launches bound before the build has
        finished are packed once it has."""
        unit = (source, None) if (source, None) in self.modules else unit_of(source, name)
        key = (unit, name)
        if key not in self._kernels:
            self._start(unit)

            def resolve() -> tuple:
                kernel = self._loaded(unit).kernel(name)
                return kernel.func, kernel.resources, kernel.signature
            self._kernels[key] = Kernel(None, name, None, resolve=resolve)
        return self._kernels[key]

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


def require_slope(k: "Kernels", slope: "Tensor | None", like: "Tensor | None", what: str) -> None:
    """An activation's backward that reads the slope act'(z) the forward saved (recipe.SLOPE_SAVED, as the kernels
    were built) gets `slope`, fp16 of the shape of `like` (the gradient it scales, whose layout the kernel reads it
    by); the others get none."""
    import numpy as np

    from ..contract.activation import SLOPE_SAVED

    if k.activation not in SLOPE_SAVED or like is None:
        if slope is not None:
            why = "no fp16 gradient to scale here" if like is None else f"{k.activation}'s backward reads the output"
            raise ValueError(f"{what}: pass no slope ({why})")
        return
    if slope is None:
        raise ValueError(f"{what}: {k.activation}'s backward reads the slope the forward saved: pass slope")
    require(slope, np.float16, tuple(like.shape), f"{what}: slope (act' saved by the forward)")


def require_exact_sums(scratch: "Tensor | None", ticket: "Tensor | None", words: int, tickets: int, what: str) -> None:
    """A launch whose blocks' integer sums meet exactly (ptx/exact_sum.cuh) needs an int64 scratch of `words` and an
    int32 ticket array of `tickets`, both zero (the model's exact-sum buffers, which every such launch leaves zero)."""
    import numpy as np

    if scratch is None or ticket is None:
        raise ValueError(f"{what}: its blocks' sums need the exact-sum scratch and tickets")
    require(scratch, np.int64, what=f"{what}: exact-sum scratch")
    require(ticket, np.int32, what=f"{what}: exact-sum tickets")
    if scratch.size < words or ticket.size < tickets:
        raise ValueError(f"{what}: needs {words} scratch words and {tickets} tickets, got {scratch.size} and "
                         f"{ticket.size}")


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
