"""Launcher for cu/narrow_update.cu: a narrow first layer's weight and bias update (dW = x^T dy, the optimiser's
step on the master and its state, the bias from dy's exact column sums), the layered step's short form's backward of
a first layer of at most NU_MAX_INPUTS padded inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract.narrow_update import NU_COLS, NU_KROWS, NU_MAX_INPUTS, NU_THREADS, narrow_update_kernel
from ..contract.optim import update_family
from ..contract.shapes import cdiv
from ..runtime.compiler import unit_of
from ..runtime.driver import Launch
from ..runtime.memory import Tensor
from . import Kernels, require

SRC = "narrow_update.cu"
MAX_BATCH = 256  # the short form's batches: the block's x and dy columns fit the default 48 KB of shared memory
SUMS_BYTES = (NU_THREADS // (NU_COLS // 2)) * NU_KROWS * NU_COLS * 4 + (NU_THREADS // NU_COLS) * NU_COLS * 8


@dataclass(frozen=True)
class NarrowPlan:
    """A first layer of K padded inputs and N outputs at batch B, updated by `family`'s rule (sgd or adam)."""

    B: int
    K: int
    N: int
    family: str
    workspace_floats: int = 0  # no split-K partials (the model sizes its shared scratch from every plan)
    tickets: int = 0

    @property
    def kernel(self) -> str:
        return narrow_update_kernel(self.family)

    @property
    def unit(self):
        return unit_of(SRC, self.kernel)

    @property
    def smem_bytes(self) -> int:
        """The block's x and dy columns, then over them the partial sums (dW's per batch slice, the bias's)."""
        return max(2 * self.B * (NU_KROWS + NU_COLS), SUMS_BYTES)


def plan_narrow_update(B: int, K: int, N: int, optimizer: str, sm_count: int) -> NarrowPlan | None:
    """The plan where the kernel takes the layer (1 <= B <= MAX_BATCH, K a multiple of NU_KROWS up to NU_MAX_INPUTS,
    N a multiple of 8, its blocks one wave of sm_count SMs), else None. One wave: every block is resident, reading the
    master before its wait while the launch before it ends; a second wave ran after dx_update's pass would have."""
    if not (1 <= B <= MAX_BATCH and NU_KROWS <= K <= NU_MAX_INPUTS and K % NU_KROWS == 0 and N >= 2 and N % 8 == 0
            and cdiv(N, NU_COLS) * (K // NU_KROWS) <= sm_count):
        return None
    return NarrowPlan(B, K, N, update_family(optimizer))


def narrow_update(k: Kernels, plan: NarrowPlan, x: Tensor, dy: Tensor, wlo: Tensor, w16: Tensor, optim: Tensor,
                  mw: Tensor | None = None, vw: Tensor | None = None, bias: Tensor | None = None,
                  mb: Tensor | None = None, vb: Tensor | None = None) -> Launch:
    """W (the master: w16, wlo [K, N]) -= the optimiser's step for x^T @ dy (x fp16 [>= B, K], dy fp16 [>= B, N], the
    loss-scaled gradient, as the layer's dW GEMM takes them), with its state mw (momentum or Adam's first moment)
    and vw (Adam's second) [K, N] float32 where kept; the bias [N] (and mb, vb) likewise from dy's column sums."""
    B, K, N = plan.B, plan.K, plan.N
    require(x, np.float16, what="x")
    require(dy, np.float16, what="dy")
    for name, t, ld in (("x", x, K), ("dy", dy, N)):
        if len(t.shape) != 2 or t.shape[0] < B or t.shape[1] != ld:
            raise ValueError(f"{name}: expected [>= {B}, {ld}], got shape {t.shape}")
        if t.offset % 16:
            raise ValueError(f"{name}: must start 16-byte aligned (offset {t.offset})")
    require(w16, np.float16, (K, N), what="w16")
    require(wlo, np.int16, (K, N), what="wlo")
    adam = plan.family == "adam"
    if adam and (mw is None or vw is None):
        raise ValueError("narrow_update: Adam's rule needs both moments, mw and vw")
    if not adam and vw is not None:
        raise ValueError("narrow_update: SGD's rule keeps no second moment (vw)")
    for name, t, shape in (("mw", mw, (K, N)), ("vw", vw, (K, N)), ("bias", bias, (N,)), ("mb", mb, (N,)),
                           ("vb", vb, (N,))):
        if t is not None:
            require(t, np.float32, shape, what=name)
    if bias is None and (mb is not None or vb is not None):
        raise ValueError("narrow_update: a bias state without the bias")
    require(optim, np.float32, what="optim")
    opt = lambda t: t if t is not None else 0  # noqa: E731 - a null pointer where the rule keeps no state
    return k.get(SRC, plan.kernel).bind(
        (cdiv(N, NU_COLS), K // NU_KROWS), NU_THREADS, plan.smem_bytes, x, K, dy, N, B, K, N, wlo, w16, opt(mw),
        opt(vw), opt(bias), opt(mb), opt(vb), optim)
