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
from .console import EpochStats
from .data import DATASET_NAMES, Dataset, load_dataset
from .errors import RawgpuError
from .parallel.ranks import Rank, gather_to_root
from .recipe import DEFAULTS, Recipe, cdiv, run_length
from .steps import resumed

PROGRESS_TICKS = 50  # progress events per epoch
MAX_AHEAD = 8  # progress ticks the host may queue ahead of the GPU: bounds Ctrl-C latency, never starves it
MAX_AUTO_STEPS_PER_GRAPH = 64  # bounds the graph's nodes, so its capture stays short (docs/history.md, Version 14)
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
    """Test loss and accuracy (as training reports them) and the confusion matrix: counts[true, predicted]."""

    loss: float
    accuracy: float
    confusion: np.ndarray


def softmax(logits: np.ndarray) -> np.ndarray:
    """Class probabilities of logits, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _data_shape(data: Dataset) -> dict[str, int]:
    return dict(inputs=data.inputs, classes=data.classes, train_rows=len(data.train_labels),
                test_rows=len(data.test_labels))


def dataset_record(data: Dataset | None, recipe: Recipe, image_shape: tuple[int, int] | None = None) -> dict[str, Any]:
    """What a checkpoint says about its data: the name, the image shape and the classes."""
    if data is not None:
        return {"name": data.name, "image_shape": list(data.image_shape), "classes": data.classes}
    return {"name": None, "image_shape": list(image_shape) if image_shape else None, "classes": recipe.classes}


class Trainer:
    """An MLP on one GPU with its data: `fit`, `evaluate`, `predict`, `save`, `load`, `close` (or a `with` block)."""

    def __init__(self, recipe: Recipe | None = None, *, data: Dataset | str | None = "mnist",
                 data_dir: str | Path | None = None, epochs: int | None = None, steps: int | None = None,
                 device: int = 0, step: str = "auto", options=None, steps_per_graph: int | None = None,
                 graphs: bool = True, rank: Rank | None = None,
                 on_compile: Callable[[int, int], None] | None = None,
                 download_progress: Callable[[str, int, int | None], None] | None = None,
                 _checkpoint: ck.Checkpoint | None = None):
        """recipe: the model and optimiser (default: the CLI's default recipe); its data shape is set from `data`.
        data: a Dataset, a name in data.DATASET_NAMES (loaded from data_dir, the cache or a download), or None
        (predict only). epochs / steps: the run's length (default the recipe's total_steps, else DEFAULTS' epochs).
        step: the step kind (steps.CHOICES). steps_per_graph: steps captured into one CUDA graph (None:
        auto_steps_per_graph); graphs=False launches the kernels one by one. rank: this process's part of a model
        split over several GPUs (ranks.Rank; every rank makes the same calls, rank 0 alone writes checkpoints).
        on_compile(done, total): the progress of a kernel build that is not all in the cache."""
        self._session = None
        self.closed = False
        recipe = recipe or Recipe()
        if isinstance(data, str):
            if data not in DATASET_NAMES:
                raise ValueError(f"data must be a Dataset or one of {', '.join(DATASET_NAMES)}, got {data!r}")
            data = load_dataset(data, data_dir, progress=download_progress)
        self.data: Dataset | None = data
        if data is not None and _checkpoint is None:
            recipe = replace(recipe, **_data_shape(data))  # validates batch <= the training images too
        if _checkpoint is None:
            if epochs is None and steps is None and recipe.total_steps:
                steps = recipe.total_steps
            total, _ = run_length(recipe.batch, epochs or DEFAULTS["epochs"], steps, recipe.train_rows)
            recipe = replace(recipe, total_steps=total)
        self.recipe = recipe
        self.plan = RunPlan(cdiv(recipe.total_steps, recipe.steps_per_epoch), recipe.total_steps,
                            recipe.steps_per_epoch)
        if steps_per_graph is None:
            steps_per_graph = auto_steps_per_graph(self.plan.steps_per_epoch) if graphs else 1
        self.steps_per_graph, self.graphs = max(1, min(steps_per_graph, recipe.total_steps)), graphs
        self.history: list[EpochStats] = []
        self.saved: tuple[Path, int] | None = None  # the last checkpoint this trainer wrote, and its step
        self.train_seconds = 0.0
        self._epoch_metrics = (0.0, 0)  # a resumed epoch's loss sum and hits before it was saved
        self._image_shape = tuple(data.image_shape) if data is not None else None
        self.rank = rank
        if _checkpoint is not None:
            step = resumed(_checkpoint.step_kind, rank.ranks if rank is not None else 0)
            self.history = [EpochStats(**h) for h in _checkpoint.progress.get("history", [])]
            self.train_seconds = float(_checkpoint.progress.get("train_seconds", 0.0))
            self._epoch_metrics = (float(_checkpoint.progress.get("epoch_loss_sum", 0.0)),
                                   int(_checkpoint.progress.get("epoch_correct", 0)))
            self._image_shape = self._image_shape or tuple(_checkpoint.dataset.get("image_shape") or ()) or None
        from .session import Session

        self._session = Session(recipe, device, on_compile=on_compile, step_kind=step, options=options, rank=rank)
        self.model, self.stream = self._session.model, self._session.stream
        if data is not None:
            self.model.upload_data(data)
        else:
            self.model.prepare_predict()
        if _checkpoint is None:
            self.model.init_parameters(self.stream)
            self.steps_done = 0
        else:
            self.model.set_state([b for _, b in _checkpoint.weights], _checkpoint.state, _checkpoint.steps_done,
                                 self.stream)
            self.steps_done = _checkpoint.steps_done
        self._graphs: dict[str, Any] = {}

    # --- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, source: str | Path | ck.Checkpoint, *, data: Dataset | str | None = "checkpoint", data_dir: str | Path | None = None,
             device: int = 0, on_compile: Callable[[int, int], None] | None = None,
             download_progress: Callable[[str, int, int | None], None] | None = None, **kw) -> "Trainer":
        """A trainer at the state a checkpoint saved: `fit` continues its run to the end, `evaluate`/`predict` use
        it. data: "checkpoint" (the dataset the checkpoint names, from data_dir or the cache), a name, a Dataset,
        or None (predict only). The data's image shape and classes must be the model's."""
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
        return cls(recipe, data=data, device=device, on_compile=on_compile, _checkpoint=replace(ckpt, recipe=recipe),
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
        self._check_open()
        if self.data is None:
            raise RawgpuError("this trainer has no training data: load it with data=...")
        trained_on = getattr(self, "_trained_on", None)
        if trained_on and (trained_on[0], trained_on[1]) != (self.data.name, len(self.data.train_labels)):
            raise ck.CheckpointError(f"{trained_on[2]}: trained on {trained_on[0]} ({trained_on[1]} images); resuming "
                                     f"needs the same data, got {self.data.name} ({len(self.data.train_labels)})")
        m, stream, plan, r = self.model, self.stream, self.plan, self.recipe
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        stop = plan.total_steps if stop_at is None else min(stop_at, plan.total_steps)
        if self.steps_done >= stop:
            if save_to is not None:
                self.save(save_to)
            return self.history
        from .driver import Event
        from .kernels.data import lr_at

        events = [Event() for _ in range(MAX_AHEAD + 3)]
        try:  # the graphs' capture too: an interrupt there stops at a step boundary as well
            step_graph = self._graph("step1") if self.graphs else None
            k = self.steps_per_graph
            multi_graph = self._graph(f"step{k}") if self.graphs and k > 1 else None
            eval_graph = self._graph("eval")
            launches = None if self.graphs else m.step_launches()
            flops, traffic = r.step_flops(), r.step_bytes()
            rng = np.random.default_rng(r.seed)
            first_epoch = self.steps_done // plan.steps_per_epoch
            for _ in range(first_epoch):  # the data order of the epochs already run: replayed, not stored
                rng.permutation(r.train_rows)

            def run_steps(n: int) -> None:
                done = 0
                while done < n:
                    if multi_graph is not None and n - done >= k:
                        multi_graph.launch(stream)
                        done += k
                    elif step_graph is not None:
                        step_graph.launch(stream)
                        done += 1
                    else:
                        for launch in launches:
                            launch.run(stream)
                        done += 1

            for epoch in range(first_epoch, plan.epochs):
                if epoch * plan.steps_per_epoch >= stop:
                    break
                n = plan.steps_in(epoch)
                started = self.steps_done - epoch * plan.steps_per_epoch  # > 0: resuming inside this epoch
                stream.synchronize(f"the work queued before step {self.steps_done + 1}")  # names the wait it is
                m.set_permutation(rng.permutation(r.train_rows))
                if started:
                    m.set_train_metrics(*self._epoch_metrics)
                else:
                    m.zero_metrics().run(stream)
                if progress is not None:
                    progress.epoch_begin(epoch + 1, plan.epochs, n)
                start, end, eval_end = events[0], events[1], events[2]
                ticks = events[3:]
                self._session.sync_ranks()
                start.record(stream)
                # Progress: an event every n/PROGRESS_TICKS steps; the host waits for the oldest when it is
                # MAX_AHEAD ticks in front, so the GPU always has queued work and Ctrl-C acts within a few ticks.
                chunk, free, pending, launched = max(k, cdiv(n, PROGRESS_TICKS) // k * k), list(ticks), [], started
                limit = min(n, stop - epoch * plan.steps_per_epoch)
                while launched < limit:
                    todo = min(chunk, limit - launched)
                    if save_to is not None and save_every:
                        todo = min(todo, save_every - (epoch * plan.steps_per_epoch + launched) % save_every)
                    run_steps(todo)
                    launched += todo
                    self.steps_done = epoch * plan.steps_per_epoch + launched
                    if not free:
                        ev, at = pending.pop(0)
                        ev.synchronize(f"step {epoch * plan.steps_per_epoch + at}")
                        if progress is not None:
                            progress.epoch_progress(at)
                        free.append(ev)
                    pending.append((free.pop().record(stream), launched))
                    if save_to is not None and save_every and self.steps_done % save_every == 0 and launched < n:
                        self._save_mid_epoch(save_to)
                if limit < n:  # stopped inside the epoch: keep its metrics so far for the rest of it
                    self._save_mid_epoch(save_to)
                    return self.history
                end.record(stream)
                eval_graph.launch(stream)
                eval_end.record(stream)
                for ev, at in pending:
                    ev.synchronize(f"step {epoch * plan.steps_per_epoch + at}")
                    if progress is not None:
                        progress.epoch_progress(at)
                # An epoch with a mid-epoch save also counts the idle GPU time of that save.
                seconds, eval_seconds = start.elapsed_ms(end) / 1e3, end.elapsed_ms(eval_end) / 1e3
                loss_sum, correct = m.train_metrics(stream)
                test_loss, test_acc = m.eval_metrics()
                ran = n - started
                self.train_seconds += seconds
                train_loss = loss_sum / (n * r.batch)
                stats = EpochStats(
                    epoch=epoch + 1, epochs=plan.epochs, steps=n, train_loss=train_loss,
                    train_accuracy=correct / (n * r.batch), test_loss=test_loss, test_accuracy=test_acc,
                    seconds=seconds, eval_seconds=eval_seconds, steps_per_s=ran / seconds,
                    samples_per_s=ran * r.batch / seconds, tflops=flops * ran / seconds / 1e12,
                    gbps=traffic * ran / seconds / 1e9,
                    lr=lr_at(self.steps_done - 1, r.lr, r.lr_min, r.total_steps, r.warmup_steps, r.schedule),
                    total_seconds=self.train_seconds)
                self.history.append(stats)
                self._epoch_metrics = (0.0, 0)
                keep_going = on_epoch is None or on_epoch(stats) is not False
                if not math.isfinite(train_loss):  # every later step would train on NaN: stop here, save nothing
                    raise TrainingDiverged(
                        f"training diverged in epoch {epoch + 1}: the train loss is {train_loss}; the learning rate "
                        f"(lr {r.lr:g}) is the likely cause, try a smaller one"
                        + (f"; {save_to} keeps the last good checkpoint" if save_to and Path(save_to).exists() else ""))
                if save_to is not None and save_every and self.steps_done % save_every == 0 and epoch + 1 < plan.epochs:
                    self._save_if_finite(save_to)
                if not keep_going:
                    break
        except KeyboardInterrupt:
            if self.rank is not None and self.rank.ranks > 1:  # the other ranks' steps may never come: no save
                raise
            if not self._session.settle(INTERRUPT_GRACE):  # the GPU never reached a step boundary: no save
                raise
            self.steps_done = m.step_count()
            if save_to is not None:
                self._save_mid_epoch(save_to)
            raise
        finally:
            for ev in events:
                ev.close()
        if save_to is not None:
            self.save(save_to)
        return self.history

    def _save_mid_epoch(self, path) -> None:
        """Keep the epoch's metrics so far (a later fit or a checkpoint continues the epoch with them) and save to
        `path` (None: don't); skipped when the loss or the weights are not finite, so the last good checkpoint
        stays."""
        self.stream.synchronize()
        loss_sum, correct = self.model.train_metrics(self.stream)
        if math.isfinite(loss_sum):
            self._epoch_metrics = (loss_sum, correct)
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
        predicted = self.model.logits(np.asarray(self.data.test_images), self.stream).argmax(axis=1)
        c = self.recipe.classes
        confusion = np.bincount(self.data.test_labels.astype(np.int64) * c + predicted, minlength=c * c)
        return Evaluation(loss, accuracy, confusion.reshape(c, c))

    def predict(self, images: np.ndarray) -> np.ndarray:
        """Class probabilities (float64 [N, classes]) of uint8 images [N, pixels] or [N, rows, cols]."""
        self._check_open()
        x = np.asarray(images)
        if x.dtype != np.uint8:
            raise ValueError(f"images must be uint8 (0..255 per pixel), got {x.dtype}")
        x = x.reshape(len(x), -1) if x.ndim >= 2 else x.reshape(1, -1)
        if x.shape[1] != self.recipe.inputs:
            raise ValueError(f"images have {x.shape[1]} pixels each; the model takes {self.recipe.inputs}")
        if len(x) == 0:
            return np.zeros((0, self.recipe.classes))
        return softmax(self.model.logits(x, self.stream))

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
        progress = {"steps_done": self.steps_done, "epoch_loss_sum": self._epoch_metrics[0],
                    "epoch_correct": self._epoch_metrics[1], "train_seconds": self.train_seconds,
                    "history": [dataclasses.asdict(h) for h in self.history]}
        return ck.Checkpoint(self.recipe, self.model.kind, dataset_record(self.data, self.recipe, self._image_shape),
                             weights, state, progress)

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
        """Each layer's fp32 master (W [fan_in, fan_out], b); on several GPUs this rank's part (parallel/sharded.py)."""
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


def check_fits(ckpt: ck.Checkpoint, data: Dataset, path) -> None:
    """CheckpointError when the data's images or classes are not the model's."""
    r = ckpt.recipe
    if data.inputs != r.inputs or data.classes > r.classes:
        shape = ckpt.dataset.get("image_shape")
        was = f"{shape[0]}x{shape[1]} images" if shape else f"{r.inputs}-pixel images"
        raise ck.CheckpointError(f"{path}: the model takes {was} and {r.classes} classes; {data.name} has "
                                 f"{data.image_shape[0]}x{data.image_shape[1]} images and {data.classes} classes")
