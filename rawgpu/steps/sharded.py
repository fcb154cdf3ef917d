"""One rank's part of a model split over several GPUs by tensor parallelism (the split itself: split.py).

`ShardedMLP` is the one-GPU model (mlp.py) over this rank's slice of every layer: at 3 hidden layers of H over N
ranks its layers are 784 -> H/N -> H -> H/N -> classes. Where a layer's output, or its input's gradient, is a partial
sum over the ranks, the GEMM writes it in fp32 (epilogue store32), the group sums it across the ranks, and
kernels/elementwise.finish_sum does what the GEMM's epilogue would have done: the bias and the activation forward,
its derivative backward. So with one rank every bit is the one-GPU layered step's (its long form).

Every rank draws its part of the model from the seed (the values one GPU draws there), so N GPUs start where one does;
`parameters()` and `state()` give the rank's part with the padding cut off, which `join_parameters` (split.gather)
puts back together. The group is anything with `all_reduce(send, recv, count)` returning a launch: nccl.Communicator
on several GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..runtime.driver import Launch, Stream
from ..kernels import PLANNING_SM_COUNT
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..kernels import l2 as kl2
from ..runtime.memory import Tensor
from ..model.mlp import MLP
from ..model.recipe import Recipe
from . import split

if TYPE_CHECKING:
    from ..kernels.gemm import GemmPlan


class ShardedMLP(MLP):
    """Rank `rank` of `plan.ranks`, planned with its step by steps.plan_model: as MLP."""

    def __init__(self, recipe: Recipe, ranks: int, rank: int, group: Any, arch: str = "sm_86",
                 sm_count: int = PLANNING_SM_COUNT, capacity: tuple[int, ...] | None = None):
        """group: the ranks' all-reduce (nccl.Communicator, or a stand-in in tests); None to plan only."""
        self.plan = split.plan_tensor_parallel(recipe.widths, recipe.batch, ranks)
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in 0..{ranks - 1}, got {rank}")
        self.rank, self.group = rank, group
        super().__init__(recipe, arch, sm_count, capacity)
        # the evaluation's partial sums, one buffer per shape of output they are finished into
        self.eval_sums = {shape: self.arena.tensor(f"eval_sum_{shape[1]}", shape, np.float32)
                          for shape in {out.shape for i, out in enumerate(self._eval_outs()) if self.reduces(i)}}

    # --- the shapes ---------------------------------------------------------------------------------------------

    def layer_widths(self) -> tuple[list[int], list[int]]:
        """This rank's chain: a column-split layer's true width is the real columns of its slice (the padding of the
        whole layer sits at the end of the last slices)."""
        plan, r = self.plan, self.recipe
        padded = [plan.widths[0]] + [s.fan_out for s in plan.shards[:-1]] + [r._padded_classes]
        true = [r.inputs] + [len(self._slice(i, r.widths[i + 1], 1)) for i in range(len(plan.shards))]
        return true, padded

    def reduces(self, i: int) -> bool:
        """Layer i's forward output is a partial sum over the ranks."""
        return self.plan.shards[i].reduce_output

    def forward_epilogue(self, i: int) -> str:
        return "store32" if self.reduces(i) else super().forward_epilogue(i)

    def _eval_outs(self) -> list[Tensor]:
        return [self.eval_h[i % 2] for i in range(len(self.layers) - 1)] + [self.eval_logits]

    # --- the forward, shared by the training step and the evaluation ---------------------------------------------

    def layer_forward(self, i: int, x: Tensor, out: Tensor, plan: "GemmPlan", total: Tensor | None,
                      keep: float = kl2.NORMAL, slope: Tensor | None = None) -> list[Launch]:
        """Layer i from x into out (fp16): the GEMM with its epilogue, or, where the output is a partial sum, the
        GEMM into `total` (fp32, out's shape), the sum over the ranks and the epilogue after it. slope: where the
        slope act'(z) goes for the backward (training, where the backward reads it)."""
        lay = self.layers[i]
        if not self.reduces(i):
            return [kg.gemm(self.k, plan, x, lay.w16, out, bias=lay.b, act=slope, workspace=self.workspace,
                            tickets=self.tickets, keep_b=keep)]
        count = plan.M * total.shape[1]
        return [kg.gemm(self.k, plan, x, lay.w16, total, workspace=self.workspace, tickets=self.tickets, keep_b=keep),
                self.group.all_reduce(total, total, count),
                ke.finish_sum(self.k, total, out, plan.M, super().forward_epilogue(i), bias=lay.b, act=slope)]

    def forward(self, x: Tensor, outs: list[Tensor], plans: list["GemmPlan"],
                keep: list[float] | None = None) -> list[Launch]:
        """The evaluation's forward (the training step's is steps/tensor.py's, through layer_forward too)."""
        launches, inp = [], x
        for i, (out, plan) in enumerate(zip(outs, plans)):
            launches += self.layer_forward(i, inp, out, plan, self.eval_sums.get(out.shape))
            inp = out
        return launches

    # --- the parameters -------------------------------------------------------------------------------------------

    def init_windows(self, i: int) -> tuple[ke.Window, ke.Window]:
        """This rank's part of layer i: the whole layer's values at the part's own indices, drawn on this GPU, so N
        GPUs start where one does and no rank ever holds a whole layer."""
        fan_out = self.recipe.widths[i + 1]
        rows, cols = self._slice(i, self.recipe.widths[i], 0), self._slice(i, fan_out, 1)
        row0, col0 = (int(ix[0]) if len(ix) else 0 for ix in (rows, cols))
        return (ke.Window((len(rows), len(cols)), (row0, col0), fan_out),
                ke.Window((1, len(cols)), (0, col0), fan_out))

    def _slice(self, i: int, whole: int, axis: int) -> np.ndarray:
        """The indices in the whole layer i of this rank's rows (axis 0) or columns (axis 1), padding left out."""
        s = self.plan.shards[i]
        split = {0: "rows", 1: "columns"}[axis]
        if s.split != split:
            return np.arange(whole, dtype=np.uint64)
        share = s.fan_in if axis == 0 else s.fan_out
        return np.arange(self.rank * share, min(whole, (self.rank + 1) * share), dtype=np.uint64)

    def set_state(self, biases: list[np.ndarray], state: dict[str, np.ndarray], steps_done: int,
                  stream: Stream) -> None:
        """Continue a run from the whole model's state (a checkpoint's, as one GPU's state() gives it): this rank's
        part of every entry."""
        mine = {key: self._part(int(key.split(".")[1]), v) for key, v in state.items()}
        super().set_state([self._part(i, b) for i, b in enumerate(biases)], mine, steps_done, stream)

    def _part(self, i: int, whole: np.ndarray) -> np.ndarray:
        """This rank's part of layer i's whole weight-shaped (2-D) or bias-shaped (1-D) array, padding left out."""
        cols = self._slice(i, whole.shape[-1], 1).astype(np.intp)
        if whole.ndim == 1:
            return whole[cols]
        return whole[self._slice(i, whole.shape[0], 0).astype(np.intp)][:, cols]

    def join(self, parts: list[tuple[list, dict[str, np.ndarray]]]) -> tuple[list, dict[str, np.ndarray]]:
        """The whole model's (parameters(), state()) from every rank's, in rank order."""
        return (join_parameters(self.plan, [p[0] for p in parts]), join_state(self.plan, [p[1] for p in parts]))


def join_parameters(plan: split.TensorParallelPlan,
                    parts: list[list[tuple[np.ndarray, np.ndarray]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole model's (W, b) per layer from every rank's parameters() (padding cut off, rank order)."""
    return [split.gather(plan, i, [p[i][0] for p in parts], [p[i][1] for p in parts])
            for i in range(len(plan.shards))]


def join_state(plan: split.TensorParallelPlan, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The whole model's state() entries from every rank's (rank order): weights and their optimiser state joined
    as their layer is split, the biases' state as its bias."""
    out = {}
    for key in parts[0]:
        layer = int(key.split(".")[1])
        split = plan.shards[layer].split
        values = [p[key] for p in parts]
        if values[0].ndim == 1:  # a bias's state: sliced only where the layer is split by columns
            out[key] = np.concatenate(values) if split == "columns" else _same(values, key)
        elif split == "whole":
            out[key] = _same(values, key)
        else:
            out[key] = np.concatenate(values, axis=1 if split == "columns" else 0)
    return out


def _same(values: list[np.ndarray], key: str) -> np.ndarray:
    if any(not np.array_equal(v, values[0]) for v in values):
        raise ValueError(f"{key}: the ranks' copies differ")
    return values[0]

