"""`Trainer`: the Python API. Train, evaluate, predict, save and load an MLP on one GPU; the CLIs are thin layers over it.

    from rawgpu import Recipe, Trainer
    with Trainer(Recipe(hidden=256), epochs=2) as t:
        t.fit(on_epoch=lambda s: print(s.epoch, s.test_accuracy))
        t.save("mnist.safetensors")

Cheap checks come first: the recipe and the data are checked and loaded before the GPU is opened and the kernels are
compiled. A run is a fixed number of steps (the schedule spans it); a checkpoint saved at any step continues to the
same end bit for bit, because the step counter, the master halves, the momentum and the data order are restored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import checkpoint as ck
from .stats import EpochStats
from ..data.datasets import DATASET_NAMES, Dataset, check_data_argument, load_dataset
from ..runtime.errors import RawgpuError
from ..runtime.ranks import Rank, gather_to_root
from ..model.recipe import (Recipe, SettingError, SettingTypeError, cdiv, check_setting, plan_run, recipe_or_default,
                            shown)
from ..steps import CHOICES, resumed

PROGRESS_TICKS = 50  # progress events per epoch
MAX_AHEAD = 8  # progress ticks the host may queue ahead of the GPU: bounds Ctrl-C latency, never starves it
# A progress tick's steps per graph by default (`python -m rawgpu.train --hidden 512 --steps-per-graph 1` against the
# same run without it shows the gain), at most this many: it bounds the graph's nodes, so its capture stays short
MAX_AUTO_STEPS_PER_GRAPH = 64
# After Ctrl-C or SIGTERM the queued steps get this many seconds to finish, so the run saves at a step boundary; a
# GPU that has not finished by then is given up (nothing saved), and the process still ends at once.
INTERRUPT_GRACE = 1.0


def auto_steps_per_graph(steps_per_epoch: int) -> int:
    """Steps per CUDA graph when the caller names none: one progress tick's worth, so each tick is one graph
    launch and the GPU never idles between the steps of a tick (the next step's first kernel overlaps the last)."""
    return max(1, min(MAX_AUTO_STEPS_PER_GRAPH, cdiv(steps_per_epoch, PROGRESS_TICKS)))


class TrainingDiverged(RawgpuError):
    """The train loss became NaN or infinite; the run stopped at the end of that epoch."""


@dataclass(frozen=True)
class RunPlan:
    """How many steps run in each epoch."""

    epochs: int
    total_steps: int
    steps_per_epoch: int

    def steps_in(self, epoch: int) -> int:
        return min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)


@dataclass(frozen=True)
class Evaluation:
    """Test loss and accuracy (as training reports them) and the confusion matrix: counts[true, predicted]. A
    regression's: the loss, RMSE, MAE and R^2 over every value (accuracy NaN, no confusion matrix)."""

    loss: float
    accuracy: float
    confusion: np.ndarray | None
    rmse: float | None = None
    mae: float | None = None
    r2: float | None = None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Class probabilities of logits, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _data_shape(data: Dataset) -> dict[str, int]:
    return dict(inputs=data.inputs, classes=data.classes, train_rows=len(data.train_labels),
                test_rows=len(data.test_labels))


def fit_to_data(recipe: Recipe, data: Dataset) -> Recipe:
    """`recipe` with the data's shape, and its features' dtype where the recipe names none; SettingError where the
    task or dtype does not go with the data (a regression's loss for class labels, bytes for float features)."""
    if data.regression and not recipe.regression:
        raise SettingError("loss", "the data's targets are values: use a regression loss (mse, l1 or huber)")
    if recipe.regression and not data.regression:
        raise SettingError("loss", f"{recipe.loss} is a regression's loss; the data has class labels (use xent, or "
                                   "give the targets as values)")
    dtype = recipe.input_dtype or data.input_dtype
    if data.on_gpu and dtype != data.input_dtype:
        raise SettingError("input_dtype", f"the features are on the GPU as {data.train_images.dtype} and are used "
                                          f"as they are ({data.input_dtype}): hand them over as {dtype} or leave "
                                          "input_dtype unset")
    if dtype == "u8" and data.input_dtype != "u8":
        raise SettingError("input_dtype", f"u8 keeps bytes (0..255 pixels); the data's features are "
                                          f"{data.train_images.dtype}: use fp16 or fp32")
    return replace(recipe, input_dtype=dtype, **_data_shape(data))


def as_dataset(data: Any) -> Any:
    """data as Trainer and Sweep take it: a tuple of arrays, (x, y) or (x, y, x_test, y_test), becomes
    Dataset.from_arrays'; anything else stays as it is."""
    if isinstance(data, tuple):
        if len(data) not in (2, 4):
            raise SettingError("data", f"a tuple of arrays is (x, y) or (x, y, x_test, y_test), got {len(data)} items")
        return Dataset.from_arrays(*data)
    return data


def dataset_record(data: Dataset | None, recipe: Recipe, image_shape: tuple[int, int] | None = None,
                   columns: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint says about its data: the name, the image shape and the classes (a regression's outputs),
    and a table's columns (features and targets)."""
    if data is not None:
        record = {"name": data.name, "image_shape": list(data.image_shape), "classes": data.classes}
        if data.features or data.targets:
            record["columns"] = {"features": list(data.features), "targets": list(data.targets)}
        return record
    record = {"name": None, "image_shape": list(image_shape) if image_shape else None, "classes": recipe.classes}
    return {**record, "columns": columns} if columns else record


# --- the pieces of Trainer.fit ----------------------------------------------------------------------------------

class _Launches:
    """What fit queues on the stream: training steps (the k-step graph while k or more remain, then the one-step
    graph; without graphs the kernels one by one) and the evaluation graph. Building it captures the graphs."""

    def __init__(self, trainer: "Trainer"):
        graphs, k = trainer.graphs, trainer.steps_per_graph
        self._one = trainer._graph("step1") if graphs else None
        self._many = trainer._graph(f"step{k}") if graphs and k > 1 else None
        self._eval = trainer._graph("eval")
        self._kernels = None if graphs else trainer.model.step_launches()
        self._k, self._stream = k, trainer.stream

    def steps(self, n: int) -> None:
        done = 0
        while done < n:
            if self._many is not None and n - done >= self._k:
                self._many.launch(self._stream)
                done += self._k
            elif self._one is not None:
                self._one.launch(self._stream)
                done += 1
            else:
                for launch in self._kernels:
                    launch.run(self._stream)
                done += 1

    def evaluate(self) -> None:
        self._eval.launch(self._stream)


class _ProgressTicks:
    """An epoch's progress events, one recorded behind each chunk of steps queued. The host waits for the oldest
    only when all MAX_AHEAD are in flight, so the GPU always has work queued and Ctrl-C acts within a few ticks;
    progress.epoch_progress reports a tick once the GPU has reached it."""

    def __init__(self, events: list, stream, progress, first_step: int):
        self._free, self._pending = list(events), []
        self._stream, self._progress, self._first_step = stream, progress, first_step

    def record(self, launched: int) -> None:
        """A tick after the epoch's first `launched` steps; with none free, first wait for the oldest."""
        if not self._free:
            ev, at = self._pending.pop(0)
            self._wait(ev, at)
            self._free.append(ev)
        self._pending.append((self._free.pop().record(self._stream), launched))

    def wait_all(self) -> None:
        """Wait for the ticks still in flight, oldest first."""
        for ev, at in self._pending:
            self._wait(ev, at)

    def _wait(self, ev, at: int) -> None:
        ev.synchronize(f"step {self._first_step + at}")
        if self._progress is not None:
            self._progress.epoch_progress(at)


class _SavePolicy:
    """When fit writes its checkpoint `path` (None: never): every `every` steps, where stop_at ends it inside an
    epoch, after an interrupt that settled at a step boundary, and when fit returns at an epoch boundary. A save
    inside an epoch keeps its metrics so far, for the checkpoint or a later fit; the saves during the run are skipped
    when the loss or a weight is not finite, so the last good checkpoint stays."""

    def __init__(self, trainer: "Trainer", path, every: int | None):
        self._trainer, self.path, self._every = trainer, path, every

    def steps_to_queue(self, todo: int) -> int:
        """`todo` cut short where the next periodic save falls, so that the save sees exactly its step."""
        if self.path is not None and self._every:
            return min(todo, self._every - self._trainer.steps_done % self._every)
        return todo

    def inside_epoch(self) -> None:
        """After a chunk that ends inside its epoch: the periodic save, with the epoch's metrics so far."""
        if self._due():
            self._trainer._save_mid_epoch(self.path)

    def epoch_end(self, last: bool) -> None:
        """After an epoch's evaluation: the periodic save, but not after the run's last epoch (at_end saves it)."""
        if self._due() and not last:
            self._trainer._save_if_finite(self.path)

    def stopped_inside_epoch(self) -> None:
        """stop_at falls inside an epoch: keep its metrics so far (a later fit continues with them), and save."""
        self._trainer._save_mid_epoch(self.path)

    def interrupted(self) -> None:
        """After Ctrl-C or SIGTERM, once the run has settled at a step boundary: keep the epoch's metrics so far (a
        later fit continues with them, saved or not), and save."""
        self._trainer._save_mid_epoch(self.path)

    def at_end(self) -> None:
        """fit returns at an epoch boundary: the run's end, stop_at there, or on_epoch said stop."""
        if self.path is not None:
            self._trainer.save(self.path)

    def _due(self) -> bool:
        return self.path is not None and bool(self._every) and self._trainer.steps_done % self._every == 0


class Trainer:
    """An MLP on one GPU with its data: `fit`, `evaluate`, `predict`, `save`, `load`, `close` (or a `with` block)."""

    def __init__(self, recipe: Recipe | None = None, *, data: Dataset | str | None = "mnist",
                 data_dir: str | Path | None = None, epochs: int | None = None, steps: int | None = None,
                 device: int = 0, step: str = "auto", steps_per_graph: int | None = None, graphs: bool = True,
                 on_compile: Callable[[int, int], None] | None = None,
                 download_progress: Callable[[str, int, int | None], None] | None = None):
        """recipe: the model and optimiser (default: the CLI's default recipe); its data shape is set from `data`.
        data: a Dataset, a name in data.DATASET_NAMES (loaded from data_dir, the cache or a download), or None
        (predict only). epochs / steps: the run's length (default the recipe's total_steps, else DEFAULTS' epochs).
        device: the GPU's index. step: the step kind (steps.CHOICES). steps_per_graph: steps captured into one CUDA
        graph (None: auto_steps_per_graph); graphs=False launches the kernels one by one. on_compile(done, total):
        the progress of a kernel build that is not all in the cache. Every argument is checked before the data is
        read and the GPU is opened: a bad one raises a ValueError or TypeError naming it in one line."""
        self._setup(recipe, data=data, data_dir=data_dir, epochs=epochs, steps=steps, device=device, step=step,
                    steps_per_graph=steps_per_graph, graphs=graphs, on_compile=on_compile,
                    download_progress=download_progress)

    @classmethod
    def _make(cls, recipe: Recipe | None = None, *, rank: Rank | None = None, options=None,
              checkpoint: ck.Checkpoint | None = None, **public) -> "Trainer":
        """Trainer(recipe, **public) with what the package alone passes: rank, this process's part of a model split
        over several GPUs (ranks.Rank; every rank makes the same calls, rank 0 alone writes checkpoints); options, the
        step's StepOptions; checkpoint, the state to start from (Trainer.load)."""
        self = cls.__new__(cls)
        self._setup(recipe, rank=rank, options=options, checkpoint=checkpoint, **public)
        return self

    def _setup(self, recipe, *, data="mnist", data_dir=None, epochs=None, steps=None, device=0, step="auto",
               steps_per_graph=None, graphs=True, on_compile=None, download_progress=None, rank=None, options=None,
               checkpoint: ck.Checkpoint | None = None) -> None:
        self._session = None
        self.closed = False
        recipe = check_arguments(recipe, data=data, epochs=epochs, steps=steps, device=device, step=step,
                                 steps_per_graph=steps_per_graph, graphs=graphs, on_compile=on_compile,
                                 download_progress=download_progress)
        if isinstance(data, str):
            data = load_dataset(data, data_dir, progress=download_progress)
        data = as_dataset(data)
        if data is not None and data.on_gpu:
            held = {a.device_id for a in (data.train_images, data.test_images) if hasattr(a, "device_id")}
            if held != {device} or rank is not None:
                where = ", ".join(f"GPU {i}" for i in sorted(held))
                raise SettingError("data", f"the features are on {where}; they train where they are, on that one GPU "
                                           f"(device={sorted(held)[0]}, no ranks), or pass host arrays")
        self.data: Dataset | None = data
        if data is not None and checkpoint is None:
            recipe = fit_to_data(recipe, data)  # validates batch <= the training images too
        if checkpoint is None:
            recipe = plan_run(recipe, epochs, steps)
        self.recipe = recipe
        self.plan = RunPlan(cdiv(recipe.total_steps, recipe.steps_per_epoch), recipe.total_steps,
                            recipe.steps_per_epoch)
        if steps_per_graph is None:
            steps_per_graph = auto_steps_per_graph(self.plan.steps_per_epoch) if graphs else 1
        self.steps_per_graph, self.graphs = max(1, min(steps_per_graph, recipe.total_steps)), graphs
        self.history: list[EpochStats] = []
        self.saved: tuple[Path, int] | None = None  # the last checkpoint this trainer wrote, and its step
        self.train_seconds = 0.0
        self._epoch_metrics: tuple = ()  # a resumed epoch's metric sums before it was saved (MLP.train_metrics)
        self._image_shape = tuple(data.image_shape) if data is not None else None
        self.rank = rank
        if checkpoint is not None:
            step = resumed(checkpoint.step_kind, rank.ranks if rank is not None else 0)
            progress = checkpoint.progress  # checked by checkpoint.load
            self.history = [EpochStats(**h) for h in progress.get("history", [])]
            self.train_seconds = float(progress.get("train_seconds", 0.0))
            self._epoch_metrics = _saved_epoch_metrics(progress, recipe)
            self._image_shape = self._image_shape or tuple(checkpoint.dataset.get("image_shape") or ()) or None
        self._columns = checkpoint.dataset.get("columns") if checkpoint is not None else None
        from .session import Session

        self._session = Session(recipe, device, on_compile=on_compile, step_kind=step, options=options, rank=rank)
        self.model, self.stream = self._session.model, self._session.stream
        if recipe.regression and (checkpoint is not None or data is not None):  # else untrained: no scaling
            from ..model.mlp import target_scaling

            self.model.set_target_scaling(*(checkpoint.target_scaling if checkpoint is not None
                                            else target_scaling(data.train_labels)))
        if data is not None:
            self.model.upload_data(data)
        else:
            self.model.prepare_predict()
        if recipe.standardize:  # the checkpoint's scaling, else the training split's
            if checkpoint is not None:
                self.model.set_scaling(*checkpoint.scaling)
            else:
                self.model.compute_scaling(self.stream)
        if checkpoint is None:
            self.model.init_parameters(self.stream)
            self.steps_done = 0
        else:
            self.model.set_state([b for _, b in checkpoint.weights], checkpoint.state, checkpoint.steps_done,
                                 self.stream)
            self.steps_done = checkpoint.steps_done
        self._graphs: dict[str, Any] = {}

    # --- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, source: str | Path | ck.Checkpoint, *, data: Dataset | str | None = "checkpoint",
             data_dir: str | Path | None = None, device: int = 0, steps_per_graph: int | None = None,
             graphs: bool = True, on_compile: Callable[[int, int], None] | None = None,
             download_progress: Callable[[str, int, int | None], None] | None = None) -> "Trainer":
        """A trainer at the state a checkpoint saved: `fit` continues its run to the end, `evaluate`/`predict` use
        it. data: "checkpoint" (the dataset the checkpoint names, from data_dir or the cache), a name, a Dataset,
        or None (predict only). The data's image shape and classes must be the model's. The other arguments are
        Trainer's."""
        return cls._load(source, data=data, data_dir=data_dir, device=device, steps_per_graph=steps_per_graph,
                         graphs=graphs, on_compile=on_compile, download_progress=download_progress)

    @classmethod
    def _load(cls, source: str | Path | ck.Checkpoint, *, data: Dataset | str | None = "checkpoint",
              data_dir: str | Path | None = None, download_progress=None, **kw) -> "Trainer":
        """Trainer.load, with what Trainer._make also takes (rank, options)."""
        check_data_argument(data, none_ok=True, also=("checkpoint",))
        if not isinstance(source, (str, Path, ck.Checkpoint)):
            raise SettingTypeError("source", f"must be a checkpoint's path or a Checkpoint, got {shown(source)}")
        ckpt = source if isinstance(source, ck.Checkpoint) else ck.load(source)
        path = ckpt.path
        if isinstance(data, str):
            name = ckpt.dataset.get("name") if data == "checkpoint" else data
            if name not in DATASET_NAMES:
                raise ck.CheckpointError(f"{path}: the checkpoint names no known dataset ({name!r}); pass one")
            data = load_dataset(name, data_dir, progress=download_progress)
        if data is not None:
            check_fits(ckpt, data, path)
        recipe = ckpt.recipe
        if data is not None and (len(data.train_labels), len(data.test_labels)) != (recipe.train_rows,
                                                                                    recipe.test_rows):
            recipe = replace(recipe, **_data_shape(data))  # evaluation on another set of the same shape
        return cls._make(recipe, data=data, checkpoint=replace(ckpt, recipe=recipe),
                         **kw)._remember(ckpt, path)

    def _remember(self, ckpt: ck.Checkpoint, path) -> "Trainer":
        self._trained_on = (ckpt.dataset.get("name"), ckpt.recipe.train_rows, str(path))
        return self

    # --- training -----------------------------------------------------------------------------------------------

    def fit(self, on_epoch: Callable[[EpochStats], Any] | None = None, *, progress=None,
            save_to: str | Path | None = None, save_every: int | None = None,
            stop_at: int | None = None) -> list[EpochStats]:
        """Train from the current step to the end of the run; returns the history of every epoch (earlier runs of a
        loaded checkpoint included). on_epoch(stats) after each epoch: returning False stops the run there.
        progress: an object with epoch_begin(epoch, epochs, steps) and epoch_progress(done), as the CLI's console.
        save_to: a checkpoint written at the end, every `save_every` steps, and on Ctrl-C (then KeyboardInterrupt
        propagates). stop_at: stop after this many steps of the run (inside an epoch too); fit() again, or a saved
        checkpoint, continues. A train loss that turns NaN or infinite raises TrainingDiverged at the end of that
        epoch and saves nothing: the last good checkpoint stays."""
        self._check_can_fit()
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        saves = _SavePolicy(self, save_to, save_every)
        stop = self.plan.total_steps if stop_at is None else min(stop_at, self.plan.total_steps)
        if self.steps_done >= stop:
            saves.at_end()
            return self.history
        from ..runtime.driver import Event

        events = [Event() for _ in range(MAX_AHEAD + 3)]  # an epoch's start, end and evaluation's end; the ticks
        try:  # the graphs' capture too: an interrupt there stops at a step boundary as well
            at_epoch_boundary = self._run_epochs(on_epoch, progress, saves, stop, events)
        except KeyboardInterrupt:
            if self._settle_interrupted():
                saves.interrupted()
            raise
        finally:
            for ev in events:
                ev.close()
        if at_epoch_boundary:
            saves.at_end()
        return self.history

    def _check_can_fit(self) -> None:
        """Refuse a closed trainer, one without training data, and a loaded checkpoint on other data than its own."""
        self._check_open()
        if self.data is None:
            raise RawgpuError("this trainer has no training data: load it with data=...")
        trained_on = getattr(self, "_trained_on", None)
        if trained_on:
            _check_same_data(*trained_on, self.data)

    def _run_epochs(self, on_epoch, progress, saves: _SavePolicy, stop: int, events: list) -> bool:
        """The epoch loop, from the current step to step `stop`. True when it ends at an epoch boundary (the run's
        end, `stop` there, or on_epoch said stop); False when `stop` falls inside an epoch."""
        plan, stream = self.plan, self.stream
        launches = _Launches(self)
        first_epoch = self.steps_done // plan.steps_per_epoch
        order = self._data_order(first_epoch)
        start, end, eval_end = events[0], events[1], events[2]
        for epoch in range(first_epoch, plan.epochs):
            first = epoch * plan.steps_per_epoch
            if first >= stop:
                break
            n = plan.steps_in(epoch)
            started = self.steps_done - first  # > 0: resuming inside this epoch
            self._begin_epoch(epoch, n, started, order, progress)
            ticks = _ProgressTicks(events[3:], stream, progress, first)
            self._session.sync_ranks()
            start.record(stream)
            limit = min(n, stop - first)
            self._queue_steps(epoch, started, limit, launches, ticks, saves)
            if limit < n:
                saves.stopped_inside_epoch()
                return False
            end.record(stream)
            launches.evaluate()
            eval_end.record(stream)
            ticks.wait_all()
            stats = self._record_epoch(epoch, n, started, (start, end, eval_end))
            keep_going = on_epoch is None or on_epoch(stats) is not False
            self._stop_if_diverged(stats, saves.path)
            saves.epoch_end(last=epoch + 1 == plan.epochs)
            if not keep_going:
                break
        return True

    def _data_order(self, first_epoch: int) -> np.random.Generator:
        """The generator of the epochs' sample orders, past those of the epochs already run: the order is replayed
        from the seed, not stored, so a resumed run sees the same data as an uninterrupted one."""
        rng = np.random.default_rng(self.recipe.seed)
        for _ in range(first_epoch):
            rng.permutation(self.recipe.train_rows)
        return rng

    def _begin_epoch(self, epoch: int, n: int, started: int, order: np.random.Generator, progress) -> None:
        """After a named wait for the work queued before (the order must not change under queued steps): the epoch's
        sample order and metrics (zero, or those a resumed epoch had summed), then progress.epoch_begin."""
        m, stream = self.model, self.stream
        stream.synchronize(f"the work queued before step {self.steps_done + 1}")  # names the wait it is
        m.set_permutation(order.permutation(self.recipe.train_rows))
        if started and self._epoch_metrics:
            m.set_train_metrics(*self._epoch_metrics)
        else:
            m.zero_metrics().run(stream)
        if progress is not None:
            progress.epoch_begin(epoch + 1, self.plan.epochs, n)

    def _queue_steps(self, epoch: int, launched: int, limit: int, launches: _Launches, ticks: _ProgressTicks,
                     saves: _SavePolicy) -> None:
        """Queue the epoch's steps from `launched` to `limit` in chunks of one progress tick (whole graphs of
        steps_per_graph steps; cut short where a periodic save falls), a tick after each. steps_done counts the
        steps queued: the GPU catches up at the ticks and the saves."""
        k, first, n = self.steps_per_graph, epoch * self.plan.steps_per_epoch, self.plan.steps_in(epoch)
        chunk = max(k, cdiv(n, PROGRESS_TICKS) // k * k)
        while launched < limit:
            todo = saves.steps_to_queue(min(chunk, limit - launched))
            launches.steps(todo)
            launched += todo
            self.steps_done = first + launched
            ticks.record(launched)
            if launched < n:
                saves.inside_epoch()

    def _record_epoch(self, epoch: int, n: int, started: int, timing: tuple) -> EpochStats:
        """The finished epoch's EpochStats, from its events (start, end, evaluation's end) and the metrics read
        back; added to the history and the training time, and the resumed epoch's metrics cleared."""
        from ..kernels.gather import lr_at

        m, r, plan = self.model, self.recipe, self.plan
        start, end, eval_end = timing
        # An epoch with a mid-epoch save also counts the idle GPU time of that save.
        seconds, eval_seconds = start.elapsed_ms(end) / 1e3, end.elapsed_ms(eval_end) / 1e3
        sums = m.train_metrics(self.stream)
        test_loss, test_acc = m.eval_metrics()
        flops, traffic = r._step_flops(), r._step_bytes()
        ran = n - started
        self.train_seconds += seconds
        train_loss = sums[0] / (n * r.batch)
        errors = {}
        if r.regression:
            rmse, mae, r2 = m.eval_errors()
            errors = dict(train_rmse=math.sqrt(sums[1] / (n * r.batch * r.classes)) * m.target_scale, test_rmse=rmse,
                          test_mae=mae, test_r2=r2)
        stats = EpochStats(
            epoch=epoch + 1, epochs=plan.epochs, steps=n, train_loss=train_loss,
            train_accuracy=math.nan if r.regression else sums[1] / (n * r.batch), test_loss=test_loss,
            test_accuracy=test_acc, **errors,
            seconds=seconds, eval_seconds=eval_seconds, steps_per_s=ran / seconds,
            samples_per_s=ran * r.batch / seconds, tflops=flops * ran / seconds / 1e12,
            gbps=traffic * ran / seconds / 1e9,
            lr=lr_at(self.steps_done - 1, r.lr, r.lr_min, r.total_steps, r.warmup_steps, r.schedule),
            total_seconds=self.train_seconds)
        self.history.append(stats)
        self._epoch_metrics = ()
        return stats

    def _stop_if_diverged(self, stats: EpochStats, save_to) -> None:
        """TrainingDiverged when the epoch's train loss is not finite: every later step would train on NaN."""
        if not math.isfinite(stats.train_loss):
            raise TrainingDiverged(
                f"training diverged in epoch {stats.epoch}: the train loss is {stats.train_loss}; the learning rate "
                f"(lr {self.recipe.lr:g}) is the likely cause, try a smaller one"
                + (f"; {save_to} keeps the last good checkpoint" if save_to and Path(save_to).exists() else ""))

    def _settle_interrupted(self) -> bool:
        """After Ctrl-C or SIGTERM: whether the run stopped at a step boundary it can save (steps_done then names
        it). Not on several GPUs (the other ranks' steps may never come), nor when the queued steps have not
        finished within INTERRUPT_GRACE (the GPU is then given up)."""
        if self.rank is not None and self.rank.ranks > 1:
            return False
        if not self._session.settle(INTERRUPT_GRACE):
            return False
        self.steps_done = self.model.step_count()
        return True

    def _save_mid_epoch(self, path) -> None:
        """Keep the epoch's metrics so far (a later fit or a checkpoint continues the epoch with them) and save to
        `path` (None: don't); skipped when the loss or the weights are not finite, so the last good checkpoint
        stays."""
        self.stream.synchronize()
        sums = self.model.train_metrics(self.stream)
        if math.isfinite(sums[0]):
            self._epoch_metrics = sums
            if path is not None:
                self._save_if_finite(path)

    def _save_if_finite(self, path) -> None:
        """A save during the run: skipped when a weight is NaN or infinite, so the last good checkpoint stays."""
        ckpt = self.checkpoint()
        if ckpt is not None and all(np.isfinite(w).all() and np.isfinite(b).all() for w, b in ckpt.weights):
            self.saved = (ck.save(path, ckpt), self.steps_done)

    # --- evaluation and prediction -------------------------------------------------------------------------------

    def evaluate(self) -> Evaluation:
        """Test loss and accuracy through the evaluation graph training uses, and the confusion matrix from the
        predictions of the same forward kernels."""
        self._check_open()
        if self.data is None:
            raise RawgpuError("this trainer has no test data: load it with data=...")
        self._graph("eval").launch(self.stream)
        self.stream.synchronize()
        loss, accuracy = self.model.eval_metrics()
        if self.recipe.regression:
            rmse, mae, r2 = self.model.eval_errors()
            return Evaluation(loss, accuracy, None, rmse, mae, r2)
        predicted = self.model.logits(np.asarray(self.data.test_images), self.stream).argmax(axis=1)
        c = self.recipe.classes
        confusion = np.bincount(self.data.test_labels.astype(np.int64) * c + predicted, minlength=c * c)
        return Evaluation(loss, accuracy, confusion.reshape(c, c))

    def predict(self, images: Any) -> np.ndarray:
        """Class probabilities (float64 [N, classes]) or a regression's values (float64 [N, outputs]) of rows of
        features [N, inputs] (uint8 images also [N, rows, cols]; features as the model was trained on: bytes for a
        model of bytes, numbers otherwise, with its standardization applied on the GPU)."""
        from ..data.arrays import host_array, numbers

        self._check_open()
        x = host_array(images, "images" if self.recipe._input_dtype == "u8" else "rows")
        r = self.recipe
        if r._input_dtype == "u8" and x.dtype != np.uint8:
            raise ValueError(f"images must be uint8 (0..255 per pixel), got {x.dtype}")
        x = x.reshape(len(x), -1) if x.ndim >= 2 else x.reshape(1, -1)
        if x.shape[1] != r.inputs:
            what = "pixels" if r._input_dtype == "u8" else "features"
            raise ValueError(f"the rows have {x.shape[1]} {what} each; the model takes {r.inputs}")
        x = numbers(x, "rows")  # the checks a training set gets: real, finite, within float32
        if len(x) == 0:
            return np.zeros((0, r.classes))
        out = self.model.logits(x, self.stream)
        return self.model.in_target_units(out) if r.regression else softmax(out)

    # --- saving ---------------------------------------------------------------------------------------------------

    def checkpoint(self) -> ck.Checkpoint | None:
        """The model and the run's state now (synchronises). On several GPUs every rank must call it: rank 0 gets
        the whole model, joined from every rank's part, the others None."""
        self._check_open()
        self.stream.synchronize()
        weights, state = self.model.state()
        if self.rank is not None:
            parts = gather_to_root((weights, state), self.rank)
            if parts is None:
                return None
            weights, state = self.model.join(parts)
        metrics = self._epoch_metrics or (0.0,) * (3 if self.recipe.regression else 2)
        progress = {"steps_done": self.steps_done, "epoch_loss_sum": metrics[0], "train_seconds": self.train_seconds,
                    "history": [dataclasses.asdict(h) for h in self.history]}
        if self.recipe.regression:
            progress["epoch_errors"] = [metrics[1], metrics[2]]  # the squared and absolute error sums
        else:
            progress["epoch_correct"] = int(metrics[1])
        return ck.Checkpoint(self.recipe, self.model.kind,
                             dataset_record(self.data, self.recipe, self._image_shape, self._columns),
                             weights, state, progress, scaling=self.model.scaling(),
                             target_scaling=((self.model.target_mean, self.model.target_scale)
                                             if self.recipe.regression else None))

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint atomically; it loads with `Trainer.load` and with the standard safetensors loaders.
        On several GPUs every rank calls it and rank 0 writes the whole model."""
        ckpt = self.checkpoint()
        if ckpt is None:
            return Path(path)
        self.saved = (ck.save(path, ckpt), self.steps_done)
        return self.saved[0]

    # --- the rest -----------------------------------------------------------------------------------------------

    @property
    def session(self):
        return self._session

    @property
    def done(self) -> bool:
        return self.steps_done >= self.plan.total_steps

    def parameters(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's fp32 master (W [fan_in, fan_out], b); on several GPUs this rank's part (steps/sharded.py)."""
        self._check_open()
        return self.model.parameters()

    def _graph(self, name: str):
        if name not in self._graphs:
            s = self._session
            self._graphs[name] = s.capture_eval() if name == "eval" else s.capture_step(int(name[4:]))
        return self._graphs[name]

    def _check_open(self) -> None:
        if self.closed:
            raise RawgpuError("this trainer is closed")

    def close(self) -> None:
        """Free the graphs and the GPU memory (idempotent; nothing, once the GPU was given up: Session.close)."""
        if self.closed:
            return
        self.closed = True
        if self._session is not None and self._session.gpu_given_up():
            return
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not self.closed:
            self._session.settle(INTERRUPT_GRACE)  # a GPU that never finishes must not hold up the exit
        self.close()


def _saved_epoch_metrics(progress: dict, recipe: Recipe) -> tuple:
    """The metric sums a checkpoint kept of its unfinished epoch (MLP.train_metrics' tuple)."""
    loss = float(progress.get("epoch_loss_sum", 0.0))
    if recipe.regression:
        sq, ab = progress.get("epoch_errors", [0.0, 0.0])
        return loss, float(sq), float(ab)
    return loss, int(progress.get("epoch_correct", 0))


def check_fits(ckpt: ck.Checkpoint, data: Dataset, path) -> None:
    """CheckpointError when the data's images or classes are not the model's."""
    r = ckpt.recipe
    if data.regression != r.regression:
        have = "values" if data.regression else "class labels"
        raise ck.CheckpointError(f"{path}: the model is a {'regression' if r.regression else 'classifier'}; "
                                 f"{data.name} has {have}")
    if data.is_table or r._input_dtype != "u8":
        if data.inputs != r.inputs or (data.classes != r.classes if r.regression else data.classes > r.classes):
            what = f"{r.classes} {'outputs' if r.regression else 'classes'}"
            has = f"{data.classes} {'outputs' if data.regression else 'classes'}"
            raise ck.CheckpointError(f"{path}: the model takes {r.inputs} features and {what}; {data.name} has "
                                     f"{data.inputs} features and {has}")
        return
    if data.inputs != r.inputs or data.classes > r.classes:
        shape = ckpt.dataset.get("image_shape")
        was = f"{shape[0]}x{shape[1]} images" if shape else f"{r.inputs}-pixel images"
        raise ck.CheckpointError(f"{path}: the model takes {was} and {r.classes} classes; {data.name} has "
                                 f"{data.image_shape[0]}x{data.image_shape[1]} images and {data.classes} classes")


def check_arguments(recipe: Any, *, data: Any = "mnist", epochs: Any = None, steps: Any = None, device: Any = 0,
                    step: Any = "auto", steps_per_graph: Any = None, graphs: Any = True, on_compile: Any = None,
                    download_progress: Any = None) -> Recipe:
    """Trainer's arguments, before the data is read or the GPU opened (recipe.check_setting's rules, which the CLIs
    share): the recipe (the default one for None), or a SettingError / SettingTypeError naming the parameter."""
    recipe = recipe_or_default(recipe)
    check_data_argument(data, none_ok=True, arrays_ok=True)
    for name, value in (("epochs", epochs), ("steps", steps), ("device", device), ("steps_per_graph", steps_per_graph),
                        ("graphs", graphs)):
        check_setting(name, value, none_ok=name not in ("device", "graphs"))
    if step not in CHOICES:
        raise (SettingError if isinstance(step, str) else SettingTypeError)(
            "step", f"must be one of {', '.join(CHOICES)}, got {shown(step)}")
    for name, value in (("on_compile", on_compile), ("download_progress", download_progress)):
        if value is not None and not callable(value):
            raise SettingTypeError(name, f"must be a function or None, got {shown(value)}")
    return recipe


def _check_same_data(name: str | None, train_rows: int, path, data: Dataset) -> None:
    if (name, train_rows) != (data.name, len(data.train_labels)):
        raise ck.CheckpointError(f"{path}: trained on {name} ({train_rows} images); resuming needs the same data, "
                                 f"got {data.name} ({len(data.train_labels)})")


def check_resumable(ckpt: ck.Checkpoint, data: Dataset, path) -> None:
    """CheckpointError unless the run the checkpoint saved can continue on `data`: the model's images and classes
    (check_fits), and the same training set (name and size), as fit checks before it continues."""
    check_fits(ckpt, data, path)
    _check_same_data(ckpt.dataset.get("name"), ckpt.recipe.train_rows, path, data)
