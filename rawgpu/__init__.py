"""rawgpu: a minimal GPU training runtime that talks to the NVIDIA driver directly.

The Python API is `Trainer` (train, evaluate, predict, save, load) and `Recipe` (the model and optimiser); nothing
touches the GPU until a Trainer is made. Both are imported on first use, so `import rawgpu.recipe` stays light.
"""

__version__ = "0.1.0"

__all__ = ["Evaluation", "Recipe", "Trainer", "TrainingDiverged", "__version__"]
_HOMES = {"Recipe": "recipe", "Trainer": "trainer", "Evaluation": "trainer", "TrainingDiverged": "trainer"}


def __getattr__(name: str):
    if name in _HOMES:
        from importlib import import_module

        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'rawgpu' has no attribute {name!r}")
