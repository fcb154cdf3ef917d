"""Launchers for cu/gather.cu (batch gather with the step's optimiser values, of images or of a table of your own;
step counter) and `lr_at`, the schedule's host twin.

Everything reads the device step counter, so a captured training step replays unchanged every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..contract import (COLUMNS_MAX, COLUMNS_THREADS, COLUMNS_TILE_ROWS, GATHER_MAX_THREADS, OPTIM_WORDS,
                        column_kernel, columns_kernel, gather_table_kernel)
from ..contract.optim import SCHEDULES  # the schedule codes gather_batch takes
from ..runtime.driver import Launch
from ..runtime.memory import Tensor
from . import Kernels, require

SRC = "gather.cu"
MAX_THREADS = GATHER_MAX_THREADS  # gather_batch: a block per row, a thread per 16 columns up to this many


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule as the device evaluates it each step (`lr_at` says how)."""

    lr0: float
    lr_min: float
    total_steps: int
    warmup_steps: int
    kind: int | str

    def args(self) -> tuple:
        """(lr0, lr_min, total_steps, warmup_steps, kind code), checked."""
        if self.total_steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"total_steps ({self.total_steps}) and warmup_steps ({self.warmup_steps}) must be >= 0")
        return self.lr0, self.lr_min, self.total_steps, self.warmup_steps, _kind(self.kind)


def gather_batch(k: Kernels, images: Tensor, labels: Tensor, perm: Tensor, step: Tensor, x_out: Tensor,
                 y_out: Tensor, batch: int, steps_per_epoch: int, optim: Tensor | None = None,
                 schedule: Schedule | None = None, early: bool = False, blocks: int | None = None) -> Launch:
    """x_out[i] = images[perm[p + i]] / 255 (fp16, padding columns zeroed), y_out[i] = its label,
    p = (step % steps_per_epoch) * batch. images uint8 [N, row_bytes], x_out fp16 [>= batch, ld_out].
    With optim and schedule (both or neither): also the step's values of the optimiser table `optim` (contract.Optim
    as OPTIM_WORDS float32; its first, lr, = lr_at(step, schedule)).
    early: read the counter, permutation and pixels before waiting for the kernel before (pdl.cuh); only when the
    counter was moved at least two launches back, as in the layered step whose head kernel moves it.
    blocks: how many blocks share the rows (default a block per row)."""
    require(images, np.uint8, what="images")
    if len(images.shape) != 2:
        raise ValueError(f"images: expected [N, row_bytes], got shape {images.shape}")
    n, row_bytes = images.shape
    require(labels, np.uint8, (n,), what="labels")
    require(y_out, np.int32, what="y_out")
    ld_out = _check_order_and_batch(perm, step, x_out, batch, steps_per_epoch, row_bytes)
    if len(y_out.shape) != 1 or y_out.shape[0] < batch:
        raise ValueError(f"y_out: expected [>= {batch}], got shape {y_out.shape}")
    if (optim is None) != (schedule is None):
        raise ValueError("gather_batch: give optim and schedule together, or neither")
    if optim is not None:
        require(optim, np.float32, (OPTIM_WORDS,), what="optim")
    sched = schedule.args() if schedule is not None else (0.0, 0.0, 0, 0, 0)
    threads = min(MAX_THREADS, -(-ld_out // (16 * 32)) * 32)  # a thread per 16 columns, whole warps
    if blocks is not None and not 1 <= blocks <= batch:
        raise ValueError(f"gather_batch: blocks must be in 1..{batch}, got {blocks}")
    return k.get(SRC, "gather_batch").bind(
        blocks or batch, threads, 0, images, labels, perm, step, batch, steps_per_epoch, row_bytes, ld_out, x_out,
        y_out, optim if optim is not None else 0, *sched, int(early))


def _check_order_and_batch(perm: Tensor, step: Tensor, x_out: Tensor, batch: int, steps_per_epoch: int,
                           width: int) -> int:
    """What both gathers read and write beside the data: the epoch's order, the counter and the fp16 batch of rows
    `width` wide. Its row stride (ld_out)."""
    require(perm, np.int32, what="perm")
    require(step, np.int64, (1,), what="step")
    require(x_out, np.float16, what="x_out")
    if batch < 1 or steps_per_epoch < 1:
        raise ValueError(f"batch ({batch}) and steps_per_epoch ({steps_per_epoch}) must be >= 1")
    if len(perm.shape) != 1 or perm.shape[0] < batch * steps_per_epoch:
        raise ValueError(f"perm: needs {batch * steps_per_epoch} entries (batch x steps_per_epoch), got shape {perm.shape}")
    if len(x_out.shape) != 2 or x_out.shape[0] < batch:
        raise ValueError(f"x_out: expected [>= {batch}, ld], got shape {x_out.shape}")
    ld_out = x_out.shape[1]
    if ld_out < width or ld_out % 8:
        raise ValueError(f"x_out: row stride {ld_out} must be >= {width} and a multiple of 8")
    if x_out.offset % 16:
        raise ValueError(f"x_out: must start 16-byte aligned for vector stores (offset {x_out.offset})")
    return ld_out


TABLE_DTYPES = {np.dtype(np.uint8): "u8", np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}  # contract's names
TABLE_THREADS = 1024  # gather_table: a thread per 8 columns, looping past 8192


def gather_table(k: Kernels, x: Tensor, targets: Tensor, perm: Tensor, step: Tensor, x_out: Tensor, y_out: Tensor,
                 batch: int, steps_per_epoch: int, mean: Tensor | None = None, inv_std: Tensor | None = None,
                 optim: Tensor | None = None, schedule: Schedule | None = None, early: bool = False,
                 blocks: int | None = None) -> Launch:
    """gather_batch for a table of your own: x_out[i] = row perm[p + i] of x (uint8 / 255 as pixels, float16 or
    float32 [N, F]; with mean and inv_std, float32 [F] each, (v - mean) * inv_std per column) as fp16, zero past F;
    y_out[i] its target: a class label (targets int32 [N] -> y_out int32 [>= batch]) or K values (targets float32
    [N, K] -> y_out float32 [>= batch, K]). optim, schedule, early, blocks: as gather_batch."""
    kind, values, outputs, ld_out, sched = table_arguments("gather_table", x, targets, perm, step, x_out, y_out, batch,
                                                           steps_per_epoch, mean, inv_std, optim, schedule)
    if blocks is not None and not 1 <= blocks <= batch:
        raise ValueError(f"gather_table: blocks must be in 1..{batch}, got {blocks}")
    threads = min(TABLE_THREADS, -(-ld_out // (8 * 32)) * 32)  # a thread per 8 columns, whole warps
    name = gather_table_kernel(kind, "values" if values else "labels", mean is not None)
    return k.get(SRC, name).bind(
        blocks or batch, threads, 0, x, targets, outputs, perm, step, batch, steps_per_epoch, x.shape[1], ld_out,
        mean if mean is not None else 0, inv_std if inv_std is not None else 0, x_out, y_out,
        optim if optim is not None else 0, *sched, int(early))


def table_arguments(name: str, x: Tensor, targets: Tensor, perm: Tensor, step: Tensor, x_out: Tensor, y_out: Tensor,
                    batch: int, steps_per_epoch: int, mean: Tensor | None, inv_std: Tensor | None,
                    optim: Tensor | None, schedule: Schedule | None) -> tuple[str, bool, int, int, tuple]:
    """What the table gathers (gather_table, gather_forward.py's) read and write, checked: (the features' dtype as
    the contract names it, whether the targets are values, how many per row, x_out's row stride, the schedule's
    arguments)."""
    kind = TABLE_DTYPES.get(x.dtype)
    if kind is None:
        raise TypeError(f"x: expected uint8, float16 or float32 features, got {x.dtype}")
    if len(x.shape) != 2:
        raise ValueError(f"x: expected [N, features], got shape {x.shape}")
    n, features = x.shape
    if targets.dtype == np.int32:
        require(targets, np.int32, (n,), what="targets (class labels)")
        require(y_out, np.int32, what="y_out")
        values, outputs = False, 1
        if len(y_out.shape) != 1 or y_out.shape[0] < batch:
            raise ValueError(f"y_out: expected [>= {batch}], got shape {y_out.shape}")
    else:
        require(targets, np.float32, what="targets (values)")
        if len(targets.shape) != 2 or targets.shape[0] != n:
            raise ValueError(f"targets: expected [{n}, outputs] values, got shape {targets.shape}")
        values, outputs = True, targets.shape[1]
        require(y_out, np.float32, what="y_out")
        if len(y_out.shape) != 2 or y_out.shape[0] < batch or y_out.shape[1] != outputs:
            raise ValueError(f"y_out: expected [>= {batch}, {outputs}], got shape {y_out.shape}")
    if (mean is None) != (inv_std is None):
        raise ValueError(f"{name}: give mean and inv_std together, or neither")
    if mean is not None:
        require(mean, np.float32, (features,), what="mean")
        require(inv_std, np.float32, (features,), what="inv_std")
    ld_out = _check_order_and_batch(perm, step, x_out, batch, steps_per_epoch, features)
    if (optim is None) != (schedule is None):
        raise ValueError(f"{name}: give optim and schedule together, or neither")
    if optim is not None:
        require(optim, np.float32, (OPTIM_WORDS,), what="optim")
    sched = schedule.args() if schedule is not None else (0.0, 0.0, 0, 0, 0)
    return kind, values, outputs, ld_out, sched


COLUMN_TILE = 32  # column_sums: a lane per column, 32 per block
COLUMN_THREADS = 256  # column_sums: 8 warps (cu/gather.cu: COLUMN_WARPS); column_scaling: a thread per column
COLUMN_CHUNK_ROWS = 4096  # at least this many rows per chunk, so a chunk's sums are not all launch overhead
COLUMN_BLOCKS_PER_SM = 4


def column_chunks(rows: int, features: int, sm_count: int) -> int:
    """How many chunks of rows column_sums cuts a table into: enough blocks to fill the GPU, none of few rows."""
    tiles = -(-features // COLUMN_TILE)
    return max(1, min(-(-rows // COLUMN_CHUNK_ROWS), -(-COLUMN_BLOCKS_PER_SM * sm_count // tiles)))


def column_scaling(k: Kernels, x: Tensor, mean: Tensor, inv_std: Tensor, partial: Tensor) -> list[Launch]:
    """The standardization of x's columns (uint8 / 255, float16, float32 [N, F]), as the table gather applies it:
    mean[c] and inv_std[c] = 1 / std[c] (population std, float64 sums; 1 for a constant column), float32 [F] each,
    over every row, deterministically. partial: float64 [chunks, 2, F] scratch (chunks: column_chunks)."""
    kind = TABLE_DTYPES.get(x.dtype)
    if kind is None:
        raise TypeError(f"x: expected uint8, float16 or float32 features, got {x.dtype}")
    if len(x.shape) != 2 or x.shape[0] < 1:
        raise ValueError(f"x: expected [N >= 1, features], got shape {x.shape}")
    rows, features = x.shape
    require(mean, np.float32, (features,), what="mean")
    require(inv_std, np.float32, (features,), what="inv_std")
    require(partial, np.float64, what="partial")
    if len(partial.shape) != 3 or partial.shape[1:] != (2, features) or partial.shape[0] < 1:
        raise ValueError(f"partial: expected [chunks, 2, {features}], got shape {partial.shape}")
    chunks = min(partial.shape[0], rows)
    tiles = -(-features // COLUMN_TILE)
    return [k.get(SRC, column_kernel("sums", kind)).bind((tiles, chunks), COLUMN_THREADS, 0, x, rows, features,
                                                          partial),
            k.get(SRC, column_kernel("scaling", kind)).bind(-(-features // COLUMN_THREADS), COLUMN_THREADS, 0, x,
                                                             rows, features, chunks, partial, mean, inv_std)]


NONFINITE_THREADS = 256
NONFINITE_BLOCKS_PER_SM = 8


def first_nonfinite(k: Kernels, x: Tensor, first: Tensor, sm_count: int) -> Launch:
    """first[0] = min(first[0], the flat index of x's first value that is NaN or infinite) for fp16 or fp32 x;
    set first to x.size before the launch, and a value still x.size after it means every value is finite."""
    kind = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(x.dtype)
    if kind is None:
        raise TypeError(f"x: expected float16 or float32 features, got {x.dtype}")
    require(first, np.uint64, (1,), what="first")
    n = int(np.prod(x.shape))
    blocks = max(1, min(-(-n // (8 * NONFINITE_THREADS)), NONFINITE_BLOCKS_PER_SM * sm_count))
    return k.get(SRC, f"first_nonfinite_{kind}").bind(blocks, NONFINITE_THREADS, 0, x, n, first)


COLUMN_KINDS = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
ROW_KINDS = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}


def columns_to_rows(k: Kernels, cols: Tensor, rows: int, out: Tensor, row0: int, first: Tensor) -> Launch:
    """out[row0 + r, c] = cols[c, r] for r < rows, every column of a chunk of a table (cols [features, stride] of
    float32 or float64, the chunk's `rows` rows first in each) as out's dtype (fp16 or fp32, rounded as the host
    rounds); first[0] = min(first[0], the flat index in out of a value out's dtype cannot hold): set it to out.size
    before a table's first chunk. row0 is a multiple of COLUMNS_TILE_ROWS (out's rows from there start 16-byte
    aligned)."""
    column, row = COLUMN_KINDS.get(cols.dtype), ROW_KINDS.get(out.dtype)
    if column is None or row is None:
        raise TypeError(f"columns_to_rows: float32 or float64 columns into fp16 or fp32 rows, got {cols.dtype} "
                        f"into {out.dtype}")
    require(first, np.uint64, (1,), what="first")
    if len(cols.shape) != 2 or len(out.shape) != 2 or cols.shape[0] != out.shape[1]:
        raise ValueError(f"columns_to_rows: columns {cols.shape} into rows {out.shape}: expected [features, stride] "
                         "and [rows, features]")
    features, stride = cols.shape
    if not 1 <= features <= COLUMNS_MAX:
        raise ValueError(f"columns_to_rows: {features} columns, it takes 1 to {COLUMNS_MAX}")
    if not 1 <= rows <= stride or row0 < 0 or row0 % COLUMNS_TILE_ROWS or row0 + rows > out.shape[0]:
        raise ValueError(f"columns_to_rows: rows {row0}..{row0 + rows - 1} of a chunk of {stride} into {out.shape[0]} "
                         f"rows (row0 a multiple of {COLUMNS_TILE_ROWS})")
    at = out.view((rows, features), offset_bytes=row0 * features * out.dtype.itemsize)
    return k.get(SRC, columns_kernel(column, row)).bind(-(-rows // COLUMNS_TILE_ROWS), COLUMNS_THREADS, 0, cols,
                                                        stride, rows, features, row0, at, first)


def step_increment(k: Kernels, step: Tensor) -> Launch:
    """step[0] += 1 on the device."""
    require(step, np.int64, (1,), what="step")
    return k.get(SRC, "step_increment").bind(1, 32, 0, step)


def set_i64(k: Kernels, p: Tensor, value: int) -> Launch:
    """p[0] = value on the device (reset a counter inside a graph)."""
    require(p, np.int64, (1,), what="set_i64 target")
    return k.get(SRC, "set_i64").bind(1, 32, 0, p, value)


def _kind(kind: int | str) -> int:
    code = SCHEDULES.get(kind, kind) if isinstance(kind, str) else kind
    if code not in SCHEDULES.values():
        raise ValueError(f"unknown lr schedule {kind!r}: use one of {sorted(SCHEDULES)} or 0..2")
    return int(code)


def lr_at(step: int, lr0: float, lr_min: float, total: int, warmup: int, kind: int | str) -> float:
    """The learning rate gather_batch writes for `step` (same double arithmetic, fp32 inputs and result).

    constant: lr0. cosine/linear: lr0 * (s+1)/warmup while s < warmup, then from lr0 to lr_min over
    t = min(1, (s - warmup) / max(1, total - warmup)): lr_min + (lr0-lr_min)(1+cos(pi t))/2, or lr0 + (lr_min-lr0) t.
    """
    code = _kind(kind)
    a, b = float(np.float32(lr0)), float(np.float32(lr_min))  # the kernel receives fp32 arguments
    if code == 0:
        out = a
    elif step < warmup:
        out = a * (step + 1) / warmup
    else:
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        out = b + 0.5 * (a - b) * (1.0 + math.cos(math.pi * t)) if code == 1 else a + (b - a) * t
    return float(np.float32(out))
