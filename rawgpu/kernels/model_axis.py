"""Launchers of the models step (steps/models.py): one launch runs a kernel of today's step for every model of a
sweep. Each is model 0's launch, made and checked by the family's own launcher, plus a model axis: the grid
repeats over the models and each model's operands sit a fixed stride after model 0's (the *_models.cu sources,
rawgpu/contract/model_axis.py). The buffers are model-major: [N x rows, cols] for a matrix of N models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import contract
from ..contract import (GATHER_MODELS_SOURCE, DX_UPDATE_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE,
                        GEMM_MODELS_SOURCE, HEAD_MODELS_SOURCE, LOSS_MODELS_SOURCE, OPTIM_WORDS, UPDATE_EPILOGUES)
from ..runtime.driver import Launch
from ..runtime.memory import Tensor
from . import Kernels, require
from . import gather as kd
from . import dx_update as ku
from . import elementwise as ke
from . import gemm as kg
from . import head as kh
from . import loss as kl

SCHEDULE_WORDS = 4  # a model's row of the schedule table (float64): lr0, lr_min, warmup_steps, kind code
# softmax_xent's rows per block over models: a warp per row runs a row at a time, so a batch in one block waits for
# its rows' loads one after another; 2 rows per warp spread them over the GPU (their sums meet exactly)
XENT_ROWS_PER_BLOCK = 16
GATHER_BLOCKS_PER_SM = 16  # the gather's small blocks (a warp or two) resident at once per SM over all models


@dataclass
class _Bound:
    """What a family's launcher would launch for one model: its source, kernel, geometry and arguments."""

    source: str
    name: str
    grid: Any = None
    block: Any = None
    shared_bytes: int = 0
    args: tuple = ()
    cluster: Any = 1

    def bind(self, grid, block, shared_bytes, *args, cluster=1, cooperative=False) -> "_Bound":
        if cooperative:
            raise ValueError(f"{self.name}: a cooperative launch has no model axis")
        self.grid, self.block, self.shared_bytes, self.args, self.cluster = grid, block, shared_bytes, args, cluster
        return self


class _Recorder:
    """Stands in for Kernels in a launcher of one model: it builds nothing and returns what would be bound."""

    def __init__(self, k: Kernels):
        self.arch, self.activation = k.arch, k.activation

    def get(self, source: str, name: str) -> _Bound:
        return _Bound(source, name)


def _over_models(k: Kernels, one: _Bound, source: str, axis: int, models: int, strides: tuple[int, ...]) -> Launch:
    """`one` (model 0's launch) over `models` models: its grid times `models` along `axis` (0: x, where gemm.cu
    packs every model's m tiles after model 0's), the strides appended to its arguments."""
    grid = list(one.grid) if isinstance(one.grid, (tuple, list)) else [one.grid]
    grid += [1] * (3 - len(grid))
    if grid[axis] != 1 and axis != 0:
        raise ValueError(f"{one.name}: grid {tuple(grid)} already uses axis {axis}, the model axis")
    grid[axis] *= models
    cluster = list(one.cluster) if isinstance(one.cluster, (tuple, list)) else [one.cluster, 1, 1]
    if cluster[axis] != 1:  # a cluster is one model's: it may not span the model axis
        raise ValueError(f"{one.name}: clusters {tuple(cluster)} span axis {axis}, the model axis")
    kernel = k.get(source, one.name)
    return kernel.bind(tuple(grid), one.block, one.shared_bytes, *one.args, *strides, cluster=tuple(cluster))


def _models(t: Tensor, n: int, what: str) -> int:
    """Elements of one model's part of `t` (model-major, n parts)."""
    if t.shape[0] % n:
        raise ValueError(f"{what}: {t.name} of shape {t.shape} is not {n} models' parts")
    return t.size // n


def model_part(t: Tensor, n: int, i: int = 0) -> Tensor:
    """Model i's part of a model-major buffer of n models, as a tensor of its own."""
    per = _models(t, n, "model_part")
    shape = (t.shape[0] // n, *t.shape[1:])
    return t.view(shape, offset_bytes=i * per * t.dtype.itemsize, name=f"{t.name}[{i}]")


def gather(k: Kernels, n: int, images: Tensor, labels: Tensor, perm: Tensor, step: Tensor, x: Tensor, y: Tensor,
           batch: int, steps_per_epoch: int, optim: Tensor, schedules: Tensor, total_steps: int,
           early: bool = False, sm_count: int | None = None, mean: Tensor | None = None,
           inv_std: Tensor | None = None) -> Launch:
    """Every model's batch: model m's rows of x and y from its own order perm[m], and its optimiser row optim[m] for
    the step from its own schedule (schedules[m]: lr0, lr_min, warmup steps, kind code; total_steps is the run's,
    the same for all). perm int32 [n, >= batch x steps_per_epoch], x fp16 [n x batch, ld], y int32 [n x batch].
    images: uint8 images with byte labels (gather.gather_batch's), or a table's features (uint8, fp16, fp32) with
    int32 labels (gather.gather_table's, standardized where mean and inv_std, the data's, are given).
    early: as gather_batch's. sm_count: the GPU's SMs, so that every model's blocks are resident at once (a block
    per row up to GATHER_BLOCKS_PER_SM per SM, then blocks of several rows): a block's dependent loads (counter,
    order, pixels) start before the kernel before ends only in the first wave."""
    require(schedules, np.float64, (n, SCHEDULE_WORDS), what="schedules")
    require(optim, np.float32, (n, OPTIM_WORDS), what="optim")
    if len(perm.shape) != 2 or perm.shape[0] != n:
        raise ValueError(f"perm: expected [{n}, rows], got shape {perm.shape}")
    order = model_part(perm, n).view((perm.shape[1],))
    options = dict(optim=model_part(optim, n).view((OPTIM_WORDS,)), schedule=kd.Schedule(0.0, 0.0, total_steps, 0, 0),
                   early=early, blocks=None if sm_count is None else max(1, min(batch,
                                                                                 GATHER_BLOCKS_PER_SM * sm_count // n)))
    parts = (_Recorder(k), images, labels, order, step, model_part(x, n), model_part(y, n), batch, steps_per_epoch)
    one = (kd.gather_batch(*parts, **options) if labels.dtype == np.uint8 else
           kd.gather_table(*parts, mean=mean, inv_std=inv_std, **options))
    return _over_models(k, one, GATHER_MODELS_SOURCE, 1, n,
                        (perm.shape[1], _models(x, n, "x"), _models(y, n, "y"), schedules))


def gemm(k: Kernels, n: int, plan: kg.GemmPlan, A: Tensor, B: Tensor, out: Tensor, *, shared_a: bool = False,
         bias: Tensor | None = None, act: Tensor | None = None, mom: Tensor | None = None, var: Tensor | None = None,
         w16: Tensor | None = None, optim: Tensor | None = None) -> Launch:
    """`plan` (one model's GEMM, without split-K) for every model: operands model-major as kernels.gemm takes one
    model's, the optimiser table [n, words]. shared_a: every model reads the same A (the evaluation's input)."""
    if plan.splits != 1 or plan.cluster or plan.config.tma or plan.config.persistent:
        raise ValueError(f"{plan.kernel}: a GEMM over models runs whole tiles, one block each (no split-K, cluster, "
                         "tensor copies or resident grid)")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731 - model 0's operand
    one = kg.gemm(_Recorder(k), plan, A if shared_a else part(A), part(B), part(out), bias=part(bias), act=part(act),
                  mom=part(mom), var=part(var), w16=part(w16),
                  optim=None if optim is None else part(optim).view((OPTIM_WORDS,)))
    per = lambda t: 0 if t is None else _models(t, n, t.name)  # noqa: E731 - elements of one model's part
    strides = (0 if shared_a else per(A), per(B), per(out) * out.dtype.itemsize, per(bias), per(act),
               per(out) if plan.epilogue in UPDATE_EPILOGUES else 0, 0 if optim is None else 1)
    return _over_models(k, one, GEMM_MODELS_SOURCE, 0, n, strides)


def softmax_xent(k: Kernels, n: int, logits: Tensor, labels: Tensor, dlogits: Tensor | None, loss_sum: Tensor,
                 correct: Tensor, batch: int, classes: int, grad_scale: float = 1.0, shared_labels: bool = False,
                 scratch: Tensor | None = None, ticket: Tensor | None = None) -> Launch:
    """Every model's softmax cross-entropy (loss.softmax_xent's), model m's metrics in loss_sum[m] and correct[m];
    logits and dlogits [n x batch, ld]; labels [n x batch], or one batch every model shares (shared_labels);
    scratch int64 [n, >= 2] and ticket int32 [n, >= 1] where the batch takes several blocks."""
    require(loss_sum, np.float64, (n,), what="loss_sum")
    require(correct, np.int32, (n,), what="correct")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731
    if scratch is not None and (scratch.shape != (n, 2) or ticket is None or ticket.shape != (n, 1)):
        raise ValueError(f"softmax_xent over {n} models: scratch [{n}, 2] and ticket [{n}, 1]")
    one = kl.softmax_xent(_Recorder(k), part(logits), labels if shared_labels else part(labels), part(dlogits),
                          loss_sum.view((1,)), correct.view((1,)), batch, classes, grad_scale,
                          scratch=part(scratch), ticket=part(ticket),
                          block_rows=XENT_ROWS_PER_BLOCK if scratch is not None else None)
    return _over_models(k, one, LOSS_MODELS_SOURCE, 1, n,
                        (_models(logits, n, "logits"), 0 if shared_labels else _models(labels, n, "labels")))


def bias_update(k: Kernels, n: int, dy: Tensor, bias: Tensor, m: Tensor | None, v: Tensor | None, optim: Tensor,
                rows: int, scratch: Tensor | None = None, tickets: Tensor | None = None) -> Launch:
    """Every model's bias step (elementwise.bias_update's): dy [n x rows, ld], bias and its state [n x cols], optim
    [n, words], scratch int64 [n, >= cols] and tickets int32 [n, >= column tiles] where the rows are split."""
    require(optim, np.float32, (n, OPTIM_WORDS), what="optim")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731
    one = ke.bias_update(_Recorder(k), part(dy), part(bias), part(m), part(v), part(optim).view((OPTIM_WORDS,)), rows,
                         part(scratch), part(tickets))
    return _over_models(k, one, ELEMENTWISE_MODELS_SOURCE, 2, n,
                        (_models(dy, n, "dy"), _models(bias, n, "bias"),
                         0 if scratch is None else _models(scratch, n, "scratch"),
                         0 if tickets is None else _models(tickets, n, "tickets")))


def dx_update(k: Kernels, n: int, plan: ku.DxUpdatePlan, x: Tensor, dy: Tensor, wlo: Tensor, w16: Tensor,
              mw: Tensor | None, vw: Tensor | None, dx: Tensor | None, optim: Tensor, bias: Tensor,
              mb: Tensor | None, vb: Tensor | None, slope: Tensor | None = None) -> Launch:
    """Every model's one-pass backward of a layer (dx_update.dx_update's, without L2 hints): x, dy, dx and slope
    [n x batch, cols], the weight-shaped operands [n x in, out], the bias and its state [n x out], optim [n, words].
    The column ranges of a band add their dx in a cluster or not at all (plan.splits == 1): no workspace to share."""
    if dx is not None and plan.splits > 1 and not plan.cluster:
        raise ValueError(f"{plan.kernel} over models: {plan.splits} column ranges would add their dx in a workspace")
    require(optim, np.float32, (n, OPTIM_WORDS), what="optim")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731
    one = ku.dx_update(_Recorder(k), plan, part(x), part(dy), part(wlo), part(w16), part(mw), part(vw), part(dx),
                       part(optim).view((OPTIM_WORDS,)), bias=part(bias), mb=part(mb), vb=part(vb), slope=part(slope))
    if slope is not None and slope.shape != dx.shape:  # the kernel finds model m's slope at dx's model stride
        raise ValueError(f"dx_update over models: slope {slope.shape} shaped as dx {dx.shape}")
    strides = (_models(x, n, "x"), _models(dy, n, "dy"), _models(wlo, n, "W lo"),
               0 if dx is None else _models(dx, n, "dx") * dx.dtype.itemsize, _models(bias, n, "bias"))
    return _over_models(k, one, DX_UPDATE_MODELS_SOURCE, 0, n, strides)


def streams_update(arch: str, batch: int, family: str) -> bool:
    """Whether a layer's update alone (no dx) over models of `batch` rows with `family`'s update ("sgd", "adam") can
    run streamed on `arch` (update_stream): its batch tile and family have a streamed instance there."""
    tile = ku.batch_tile(batch)
    return tile is not None and contract.dxu_stream_kernel_name(tile, family) in contract.dxu_stream_kernels(arch)


def update_stream(k: Kernels, n: int, plan: ku.DxUpdatePlan, x: Tensor, dy: Tensor, wlo: Tensor, w16: Tensor,
                  mw: Tensor | None, vw: Tensor | None, optim: Tensor, bias: Tensor, mb: Tensor | None,
                  vb: Tensor | None, blocks: int) -> Launch:
    """Every model's update alone (a first layer: dx_update without dx), streamed: `blocks` blocks (about one an SM)
    split the chunks of every model's row bands into equal runs, each walked through one pipeline (dx_update.cu's
    update_stream_body); each chunk's arithmetic is the band kernel's, so each model's bits are too. plan: the band
    kernel's plan of one model, in one column range. Operands as dx_update's."""
    if plan.splits != 1 or plan.roles != 1:
        raise ValueError(f"the streamed update takes one column range and one role, not {plan.splits} x {plan.roles}")
    if not streams_update(k.arch, plan.B, plan.family):
        raise ValueError(f"no streamed update for a {plan.rows}-row tile with {plan.family} on {k.arch}")
    if blocks < 1:
        raise ValueError(f"the streamed update needs at least one block, not {blocks}")
    require(optim, np.float32, (n, OPTIM_WORDS), what="optim")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731
    one = ku.dx_update(_Recorder(k), plan, part(x), part(dy), part(wlo), part(w16), part(mw), part(vw), None,
                       part(optim).view((OPTIM_WORDS,)), bias=part(bias), mb=part(mb), vb=part(vb))
    strides = (_models(x, n, "x"), _models(dy, n, "dy"), _models(wlo, n, "W lo"), 0, _models(bias, n, "bias"))
    chunks = n * plan.bands * -(-plan.N // ku.BN)
    kernel = k.get(DX_UPDATE_MODELS_SOURCE, plan.stream_kernel)
    return kernel.bind((min(blocks, chunks), 1, 1), one.block,
                       contract.dxu_stream_smem_bytes(plan.rows, plan.family, k.arch), *one.args, *strides, n)


def head_step(k: Kernels, n: int, plan: kh.HeadPlan, h: Tensor, labels: Tensor, wlo: Tensor, w16: Tensor,
              bias: Tensor, optim: Tensor, logits: Tensor, dlogits: Tensor, dh: Tensor, loss_sum: Tensor,
              correct: Tensor, classes: int, grad_scale: float, step: Tensor, mw: Tensor | None = None,
              vw: Tensor | None = None, mb: Tensor | None = None, vb: Tensor | None = None,
              slope: Tensor | None = None) -> Launch:
    """Every model's head step (head.head_step's), one cluster per model: h, dh, slope [n x batch, K], labels
    [n x batch], logits and dlogits [n x batch, 16], the head's weight-shaped operands [n x K, 16], its bias and state
    [n x 16], optim [n, words], loss_sum and correct [n]; model 0's cluster moves the shared step counter."""
    require(optim, np.float32, (n, OPTIM_WORDS), what="optim")
    require(loss_sum, np.float64, (n,), what="loss_sum")
    require(correct, np.int32, (n,), what="correct")
    part = lambda t: None if t is None else model_part(t, n)  # noqa: E731
    one = kh.head_step(_Recorder(k), plan, part(h), part(labels), part(wlo), part(w16), part(bias),
                       part(optim).view((OPTIM_WORDS,)), part(logits), part(dlogits), part(dh), loss_sum.view((1,)),
                       correct.view((1,)), classes, grad_scale, step=step, mw=part(mw), vw=part(vw), mb=part(mb),
                       vb=part(vb), slope=part(slope))
    per = lambda t, what: _models(t, n, what)  # noqa: E731
    if per(logits, "logits") != per(labels, "labels") * kh.CLASSES or per(dlogits, "dlogits") != per(
            logits, "logits") or per(dh, "dh") != per(h, "h") or (slope is not None and slope.shape != h.shape):
        raise ValueError("head_step over models: logits and dlogits [n x batch, 16], dh and slope shaped as h")
    strides = (_models(h, n, "h"), _models(labels, n, "labels"), _models(wlo, n, "W lo"), _models(bias, n, "bias"))
    return _over_models(k, one, HEAD_MODELS_SOURCE, 1, n, strides)
