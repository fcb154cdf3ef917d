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


def nccl_packages() -> tuple[str, ...]:
    """The CUDA stacks whose NCCL package (nvidia-nccl-cu12, -cu13) is installed here."""
    found = []
    for name in STACKS:
        try:
            metadata.distribution(f"nvidia-nccl-{name}")
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return tuple(found)


def nccl_stack_problem() -> str | None:
    """Why the NCCL installed here does not go with the CUDA stack (its bindings' major version): NCCL of the other
    stack, which `pip install ".[cu12,multi]"` (or ".[cu13,multi-cu12]") brings; one line ending in the command
    that sets it right, or None (no NCCL, no bindings, or the matching one alone). Checked before NCCL is loaded."""
    from .driver import bindings_major

    try:
        here = "cu12" if bindings_major() == 12 else "cu13"
    except ImportError:
        return None
    other = next(s for s in STACKS if s != here)
    if other not in nccl_packages():
        return None
    where = origin()
    command = (f'pip uninstall -y nvidia-nccl-{other} && pip install "{where}[{here},{MULTI[here]}]"'
               + (" in the rawgpu checkout" if where == "." else ""))
    return (f"NCCL is installed for the other CUDA stack (nvidia-nccl-{other} beside the {here} bindings); "
            f"several GPUs need the {here} one: {command}")
