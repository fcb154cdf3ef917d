"""rawgpu: a minimal GPU training runtime that talks to the NVIDIA driver directly.

The Python API is `Trainer` (train, evaluate, predict, save, load) and `Recipe` (the model and optimiser), `Sweep`
(many models over a `Grid` of settings and seeds), with `RawgpuError` and its kinds for what can go wrong; nothing touches the GPU until a Trainer is made. Each is imported
on first use, so `import rawgpu.recipe` stays light.
"""

__version__ = "0.1.0"

_ERRORS = ("RawgpuError", "NoDeviceError", "CudaError", "GpuHangError", "CompileError", "OutOfMemoryError",
           "GraphCaptureError", "DataError", "StepUnsupported")
_HOMES = {"Recipe": "recipe", "Trainer": "trainer", "Evaluation": "trainer", "TrainingDiverged": "trainer",
          "Sweep": "sweeper", "Grid": "grid",
          "CheckpointError": "checkpoint", **{name: "errors" for name in _ERRORS}}
__all__ = sorted(_HOMES) + ["__version__"]


def __getattr__(name: str):
    if name in _HOMES:
        from importlib import import_module

        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'rawgpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, which load on first use, beside what is already here (tab completion, dir())."""
    return sorted(set(globals()) | set(__all__))
