"""Launcher for dx_update.cu: a layer's whole backward at batch size with any optimiser (dx with the ReLU mask, and
the optimiser's step on the master weights W16 and lo, rawgpu/model/master.py, their state and the bias) in one pass over
its weights.

`plan_dx_update` is plain Python (tested on CPU): the batch tile and optimiser family (the instance), the grid
(row bands of 64 input features, times column ranges so every SM has a block; for layers that fit L2 twice over,
dx and the update in blocks of their own), and where the column ranges' dx sums meet: a cluster's shared memory or
the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .. import contract
from ..contract.optim import update_family
from ..runtime.compiler import unit_of
from . import PLANNING_ARCH, PLANNING_SM_COUNT, Kernels, require, require_slope, require_split_scratch
from .dx_sgd import BM, OnePassPlan, dx_operand, layer_operands, one_pass_layout
from .l2 import LayerPolicy

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from ..runtime.memory import Tensor

SOURCE = "dx_update.cu"
BN = contract.DXU_BN
assert contract.DXU_BM == BM, "the one-pass backward kernels share their row bands"
MAX_BATCH = max(contract.DXU_BATCHES)


def batch_tile(batch: int) -> int | None:
    """The smallest instance's batch rows that hold `batch`; None past the largest."""
    return next((bb for bb in contract.DXU_BATCHES if batch <= bb), None)


def unsupported_reason(batch: int, optimizer: str, accum: str, arch: str) -> str | None:
    """Why a layer's backward cannot be this one pass here; None when it can. Otherwise the dx GEMM, the dW +
    update GEMM and the bias update run apart."""
    if accum != "f32":
        return "the one-pass backward accumulates in fp32 only"
    bb = batch_tile(batch)
    if bb is None:
        return f"the one-pass backward takes batch <= {MAX_BATCH}, not {batch}"
    if contract.dxu_stages(bb, update_family(optimizer), arch) < 2:
        return f"its {bb}-row tile with {optimizer}'s state does not fit {arch}'s shared memory twice over"
    return None


@dataclass(frozen=True)
class DxUpdatePlan(OnePassPlan):
    family: str = "sgd"  # "sgd" or "adam": the instance's update
    arch: str = PLANNING_ARCH

    @property
    def rows(self) -> int:
        return batch_tile(self.B)

    @property
    def threads(self) -> int:
        return 32 * contract.DXU_WARPS[self.rows]

    @property
    def kernel(self) -> str:
        return contract.dxu_kernel_name(self.rows, self.family)

    @property
    def smem_bytes(self) -> int:
        return contract.dxu_smem_bytes(self.rows, self.family, self.arch)

    @property
    def stream_kernel(self) -> str:
        """The streamed update of its tile and family (the models step's first layer: model_axis.update_stream)."""
        return contract.dxu_stream_kernel_name(self.rows, self.family)

    @property
    def unit(self):
        """The unit of compilation it launches (compiler.unit_of): its instance alone."""
        return unit_of(SOURCE, self.kernel)


def plan_dx_update(B: int, IN: int, N: int, optimizer: str, arch: str, sm_count: int = PLANNING_SM_COUNT,
                   splits: int | None = None, capacity: Sequence[int] | None = None,
                   cluster: bool | None = None, dx: bool = True, roles: int | None = None) -> DxUpdatePlan:
    """The instance (batch tile, optimiser family) and the grid: row bands of BM, each band's columns split into
    ranges (whole chunks of BN) until the grid is about one block per SM (dx_sgd.column_ranges), their dx sums
    meeting as dx_sgd.one_pass_grid says (dx=False: the update alone, nothing to add); dx and the update apart as
    dx_sgd.one_pass_layout says (roles: 1 or 2 instead of its rule)."""
    if B < 1:
        raise ValueError(f"the one-pass backward takes 1..{MAX_BATCH} batch rows, got {B}")
    if why := unsupported_reason(B, optimizer, "f32", arch):
        raise ValueError(why)
    layout = one_pass_layout(IN, N, BN, sm_count, splits, arch, capacity, cluster, batch_tile(B), dx, roles)
    return DxUpdatePlan(B, IN, N, *layout, family=update_family(optimizer), arch=arch)


def dx_update(k: Kernels, plan: DxUpdatePlan, x: "Tensor", dy: "Tensor", wlo: "Tensor", w16: "Tensor",
              mw: "Tensor | None", vw: "Tensor | None", dx: "Tensor | None", optim: "Tensor",
              workspace: "Tensor | None" = None, tickets: "Tensor | None" = None, l2: "LayerPolicy | None" = None,
              bias: "Tensor | None" = None, mb: "Tensor | None" = None, vb: "Tensor | None" = None,
              slope: "Tensor | None" = None) -> "Launch":
    """x [B, IN] (the layer's input), dy [B, N], the master weights as wlo (int16) and W16 [IN, N]
    (rawgpu/model/master.py) with the optimiser's state mw (SGD's momentum or Adam's first moment) and vw (Adam's second),
    fp32 of W's shape or None where the optimiser keeps none; all updated. dx [B, IN] written (None: the update
    alone, e.g. for the first layer): fp16, times act' (from x, or from slope: act' at x as the forward saved it, of
    dx's shape, where the backward reads it); fp32: the raw sums: a partial sum other GPUs add to
    (rawgpu/steps/sharded.py; elementwise.finish_sum's dact applies act' and rounds their total the same way).
    optim: the optimiser table (contract.Optim; the gather writes the step's values). l2: the weights' cache policies
    (kernels/l2.py; default normal). bias [N] fp32 with its state mb, vb: also updated, with the same bits as
    elementwise.bias_update."""
    p = plan
    ldx, lddy, ldw = layer_operands(p, x, dy, wlo, w16)
    if p.family == "adam" and (mw is None or vw is None):
        raise ValueError("Adam's update needs both moments (mw and vw)")
    if p.family == "sgd" and vw is not None:
        raise ValueError("SGD keeps no second moment: vw must be None")
    for t, what in ((mw, "mw"), (vw, "vw")):
        if t is not None:
            require(t, np.float32, wlo.shape, what)
    lddx, dx_f32 = dx_operand(dx, p.B, p.IN)
    require_slope(k, slope, None if dx_f32 else dx, "dx_update")
    require(optim, np.float32, (contract.OPTIM_WORDS,), "optim")
    if bias is not None:
        for t, what in ((bias, "bias"), (mb, "mb"), (vb, "vb")):
            if t is not None:
                require(t, np.float32, what=what)
                if t.size < p.N:
                    raise ValueError(f"{what}: {t.size} values for {p.N} columns")
        if (mb is None) != (mw is None) or (vb is None) != (vw is None):
            raise ValueError("the bias keeps the same optimiser state as the weights")
    if dx is not None and not p.cluster:  # the column ranges' dx sums meet in the workspace
        require_split_scratch(p.splits, workspace, tickets, p.workspace_floats, p.tickets, f"{p.splits} column ranges")
    ptr = lambda t: 0 if t is None else t  # noqa: E731
    l2 = l2 or LayerPolicy()
    return k.get(SOURCE, p.kernel).bind(
        p.grid, p.threads, p.smem_bytes, x, dy, wlo, w16, ptr(mw), ptr(vw), ptr(dx), optim, p.B, p.IN, p.N, ldx, lddy,
        ldw, lddx, dx_f32, p.n_chunk, ptr(workspace), ptr(tickets), l2.read, l2.hi, l2.lo, ptr(bias), ptr(mb), ptr(vb),
        ptr(slope), cluster=p.cluster_dims)
