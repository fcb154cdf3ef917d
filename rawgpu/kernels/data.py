"""Launchers for cu/data.cu (batch gather, step counter, lr schedule) and `lr_at`, the schedule's host twin.

Everything reads the device step counter, so a captured training step replays unchanged every step.
"""

from __future__ import annotations

import math

import numpy as np

from ..driver import Launch
from ..memory import Tensor
from . import Kernels, require

SRC = "data.cu"
SCHEDULES = {"constant": 0, "cosine": 1, "linear": 2}


def gather_batch(k: Kernels, images: Tensor, labels: Tensor, perm: Tensor, step: Tensor, x_out: Tensor,
                 y_out: Tensor, batch: int, steps_per_epoch: int) -> Launch:
    """x_out[i] = images[perm[p + i]] / 255 (fp16, padding columns zeroed), y_out[i] = its label,
    p = (step % steps_per_epoch) * batch. images uint8 [N, row_bytes], x_out fp16 [>= batch, ld_out]."""
    require(images, np.uint8, what="images")
    if len(images.shape) != 2:
        raise ValueError(f"images: expected [N, row_bytes], got shape {images.shape}")
    n, row_bytes = images.shape
    require(labels, np.uint8, (n,), what="labels")
    require(perm, np.int32, what="perm")
    require(step, np.int64, (1,), what="step")
    require(x_out, np.float16, what="x_out")
    require(y_out, np.int32, what="y_out")
    if batch < 1 or steps_per_epoch < 1:
        raise ValueError(f"batch ({batch}) and steps_per_epoch ({steps_per_epoch}) must be >= 1")
    if len(perm.shape) != 1 or perm.shape[0] < batch * steps_per_epoch:
        raise ValueError(f"perm: needs {batch * steps_per_epoch} entries (batch x steps_per_epoch), got shape {perm.shape}")
    if len(x_out.shape) != 2 or x_out.shape[0] < batch:
        raise ValueError(f"x_out: expected [>= {batch}, ld], got shape {x_out.shape}")
    ld_out = x_out.shape[1]
    if ld_out < row_bytes or ld_out % 8:
        raise ValueError(f"x_out: row stride {ld_out} must be >= {row_bytes} and a multiple of 8")
    if x_out.offset % 16:
        raise ValueError(f"x_out: must start 16-byte aligned for vector stores (offset {x_out.offset})")
    if len(y_out.shape) != 1 or y_out.shape[0] < batch:
        raise ValueError(f"y_out: expected [>= {batch}], got shape {y_out.shape}")
    threads = 64 if ld_out <= 64 * 16 else 128
    return k.get(SRC, "gather_batch", "ppppiiiipp").bind(batch, threads, 0, images, labels, perm, step, batch,
                                                         steps_per_epoch, row_bytes, ld_out, x_out, y_out)


def step_increment(k: Kernels, step: Tensor) -> Launch:
    """step[0] += 1 on the device."""
    require(step, np.int64, (1,), what="step")
    return k.get(SRC, "step_increment", "p").bind(1, 32, 0, step)


def set_i64(k: Kernels, p: Tensor, value: int) -> Launch:
    """p[0] = value on the device (reset a counter inside a graph)."""
    require(p, np.int64, (1,), what="set_i64 target")
    return k.get(SRC, "set_i64", "pq").bind(1, 32, 0, p, value)


def _kind(kind: int | str) -> int:
    code = SCHEDULES.get(kind, kind) if isinstance(kind, str) else kind
    if code not in SCHEDULES.values():
        raise ValueError(f"unknown lr schedule {kind!r}: use one of {sorted(SCHEDULES)} or 0..2")
    return int(code)


def lr_schedule(k: Kernels, step: Tensor, lr: Tensor, lr0: float, lr_min: float, total_steps: int,
                warmup_steps: int, kind: int | str) -> Launch:
    """lr[0] = lr_at(step[0], ...) on the device: the step's learning rate without a host round trip."""
    require(step, np.int64, (1,), what="step")
    require(lr, np.float32, (1,), what="lr")
    if total_steps < 0 or warmup_steps < 0:
        raise ValueError(f"total_steps ({total_steps}) and warmup_steps ({warmup_steps}) must be >= 0")
    code = _kind(kind)
    return k.get(SRC, "lr_schedule", "ppffqqi").bind(1, 32, 0, step, lr, lr0, lr_min, total_steps, warmup_steps, code)


def lr_at(step: int, lr0: float, lr_min: float, total: int, warmup: int, kind: int | str) -> float:
    """The learning rate lr_schedule writes for `step` (same double arithmetic, fp32 inputs and result).

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
