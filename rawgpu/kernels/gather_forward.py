"""Launcher for cu/gather_forward.cu: the table gather and the first layer's forward in one launch, for tables whose
first layer takes at most GF_MAX_INPUTS padded inputs (the layered step's `fold` rule, `folds`)."""

from __future__ import annotations

import numpy as np

from ..contract import GF_MAX_INPUTS, GF_ROWS, GF_THREADS, gather_forward_kernel
from ..contract.shapes import cdiv
from ..runtime.driver import Launch
from ..runtime.memory import Tensor
from . import Kernels, require
from .gather import Schedule, table_arguments

SRC = "gather_forward.cu"
# The most multiply-adds (batch x outputs x padded inputs) the fold takes: fp32 FMAs, not tensor cores, so past some
# size they cost more than the launch they save. The largest measured, higgs-like's (batch 1024 x 32 x 512), neither
# wins nor loses (docs/perf.md: Your own data).
MAX_MACS = 1 << 24


def folds(batch: int, inputs_padded: int, outputs_padded: int, accum: str) -> bool:
    """Whether a table's gather and first layer run as one gather_forward launch: fp32 accumulation (the kernel's
    own), at most GF_MAX_INPUTS padded inputs and MAX_MACS multiply-adds."""
    return (accum == "f32" and inputs_padded <= GF_MAX_INPUTS
            and batch * inputs_padded * outputs_padded <= MAX_MACS)


def gather_forward(k: Kernels, x: Tensor, targets: Tensor, perm: Tensor, step: Tensor, x_out: Tensor, y_out: Tensor,
                   batch: int, steps_per_epoch: int, w16: Tensor, bias: Tensor, h: Tensor,
                   slope: Tensor | None = None, mean: Tensor | None = None, inv_std: Tensor | None = None,
                   optim: Tensor | None = None, schedule: Schedule | None = None, early: bool = False) -> Launch:
    """gather_table (x_out, y_out, the optimiser's values: as it writes them, bit for bit), then the first layer's
    forward of the gathered rows: h[i, c] = act(sum_k x_out[i, k] W16[k, c] + bias[c]) as fp16 (fp32 multiply-adds in
    k order, the forward GEMM's bias_act epilogue), and act' into `slope` where the activation saves it. w16 fp16
    [ld, N] with ld = x_out's row stride (<= GF_MAX_INPUTS), bias float32 [N], h (and slope) fp16 [>= batch, N],
    N even. early: as gather_table's (only the weight and bias wait for the kernel before)."""
    kind, values, outputs, ld_x, sched = table_arguments("gather_forward", x, targets, perm, step, x_out, y_out,
                                                         batch, steps_per_epoch, mean, inv_std, optim, schedule)
    if ld_x > GF_MAX_INPUTS:
        raise ValueError(f"gather_forward: rows of at most {GF_MAX_INPUTS} inputs, got x_out's stride {ld_x}")
    require(w16, np.float16, what="w16")
    if len(w16.shape) != 2 or w16.shape[0] != ld_x or w16.shape[1] % 2:
        raise ValueError(f"w16: expected [{ld_x}, N] with N even, got shape {w16.shape}")
    n = w16.shape[1]
    require(bias, np.float32, (n,), what="bias")
    for name, t in (("h", h), ("slope", slope)):
        if t is None:
            continue
        require(t, np.float16, what=name)
        if len(t.shape) != 2 or t.shape[0] < batch or t.shape[1] != n:
            raise ValueError(f"{name}: expected [>= {batch}, {n}], got shape {t.shape}")
    grid = (cdiv(batch, GF_ROWS), cdiv(n, 2 * GF_THREADS))
    name = gather_forward_kernel(kind, "values" if values else "labels", mean is not None)
    return k.get(SRC, name).bind(
        grid, GF_THREADS, 0, x, targets, outputs, perm, step, batch, steps_per_epoch, x.shape[1], ld_x,
        mean if mean is not None else 0, inv_std if inv_std is not None else 0, x_out, y_out,
        optim if optim is not None else 0, *sched, int(early), w16, bias, n, h, slope if slope is not None else 0)
