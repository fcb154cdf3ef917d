"""How to add an optional extra to this installation: the one place that knows rawgpu's extras and where it was
installed from, so every hint is a command that works (rawgpu is installed from its checkout, not from an index)."""

from __future__ import annotations

import json
from importlib import metadata

STACKS = ("cu13", "cu12")  # the CUDA stacks (pyproject.toml's extras of the same names)
MULTI = {"cu13": "multi", "cu12": "multi-cu12"}  # NCCL for several GPUs, built for each stack


def stack() -> str:
    """The CUDA stack installed: cu12 or cu13, from the cuda-bindings' major version (cu13 when none is)."""
    from .driver import bindings_major

    try:
        return "cu12" if bindings_major() == 12 else "cu13"
    except ImportError:
        return "cu13"


def origin() -> str:
    """Where rawgpu was installed from: its checkout's path where pip recorded one, else "." (run from there)."""
    try:
        text = metadata.distribution("rawgpu").read_text("direct_url.json")
        url = json.loads(text)["url"] if text else ""
    except (metadata.PackageNotFoundError, KeyError, ValueError):
        url = ""
    return url[len("file://"):] if url.startswith("file://") else "."


def hint(extra: str) -> str:
    """The command that adds `extra` (plot, multi) to this installation, the CUDA stack kept as it is."""
    name = MULTI[stack()] if extra == "multi" else extra
    where = origin()
    command = f'pip install "{where}[{stack()},{name}]"'
    return command + (" in the rawgpu checkout" if where == "." else "")
