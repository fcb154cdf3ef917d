"""Launchers for cu/loss.cu: softmax cross-entropy (loss, accuracy, dlogits), the regression losses (loss, squared and
absolute error, the gradient) and the metrics resets."""

from __future__ import annotations

import numpy as np

from ..contract import XENT_MAX_THREADS
from ..contract.arch import sm90_or_later
from ..contract.loss import LX_CLASSES, LX_ROWS, LX_WARPS
from ..contract.loss import REGRESSION_LOSSES
from ..contract.shapes import MAX_OUTPUTS
from ..runtime.driver import Kernel, Launch
from ..runtime.memory import Tensor
from . import Kernels, require, require_exact_sums

SRC = "loss.cu"
# A warp per row (enough for 10 classes). One block takes a batch of up to ONE_BLOCK_ROWS rows, its rows one after
# another per warp: it gets the most warps (softmax_xent's per-warp sums are sized for them). Above, blocks of
# BLOCK_ROWS rows (or the caller's block_rows) spread the rows over the GPU in 8 warps each, one row a warp (a warp's
# rows are dependent round trips: more of them per warp is slower, not cheaper; docs/perf.md), and their sums meet
# exactly.
THREADS = XENT_MAX_THREADS
SPREAD_THREADS = 256
ONE_BLOCK_ROWS = 256
BLOCK_ROWS = 8
# Above the one-tile heads' classes a row is long (up to 1000 classes, a lane's 32 values in three passes): a warp
# per row, in blocks of WIDE_ROWS rows spread over the SMs, so the rows' round trips run side by side.
WIDE_CLASSES = 16
WIDE_ROWS = 8
# logits_xent takes the head's forward from the GEMM and softmax_xent up to this width of the layer below: beyond it
# a block's 16 rows by K are the longer path of the step than the GEMM split over the GPU (docs/perf.md).
FUSE_MAX_K = 512


def xent_rows_per_block(batch: int, classes: int = 10) -> int | None:
    """softmax_xent's rows per block: None where the whole batch takes one block (few classes, batch up to
    ONE_BLOCK_ROWS), else BLOCK_ROWS (WIDE_ROWS above WIDE_CLASSES classes)."""
    if classes > WIDE_CLASSES:
        return WIDE_ROWS
    return None if batch <= ONE_BLOCK_ROWS else BLOCK_ROWS


def xent_blocks(batch: int, classes: int = 10) -> int:
    """softmax_xent's blocks for a batch: above one, the launch needs an exact-sum scratch and ticket."""
    rows = xent_rows_per_block(batch, classes)
    return 1 if rows is None else -(-batch // rows)


def softmax_xent(k: Kernels, logits: Tensor, labels: Tensor, dlogits: Tensor | None, loss_sum: Tensor,
                 correct: Tensor, batch: int, classes: int = 10, grad_scale: float = 1.0,
                 mean_over: int | None = None, scratch: Tensor | None = None, ticket: Tensor | None = None,
                 block_rows: int | None = None) -> Launch:
    """loss_sum += sum of per-row cross-entropy, correct += argmax hits;
    dlogits = (softmax - onehot) * grad_scale / mean_over (grad_scale: a loss scale that keeps fp16 gradients
    normal; mean_over: the rows of the loss's mean, default batch; more where other GPUs hold the rest of the batch).

    logits fp16 [>= batch, ld >= classes]; dlogits None for evaluation (metrics only), else the logits' shape
    (its padding columns are written as zero). loss_sum float64 [1] and correct int32 [1] accumulate. Above
    ONE_BLOCK_ROWS rows the blocks' sums meet through scratch (int64 [>= 2]) and ticket (int32 [>= 1]), both zero, which
    the launch leaves zero (the model's exact-sum buffers). block_rows: rows per block instead of that rule.
    """
    require(logits, np.float16, what="logits")
    if len(logits.shape) != 2 or logits.shape[0] < batch or logits.shape[1] < classes:
        raise ValueError(f"logits: expected [>= {batch}, ld >= {classes}], got shape {logits.shape}")
    if batch < 1 or classes < 1:
        raise ValueError(f"batch ({batch}) and classes ({classes}) must be >= 1")
    require(labels, np.int32, what="labels")
    if len(labels.shape) != 1 or labels.shape[0] < batch:
        raise ValueError(f"labels: expected [>= {batch}], got shape {labels.shape}")
    mean_over = _gradient_rows(dlogits, logits, "dlogits", batch, grad_scale, mean_over)
    require(loss_sum, np.float64, (1,), what="loss_sum")
    require(correct, np.int32, (1,), what="correct")
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    rows = block_rows if block_rows is not None else xent_rows_per_block(batch, classes)
    blocks = 1 if rows is None else -(-batch // rows)
    if blocks > 1:
        require_exact_sums(scratch, ticket, 2, 1, f"softmax_xent over {batch} rows")
    return k.get(SRC, "softmax_xent").bind(
        blocks, THREADS if blocks == 1 else SPREAD_THREADS, 0, logits, logits.shape[1], labels, batch, classes,
        grad_scale / mean_over,
        0 if dlogits is None else dlogits, loss_sum, correct,
        batch if blocks == 1 else rows,
        0 if blocks == 1 else scratch, 0 if blocks == 1 else ticket)


def logits_xent(k: Kernels, h: Tensor, w16: Tensor, bias: Tensor, labels: Tensor, logits: Tensor, dlogits: Tensor,
                loss_sum: Tensor, correct: Tensor, batch: int, classes: int, grad_scale: float = 1.0,
                mean_over: int | None = None, scratch: Tensor | None = None, ticket: Tensor | None = None) -> Launch:
    """The head's forward and softmax_xent in one launch: logits = fp16(h @ W + bias) for h fp16 [>= batch, K] (K a
    multiple of 8), W16 fp16 [K, LX_CLASSES] and bias float32 [LX_CLASSES] (the head at up to LX_CLASSES classes);
    then softmax_xent's loss, hits and dlogits on those logits (logits, dlogits fp16 [>= batch, LX_CLASSES]). Above one
    block of LX_ROWS rows, the blocks' sums meet through scratch and ticket as softmax_xent's."""
    require(h, np.float16, what="h")
    if len(h.shape) != 2 or h.shape[0] < batch or h.shape[1] % 8:
        raise ValueError(f"h: expected [>= {batch}, a multiple of 8], got shape {h.shape}")
    K = h.shape[1]
    require(w16, np.float16, (K, LX_CLASSES), what="w16")
    require(bias, np.float32, (LX_CLASSES,), what="bias")
    if not 1 <= classes <= LX_CLASSES or batch < 1:
        raise ValueError(f"logits_xent takes 1..{LX_CLASSES} classes and batch >= 1, got {classes} and {batch}")
    require(labels, np.int32, what="labels")
    if len(labels.shape) != 1 or labels.shape[0] < batch:
        raise ValueError(f"labels: expected [>= {batch}], got shape {labels.shape}")
    require(logits, np.float16, what="logits")
    if len(logits.shape) != 2 or logits.shape[0] < batch or logits.shape[1] != LX_CLASSES:
        raise ValueError(f"logits: expected [>= {batch}, {LX_CLASSES}], got shape {logits.shape}")
    if dlogits is None:
        raise ValueError("logits_xent trains: it needs dlogits (an evaluation runs the GEMM and softmax_xent)")
    mean_over = _gradient_rows(dlogits, logits, "dlogits", batch, grad_scale, mean_over)
    require(loss_sum, np.float64, (1,), what="loss_sum")
    require(correct, np.int32, (1,), what="correct")
    blocks = -(-batch // LX_ROWS)
    if blocks > 1:
        require_exact_sums(scratch, ticket, 2, 1, f"logits_xent over {batch} rows")
    kernel = k.get(SRC, "logits_xent")
    return kernel.bind(
        blocks, LX_WARPS * 32, _two_to_an_sm(k, kernel), h, K, K, w16, bias, labels, batch, classes,
        grad_scale / mean_over, logits, dlogits, loss_sum, correct, 0 if blocks == 1 else scratch,
        0 if blocks == 1 else ticket)


def _two_to_an_sm(k: Kernels, kernel: Kernel) -> int:
    """Shared memory for logits_xent to ask for (it uses none of it) so that no more than two of its blocks share an
    SM, on sm_90+. There it starts while the GEMM before it still holds nearly every SM (programmatic dependent
    launch), and its small blocks would all be placed on the few SMs left free and run there, eight or more to an SM
    (docs/perf.md). Asked of the driver once per Kernels."""
    if not sm90_or_later(k.arch):
        return 0
    if "logits_xent_shared" not in k.facts:
        nbytes = 0
        while kernel.max_blocks_per_sm(LX_WARPS * 32, nbytes) > 2:
            nbytes += 8192
        k.facts["logits_xent_shared"] = nbytes
    return k.facts["logits_xent_shared"]


def _gradient_rows(grad: Tensor | None, out: Tensor, what: str, batch: int, grad_scale: float,
                   mean_over: int | None) -> int:
    """The gradient's buffer (out's shape, or None: evaluation) and scale checked; the rows of the loss's mean."""
    if grad is not None:
        require(grad, np.float16, out.shape, what=what)
    mean_over = batch if mean_over is None else mean_over
    if mean_over < batch:
        raise ValueError(f"mean_over ({mean_over}) must be at least the batch ({batch})")
    if not (grad_scale > 0 and np.isfinite(grad_scale)):
        raise ValueError(f"grad_scale must be a positive finite number, got {grad_scale}")
    return mean_over


def zero_metrics(k: Kernels, loss_sum: Tensor, correct: Tensor) -> Launch:
    """loss_sum = 0, correct = 0 (a kernel, so the reset can live inside a graph)."""
    require(loss_sum, np.float64, (1,), what="loss_sum")
    require(correct, np.int32, (1,), what="correct")
    return k.get(SRC, "zero_metrics").bind(1, 32, 0, loss_sum, correct)


REGRESSION_SUMS = 3  # loss, squared error, absolute error


def regression_loss(k: Kernels, pred: Tensor, targets: Tensor, dpred: Tensor | None, sums: Tensor, batch: int,
                    outputs: int, loss: str = "mse", grad_scale: float = 1.0, mean_over: int | None = None,
                    scratch: Tensor | None = None, ticket: Tensor | None = None) -> Launch:
    """sums += (the rows' losses, each the mean over the outputs of l(pred - y); the squared errors; the absolute
    errors); dpred = l'(pred - y) * grad_scale / (mean_over * outputs), zero in the padding columns. loss: mse (l = e^2),
    l1 (|e|) or huber (delta 1). pred fp16 [>= batch, ld >= outputs]; targets float32 [>= batch, outputs]; dpred None
    for evaluation, else pred's shape; sums float64 [3]. Above ONE_BLOCK_ROWS rows, scratch (int64 [>= 3]) and ticket
    as softmax_xent's."""
    if loss not in REGRESSION_LOSSES:
        raise ValueError(f"unknown regression loss {loss!r}: use one of {', '.join(REGRESSION_LOSSES)}")
    if not 1 <= outputs <= MAX_OUTPUTS:
        raise ValueError(f"outputs must be in 1..{MAX_OUTPUTS}, got {outputs}")
    require(pred, np.float16, what="pred")
    if len(pred.shape) != 2 or pred.shape[0] < batch or pred.shape[1] < outputs:
        raise ValueError(f"pred: expected [>= {batch}, ld >= {outputs}], got shape {pred.shape}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    require(targets, np.float32, what="targets")
    if len(targets.shape) != 2 or targets.shape[0] < batch or targets.shape[1] != outputs:
        raise ValueError(f"targets: expected [>= {batch}, {outputs}], got shape {targets.shape}")
    mean_over = _gradient_rows(dpred, pred, "dpred", batch, grad_scale, mean_over)
    require(sums, np.float64, (REGRESSION_SUMS,), what="sums")
    blocks = xent_blocks(batch)
    if blocks > 1:
        require_exact_sums(scratch, ticket, REGRESSION_SUMS, 1, f"regression_loss over {batch} rows")
    return k.get(SRC, "regression_loss").bind(
        blocks, THREADS if blocks == 1 else SPREAD_THREADS, 0, pred, pred.shape[1], targets, batch, outputs,
        REGRESSION_LOSSES[loss], grad_scale / (mean_over * outputs), 0 if dpred is None else dpred, sums,
        batch if blocks == 1 else BLOCK_ROWS, 0 if blocks == 1 else scratch, 0 if blocks == 1 else ticket)


def zero_sums(k: Kernels, sums: Tensor) -> Launch:
    """sums = 0 (the regression metrics; a kernel, so the reset can live inside a graph)."""
    require(sums, np.float64, what="sums")
    if len(sums.shape) != 1 or not 1 <= sums.shape[0] <= 32:
        raise ValueError(f"sums: expected [1..32], got shape {sums.shape}")
    return k.get(SRC, "zero_sums").bind(1, 32, 0, sums, sums.shape[0])
