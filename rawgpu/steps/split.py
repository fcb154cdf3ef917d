"""How a model is split over several GPUs (plain Python, tested on CPU): which rank holds which part of each layer,
where the step's collectives go, what they move, and why the split was chosen.

Tensor parallel (the Megatron pattern) for wide layers: hidden layer i is split by columns when i is even (rank r
holds W[:, J_r] and b[J_r]; its output h[:, J_r] stays on the rank) and by rows when i is odd (W[J_r, :]: its input
is the column slice the layer below left, its output a partial sum over the ranks, all-reduced before the bias and
the ReLU, so the whole bias is on every rank and updated alike). Per pair of layers that is one all-reduce forward
and, for the column-split layer's input gradient (dy[:, J_r] W[:, J_r]^T, again a partial sum), one backward. The
head follows the last hidden layer: split by rows after a column-split layer (its logits all-reduced), whole on
every rank after a row-split one. Each rank streams 1/N of the weights and their optimiser state and updates only
its shard; what moves between GPUs is batch x hidden activations, in fp32 so the sums round as one GPU's do.

Data parallel (every rank the whole model and 1/N of the batch, the gradients all-reduced) moves every weight's
gradient each step: it pays only where that is less than the activations tensor parallelism moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.recipe import cdiv, pad8

SPLITS = ("columns", "rows", "whole")
ACTIVATION_BYTES = 4  # fp32 partial sums on the wire
GRADIENT_BYTES = 4  # data parallelism's fp32 gradients


@dataclass(frozen=True)
class LayerShard:
    """One linear layer on one rank (every rank's shard has the same shape)."""

    index: int
    split: str  # "columns" (W[:, J_r]), "rows" (W[J_r, :]) or "whole"
    fan_in: int  # this rank's rows of W
    fan_out: int  # this rank's columns of W
    reduce_output: bool  # the layer's output is a partial sum: all-reduced forward
    reduce_input_grad: bool  # the gradient of its input is a partial sum: all-reduced backward

    @property
    def sharded_bias(self) -> bool:
        """Only a column-split layer holds a slice of its bias; the others hold all of it."""
        return self.split == "columns"


@dataclass(frozen=True)
class TensorParallelPlan:
    ranks: int
    batch: int
    widths: tuple[int, ...]  # the model's (padded) widths, inputs ... classes, hidden widths padded to ranks x shard
    shards: tuple[LayerShard, ...]

    def collectives(self) -> list[tuple[str, int, int]]:
        """(direction, layer, floats) of every all-reduce of a step, in order: forward bottom-up, then backward
        top-down."""
        out = [("forward", s.index, self.batch * self.widths[s.index + 1]) for s in self.shards if s.reduce_output]
        out += [("backward", s.index, self.batch * self.widths[s.index])
                for s in reversed(self.shards) if s.reduce_input_grad]
        return out

    def wire_bytes(self) -> int:
        """Bytes each rank sends per step (a ring all-reduce sends 2 (N - 1) / N of its buffer)."""
        floats = sum(f for _, _, f in self.collectives())
        return int(2 * (self.ranks - 1) * floats * ACTIVATION_BYTES / self.ranks)

    def weights_per_rank(self) -> int:
        return sum(s.fan_in * s.fan_out for s in self.shards)


def shard(plan: TensorParallelPlan, layer: int, rank: int, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s part of layer `layer`'s whole weight w [fan_in, fan_out] (in the plan's padded widths) and bias
    b: every rank initialises the whole model from the seed and keeps its part, so N GPUs start where one does."""
    s = plan.shards[layer]
    if w.shape != (plan.widths[layer], plan.widths[layer + 1]) or b.shape != (plan.widths[layer + 1],):
        raise ValueError(f"layer {layer}: weight {w.shape} and bias {b.shape} are not the plan's "
                         f"{plan.widths[layer]} x {plan.widths[layer + 1]}")
    if s.split == "columns":
        cols = slice(rank * s.fan_out, (rank + 1) * s.fan_out)
        return w[:, cols].copy(), b[cols].copy()
    if s.split == "rows":
        return w[rank * s.fan_in:(rank + 1) * s.fan_in].copy(), b.copy()
    return w.copy(), b.copy()


def gather(plan: TensorParallelPlan, layer: int, ws: list[np.ndarray], bs: list[np.ndarray]) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
    """Layer `layer`'s whole weight and bias from every rank's part (shard's inverse; what a checkpoint holds). The
    bias of a layer that is not column-split is the same on every rank, which it checks."""
    s = plan.shards[layer]
    if len(ws) != plan.ranks or len(bs) != plan.ranks:
        raise ValueError(f"layer {layer}: {len(ws)} weights and {len(bs)} biases for {plan.ranks} ranks")
    if s.split == "columns":
        return np.concatenate(ws, axis=1), np.concatenate(bs)
    if any(not np.array_equal(v, bs[0]) for v in bs):
        raise ValueError(f"layer {layer}: the ranks' copies of its bias differ")
    if s.split == "rows":
        return np.concatenate(ws, axis=0), bs[0].copy()
    if any(not np.array_equal(v, ws[0]) for v in ws):
        raise ValueError(f"layer {layer}: the ranks' copies of its weight differ")
    return ws[0].copy(), bs[0].copy()


def shard_width(width: int, ranks: int) -> int:
    """A hidden width's share per rank, padded to 8 (the padding columns stay zero, as one GPU's do)."""
    return pad8(cdiv(width, ranks))


def plan_tensor_parallel(widths: list[int], batch: int, ranks: int) -> TensorParallelPlan:
    """The split of an MLP of `widths` (inputs, hidden ..., classes) over `ranks` GPUs."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(widths) < 3:
        raise ValueError("tensor parallelism splits hidden layers: the model has none")
    hidden = len(widths) - 2
    n = [shard_width(w, ranks) for w in widths[1:-1]]
    full = (pad8(widths[0]),) + tuple(ranks * x for x in n) + (widths[-1],)
    shards = []
    for i in range(hidden):
        if i % 2 == 0:  # columns: the whole input, a slice of the outputs
            shards.append(LayerShard(i, "columns", full[i], n[i], False, i > 0))
        else:  # rows: the slice the column-split layer below left, every output as a partial sum
            shards.append(LayerShard(i, "rows", n[i - 1], full[i + 1], True, False))
    if hidden % 2:  # the last hidden layer is column-split: the head takes its slice by rows
        shards.append(LayerShard(hidden, "rows", n[-1], full[-1], True, False))
    else:
        shards.append(LayerShard(hidden, "whole", full[-2], full[-1], False, False))
    return TensorParallelPlan(ranks, batch, full, tuple(shards))


@dataclass(frozen=True)
class ParallelChoice:
    kind: str  # "one GPU", "tensor" or "data"
    reason: str


MODES = ("auto", "tensor", "data")  # how the ranks share the model: `choose` decides, or the caller names one


def data_parallel_reason(batch: int, ranks: int) -> str | None:
    """Why data parallelism cannot split this batch over the ranks; None when it can."""
    return f"the batch of {batch} does not split over {ranks} ranks" if batch % ranks else None


def choose(widths: list[int], batch: int, ranks: int, wanted: str = "auto") -> ParallelChoice:
    """How `ranks` GPUs share the model, with the reason: `auto` takes the split that moves fewer bytes per step
    (tensor where the batch does not split); a named mode is taken where it can run (ValueError otherwise)."""
    if wanted not in MODES:
        raise ValueError(f"parallel mode must be one of {', '.join(MODES)}, got {wanted!r}")
    if wanted == "data" and (why := data_parallel_reason(batch, ranks)):
        raise ValueError(f"data parallelism cannot run here: {why}")
    if ranks == 1 and wanted == "auto":
        return ParallelChoice("one GPU", "one rank")
    tp = plan_tensor_parallel(widths, batch, ranks)
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    dp = int(2 * (ranks - 1) * params * GRADIENT_BYTES / ranks)
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    tensor_moves = (f"{len(tp.collectives())} all-reduces of activations move {mb(tp.wire_bytes())} per rank and "
                    f"step, the gradients would move {mb(dp)}")
    data_moves = f"the gradients move {mb(dp)} per rank and step, the activations would move {mb(tp.wire_bytes())}"
    if wanted != "auto":
        return ParallelChoice(wanted, "asked for by name: " + (tensor_moves if wanted == "tensor" else data_moves))
    if why := data_parallel_reason(batch, ranks):
        return ParallelChoice("tensor", f"{tensor_moves}; {why}")
    if tp.wire_bytes() <= dp:
        return ParallelChoice("tensor", tensor_moves)
    return ParallelChoice("data", data_moves)
