"""Launcher for head.cu: the head's forward, loss (softmax cross-entropy, or a regression's), backward and optimiser
step in one cluster launch (sm_90).

`plan_head` is plain Python (tested on CPU): the instance (batch tile, optimiser family), how many CTAs share the
head's rows, and the shared memory each needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import contract
from ..runtime.compiler import unit_of
from ..contract.loss import REGRESSION_LOSSES
from ..contract.optim import update_family
from ..contract.shapes import cdiv
from . import Kernels, require, require_slope

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from ..runtime.memory import Tensor

SOURCE = "head.cu"
THREADS, CLASSES = contract.HEAD_THREADS, contract.HEAD_CLASSES  # compiled into head.cu
MAX_BATCH = max(contract.HEAD_BATCHES)
PORTABLE_CTAS, MAX_CTAS = 8, contract.HEAD_MAX_CTAS
MIN_CTAS = 2  # the kernel's exchange (st.async) needs a cluster launch, and a launch of one CTA is none
SMEM_LIMIT = contract.block_smem_limit("sm_90")


def batch_tile(batch: int) -> int | None:
    """The smallest instance's batch rows that hold `batch`; None past the largest."""
    return next((rows for rows in contract.HEAD_BATCHES if batch <= rows), None)


def unsupported_reason(batch: int, accum: str, classes_padded: int, arch: str) -> str | None:
    """Why the head's step cannot run as one cluster here; None when it can (given a width plan_head fits).
    Otherwise the head runs as separate kernels (GEMM, softmax_xent, the backward, bias_update)."""
    if int(arch.removeprefix("sm_").rstrip("a")) < 90:
        return f"the head's one-cluster step needs sm_90 (thread-block clusters), this GPU is {arch}"
    if accum != "f32":
        return "the head's one-cluster step accumulates in fp32 only"
    if batch_tile(batch) is None:
        return f"the head's one-cluster step takes batch <= {MAX_BATCH}, not {batch}"
    if classes_padded != CLASSES:
        return f"the head's one-cluster step computes {CLASSES} padded classes, not {classes_padded}"
    return None



@dataclass(frozen=True)
class HeadPlan:
    B: int
    K: int  # the head's inputs (the top hidden width, padded to 8)
    ctas: int  # the cluster
    kc: int  # rows of W per CTA, a multiple of 16
    family: str  # "sgd" or "adam": the instance's update
    task: str = "xent"  # contract.HEAD_TASKS: "xent" or "regression"

    @property
    def rows(self) -> int:
        return batch_tile(self.B)

    @property
    def kernel(self) -> str:
        return contract.head_kernel_name(self.rows, self.family, self.task)

    @property
    def smem_bytes(self) -> int:
        return contract.head_smem_bytes(self.rows, self.kc, self.task)

    @property
    def unit(self):
        """The unit of compilation it launches (compiler.unit_of): its instance alone."""
        return unit_of(SOURCE, self.kernel)


def plan_head(B: int, K: int, optimizer: str = "sgd", ctas: int | None = None, loss: str = "xent"
              ) -> HeadPlan | None:
    """CTAs: 8 (a portable cluster) up to 2048 inputs where their rows fit, else 16, so each holds at most 256 (or
    K / 16) rows, and at least MIN_CTAS (at K <= 16 the second holds none); None when K is too wide for 16 CTAs'
    shared memory at this batch. loss: "xent", or a regression's (REGRESSION_LOSSES)."""
    if loss != "xent" and loss not in REGRESSION_LOSSES:
        raise ValueError(f"unknown loss {loss!r}: use xent or one of {', '.join(REGRESSION_LOSSES)}")
    task = "xent" if loss == "xent" else "regression"
    rows = batch_tile(B)
    if B < 1 or rows is None:
        raise ValueError(f"the head step takes 1..{MAX_BATCH} batch rows, got {B}")
    if K < 1 or K % 8:
        raise ValueError(f"the head's inputs must be a positive multiple of 8, got {K}")
    if ctas is not None and not 1 <= ctas <= MAX_CTAS:
        raise ValueError(f"a cluster holds 1..{MAX_CTAS} CTAs, got {ctas}")
    # by default the portable cluster up to 2048 inputs, and 16 CTAs where its rows do not fit (a regression's
    # targets take more shared memory than labels)
    for c in (ctas,) if ctas is not None else (PORTABLE_CTAS, MAX_CTAS) if K <= 2048 else (MAX_CTAS,):
        kc = cdiv(cdiv(K, c), 16) * 16
        if contract.head_smem_bytes(rows, kc, task) <= SMEM_LIMIT:
            return HeadPlan(B, K, max(MIN_CTAS, cdiv(K, kc)), kc, update_family(optimizer), task)
    return None


def head_step(k: Kernels, plan: HeadPlan, h: "Tensor", labels: "Tensor", wlo: "Tensor", w16: "Tensor",
              bias: "Tensor", optim: "Tensor", logits: "Tensor", dlogits: "Tensor", dh: "Tensor", loss_sum: "Tensor",
              correct: "Tensor", classes: int, grad_scale: float, step: "Tensor | None" = None,
              mw: "Tensor | None" = None, vw: "Tensor | None" = None, mb: "Tensor | None" = None,
              vb: "Tensor | None" = None, slope: "Tensor | None" = None, loss: str = "xent") -> "Launch":
    """h [B, K] (the top hidden layer's output; slope: act' at h as the forward saved it, of dh's shape, where the
    backward reads it); the head's master as wlo (int16) and W16
    [K, 16] and its bias [16] (all updated) with the optimiser's state mw, vw [K, 16] and mb, vb [16] (fp32; None
    where the optimiser keeps none); optim: the optimiser table (contract.Optim); logits, dlogits [B, 16] and dh
    [B, K] written; loss_sum += the rows' cross-entropy, correct += their hits. grad_scale: the loss scale (dlogits
    are d(loss)/d(z) x grad_scale / B). step: a training step counter to move forward by one (the layered step's
    own, so it needs no extra launch).

    A regression's plan (loss mse, l1 or huber: the plan's task): labels are its targets, float32 [>= B, classes]
    (the outputs); loss_sum its sums, float64 [3] (+= the rows' losses, squared and absolute errors, as
    loss.regression_loss's); correct None; dlogits = l'(pred - y) x grad_scale / (B x outputs)."""
    p = plan
    regression = p.task == "regression"
    if regression != (loss != "xent") or (regression and loss not in REGRESSION_LOSSES):
        raise ValueError(f"the plan's head is for {p.task}, not the loss {loss!r}")
    require(h, np.float16, what="h")
    if len(h.shape) != 2 or h.shape[0] < p.B or h.shape[1] < p.K or h.shape[1] % 8:
        raise ValueError(f"h: buffer {h.name} of shape {h.shape} cannot hold {p.B} x {p.K}")
    require(wlo, np.int16, (p.K, CLASSES), "W lo")
    require(w16, np.float16, (p.K, CLASSES), "W16")
    require(bias, np.float32, (CLASSES,), "bias")
    require(optim, np.float32, (contract.OPTIM_WORDS,), "optim")
    if p.family == "adam" and (mw is None or vw is None):
        raise ValueError("Adam's update needs both moments (mw and vw)")
    if p.family == "sgd" and vw is not None:
        raise ValueError("SGD keeps no second moment: vw must be None")
    for t, shape, what in ((mw, (p.K, CLASSES), "mw"), (vw, (p.K, CLASSES), "vw"), (mb, (CLASSES,), "mb"),
                           (vb, (CLASSES,), "vb")):
        if t is not None:
            require(t, np.float32, shape, what)
    if (mb is None) != (mw is None) or (vb is None) != (vw is None):
        raise ValueError("the bias keeps the same optimiser state as the weights")
    if regression:
        require(labels, np.float32, what="targets")
        if len(labels.shape) != 2 or labels.shape[0] < p.B or labels.shape[1] != classes:
            raise ValueError(f"targets: expected [>= {p.B}, {classes}], got {labels.shape}")
    else:
        require(labels, np.int32, what="labels")
    for t, what in ((logits, "logits"), (dlogits, "dlogits")):
        require(t, np.float16, what=what)
        if len(t.shape) != 2 or t.shape[0] < p.B or t.shape[1] != CLASSES:
            raise ValueError(f"{what}: expected [>= {p.B}, {CLASSES}], got {t.shape}")
    require(dh, np.float16, what="dh")
    if len(dh.shape) != 2 or dh.shape[0] < p.B or dh.shape[1] < p.K or dh.shape[1] % 8:
        raise ValueError(f"dh: buffer {dh.name} of shape {dh.shape} cannot hold {p.B} x {p.K}")
    require_slope(k, slope, dh, "head_step")
    if regression:
        require(loss_sum, np.float64, (3,), "sums")
        if correct is not None:
            raise ValueError("a regression's head counts no hits: correct must be None")
    else:
        require(loss_sum, np.float64, (1,), "loss_sum")
        require(correct, np.int32, (1,), "correct")
    if not 1 <= classes <= CLASSES:
        raise ValueError(f"the head step takes 1..{CLASSES} classes, got {classes}")
    if not (grad_scale > 0 and np.isfinite(grad_scale)):
        raise ValueError(f"grad_scale must be a positive finite number, got {grad_scale}")
    if step is not None:
        require(step, np.int64, (1,), "step")
    ptr = lambda t: 0 if t is None else t  # noqa: E731
    return k.get(SOURCE, p.kernel).bind(
        p.ctas, THREADS, p.smem_bytes, h, h.shape[1], labels, wlo, w16, ptr(mw), ptr(vw), bias, ptr(mb), ptr(vb),
        optim, logits, dlogits, dh, dh.shape[1], loss_sum, ptr(correct), p.B, p.K, p.kc, classes,
        grad_scale / (p.B * (classes if regression else 1)), ptr(step), ptr(slope),
        REGRESSION_LOSSES[loss] if regression else 0, cluster=p.ctas)
