"""A session: the GPU, the kernels compiled for it, and the planned, allocated model with its chosen step.

Everything that trains or inspects a model starts here (rawgpu.train, scripts/inspect_graph.py, scripts/bench.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from ..runtime import compiler
from .. import steps
from ..runtime.driver import Device, Launch, Stream, context_synchronize, give_up_gpu, gpu_given_up
from ..runtime.errors import NoDeviceError
from ..runtime.graph import Graph, capture
from ..kernels import PLANNING_SM_COUNT, Kernels
from ..kernels import gemm as kg
from ..model.mlp import common_units, run_launches
from ..runtime.ranks import Rank
from ..model.recipe import Recipe
from ..steps import StepOptions


def kernel_units(recipe: Recipe, arch: str, sm_count: int = PLANNING_SM_COUNT, step_kind: str | steps.Choice = "auto",
                 options: StepOptions | None = None, ranks: int = 0) -> list[compiler.Unit]:
    """The units of compilation a session of `recipe` on a GPU of `arch` and `sm_count` SMs launches, from the plan
    alone (no GPU, the planning estimate of its cluster capacity: the prebuild's list). ranks: the GPUs of a model
    on several (0: one GPU's model); step_kind is then a parallel mode (steps.MODES)."""
    model = steps.plan_model(recipe, step_kind, arch=arch, sm_count=sm_count, options=options, ranks=ranks)
    return sorted(model.kernel_units(), key=lambda u: (u[0], u[1] or ""))


class Session:
    """Device, compiled kernels and the planned, allocated model."""

    def __init__(self, recipe: Recipe, device_index: int = 0, on_compile: Callable[[int, int], None] | None = None,
                 step_kind: str = "auto", options: StepOptions | None = None, rank: Rank | None = None):
        """step_kind: one of steps.CHOICES; a named kind that cannot run here raises StepUnsupported before any
        compile. options: settings of particular step kinds (comparisons, tests). on_compile(done, total): the
        progress of a build that is not all in the cache (units of compilation built, asked for). rank: this
        process's rank of a model on several GPUs, on GPU rank.gpu, split as rank.mode says; step_kind is then
        "auto"."""
        if step_kind not in steps.CHOICES:  # a bad value fails before any GPU work
            raise ValueError(f"step kind must be one of {', '.join(steps.CHOICES)}, got {step_kind!r}")
        if rank is not None and step_kind != "auto":
            raise ValueError(f"a model on several GPUs runs the tensor- or data-parallel step, not {step_kind}")
        self.group, self.nccl_seconds = None, 0.0
        self.device = Device(rank.gpu if rank is not None else device_index)
        arch = self.device.arch
        if self.device.compute_capability < (8, 0):
            raise NoDeviceError(f"{self.device.name} is {arch}: rawgpu needs sm_80 or newer (mma.sync, cp.async)")
        if arch not in compiler.supported_archs():
            raise NoDeviceError(f"{self.device.name} is {arch}; this NVRTC builds for "
                                f"{', '.join(compiler.supported_archs())} (rawgpu needs sm_80 or newer)")
        self.choice = (steps.choose(recipe, arch, step_kind) if rank is None
                       else steps.choose(recipe, arch, rank.mode, rank.ranks))
        options = options or StepOptions()
        if options.l2_bytes == 0:  # the layered step's cache hints are planned for this GPU's L2
            options = replace(options, l2_bytes=self.device.l2_bytes)
        # The plan needs this GPU's cluster capacity, which the driver gives for a built kernel (the probe); the
        # sources every session uses build beside it. Then the model is planned once, and the units it launches
        # build at once; a unit the plan did not foresee is built when asked for. Only a build that is not all
        # cached shows progress.
        early = sorted(common_units(arch), key=lambda u: (u[0], u[1] or ""))
        act = recipe.activation
        cold_early = [u for u in early if not compiler.is_cached(u[0], arch, kernel=u[1], activation=act)]
        self.kernels = Kernels(arch, on_progress=on_compile if cold_early else None, activation=act)
        t = time.perf_counter()
        self.kernels.prefetch(early)
        try:
            capacity = kg.cluster_capacity(self.kernels)
            model = steps.plan_model(recipe, self.choice, arch=arch, sm_count=self.device.sm_count,
                                     capacity=capacity, options=options, rank=rank.rank if rank else 0)
            units = model.kernel_units()
            cold = cold_early + [u for u in units
                                 if u not in early and not compiler.is_cached(u[0], arch, kernel=u[1], activation=act)]
            if cold and on_compile is not None:
                self.kernels.on_progress = on_compile
            self.kernels.prefetch(units)
            if rank is not None:
                from ..runtime import nccl

                t_nccl = time.perf_counter()
                self.group = model.group = nccl.Communicator(rank.ranks, rank.rank, rank.unique_id)
                self.nccl_seconds = time.perf_counter() - t_nccl
                if rank.job is not None:
                    rank.job.watch(self.group)
            self.model = model.bind(self.kernels)
            self.model.allocate()
            self.step = self.model.step_launches()
        except BaseException:  # out of memory, Ctrl-C: builds not yet begun are dropped
            self.kernels.close()
            if self.group is not None:
                self.group.close()
            raise
        self.kernels.wait()
        self.compile_seconds = time.perf_counter() - t if cold else 0.0
        self.compile_note = (f"{len(cold)} of {len(units)} kernel units compiled in {self.compile_seconds:.1f} s "
                             f"(first run: cached in {compiler.cache_dir()})" if cold
                             else f"kernel cache warm ({(time.perf_counter() - t) * 1e3:.0f} ms)")
        self.stream = Stream()

    @property
    def step_description(self) -> str:
        """How a step runs, for headers: the kernel count or the one kernel's geometry, and the faster kind the
        model's architecture ruled out, with why."""
        return self.model.step.describe() + self.choice.fallback_note()

    def _capture(self, launches: list[Launch]) -> Graph:
        graph = capture(self.stream, run_launches(launches, self.stream))
        graph.upload(self.stream)
        return graph

    def capture_step(self, steps: int = 1) -> Graph:
        """The training step, `steps` times over, as one instantiated graph (uploaded, ready to launch)."""
        return self._capture(self.model.step_launches(steps))

    def capture_eval(self) -> Graph:
        return self._capture(self.model.eval_launches())

    def sync_ranks(self) -> None:
        """On several GPUs: return once every rank has come here with nothing else queued, so the work queued next
        starts on every GPU together and one rank's timing does not count another's late start. (A max over the
        ranks of the step counter, which every rank holds the same, changes nothing.) Alone: nothing."""
        if self.group is not None:
            counter = self.model.counter
            self.group.all_reduce(counter, counter, 1, op="max").run(self.stream)
            self.stream.synchronize()

    def settle(self, seconds: float) -> bool:
        """After Ctrl-C or SIGTERM: wait at most `seconds` for the queued work. True once it has finished; False
        when it has not, and then this process gives its GPU work up (driver.give_up_gpu), so nothing after waits
        for it and the process can end at once."""
        if self.gpu_given_up():
            return False
        if context_synchronize(seconds):
            return True
        give_up_gpu(f"the GPU had not finished its queued work {seconds:g} s after the interrupt")
        return False

    @staticmethod
    def gpu_given_up() -> bool:
        """Whether this process stopped waiting for its GPU work (driver.give_up_gpu): then nothing is freed."""
        return gpu_given_up() is not None

    def close(self) -> None:
        """Free the arena, the stream and the device's context (graphs captured from it belong to the caller).
        When this process has given its GPU work up (driver.give_up_gpu), nothing is freed: freeing waits for that
        work, and the process's exit hands everything back to the driver."""
        if self.gpu_given_up():
            return
        context_synchronize()  # nothing queued may still use the memory
        if self.group is not None:
            self.group.close()
        self.model.step.close()
        self.model.arena.close()
        self.stream.close()
        self.device.close()
