"""Launcher for cu/fused_step.cu: the whole training step (or several) in one persistent, cooperative kernel.

`supported` says when the fused step applies (plain Python, tested on CPU); `param_table` packs the FsParams
table the kernel reads (every field 8 bytes, in the order of the C struct); `fused_steps` binds the launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import Kernels

if TYPE_CHECKING:
    from ..driver import Launch
    from ..memory import Tensor

SOURCE = "fused_step.cu"
KERNEL = "fused_steps"
SIGNATURE = "pi"
THREADS = 256  # FS_THREADS
MAX_LINEAR_LAYERS = 65  # FS_MAX_LAYERS: --layers 64 plus the head
TILE, TILE_LD, PANEL_LD = 32, 40, 808  # FS_T, FS_LD, FS_PANEL_LD
HEADER_FIELDS = 21  # FsParams before layer[]: 9 pointers, 8 int64, 4 doubles
LAYER_FIELDS = 12  # FsLayer: wlo, w16[2], b, mw, mb, x, y, dy, dx, in_p, out_p
# Largest padded hidden width the fused step takes by default: above it the per-layer GEMMs stream the weights
# better than 32x32 blocks do (measured: docs/perf.md).
MAX_HIDDEN = 512
SCHEDULE_KINDS = {"constant": 0, "cosine": 1, "linear": 2}


def stages(arch: str) -> int:
    """FS_STAGES: sm_86/87/89 give a block 99 KB of shared memory, so their warp pipelines are 2 deep."""
    return 2 if arch in ("sm_86", "sm_87", "sm_89") else 4


def smem_bytes(arch: str) -> int:
    """FS_SMEM_BYTES: the larger of 8 warp pipelines (A + B tiles) and the layer-0 panel + B-only pipelines."""
    tile_bytes = TILE * TILE_LD * 2
    staging = 8 * stages(arch) * 2 * tile_bytes
    layer0 = TILE * PANEL_LD * 2 + 8 * stages(arch) * tile_bytes
    return max(staging, layer0)


def unsupported_reason(recipe) -> str | None:
    """Why the fused step cannot run this recipe; None when it can."""
    if recipe.accum != "fp32":
        return "the fused step accumulates in fp32 only"
    if recipe.layers + 1 > MAX_LINEAR_LAYERS:
        return f"the fused step takes at most {MAX_LINEAR_LAYERS - 1} hidden layers"
    return None


def preferred(recipe, padded_hidden: int) -> bool:
    """Whether `auto` picks the fused step: it can run the recipe and the width is at most MAX_HIDDEN."""
    return unsupported_reason(recipe) is None and padded_hidden <= MAX_HIDDEN


def phase_tasks(batch: int, widths_padded: list[int]) -> list[tuple[str, int, int]]:
    """(phase, CTA tasks, warp tasks) for every phase of a step, as the kernel splits it (for tests and docs)."""
    def cd(a: int, b: int) -> int:
        return -(-a // b)

    mt, w = cd(batch, TILE), widths_padded
    n = len(w) - 1  # linear layers
    out = [(f"forward {i}", mt * cd(w[i + 1], TILE), 0) for i in range(n - 1)]
    out += [("head", mt, 0), ("below head", 0, mt * cd(w[n - 1], TILE) + cd(w[n - 1], TILE) + 2)]
    for i in range(n - 2, -1, -1):
        out.append((f"backward {i}", mt * cd(w[i], TILE) if i else 0, cd(w[i], TILE) * cd(w[i + 1], TILE)
                    + cd(w[i + 1], TILE)))
    return out


def param_table(model, profile: int = 0) -> np.ndarray:
    """The FsParams bytes for an allocated MLP (pointers are device addresses), as uint64 words. profile: a device
    buffer for per-phase timestamps (a kernel built with -DFS_PROFILE writes it), or 0."""
    r = model.recipe
    from ..mlp import CLASSES, loss_scale

    scale = loss_scale(r.batch)
    f32 = np.float32
    doubles = [float(f32(r.lr / scale)), float(f32(r.lr_min / scale)), float(f32(r.momentum)),
               float(f32(scale / r.batch))]
    words = [model.images.ptr, model.labels.ptr, model.perm.ptr, model.step.ptr, model.loss_sum.ptr,
             model.correct.ptr, model.row_loss.ptr, model.row_hit.ptr, model.barrier.ptr,
             r.batch, r.steps_per_epoch, len(model.layers), SCHEDULE_KINDS[r.schedule], r.total_steps,
             r.warmup_steps, CLASSES, profile]
    words += [int(np.float64(d).view(np.uint64)) for d in doubles]
    assert len(words) == HEADER_FIELDS
    for i, lay in enumerate(model.layers):
        dx = model.grads[i].ptr if i else 0
        y = model.acts[i + 1].ptr if i + 1 < len(model.layers) else 0
        words += [lay.wlo.ptr, lay.w16.ptr, lay.w16_next.ptr, lay.b.ptr, lay.mw.ptr if lay.mw else 0,
                  lay.mb.ptr if lay.mb else 0, model.acts[i].ptr, y, model.grads[i + 1].ptr, dx,
                  lay.wlo.shape[0], lay.wlo.shape[1]]
    return np.array([w & (2**64 - 1) for w in words], dtype=np.uint64)


def table_words(layers: int) -> int:
    return HEADER_FIELDS + LAYER_FIELDS * layers


def fused_steps(k: Kernels, table: "Tensor", n_steps: int, grid: int) -> "Launch":
    """n_steps training steps in one cooperative launch of `grid` blocks (all resident: checked by the driver)."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    kernel = k.get(SOURCE, KERNEL, SIGNATURE)
    return kernel.bind(grid, THREADS, smem_bytes(k.arch), table, n_steps, cooperative=True)


def resident_grid(k: Kernels, sm_count: int, requested: int | None = None) -> int:
    """The grid the fused step runs on: `requested` blocks or one per SM, checked to be resident all at once (the
    grid barriers need it; a cooperative launch of more would be refused by the driver)."""
    from ..errors import RawgpuError

    per_sm = k.get(SOURCE, KERNEL, SIGNATURE).max_blocks_per_sm(THREADS, smem_bytes(k.arch))
    if per_sm < 1:
        raise RawgpuError(f"the fused step kernel does not fit on one SM of this GPU ({smem_bytes(k.arch)} B of "
                          f"shared memory, {THREADS} threads); use --kernels layered")
    grid = requested or sm_count
    if not 1 <= grid <= per_sm * sm_count:
        raise RawgpuError(f"fused step grid of {grid} blocks: this GPU holds 1..{per_sm * sm_count} at once")
    return grid
