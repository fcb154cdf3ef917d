"""Many models trained together: a ModelStack (stack.py) and its models step (steps/models.py) on one GPU, epoch by
epoch, every model with the run a Trainer gives it alone (its seed's weights and sample orders, its schedule and
optimiser settings), each step one graph launch for all. What Sweep.fit runs where the models share one stack."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from . import checkpoint as ck
from ..runtime import compiler
from .. import steps
from .stats import EpochStats
from ..data.datasets import Dataset
from ..runtime.driver import Device, Event, Stream, context_synchronize
from ..runtime.errors import NoDeviceError
from ..runtime.graph import capture
from ..contract.arch import PLANNING_ARCH
from ..kernels import Kernels
from ..kernels.gather import lr_at
from ..model.mlp import run_launches
from ..model.recipe import Recipe, cdiv, plan_run
from .trainer import INTERRUPT_GRACE, RunPlan, auto_steps_per_graph, dataset_record, fit_to_data

STEP_KIND = steps.SWEEP_KIND


def stack_recipes(recipes: Sequence[Recipe], data: Dataset, epochs: int | None, steps_: int | None) -> list[Recipe]:
    """The recipes as Trainer sets them for `data` and the run's length (each model's own, by recipe.plan_run's
    rules)."""
    return [plan_run(fit_to_data(r, data), epochs, steps_) for r in recipes]


def stack_bytes(recipes: Sequence[Recipe], arch: str = PLANNING_ARCH) -> int:
    """Device bytes a stack of these models takes (planned, no GPU)."""
    return steps.plan_model(recipes[0], arch=arch, models=list(recipes)).arena.peak_bytes


class StackTrainer:
    """The models of `recipes` (as stack_recipes made them) on one GPU: `fit` trains them all together; `checkpoint(m)`
    is model m as Trainer.checkpoint would give it alone."""

    def __init__(self, recipes: Sequence[Recipe], data: Dataset, device: int = 0,
                 on_compile: Callable[[int, int], None] | None = None):
        self.recipes, self.data = list(recipes), data
        r = self.recipe = self.recipes[0]
        self.plan = RunPlan(cdiv(r.total_steps, r.steps_per_epoch), r.total_steps, r.steps_per_epoch)
        self.steps_per_graph = max(1, min(auto_steps_per_graph(r.steps_per_epoch), r.total_steps))
        self.device = Device(device)
        arch = self.device.arch
        if self.device.compute_capability < (8, 0) or arch not in compiler.supported_archs():
            raise NoDeviceError(f"{self.device.name} is {arch}: rawgpu needs sm_80 or newer")
        self.stack = steps.plan_model(r, arch=arch, sm_count=self.device.sm_count, models=self.recipes)
        units = sorted(self.stack.kernel_units(), key=lambda u: (u[0], u[1] or ""))
        cold = [u for u in units if not compiler.is_cached(u[0], arch, kernel=u[1], activation=r.activation)]
        self.kernels = Kernels(arch, on_progress=on_compile if cold else None, activation=r.activation)
        self.kernels.prefetch(units)
        try:
            self.stack.bind(self.kernels).allocate()
        except BaseException:
            self.kernels.close()
            raise
        self.kernels.wait()
        self.stream = Stream()
        self.stack.upload_data(data)
        if r.standardize:  # the training split's, as a model alone computes it
            self.stack.compute_scaling(self.stream)
        self.stack.init_parameters(self.stream)
        self.steps_done = 0
        self.histories: list[list[EpochStats]] = [[] for _ in self.recipes]
        self.train_seconds = 0.0
        self._graphs: dict[str, Any] = {}
        self.closed = False

    def _graph(self, name: str):
        if name not in self._graphs:
            launches = self.stack.eval_launches() if name == "eval" else self.stack.step_launches(int(name[4:]))
            graph = capture(self.stream, run_launches(launches, self.stream))
            graph.upload(self.stream)
            self._graphs[name] = graph
        return self._graphs[name]

    def fit(self, on_epoch: Callable[[int, EpochStats], Any] | None = None,
            progress: Callable[[int, int], Any] | None = None) -> list[list[EpochStats]]:
        """Train every model to the end of the run; on_epoch(m, stats) for each model after each epoch, progress(done,
        steps) inside one. Returns each model's history."""
        plan, stack, stream, k = self.plan, self.stack, self.stream, self.steps_per_graph
        orders = [np.random.default_rng(r.seed) for r in self.recipes]  # as Trainer._data_order replays them
        many, one = self._graph(f"step{k}"), self._graph("step1")
        start, end, eval_end = Event(), Event(), Event()
        try:
            for epoch in range(plan.epochs):
                n = plan.steps_in(epoch)
                stream.synchronize(f"the work queued before step {self.steps_done + 1}")
                stack.set_permutations([o.permutation(r.train_rows) for o, r in zip(orders, self.recipes)])
                stack.zero_metrics()
                stack.zero_eval_metrics()
                start.record(stream)
                done, ticks = 0, max(k, cdiv(n, 10) // k * k)
                while done < n:
                    todo = min(ticks, n - done)
                    for _ in range(todo // k):
                        many.launch(stream)
                    for _ in range(todo % k):
                        one.launch(stream)
                    done += todo
                    if progress is not None:
                        stream.synchronize(f"step {self.steps_done + done}")
                        progress(done, n)
                self.steps_done += n
                end.record(stream)
                self._graph("eval").launch(stream)
                eval_end.record(stream)
                eval_end.synchronize(f"the evaluation after step {self.steps_done}")
                for m, stats in enumerate(self._record_epoch(epoch, n, start, end, eval_end)):
                    self.histories[m].append(stats)
                    if on_epoch is not None:
                        on_epoch(m, stats)
        except KeyboardInterrupt:
            context_synchronize(INTERRUPT_GRACE)
            raise
        finally:
            for ev in (start, end, eval_end):
                ev.close()
        return self.histories

    def _record_epoch(self, epoch: int, n: int, start, end, eval_end) -> list[EpochStats]:
        r, N = self.recipe, len(self.recipes)
        seconds, eval_seconds = start.elapsed_ms(end) / 1e3, end.elapsed_ms(eval_end) / 1e3
        self.train_seconds += seconds
        loss_sums, correct = self.stack.train_metrics()
        test_loss, test_acc = self.stack.eval_metrics()
        flops, traffic = r._step_flops() * N, r._step_bytes() * N
        out = []
        for m, rm in enumerate(self.recipes):
            out.append(EpochStats(
                epoch=epoch + 1, epochs=self.plan.epochs, steps=n, train_loss=float(loss_sums[m]) / (n * r.batch),
                train_accuracy=int(correct[m]) / (n * r.batch), test_loss=float(test_loss[m]),
                test_accuracy=float(test_acc[m]), seconds=seconds, eval_seconds=eval_seconds,
                steps_per_s=n / seconds, samples_per_s=n * r.batch * N / seconds, tflops=flops * n / seconds / 1e12,
                gbps=traffic * n / seconds / 1e9,
                lr=lr_at(self.steps_done - 1, rm.lr, rm.lr_min, rm.total_steps, rm.warmup_steps, rm.schedule),
                total_seconds=self.train_seconds))
        return out

    def checkpoint(self, m: int) -> ck.Checkpoint:
        """Model m now, as a checkpoint of it trained alone (evaluate, predict and train --resume take it)."""
        self.stream.synchronize()
        weights, state = self.stack.model_state(m)
        progress = {"steps_done": self.steps_done, "epoch_loss_sum": 0.0, "epoch_correct": 0,
                    "train_seconds": self.train_seconds,
                    "history": [dataclasses.asdict(h) for h in self.histories[m]]}
        return ck.Checkpoint(self.recipes[m], STEP_KIND, dataset_record(self.data, self.recipes[m]), weights, state,
                             progress, scaling=self.stack.scaling())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        from ..runtime.driver import gpu_given_up

        if gpu_given_up() is not None:
            return
        context_synchronize()
        for g in self._graphs.values():
            g.close()
        self.stack.arena.close()
        self.stream.close()
        self.device.close()

    def __enter__(self) -> "StackTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["STEP_KIND", "StackTrainer", "stack_bytes", "stack_recipes"]
