"""Launcher for dx_sgd.cu: a layer's whole backward at batch size (dx with the ReLU mask, and the SGD update of
the master weights W16 and lo, rawgpu/model/master.py) in one pass over its weights.

`plan_dx_sgd` is plain Python (tested on CPU): the grid (row bands of 64 input features, times column ranges so
every SM has a block; for layers that fit L2 twice over, dx and the update in blocks of their own) and where the
column ranges' dx sums meet: a cluster's shared memory or the workspace. The grid rules here serve dx_update.py's
planner too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .. import contract
from ..runtime.compiler import unit_of
from ..contract.shapes import cdiv
from . import PLANNING_SM_COUNT, Kernels, require, require_slope, require_split_scratch
from .gemm import MAX_CLUSTER_SPLITS, sm90_or_later, planning_capacity
from .l2 import LayerPolicy

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from ..runtime.memory import Tensor

SOURCE = "dx_sgd.cu"
KERNEL = "dx_sgd"
# The kernel's tile and block, compiled in from rawgpu/contract/dx_sgd.py
BM, BN, MAX_BATCH, THREADS = contract.DX_SGD_BM, contract.DX_SGD_BN, contract.DX_SGD_MAX_BATCH, contract.DX_SGD_THREADS
stages = contract.dx_sgd_stages  # the pipeline depth per arch
smem_bytes = contract.dx_sgd_smem_bytes  # the dynamic shared memory per arch


def supported(batch: int, plain_sgd: bool, accum: str) -> bool:
    """Whether a layer's backward can run fused: batch-sized (<= 32 rows), plain SGD (Recipe._plain_sgd: a state tile
    would not fit the pipeline), fp32 accumulation. Otherwise the dx GEMM and the dW + update GEMM run apart."""
    return batch <= MAX_BATCH and plain_sgd and accum == "f32"



@dataclass(frozen=True)
class OnePassPlan:
    """The grid of a one-pass backward over W [IN, N] (this kernel's, and dx_update's): row bands of BM input
    features, times column ranges, whose dx sums meet in a cluster's shared memory or in the workspace
    (cu/one_pass.cuh)."""

    B: int  # batch rows
    IN: int  # W's rows (input features; dx's columns)
    N: int  # W's columns (output features)
    splits: int  # column ranges per row band
    n_chunk: int  # columns per range, a multiple of the kernel's chunk
    cluster: bool = False  # each band's ranges run as one cluster and add their dx there (reduce_in_cluster)
    roles: int = 1  # 2: dx and the update in blocks of their own (grid y), side by side (`apart`)

    @property
    def rows(self) -> int:
        """The batch rows the kernel holds (its tile): each block's dx partial."""
        return MAX_BATCH

    @property
    def bands(self) -> int:
        return cdiv(self.IN, BM)

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.bands, self.roles, self.splits

    @property
    def workspace_floats(self) -> int:
        return self.splits * self.bands * self.rows * BM if self.splits > 1 and not self.cluster else 0

    @property
    def tickets(self) -> int:
        return self.bands if self.splits > 1 and not self.cluster else 0

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        """The launch's clusters: a band's ranges, where their dx sums meet there (the planners plan none for the
        update alone, dx=False); with dx and the update apart, each dx block and its update block (one_pass.cuh:
        apart_*)."""
        return (1, self.roles, self.splits if self.cluster else 1)


def reduce_in_cluster(bands: int, splits: int, arch: str, capacity: Sequence[int] | None, sm_count: int) -> bool:
    """Whether a band's column ranges add their dx in a cluster's shared memory (sm_90, 2..MAX_CLUSTER_SPLITS ranges,
    every band's cluster resident at once by `capacity`, gemm.cluster_capacity's answer, or planning_capacity's
    estimate if None) rather than through the workspace and a ticket, which costs the band's last block a round trip
    to L2 and a serial sum of every range (`python dev/backward_splits.py --sum cluster workspace`)."""
    if not sm90_or_later(arch) or not 2 <= splits <= MAX_CLUSTER_SPLITS:
        return False
    capacity = capacity or planning_capacity(sm_count)
    return splits < len(capacity) and bands <= capacity[splits]


def column_ranges(IN: int, N: int, chunk: int, sm_count: int, splits: int | None) -> tuple[int, int]:
    """(ranges, columns per range) of W [IN, N] in chunks of `chunk` columns: when there are fewer row bands than
    SMs, each band's columns split into ranges of whole chunks until the grid is about one block per SM (`splits`:
    that many instead)."""
    if min(IN, N) < 1 or IN % 8 or N % 8:
        raise ValueError(f"W must be a positive multiple of 8 in both dimensions, got {IN} x {N}")
    chunks = cdiv(N, chunk)
    s = int(splits) if splits is not None else max(1, min(chunks, sm_count // cdiv(IN, BM)))
    if not 1 <= s <= chunks:
        raise ValueError(f"splits must be in 1..{chunks} for {N} columns, got {s}")
    n_chunk = cdiv(chunks, s) * chunk
    return cdiv(N, n_chunk), n_chunk


class DxSgdPlan(OnePassPlan):
    """dx_sgd's grid (its tile holds MAX_BATCH rows)."""

    @property
    def unit(self):
        """The unit of compilation it launches (compiler.unit_of): the whole small source."""
        return unit_of(SOURCE, KERNEL)


def plan_dx_sgd(B: int, IN: int, N: int, sm_count: int = PLANNING_SM_COUNT, splits: int | None = None, arch: str = "sm_86",
                capacity: Sequence[int] | None = None, cluster: bool | None = None, dx: bool = True,
                roles: int | None = None) -> DxSgdPlan:
    """Row bands of BM; when there are fewer bands than SMs, each band's columns split into ranges (whole chunks
    of BN) until the grid is about one block per SM; their dx sums meet as one_pass_grid says (dx=False: the update
    alone, nothing to add); dx and the update apart as one_pass_layout says."""
    if not 1 <= B <= MAX_BATCH:
        raise ValueError(f"the fused backward takes 1..{MAX_BATCH} batch rows, got {B}")
    return DxSgdPlan(B, IN, N, *one_pass_layout(IN, N, BN, sm_count, splits, arch, capacity, cluster, MAX_BATCH, dx,
                                                roles))


# dx and the update in blocks of their own (roles 2) where a layer's weights and state are small enough to be read
# twice from L2: up to APART_MAX_WEIGHTS weights (1024 x 1024; from 2048 x 2048 the second read comes from DRAM and
# two passes lose), each part's blocks over at most APART_MAX_RANGES column ranges (past that the ranges' dx sums cost
# more than shorter ranges save), the doubled grid one block per SM at most (`python dev/backward_splits.py
# --roles 1 2`). Each dx block and its update block are one cluster, so that the update can wait for the dx block to
# hold the old weights before it overwrites them (cu/one_pass.cuh: apart_*): sm_90 only. The
# ranges' dx sums then go through the workspace (clusters of the ranges' pairs measured slower; no command: that
# variant is gone, docs/history.md: Each dx block and its update block one cluster).
APART_MAX_WEIGHTS = 1 << 20
APART_MAX_RANGES = 4


def apart(IN: int, N: int, dx: bool, sm_count: int, arch: str) -> bool:
    """Whether dx and the update run in blocks of their own (above)."""
    return dx and sm90_or_later(arch) and IN * N <= APART_MAX_WEIGHTS and 2 * cdiv(IN, BM) <= sm_count


def one_pass_layout(IN: int, N: int, chunk: int, sm_count: int, splits: int | None, arch: str,
                    capacity: Sequence[int] | None, cluster: bool | None, rows: int, dx: bool,
                    roles: int | None) -> tuple[int, int, bool, int]:
    """(ranges, columns per range, whether they add their dx in a cluster, roles) for both one-pass planners: with
    dx and the update in one block (roles 1), one_pass_grid's; apart (roles 2, where `apart` says so, or asked for),
    each part over the ranges that keep the doubled grid within one block per SM (at most APART_MAX_RANGES), adding
    dx in a cluster where the doubled grid's clusters all fit at once."""
    if roles is None:
        roles = 2 if apart(IN, N, dx, sm_count, arch) and not cluster else 1  # range clusters asked for: one pass
    elif roles not in (1, 2) or (roles == 2 and not dx):
        raise ValueError(f"roles must be 1, or 2 with dx (dx and the update apart), got {roles}")
    elif roles == 2 and not sm90_or_later(arch):
        raise ValueError(f"dx and the update apart pair their blocks in clusters: sm_90, not {arch}")
    if roles == 1:
        return (*one_pass_grid(IN, N, chunk, sm_count, splits, arch, capacity, cluster if dx else False, rows), 1)
    if cluster:
        raise ValueError("dx and the update apart add the ranges' dx through the workspace: their clusters are pairs")
    bands, chunks = cdiv(IN, BM), cdiv(N, chunk)
    want = splits if splits is not None else min(chunks, APART_MAX_RANGES, max(1, sm_count // (2 * bands)))
    return (*one_pass_grid(IN, N, chunk, sm_count, want, arch, capacity, False, rows), 2)


# At batch tiles of TRADE_MIN_ROWS or more, a band's ranges of at most MAX_TRADED_CHUNKS chunks are latency-bound:
# fewer, longer ranges whose dx sums meet in a cluster beat more of them through the workspace; longer ranges are
# bandwidth-bound and lose, and so does the batch-32 tile (`python dev/backward_splits.py --sizes 1024 2048
# --splits 3 4 6 8 --sum cluster workspace`, and `--batch 32`).
MAX_TRADED_CHUNKS = 3
TRADE_MIN_ROWS = 128


def one_pass_grid(IN: int, N: int, chunk: int, sm_count: int, splits: int | None, arch: str,
                  capacity: Sequence[int] | None, cluster: bool | None, rows: int) -> tuple[int, int, bool]:
    """(ranges, columns per range, whether they add their dx in a cluster) for both one-pass planners and a batch
    tile of `rows`: the ranges column_ranges gives (or `splits`), in a cluster where reduce_in_cluster says so;
    where those ranges' clusters do not all fit, at TRADE_MIN_ROWS rows or more, fewer ranges of at most
    MAX_TRADED_CHUNKS chunks whose clusters do. cluster=False: through the workspace; True: in a cluster (refused
    where it cannot run)."""
    ranges, n_chunk = column_ranges(IN, N, chunk, sm_count, splits)
    bands = cdiv(IN, BM)
    if cluster is not None:
        if cluster and not (sm90_or_later(arch) and 2 <= ranges <= MAX_CLUSTER_SPLITS):
            raise ValueError(f"{ranges} column ranges on {arch} cannot add their dx in a cluster "
                             f"(sm_90, 2..{MAX_CLUSTER_SPLITS} ranges)")
        return ranges, n_chunk, cluster
    if reduce_in_cluster(bands, ranges, arch, capacity, sm_count):
        return ranges, n_chunk, True
    if splits is None and rows >= TRADE_MIN_ROWS and sm90_or_later(arch):
        for fewer in range(min(ranges, MAX_CLUSTER_SPLITS + 1) - 1, 1, -1):
            r, nc = column_ranges(IN, N, chunk, sm_count, fewer)
            if nc > MAX_TRADED_CHUNKS * chunk:
                break
            if r < ranges and reduce_in_cluster(bands, r, arch, capacity, sm_count):
                return r, nc, True
    return ranges, n_chunk, False


def dx_operand(dx: "Tensor | None", rows: int, cols: int) -> tuple[int, int]:
    """(row stride, the kernels' dx_f32 flag) of the one-pass kernels' dx: fp16, times act', or fp32, the raw sums
    (cu/one_pass.cuh: store_dx_pair); (0, 0) for none."""
    if dx is None:
        return 0, 0
    if dx.dtype not in (np.float16, np.float32):
        raise TypeError(f"dx: expected dtype float16 (times act') or float32 (raw partial sums), got {dx.dtype}")
    if dx.offset % (2 * dx.dtype.itemsize):
        raise ValueError(f"dx: {dx.name} must start {2 * dx.dtype.itemsize}-byte aligned for pair stores "
                         f"(offset {dx.offset})")
    return matrix_stride(dx, rows, cols, dx.dtype, "dx"), int(dx.dtype == np.float32)


def layer_operands(p: OnePassPlan, x: "Tensor", dy: "Tensor", wlo: "Tensor", w16: "Tensor") -> tuple[int, int, int]:
    """The row strides of x [B, IN] and dy [B, N] (fp16) and of the master's halves wlo (int16) and W16 [IN, N], after
    checking them: the one-pass kernels' operands."""
    ldx = matrix_stride(x, p.B, p.IN, np.float16, "x")
    lddy = matrix_stride(dy, p.B, p.N, np.float16, "dy")
    ldw = matrix_stride(wlo, p.IN, p.N, np.int16, "W lo")
    require(w16, np.float16, wlo.shape, "W16")
    return ldx, lddy, ldw


def matrix_stride(t: "Tensor", rows: int, cols: int, dtype, what: str) -> int:
    """The row stride of t after checking it holds a rows x cols matrix of dtype (the one-pass kernels' operands)."""
    require(t, dtype, what=what)
    if len(t.shape) != 2 or t.shape[0] < rows or t.shape[1] < cols or t.shape[1] % 8:
        raise ValueError(f"{what}: buffer {t.name} of shape {t.shape} cannot hold {rows} x {cols} (stride multiple of 8)")
    return t.shape[1]


def dx_sgd(k: Kernels, plan: DxSgdPlan, x: "Tensor", dy: "Tensor", wlo: "Tensor", w16: "Tensor", dx: "Tensor | None",
           lr: "Tensor", workspace: "Tensor | None" = None, tickets: "Tensor | None" = None,
           l2: "LayerPolicy | None" = None, bias: "Tensor | None" = None, slope: "Tensor | None" = None) -> "Launch":
    """x [B, IN] (the layer's input), dy [B, N], the master weights as wlo (int16) and W16 [IN, N]
    (rawgpu/model/master.py; both updated), dx [B, IN] (written; None: the update alone, e.g. for the first layer): fp16,
    times act' (from x, or from slope: act' at x as the forward saved it, of dx's shape, where the backward reads it);
    fp32: the raw sums: a partial sum other GPUs add to (rawgpu/steps/sharded.py; elementwise.finish_sum's dact
    applies act' and rounds their total the same way). l2: the cache policies of the weights' reads and writes
    (kernels/l2.py; default normal). bias [N] fp32: also updated, b -= lr colsum(dy), the same bits as
    elementwise.bias_update."""
    p = plan
    ldx, lddy, ldw = layer_operands(p, x, dy, wlo, w16)
    lddx, dx_f32 = dx_operand(dx, p.B, p.IN)
    require_slope(k, slope, None if dx_f32 else dx, "dx_sgd")
    require(lr, np.float32, what="lr")
    if bias is not None:
        require(bias, np.float32, what="bias")
        if bias.size < p.N:
            raise ValueError(f"bias: {bias.size} values for {p.N} columns")
    if dx is not None and not p.cluster:  # the column ranges' dx sums meet in the workspace
        require_split_scratch(p.splits, workspace, tickets, p.workspace_floats, p.tickets, f"{p.splits} column ranges")
    ptr = lambda t: 0 if t is None else t  # noqa: E731
    l2 = l2 or LayerPolicy()
    return k.get(SOURCE, KERNEL).bind(
        p.grid, THREADS, smem_bytes(k.arch), x, dy, wlo, w16, ptr(dx), lr, p.B, p.IN, p.N, ldx, lddy, ldw, lddx,
        dx_f32, p.n_chunk, ptr(workspace), ptr(tickets), l2.read, l2.hi, l2.lo, ptr(bias), ptr(slope),
        cluster=p.cluster_dims)
