"""A sweep's grid: the values each swept setting takes, times the seeds, as one Recipe per model.

What a sweep may vary is the optimiser's and the schedule's settings (SWEPT) and the seed; the architecture, the batch
and the data are one per sweep. Every model's recipe is checked as a single run's is (Recipe's own checks and the
optimiser's), and the grid itself (no empty list, no value twice) before any GPU work, each failure in one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..model.recipe import Recipe, SettingError, SettingTypeError, check_setting, optimizer_conflict, shown

# setting -> the Recipe fields it sets (betas: a pair)
MAX_MODELS = 100_000  # a sweep's models: far past what a GPU trains in a day at the smallest size, and what the
# grid's checks, the results file and the ranking handle in a second; a grid of more is refused before it is made

SWEPT: dict[str, tuple[str, ...]] = {"lr": ("lr",), "momentum": ("momentum",), "weight_decay": ("weight_decay",),
                                     "betas": ("beta1", "beta2"), "eps": ("eps",), "warmup": ("warmup_steps",),
                                     "schedule": ("schedule",)}


@dataclass(frozen=True)
class Grid:
    """axes: (setting, its values) in the order given, each setting of SWEPT at most once; seeds: one model per seed
    at every point. Model i is the i-th of every combination, the first setting varying slowest and the seed
    fastest."""

    axes: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        axes = self.axes
        if isinstance(axes, Mapping):  # {"lr": [0.1, 0.2]}: the same axes, in the dict's order
            axes = tuple(axes.items())
        if not _is_list(axes) or not all(_is_list(axis) and len(axis) == 2 and isinstance(axis[0], str)
                                         for axis in axes):
            raise SettingTypeError("axes", "must be (setting, values) pairs, e.g. ((\"lr\", (0.01, 0.1)),) or "
                                           f"{{\"lr\": [0.01, 0.1]}}, got {shown(self.axes)}")
        for name, values in axes:
            if not _is_list(values):
                raise SettingTypeError("axes", f"{name}'s values must be a list, got {shown(values)}")
        if not _is_list(self.seeds):
            raise SettingTypeError("seeds", f"must be a list of integers >= 0, e.g. range(8), got {shown(self.seeds)}")
        object.__setattr__(self, "axes", tuple((name, tuple(values)) for name, values in axes))  # frozen: set here
        object.__setattr__(self, "seeds", tuple(self.seeds))
        names = [name for name, _ in self.axes]
        for name, values in self.axes:
            if name not in SWEPT:
                raise ValueError(f"{name} cannot be swept: a sweep varies {', '.join(SWEPT)} and the seed")
            if names.count(name) > 1:
                raise ValueError(f"{name} is swept twice: give all its values in one list")
            _check_values(name, values)
        if self.models > MAX_MODELS:
            raise ValueError(f"{self.describe()} is {self.models:,} models; a sweep trains at most {MAX_MODELS:,}")
        _check_values("seeds", self.seeds)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be integers >= 0, got {list(self.seeds)}")

    @property
    def models(self) -> int:
        n = len(self.seeds)
        for _, values in self.axes:
            n *= len(values)
        return n

    def points(self) -> list[dict[str, Any]]:
        """Every model's swept settings and its seed, in model order."""
        names = [name for name, _ in self.axes] + ["seed"]
        return [dict(zip(names, combo)) for combo in itertools.product(*[v for _, v in self.axes], self.seeds)]

    def recipes(self, base: Recipe) -> list[Recipe]:
        """One recipe per model: `base` with the model's settings and seed. ValueError naming the model and its
        settings where one of them does not go with the others."""
        out = []
        for i, point in enumerate(self.points()):
            given = {name: value for name, value in point.items() if name in SWEPT}
            if (error := optimizer_conflict(base.optimizer, given)) is not None:
                raise SettingError(error.name, f"{error.cli_reason} (swept)")
            changes: dict[str, Any] = {"seed": point["seed"]}
            for name, value in given.items():
                changes.update(zip(SWEPT[name], value if name == "betas" else (value,)))
            try:
                out.append(replace(base, **changes))
            except ValueError as exc:
                raise ValueError(f"model {i} ({describe_point(point)}): {exc}") from None
        return out

    def describe(self) -> str:
        """`4 lr x 8 seeds`: each axis by its size, the seeds last."""
        parts = [f"{len(values)} {name}" for name, values in self.axes]
        return " x ".join(parts + [f"{len(self.seeds)} seed{'s' if len(self.seeds) > 1 else ''}"])

    def size_line(self, base: Recipe) -> str:
        """What the sweep trains, said before any GPU work: `32 models: 4 lr x 8 seeds, 784-256-256-256-10, ...`."""
        return (f"{self.models} model{'s' if self.models > 1 else ''}: {self.describe()}, "
                f"{'-'.join(map(str, base.widths))}, batch {base.batch}, {base.optimizer_text}")


def describe_point(point: dict[str, Any]) -> str:
    """A model's settings as a results table names them: `lr 0.05, seed 3`."""
    return ", ".join(f"{name} {value[0]:g}/{value[1]:g}" if name == "betas" else
                     f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                     for name, value in point.items())


def parse_seeds(texts: list[str]) -> tuple[int, ...]:
    """`--seeds 0-7` or `--seeds 0 3 9` (or both: `0-3 8`): the seeds in the order given, each once."""
    seeds: list[int] = []
    for text in texts:
        first, dash, last = text.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"seeds are integers or ranges such as 0-7, got {text!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"a seed range runs from a seed >= 0 up to a later one, got {text!r}")
        if len(seeds) + hi - lo + 1 > MAX_MODELS:  # counted before the range is made
            raise ValueError(f"{text!r} makes more than {MAX_MODELS:,} seeds; a sweep trains at most {MAX_MODELS:,} "
                             "models")
        seeds += range(lo, hi + 1)
    _check_values("seeds", seeds)
    return tuple(seeds)


def _check_values(name: str, values) -> None:
    if len(values) == 0:
        raise ValueError(f"{name}: the grid needs at least one value")
    seen = set()
    for v in values:
        key = tuple(v) if isinstance(v, (list, tuple)) else v
        if key in seen:
            raise ValueError(f"{name}: {v} is given twice")
        seen.add(key)


def _is_list(value: Any) -> bool:
    """A list of values as a grid takes them: any iterable of known length but a string or a mapping."""
    return isinstance(value, Iterable) and hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))


def check_sweep(models: Any, base: Any = None, *, data: Any = "mnist", epochs: Any = None, steps: Any = None,
                device: Any = 0, out: Any = None, save_best: Any = 0, save_all: Any = False, together: Any = None,
                chunk: Any = None) -> None:
    """Sweep's arguments, before anything is loaded or built: SettingError (a ValueError; SettingTypeError, also a
    TypeError, for the wrong type) naming the parameter in one line. The run's settings by the rules a single run
    takes (recipe.check_setting), the data by data.check_data_argument."""
    from ..data.datasets import check_data_argument

    if not isinstance(models, Grid) and not (_is_list(models) and all(isinstance(r, Recipe) for r in models)):
        bad = next((r for r in models if not isinstance(r, Recipe)), models) if _is_list(models) else models
        raise SettingTypeError("models", f"must be a Grid or a list of Recipes, got {shown(bad)}")
    if base is not None and not isinstance(base, Recipe):
        raise SettingTypeError("base", f"must be a Recipe or None, got {shown(base)}")
    check_data_argument(data, arrays_ok=True)
    for name, value in (("epochs", epochs), ("steps", steps), ("device", device)):
        check_setting(name, value, none_ok=name != "device")
    if out is not None and not isinstance(out, (str, Path)):
        raise SettingTypeError("out", f"must be a folder's path or None, got {shown(out)}")
    if not isinstance(save_best, int) or isinstance(save_best, bool) or save_best < 0:
        raise SettingError("save_best", f"must be an integer >= 0 (the checkpoints kept), got {shown(save_best)}")
    for name, value, none_ok in (("save_all", save_all, False), ("together", together, True)):
        if not (isinstance(value, bool) or (value is None and none_ok)):
            raise SettingTypeError(name, f"must be True or False{' or None' if none_ok else ''}, got {shown(value)}")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise SettingError("chunk", f"must be >= 1 models, got {shown(chunk)}")
