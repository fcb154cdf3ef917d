"""Launcher for head.cu: the classifier head's forward, loss, backward and update in one cluster launch (sm_90).

`plan_head` is plain Python (tested on CPU): how many CTAs share the head's rows, and the shared memory each needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import contract
from . import Kernels, require

if TYPE_CHECKING:
    from ..driver import Launch
    from ..memory import Tensor

SOURCE = "head.cu"
KERNEL = "head_step"
SIGNATURE = "pippppppppippiiiifp"  # head_step's parameters (tests/test_compiler.py checks it against the PTX)
THREADS, ROWS, CLASSES = contract.HEAD_THREADS, contract.HEAD_ROWS, contract.HEAD_CLASSES  # compiled into head.cu
MAX_KC = 1024  # rows of W per CTA: 190 KB of shared memory
PORTABLE_CTAS, MAX_CTAS = 8, 16
smem_bytes = contract.head_smem_bytes  # a CTA's dynamic shared memory for kc rows of W


def supported(batch: int, plain_sgd: bool, accum: str, classes_padded: int, arch: str) -> bool:
    """Whether the head's step can run as one cluster: sm_90+ (clusters), batch-sized (<= 32 rows), plain SGD,
    fp32 accumulation, the classes padded to 16. Otherwise the head runs as four kernels (GEMM, softmax_xent,
    dx_sgd, bias_update)."""
    return (int(arch.removeprefix("sm_")) >= 90 and batch <= ROWS and plain_sgd and accum == "f32"
            and classes_padded == CLASSES)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HeadPlan:
    B: int
    K: int  # the head's inputs (the top hidden width, padded to 8)
    ctas: int  # the cluster
    kc: int  # rows of W per CTA, a multiple of 16

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.kc)


def plan_head(B: int, K: int, ctas: int | None = None) -> HeadPlan | None:
    """CTAs: 8 (a portable cluster) up to 2048 inputs, 16 above, so each holds at most 128 (or 1024) rows; None when
    K is too wide for 16 CTAs of MAX_KC rows."""
    if not 1 <= B <= ROWS:
        raise ValueError(f"the head step takes 1..{ROWS} batch rows, got {B}")
    if K < 1 or K % 8:
        raise ValueError(f"the head's inputs must be a positive multiple of 8, got {K}")
    c = ctas if ctas is not None else (PORTABLE_CTAS if K <= 2048 else MAX_CTAS)
    if not 1 <= c <= MAX_CTAS:
        raise ValueError(f"a cluster holds 1..{MAX_CTAS} CTAs, got {c}")
    kc = _cdiv(_cdiv(K, c), 16) * 16
    if kc > MAX_KC:
        return None
    return HeadPlan(B, K, _cdiv(K, kc), kc)


def head_step(k: Kernels, plan: HeadPlan, h: "Tensor", labels: "Tensor", wlo: "Tensor", w16: "Tensor",
              bias: "Tensor", lr: "Tensor", logits: "Tensor", dlogits: "Tensor", dh: "Tensor", loss_sum: "Tensor",
              correct: "Tensor", classes: int, grad_scale: float, step: "Tensor | None" = None) -> "Launch":
    """h [B, K] (the top hidden layer's output, also its ReLU mask); the head's master as wlo (int16) and W16
    [K, 16] and its bias [16] (all updated); logits, dlogits [B, 16] and dh [B, K] written; loss_sum += the rows'
    cross-entropy, correct += their hits. grad_scale: the loss scale (dlogits are d(loss)/d(z) x grad_scale / B).
    step: a training step counter to move forward by one (the layered step's own, so it needs no extra launch)."""
    p = plan
    require(h, np.float16, what="h")
    if len(h.shape) != 2 or h.shape[0] < p.B or h.shape[1] < p.K or h.shape[1] % 8:
        raise ValueError(f"h: buffer {h.name} of shape {h.shape} cannot hold {p.B} x {p.K}")
    require(wlo, np.int16, (p.K, CLASSES), "W lo")
    require(w16, np.float16, (p.K, CLASSES), "W16")
    require(bias, np.float32, (CLASSES,), "bias")
    require(lr, np.float32, what="lr")
    require(labels, np.int32, what="labels")
    for t, what in ((logits, "logits"), (dlogits, "dlogits")):
        require(t, np.float16, what=what)
        if len(t.shape) != 2 or t.shape[0] < p.B or t.shape[1] != CLASSES:
            raise ValueError(f"{what}: expected [>= {p.B}, {CLASSES}], got {t.shape}")
    require(dh, np.float16, what="dh")
    if len(dh.shape) != 2 or dh.shape[0] < p.B or dh.shape[1] < p.K or dh.shape[1] % 8:
        raise ValueError(f"dh: buffer {dh.name} of shape {dh.shape} cannot hold {p.B} x {p.K}")
    require(loss_sum, np.float64, (1,), "loss_sum")
    require(correct, np.int32, (1,), "correct")
    if not 1 <= classes <= CLASSES:
        raise ValueError(f"the head step takes 1..{CLASSES} classes, got {classes}")
    if not (grad_scale > 0 and np.isfinite(grad_scale)):
        raise ValueError(f"grad_scale must be a positive finite number, got {grad_scale}")
    if step is not None:
        require(step, np.int64, (1,), "step")
    return k.get(SOURCE, KERNEL, SIGNATURE).bind(
        p.ctas, THREADS, p.smem_bytes, h, h.shape[1], labels, wlo, w16, bias, lr, logits, dlogits, dh, dh.shape[1],
        loss_sum, correct, p.B, p.K, p.kc, classes, grad_scale / p.B, step if step is not None else 0,
        cluster=p.ctas)
