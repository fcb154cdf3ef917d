"""Many models of one architecture on one dataset: `Sweep` trains every model of a grid (grid.py) and keeps each one's
history, ranks them, writes the results and the checkpoints asked for, and continues an interrupted sweep.

Models that can share one stack (stack.py: one architecture, batch, optimiser family and run length) train together,
each step one CUDA graph launch for all of them (stack_trainer.py, the models step); the others, or all with
together=False, one after another in this process, each through its own Trainer, ending with the very bits
`rawgpu.train` gives it alone. Either way each model's run is its own: its seed's weights and orders, its settings.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..contract.arch import PLANNING_ARCH
from . import checkpoint as ck
from .stats import EpochStats
from ..data.datasets import Dataset, load_dataset
from ..runtime.files import write_atomic
from .grid import Grid, check_sweep, describe_point
from .trainer import as_dataset, fit_to_data
from ..model.recipe import Recipe, SettingError, cdiv, run_total

RESULTS_FORMAT = "rawgpu-sweep-results"


@dataclass
class ModelResult:
    """One model of a sweep: its place in the grid, its swept settings and seed, and every epoch it trained."""

    index: int
    point: dict[str, Any]
    recipe: Recipe
    history: list[EpochStats] = field(default_factory=list)
    checkpoint: str | None = None  # where its checkpoint was written, if one was kept

    @property
    def done(self) -> bool:
        return bool(self.history) and self.history[-1].epoch == self.history[-1].epochs

    @property
    def regression(self) -> bool:
        return self.recipe.regression

    def _score(self, h: EpochStats) -> float:
        """What ranks an epoch, higher better: its test accuracy, or a regression's test RMSE negated."""
        value = -h.test_rmse if self.regression and h.test_rmse is not None else h.test_accuracy
        return value if math.isfinite(value) else -math.inf

    @property
    def best_epoch(self) -> int:
        return max(self.history, key=self._score).epoch if self.history else 0

    @property
    def best_score(self) -> float:
        """The best epoch's score (_score): what Sweep.best ranks the models by."""
        return max(map(self._score, self.history), default=-math.inf)

    @property
    def best_accuracy(self) -> float:
        """The best test accuracy over the epochs (NaN for a regression)."""
        if self.regression:
            return math.nan
        return max((h.test_accuracy if math.isfinite(h.test_accuracy) else -1.0 for h in self.history), default=0.0)

    @property
    def best_rmse(self) -> float | None:
        """A regression's lowest test RMSE over the epochs (None for a classification)."""
        return -self.best_score if self.regression and self.history else None

    def best_text(self) -> str:
        """What the console shows of the best epoch: 'acc 97.12%', or a regression's 'RMSE 0.4358'."""
        return f"RMSE {self.best_rmse:.4g}" if self.regression else f"acc {100 * self.best_accuracy:.2f}%"

    def describe(self) -> str:
        return describe_point(self.point)

    def to_dict(self) -> dict[str, Any]:
        best = {"best_rmse": self.best_rmse} if self.regression else {"best_accuracy": self.best_accuracy}
        errors = ("test_rmse", "test_mae", "test_r2") if self.regression else ()
        return {"index": self.index, "settings": {k: v for k, v in self.point.items() if k != "seed"},
                "seed": self.point["seed"], "best_epoch": self.best_epoch, **best,
                "epochs": [{"epoch": h.epoch, "train_loss": h.train_loss, "test_accuracy": h.test_accuracy,
                            "test_loss": h.test_loss, **{e: getattr(h, e) for e in errors}} for h in self.history],
                "checkpoint": self.checkpoint}


class Sweep:
    """Every model of `models` on `data` (a Dataset or a name: data.DATASET_NAMES). models: a Grid over `base` (the
    architecture, batch and optimiser every model shares; default the CLI's default recipe), or the models' recipes
    themselves (one architecture and batch). out: the folder of results.csv, results.json and checkpoints/ (None:
    nothing written). save_best: keep the checkpoints of the K best models; save_all: of every model.
    together: train the models in one step (None: where they can; False: one after another; True: or fail).
    chunk: at most this many models in one step (None: all that fit the GPU's free memory)."""

    def __init__(self, models: Grid | Sequence[Recipe], base: Recipe | None = None, *, data: Dataset | str = "mnist",
                 data_dir: str | Path | None = None, epochs: int | None = None, steps: int | None = None,
                 device: int = 0, out: str | Path | None = None, save_best: int = 0, save_all: bool = False,
                 together: bool | None = None, chunk: int | None = None):
        check_sweep(models, base, data=data, epochs=epochs, steps=steps, device=device, out=out, save_best=save_best,
                    save_all=save_all, together=together, chunk=chunk)
        if isinstance(models, Grid):
            self.grid, self.base = models, base or Recipe()
            self.recipes = models.recipes(self.base)  # every model checked before any GPU work
        else:
            self.recipes = list(models)
            if not self.recipes or base is not None:
                raise ValueError("a sweep of recipes takes at least one Recipe, and no base (a Grid's)")
            self.grid, self.base = Grid(seeds=tuple(range(len(self.recipes)))), self.recipes[0]
            if any((r.widths, r.batch) != (self.base.widths, self.base.batch) for r in self.recipes):
                raise ValueError("the recipes of a sweep share one architecture and one batch")
        if save_best < 0 or ((save_best or save_all) and out is None):
            raise ValueError("save_best and save_all keep checkpoints in `out`: give a folder (and save_best >= 0)")
        self.data = load_dataset(data, data_dir) if isinstance(data, str) else as_dataset(data)
        for r in self.recipes:  # the task and the features' dtype go with the data (before any GPU work)
            fit_to_data(r, self.data)
        if self.data.on_gpu:
            raise SettingError("data", "a sweep keeps its data on the host (each model's run, or a GPU's share, "
                                       "reads it): pass host arrays or a file")
        self.epochs, self.steps, self.device = epochs, steps, device
        self.out = Path(out) if out is not None else None
        self.save_best, self.save_all = save_best, save_all
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1 models, got {chunk}")
        self.together, self.chunk = together, chunk
        if together and (why := self.together_problem()):
            raise ValueError(f"these models cannot train in one step: {why}")
        points = (self.grid.points() if isinstance(models, Grid) else
                  [{"model": i, "seed": r.seed} for i, r in enumerate(self.recipes)])
        self.results = [ModelResult(i, point, r) for i, (point, r) in enumerate(zip(points, self.recipes))]

    # --- training ------------------------------------------------------------------------------------------------

    def fit(self, on_epoch: Callable[[ModelResult, EpochStats], Any] | None = None,
            on_model: Callable[[ModelResult], Any] | None = None, on_start: Callable[[ModelResult], Any] | None = None,
            gpus: int = 1) -> list[ModelResult]:
        """Train every model not yet done, in grid order; after each, the results and checkpoints on disk are
        brought up to date (written atomically), so Ctrl-C loses at most the models in training. on_start(result),
        on_epoch(result, stats), on_model(result): progress for a console. gpus: spread the models over GPUs
        0..gpus-1, one process each (model i of those left on GPU i mod gpus; on_start and on_epoch are not called
        then): every model ends as on one GPU."""
        if gpus > 1:
            return self._fit_on_gpus(gpus, on_model)
        if self.together is not False and self.together_problem() is None:
            return self._fit_together(on_epoch, on_model, on_start)
        from .trainer import Trainer

        for result in self.results:
            if result.done:
                continue
            result.history = []
            if on_start is not None:
                on_start(result)
            with Trainer(result.recipe, data=self.data, epochs=self.epochs, steps=self.steps,
                         device=self.device) as trainer:
                def epoch_done(stats: EpochStats, result=result) -> None:
                    result.history.append(stats)
                    if on_epoch is not None:
                        on_epoch(result, stats)
                trainer.fit(epoch_done)
                self._keep(result, trainer.save)
            self.write()
            if on_model is not None:
                on_model(result)
        return self.results

    def together_problem(self) -> str | None:
        """Why the models of this sweep cannot train in one step (one line), or None."""
        from ..model.stack import stack_problem
        from .stack_trainer import stack_recipes
        from ..steps import models_reason

        recipes = stack_recipes(self.recipes, self.data, self.epochs, self.steps)
        return stack_problem(recipes) or models_reason(recipes[0], PLANNING_ARCH)  # a table's: the models step's

    def chunks(self, todo: list[int], free_bytes: int | None = None) -> list[list[int]]:
        """The models left, in groups that each train in one step: `chunk` at a time, or as many as fit in
        free_bytes (ValueError with the largest count that fits when chunk asks for more, or none fit)."""
        fits = self.models_that_fit(free_bytes) if free_bytes is not None else len(todo)
        size = self.chunk or fits
        if size > fits:
            raise ValueError(f"{size} models in one step need more than the GPU's {free_bytes / 2**30:.1f} GiB free: "
                             f"at most {fits} fit (give chunk={fits}, or fewer models)")
        return [todo[i:i + size] for i in range(0, len(todo), size)]

    def models_that_fit(self, free_bytes: int) -> int:
        """How many of these models one step holds in free_bytes (keeping a tenth spare); ValueError when none."""
        from .stack_trainer import stack_bytes, stack_recipes

        recipes = stack_recipes(self.recipes, self.data, self.epochs, self.steps)
        one, two = stack_bytes(recipes[:1]), stack_bytes(recipes[:1] * 2)
        usable = int(free_bytes * 0.9)
        if one > usable:
            raise ValueError(f"one model needs {one / 2**30:.2f} GiB; the GPU has {free_bytes / 2**30:.2f} GiB free")
        return max(1, 1 + (usable - one) // max(1, two - one))

    def _fit_together(self, on_epoch, on_model, on_start) -> list[ModelResult]:
        """The models left, trained in one step per chunk (stack_trainer.py); the results and checkpoints brought up
        to date after each chunk."""
        from ..runtime.driver import Device

        # positions in self.results (a GPU's share of a sweep keeps the whole sweep's indices)
        todo = [i for i, r in enumerate(self.results) if not r.done]
        if not todo:
            return self.results
        device = Device(self.device)  # held, so the stacks' sessions reuse its context
        try:
            self._fit_chunks(self.chunks(todo, device.memory_info()[0]), on_epoch, on_model, on_start)
        finally:
            device.close()
        return self.results

    def _fit_chunks(self, groups: list[list[int]], on_epoch, on_model, on_start) -> None:
        """groups: positions in self.results, one stack each."""
        from .stack_trainer import StackTrainer, stack_recipes

        for group in groups:
            results = [self.results[i] for i in group]
            for result in results:
                result.history = []
                if on_start is not None:
                    on_start(result)

            def epoch_done(m: int, stats: EpochStats, results=results) -> None:
                results[m].history.append(stats)
                if on_epoch is not None:
                    on_epoch(results[m], stats)
            recipes = stack_recipes([r.recipe for r in results], self.data, self.epochs, self.steps)
            with StackTrainer(recipes, self.data, device=self.device) as trainer:
                trainer.fit(epoch_done)
                for m, result in enumerate(results):
                    self._keep(result, lambda path, m=m: ck.save(path, trainer.checkpoint(m)))
            self.write()
            if on_model is not None:
                for result in results:
                    on_model(result)

    def plot(self, path: str | Path) -> None:
        """A PNG of every trained model's best test accuracy against each swept setting (plot.py; needs
        matplotlib, the plot extra)."""
        from .plot import write_sweep_plot

        done = [r for r in self.results if r.history]
        write_sweep_plot(path, {name: [r.point[name] for r in done] for name, _ in self.grid.axes},
                         [r.best_rmse if r.regression else r.best_accuracy for r in done],
                         title=f"{self.data.name} {self.base.name}: {len(done)} models",
                         regression=self.base.regression)

    def trainer(self, i: int):
        """A Trainer holding model i as it ended (from its kept checkpoint): evaluate, predict, save it. ValueError
        when its weights were not kept (save_all, or save_best with model i among the best)."""
        from .trainer import Trainer

        result = self.results[i]
        if result.checkpoint is None or not Path(result.checkpoint).exists():
            raise ValueError(f"model {i}'s weights were not kept: make the sweep with save_all=True, or save_best "
                             "of enough models, and an out folder")
        return Trainer.load(result.checkpoint, data=self.data)

    def _fit_on_gpus(self, gpus: int, on_model) -> list[ModelResult]:
        from ..runtime import driver
        from ..runtime.ranks import run_ranks

        if gpus > (count := driver.device_count()):
            raise ValueError(f"{gpus} GPUs asked for, this machine has {count}")
        todo = [r.index for r in self.results if not r.done]
        shares = [[(i, self.results[i].recipe) for i in todo[g::gpus]] for g in range(gpus)]
        keep = self.out / "checkpoints" if self.out is not None and (self.save_all or self.save_best) else None

        def trained(rank: int, value) -> None:
            index, history, path = value
            result = self.results[index]
            result.history, result.checkpoint = history, path
            self._prune()
            self.write()
            if on_model is not None:
                on_model(result)

        together = self.together is not False and self.together_problem() is None
        run_ranks(_fit_share, gpus, shares, self.data, self.epochs, self.steps, keep, together, unique_id=b"",
                  on_report=trained)
        return self.results

    def take(self, index: int, history: list[EpochStats], checkpoint: bytes = b"") -> ModelResult:
        """Model `index` as another process trained it (a rank of a job on several hosts): its history, and its
        checkpoint's bytes where this sweep keeps it (save_all, or save_best while it is among the best); the results
        on disk brought up to date."""
        result = self.results[index]
        result.history, result.checkpoint = history, None
        if checkpoint:
            self._keep(result, lambda path: write_atomic(path, checkpoint))
        self.write()
        return result

    def _prune(self) -> None:
        """save_best: only the best K models keep their files."""
        if self.save_all or not self.save_best:
            return
        kept = {r.index for r in self.best(self.save_best)}
        for r in self.results:
            if r.checkpoint is not None and r.index not in kept:
                Path(r.checkpoint).unlink(missing_ok=True)
                r.checkpoint = None

    def best(self, k: int = 1) -> list[ModelResult]:
        """The k models of the highest test accuracy (a regression's: the lowest test RMSE) over their epochs, best
        first; ties in grid order."""
        return sorted((r for r in self.results if r.history), key=lambda r: (-r.best_score, r.index))[:k]

    def _keep(self, result: ModelResult, save: Callable[[Path], Any]) -> None:
        """The checkpoint of a model just trained, where save_all or save_best keeps it; a model that falls out of
        the best K loses its file."""
        if self.out is None or not (self.save_all or self.save_best):
            return
        kept = {r.index for r in self.best(self.save_best)} if not self.save_all else None
        if kept is None or result.index in kept:
            path = self.out / "checkpoints" / f"model-{result.index}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            save(path)
            result.checkpoint = str(path)
        self._prune()

    # --- results -------------------------------------------------------------------------------------------------

    def signature(self) -> dict[str, Any]:
        """What makes two runs the same sweep (resume takes only such a run's results), as JSON keeps it."""
        sig = {"recipe": self.base.to_dict(), "grid": [[n, list(v)] for n, v in self.grid.axes],
               "seeds": list(self.grid.seeds), "epochs": self.epochs, "steps": self.steps, "dataset": self.data.name,
               "models": [r.to_dict() for r in self.recipes]}
        return json.loads(json.dumps(sig, default=_plain))

    def epochs_per_model(self) -> int:
        """The epochs each model trains (as Trainer sets its run's length)."""
        r = replace(self.recipes[0], train_rows=len(self.data.train_labels))
        return cdiv(run_total(r, self.epochs, self.steps), r.steps_per_epoch)

    def write(self) -> None:
        """results.json (every model, every epoch) and results.csv (a row per model), atomically."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"format": RESULTS_FORMAT, "version": 1, "sweep": self.signature(),
               "models": [r.to_dict() for r in self.results]}
        write_atomic(self.out / "results.json", json.dumps(doc, indent=1, default=_plain).encode())
        names = [n for n, _ in self.grid.axes]
        text = io.StringIO()
        w = csv.writer(text, lineterminator="\n")
        regression = self.base.regression
        scores = ("best_rmse", "best_epoch", "final_train_loss", "final_rmse", "final_r2") if regression else (
            "best_accuracy", "best_epoch", "final_train_loss", "final_accuracy")
        w.writerow(["model", *names, "seed", *scores, "checkpoint"])
        for r in self.results:
            last = r.history[-1] if r.history else None
            if regression:
                cells = [f"{r.best_rmse:.6g}" if r.history else "", r.best_epoch or "",
                         f"{last.train_loss:.6f}" if last else "", f"{last.test_rmse:.6g}" if last else "",
                         f"{last.test_r2:.4f}" if last else ""]
            else:
                cells = [f"{r.best_accuracy:.4f}" if r.history else "", r.best_epoch or "",
                         f"{last.train_loss:.6f}" if last else "", f"{last.test_accuracy:.4f}" if last else ""]
            w.writerow([r.index, *[_plain(r.point[n]) for n in names], r.point["seed"], *cells, r.checkpoint or ""])
        write_atomic(self.out / "results.csv", text.getvalue().encode())

    def resume_from(self, folder: str | Path) -> int:
        """Take the finished models of an earlier run of this very sweep from its results.json (the others train
        again from the start, so the sweep ends as an uninterrupted one); returns how many. ValueError when the
        folder holds no results or another sweep's."""
        path = Path(folder) / "results.json"
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{folder} holds no results.json to resume from") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} cannot be read: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT:
            raise ValueError(f"{path} is not a rawgpu sweep's results")
        if doc.get("sweep") != self.signature():
            raise ValueError(f"{path} is another sweep's: its recipe, grid, seeds, length or data differ")
        epochs, taken = self.epochs_per_model(), 0
        for saved, result in zip(doc.get("models", []), self.results):
            if len(saved.get("epochs") or []) == epochs:
                result.history = [_stats(e, epochs) for e in saved["epochs"]]
                result.checkpoint = saved.get("checkpoint")
                taken += 1
        return taken


def _fit_share(rank: int, ranks: int, unique_id: bytes, shares: list, data: Dataset, epochs: int | None,
               steps: int | None, keep: Path | None, together: bool) -> int:
    """GPU `rank`'s models of a sweep on several, shares[rank] (a process of runtime.ranks.run_ranks), each reported
    as it finishes (train_share)."""
    from ..runtime.ranks import report

    return train_share(shares[rank], data, epochs, steps, keep, together, rank,
                       lambda index, history, path: report((index, history, path)))


def train_share(share: list[tuple[int, Recipe]], data: Dataset, epochs: int | None, steps: int | None,
                keep: Path | None, together: bool, device: int,
                done: Callable[[int, list[EpochStats], str | None], Any]) -> int:
    """One GPU's models of a sweep spread over several, (index in the whole sweep, recipe) each: trained as Sweep.fit
    trains them (together: all in one step, as many as fit at a time), each one's checkpoint written to `keep` when
    given; done(index, history, checkpoint path or None) as each finishes. Returns how many."""
    from .trainer import Trainer

    if together and share:
        sweep = Sweep([r for _, r in share], data=data, epochs=epochs, steps=steps, device=device, together=True,
                      out=keep.parent if keep is not None else None, save_all=keep is not None)
        for result, (index, _) in zip(sweep.results, share):
            result.index = index  # the checkpoints' names are the whole sweep's
        sweep.write = lambda: None  # whoever called writes the results
        sweep.fit(on_model=lambda r: done(r.index, r.history, r.checkpoint))
        return len(share)
    for index, recipe in share:
        with Trainer(recipe, data=data, epochs=epochs, steps=steps, device=device) as trainer:
            trainer.fit()
            path = None
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                path = str(trainer.save(keep / f"model-{index}.safetensors"))
            done(index, trainer.history, path)
    return len(share)


def _stats(e: dict[str, Any], epochs: int) -> EpochStats:
    """An epoch as results.json keeps it (the fields a resumed sweep shows and ranks by)."""
    nan = float("nan")
    return EpochStats(epoch=e["epoch"], epochs=epochs, steps=0, train_loss=e["train_loss"], train_accuracy=nan,
                      test_loss=e.get("test_loss", nan), test_accuracy=e["test_accuracy"], seconds=0.0,
                      eval_seconds=0.0, steps_per_s=0.0, samples_per_s=0.0, tflops=0.0, gbps=0.0, lr=nan,
                      total_seconds=0.0, test_rmse=e.get("test_rmse"), test_mae=e.get("test_mae"),
                      test_r2=e.get("test_r2"))


def _plain(value: Any) -> Any:
    """JSON and CSV cells: tuples (betas) as lists."""
    return list(value) if isinstance(value, tuple) else value

