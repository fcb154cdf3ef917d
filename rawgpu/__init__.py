"""rawgpu: a minimal GPU training runtime that talks to the NVIDIA driver directly.

The Python API is `Trainer` (train, evaluate, predict, save, load) and `Recipe` (the model and optimiser), `Sweep`
(many models over a `Grid` of settings and seeds), `load_dataset` and its `Dataset`, `EpochStats` (what each epoch
reports), with `RawgpuError` and its kinds for what can go wrong (and `SettingError` for a bad argument, which names
it); nothing touches the GPU until a Trainer is made. Each is imported on first use, so `import rawgpu.model.recipe` stays
light.
"""

__version__ = "0.1.0"


def _homes() -> dict[str, str]:
    """Each public name -> the module that defines it (imported on first use)."""
    errors = ("RawgpuError", "NoDeviceError", "CudaError", "GpuHangError", "CompileError", "OutOfMemoryError",
              "GraphCaptureError", "DataError", "StepUnsupported", "Terminated")
    return {"Recipe": "model.recipe", "SettingError": "model.recipe", "Trainer": "training.trainer",
            "Evaluation": "training.trainer", "TrainingDiverged": "training.trainer", "EpochStats": "training.stats",
            "Sweep": "training.sweep", "Grid": "training.grid", "Dataset": "data.datasets",
            "load_dataset": "data.datasets", "CheckpointError": "training.checkpoint",
            **{name: "runtime.errors" for name in errors}}

__all__ = sorted(_homes()) + ["__version__"]


def __getattr__(name: str):
    homes = _homes()
    if name in homes:
        from importlib import import_module

        return getattr(import_module(f".{homes[name]}", __name__), name)
    raise AttributeError(f"module 'rawgpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, which load on first use, and the subpackages and modules already imported (tab completion,
    dir()); no private helper."""
    return sorted(set(__all__) | {name for name in globals() if not name.startswith("_")})
