"""A session: the GPU, the kernels compiled for it, and the planned, allocated model with its chosen step.

Everything that trains or inspects a model starts here (rawgpu.train, scripts/inspect_graph.py, scripts/bench.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from . import compiler, steps
from .driver import Device, Launch, Stream, context_synchronize
from .errors import NoDeviceError
from .graph import Graph, capture
from .kernels import Kernels
from .mlp import MLP, run_launches
from .recipe import Recipe
from .steps import StepOptions


class Session:
    """Device, compiled kernels and the planned, allocated model."""

    def __init__(self, recipe: Recipe, device_index: int = 0, on_compile: Callable[[str], None] | None = None,
                 step_kind: str = "auto", options: StepOptions | None = None):
        """step_kind: one of steps.CHOICES; a named kind that cannot run here raises StepUnsupported before any
        compile. options: settings of particular step kinds (comparisons, tests)."""
        if step_kind not in steps.CHOICES:  # a bad value fails before any GPU work
            raise ValueError(f"step kind must be one of {', '.join(steps.CHOICES)}, got {step_kind!r}")
        self.device = Device(device_index)
        arch = self.device.arch
        if self.device.compute_capability < (8, 0):
            raise NoDeviceError(f"{self.device.name} is {arch}: rawgpu needs sm_80 or newer (mma.sync, cp.async)")
        if arch not in compiler.supported_archs():
            raise NoDeviceError(f"{self.device.name} is {arch}; this NVRTC builds for "
                                f"{', '.join(compiler.supported_archs())} (rawgpu needs sm_80 or newer)")
        self.choice = steps.choose(recipe, arch, step_kind)
        self.kernels = Kernels(arch)
        cold = [s for s in compiler.all_sources() if not compiler.is_cached(s, arch)]
        if cold and on_compile:
            on_compile(f"compiling kernels for {arch} (first run only: the cubins are cached in "
                       f"{compiler.cache_dir()})")
        t = time.perf_counter()
        self.kernels.load_all()
        ms = (time.perf_counter() - t) * 1e3
        self.compile_note = (f"kernels compiled in {ms / 1e3:.1f} s (first run)" if cold
                             else f"kernel cache warm ({ms:.0f} ms)")
        self.stream = Stream()
        options = options or StepOptions()
        if options.l2_bytes == 0:  # the layered step's cache hints are planned for this GPU's L2
            options = replace(options, l2_bytes=self.device.l2_bytes)
        self.model = MLP(self.kernels, recipe, self.device.sm_count, step_kind=self.choice,
                         options=options).allocate()
        self.step = self.model.step_launches()

    @property
    def step_description(self) -> str:
        """How a step runs, for headers: the kernel count or the one kernel's geometry."""
        return self.model.step.describe()

    def _capture(self, launches: list[Launch]) -> Graph:
        graph = capture(self.stream, run_launches(launches, self.stream))
        graph.upload(self.stream)
        return graph

    def capture_step(self, steps: int = 1) -> Graph:
        """The training step, `steps` times over, as one instantiated graph (uploaded, ready to launch)."""
        return self._capture(self.model.step_launches(steps))

    def capture_eval(self) -> Graph:
        return self._capture(self.model.eval_launches())

    def close(self) -> None:
        """Free the arena, the stream and the device's context (graphs captured from it belong to the caller)."""
        context_synchronize()  # nothing queued may still use the memory
        self.model.arena.close()
        self.stream.close()
        self.device.close()
