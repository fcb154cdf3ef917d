"""Launcher for cu/fused_step.cu: the whole training step (or several) in one persistent, cooperative kernel.

The kernel's sizes and its FsParams table are declared once in contract/fused.py (named here as the launcher uses
them); `fused_steps` binds the launch. When the step runs and what goes into its table: steps/fused.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import contract
from ..contract.shapes import cdiv

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from . import Kernels
    from ..runtime.memory import Tensor

SOURCE = "fused_step.cu"
KERNEL = contract.fused_kernel_name(adam=False)  # SGD's update; kernel_name(True): Adam's
kernel_name = contract.fused_kernel_name
THREADS = contract.FS_THREADS
MAX_LINEAR_LAYERS = contract.FS_MAX_LAYERS  # --layers 64 plus the head
TILE = contract.FS_T
stages = contract.fs_stages
smem_bytes = contract.fs_smem_bytes


def phase_tasks(batch: int, widths_padded: list[int]) -> list[tuple[str, int, int]]:
    """(phase, CTA tasks, warp tasks) for every phase of a step, as the kernel splits it (for tests and docs)."""
    cd = cdiv
    mt, w = cd(batch, TILE), widths_padded
    n = len(w) - 1  # linear layers
    out = [(f"forward {i}", mt * cd(w[i + 1], TILE), 0) for i in range(n - 1)]
    out += [("head", mt, 0), ("below head", 0, mt * cd(w[n - 1], TILE) + cd(w[n - 1], TILE) + 2)]
    for i in range(n - 2, -1, -1):
        out.append((f"backward {i}", mt * cd(w[i], TILE) if i else 0, cd(w[i], TILE) * cd(w[i + 1], TILE)
                    + cd(w[i + 1], TILE)))
    return out


def table_words(layers: int) -> int:
    """8-byte words of an FsParams table for `layers` linear layers (the kernel reads no layer past those)."""
    return len(contract.table_bytes(contract.FsParams(), layers)) // 8


def fused_steps(k: Kernels, table: "Tensor", n_steps: int, grid: int, adam: bool = False) -> "Launch":
    """n_steps training steps in one cooperative launch of `grid` blocks (all resident: checked by the driver), with
    Adam's update (adam) or SGD's."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    kernel = k.get(SOURCE, kernel_name(adam))
    return kernel.bind(grid, THREADS, smem_bytes(k.arch), table, n_steps, cooperative=True)


def resident_grid(k: Kernels, sm_count: int, requested: int | None = None, adam: bool = False) -> int:
    """The grid the fused step runs on: `requested` blocks or one per SM, checked to be resident all at once (the
    grid barriers need it; a cooperative launch of more would be refused by the driver)."""
    from ..runtime.errors import RawgpuError

    per_sm = k.get(SOURCE, kernel_name(adam)).max_blocks_per_sm(THREADS, smem_bytes(k.arch))
    if per_sm < 1:
        raise RawgpuError(f"the fused step kernel does not fit on one SM of this GPU ({smem_bytes(k.arch)} B of "
                          f"shared memory, {THREADS} threads); use --step layered")
    grid = requested or sm_count
    if not 1 <= grid <= per_sm * sm_count:
        raise RawgpuError(f"fused step grid of {grid} blocks: this GPU holds 1..{per_sm * sm_count} at once")
    return grid
