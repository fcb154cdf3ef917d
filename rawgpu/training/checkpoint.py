"""Checkpoints: a trained model and everything needed to continue its run, in one safetensors file.

Why safetensors: PyTorch, JAX and numpy users load it with the standard loaders, and it holds no code (unlike a
pickle). The file has, per linear layer i:

- ``layers.{i}.weight`` float32 [fan_out, fan_in] and ``layers.{i}.bias`` float32 [fan_out]: the fp32 master
  weights in torch.nn.Linear's layout, so ``nn.Linear.load_state_dict`` takes them as they are;
- ``state.layers.{i}.w16`` float16 and ``state.layers.{i}.wlo`` int16 [fan_in, fan_out]: the master's two halves as
  the GPU holds them (master.py), because weights below 2^-16 do not survive fp32 -> halves exactly and a resumed
  run must continue bit for bit;
- the optimiser state as the GPU holds it, float32, torch.optim's names (optimizer.state_names):
  ``state.layers.{i}.momentum_weight`` / ``momentum_bias`` with SGD's momentum (times the loss scale), and
  ``exp_avg_*`` / ``exp_avg_sq_*`` with Adam's moments (times the loss scale, and its square).

A model that standardizes its features also has ``scaling.mean`` and ``scaling.inv_std`` float32 [inputs]: the
training split's, which evaluate and predict apply as training did. A regression has ``scaling.target_mean``
float32 [outputs] and ``scaling.target_scale`` float32 [1]: it trains on (y - mean) / scale, and its predictions are
given back in the targets' units.

The metadata (strings, as the format requires) holds JSON: the recipe (its task: the loss; its features' dtype and
scaling), the step kind, the dataset's name, image shape and a table's columns, and the run's progress (steps done,
the epoch's metrics so far, the per-epoch history).
Files are written atomically: a temp file in the same directory, flushed to disk, then renamed over the target.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime import files
from ..runtime.errors import RawgpuError
from ..model.optimizer import state_names
from ..model.recipe import Recipe

FORMAT = "rawgpu-mlp"
FORMAT_VERSION = 1


class CheckpointError(RawgpuError):
    """A checkpoint is missing, unreadable, corrupt, of another format, or does not fit what it is loaded into."""


@dataclass
class Checkpoint:
    """What a checkpoint holds. weights: per layer (W [fan_in, fan_out], b), the x @ W orientation rawgpu computes
    in. state: the exact device state for resuming (names as in the module docstring, without the "state." prefix).
    progress: steps_done, epoch metrics so far, history (see trainer.py)."""

    recipe: Recipe
    step_kind: str
    dataset: dict[str, Any]
    weights: list[tuple[np.ndarray, np.ndarray]]
    state: dict[str, np.ndarray] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # where it was loaded from, for messages
    scaling: tuple[np.ndarray, np.ndarray] | None = None  # the standardization's (mean, inv_std), where it has one
    target_scaling: tuple[np.ndarray, float] | None = None  # a regression's (target mean [outputs], scale)

    @property
    def steps_done(self) -> int:
        return int(self.progress.get("steps_done", 0))


def tensors(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """The named arrays of a checkpoint as the file stores them."""
    out: dict[str, np.ndarray] = {}
    for i, (w, b) in enumerate(ckpt.weights):
        out[f"layers.{i}.weight"] = np.ascontiguousarray(w.T, dtype=np.float32)
        out[f"layers.{i}.bias"] = np.ascontiguousarray(b, dtype=np.float32)
    for name, value in ckpt.state.items():
        out[f"state.{name}"] = np.ascontiguousarray(value)
    if ckpt.scaling is not None:
        out["scaling.mean"], out["scaling.inv_std"] = (np.ascontiguousarray(a, dtype=np.float32) for a in ckpt.scaling)
    if ckpt.target_scaling is not None:
        mean, scale = ckpt.target_scaling
        out["scaling.target_mean"] = np.ascontiguousarray(mean, dtype=np.float32)
        out["scaling.target_scale"] = np.array([scale], np.float32)
    return out


def save(path: str | Path, ckpt: Checkpoint) -> Path:
    """Write `ckpt` to `path` atomically (a crash leaves the old file or none, never half a file)."""
    from safetensors.numpy import save as encode

    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "recipe": json.dumps(ckpt.recipe.to_dict()),
                "step_kind": ckpt.step_kind, "dataset": json.dumps(ckpt.dataset), "progress": json.dumps(ckpt.progress)}
    blob = encode(tensors(ckpt), metadata=metadata)
    return write_atomic(path, blob)


def write_atomic(path: str | Path, blob: bytes) -> Path:
    """files.write_atomic, with a file system's failure as a one-line CheckpointError."""
    try:
        return files.write_atomic(path, blob)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the checkpoint ({e.strerror or e})") from None


def check_writable(path: str | Path) -> str | None:
    """Why a checkpoint cannot be written to `path` (checked before any GPU work), or None."""
    target = Path(path).expanduser()
    if target.is_dir():
        return f"{path} is a directory"
    if not target.parent.is_dir():
        return f"no directory {target.parent}"
    return files.cannot_create_in(target.parent)


def load(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint; CheckpointError (one line naming the file) on anything wrong."""
    from safetensors import safe_open

    where = Path(path).expanduser()
    if where.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file")
    if not where.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(str(where), framework="np") as f:
            meta = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - the library raises its own and OS errors; all mean "not readable"
        raise CheckpointError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a rawgpu checkpoint (metadata format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('format_version')!r}; this rawgpu "
                              f"reads version {FORMAT_VERSION}")
    try:
        recipe = Recipe.from_dict(json.loads(meta["recipe"]))
        dataset, progress = json.loads(meta["dataset"]), json.loads(meta["progress"])
        step_kind = meta["step_kind"]
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({' '.join(str(e).split())})") from None
    if why := _dataset_problem(dataset, recipe) or _progress_problem(progress, recipe):
        raise CheckpointError(f"{path}: corrupt checkpoint metadata: {why}")
    weights, state = [], {}
    widths = recipe.widths
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        w = _take(arrays, f"layers.{i}.weight", np.float32, (fan_out, fan_in), path)
        b = _take(arrays, f"layers.{i}.bias", np.float32, (fan_out,), path)
        weights.append((np.ascontiguousarray(w.T), b))
        for name, dtype in (("w16", np.float16), ("wlo", np.int16)):
            state[f"layers.{i}.{name}"] = _take(arrays, f"state.layers.{i}.{name}", dtype, (fan_in, fan_out), path)
        for name in state_names(recipe):
            state[f"layers.{i}.{name}_weight"] = _take(arrays, f"state.layers.{i}.{name}_weight", np.float32,
                                                        (fan_in, fan_out), path)
            state[f"layers.{i}.{name}_bias"] = _take(arrays, f"state.layers.{i}.{name}_bias", np.float32,
                                                      (fan_out,), path)
    scaling = None
    if recipe.standardize:
        scaling = tuple(_take(arrays, f"scaling.{name}", np.float32, (recipe.inputs,), path)
                        for name in ("mean", "inv_std"))
        if not all(np.isfinite(a).all() for a in scaling):
            raise CheckpointError(f"{path}: the feature scaling holds NaN or infinite values")
    target_scaling = None
    if recipe.regression:
        mean = _take(arrays, "scaling.target_mean", np.float32, (recipe.classes,), path)
        scale = _take(arrays, "scaling.target_scale", np.float32, (1,), path)
        if not (np.isfinite(mean).all() and np.isfinite(scale).all() and scale[0] > 0):
            raise CheckpointError(f"{path}: the target scaling holds NaN, infinite or non-positive values")
        target_scaling = (mean.astype(np.float64), float(scale[0]))
    if arrays:
        raise CheckpointError(f"{path}: unexpected tensors {', '.join(sorted(arrays)[:3])} for a {recipe.name} model")
    for i, (w, b) in enumerate(weights):
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise CheckpointError(f"{path}: layer {i} holds NaN or infinite weights")
    return Checkpoint(recipe, step_kind, dataset, weights, state, progress, str(path), scaling, target_scaling)


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dataset_problem(dataset: Any, recipe: Recipe) -> str | None:
    """Why the `dataset` metadata cannot be this model's (one line naming the field), or None: an object whose name
    is a string (or null) and whose image_shape, where given, is [rows, cols] of the first layer's width."""
    if not isinstance(dataset, dict):
        return f"dataset is {_json_kind(dataset)}, not an object"
    if not isinstance(dataset.get("name"), (str, type(None))):
        return f"dataset name is {_json_kind(dataset['name'])}, not a string"
    shape = dataset.get("image_shape")
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_count(n) and n > 0 for n in shape)):
        return f"dataset image_shape is {json.dumps(shape)}, not [rows, cols]"
    if shape[0] * shape[1] != recipe.inputs:
        return (f"dataset image_shape {shape[0]}x{shape[1]} is {shape[0] * shape[1]} pixels, but the first layer "
                f"takes {recipe.inputs}")
    return None


def _progress_problem(progress: Any, recipe: Recipe) -> str | None:
    """Why the `progress` metadata cannot continue this run (one line naming the field), or None: an object with
    steps_done and epoch_correct counts, numbers for the epoch's loss sum and the training time, and a history of
    epochs as trainer.EpochStats records them."""
    if not isinstance(progress, dict):
        return f"progress is {_json_kind(progress)}, not an object"
    steps = progress.get("steps_done", 0)
    if not _is_count(steps):
        return f"progress steps_done is {json.dumps(steps)}, not a step count"
    if recipe.total_steps and steps > recipe.total_steps:
        return f"progress steps_done {steps} is past the run's {recipe.total_steps} steps"
    if not _is_count(progress.get("epoch_correct", 0)):
        return f"progress epoch_correct is {json.dumps(progress['epoch_correct'])}, not a count"
    for name in ("epoch_loss_sum", "train_seconds"):
        if not _is_number(progress.get(name, 0.0)):
            return f"progress {name} is {json.dumps(progress[name])}, not a number"
    history = progress.get("history", [])
    if not isinstance(history, list):
        return f"progress history is {_json_kind(history)}, not an array"
    from .stats import EpochStats  # what the trainer records per epoch

    names = {f.name for f in fields(EpochStats)}
    required = {f.name for f in fields(EpochStats) if f.default is MISSING}  # the rest: a regression's, or null
    for i, epoch in enumerate(history):
        if (not isinstance(epoch, dict) or not required <= set(epoch) <= names
                or not all(_is_number(v) or (v is None and k not in required) for k, v in epoch.items())):
            return f"progress history entry {i} is not an epoch's record ({', '.join(sorted(required))}: numbers)"
    errors = progress.get("epoch_errors", [0.0, 0.0])
    if not (isinstance(errors, list) and len(errors) == 2 and all(map(_is_number, errors))):
        return f"progress epoch_errors is {json.dumps(errors)}, not two numbers"
    return None


def _take(arrays: dict[str, np.ndarray], name: str, dtype, shape: tuple[int, ...], path) -> np.ndarray:
    if name not in arrays:
        raise CheckpointError(f"{path}: missing tensor {name}")
    a = arrays.pop(name)
    if a.dtype != dtype or a.shape != shape:
        raise CheckpointError(f"{path}: tensor {name} is {a.dtype}{list(a.shape)}, expected "
                              f"{np.dtype(dtype)}{list(shape)}")
    return a
