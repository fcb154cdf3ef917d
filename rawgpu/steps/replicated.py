"""One rank of a model trained by data parallelism: every GPU holds the whole model and 1/N of each step's batch, and
the gradients are summed over the GPUs before every update (steps/data.py). split.choose picks it where the
gradients move fewer bytes than tensor parallelism's activations would: small models, large batches.

`ReplicatedMLP` is the one-GPU model with buffers for its rows of the batch: rank r takes rows r x B/N .. (r + 1) x
B/N of every step's batch (`set_permutation`), so N ranks see the batches one GPU sees. Every rank starts from the
seed's model, takes the same summed gradients and the same updates, so the copies stay the same bits; a checkpoint
is rank 0's copy, which `join` checks against the others'. The training metrics each rank sums over its rows are
added up over the ranks when read (`train_metrics`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.driver import Launch, Stream
from ..kernels import PLANNING_SM_COUNT
from ..model.mlp import MLP
from ..model.recipe import Recipe
from .split import data_parallel_reason


class ReplicatedMLP(MLP):
    """Rank `rank` of `ranks`, planned with its step by steps.plan_model: as MLP."""

    def __init__(self, recipe: Recipe, ranks: int, rank: int, group: Any, arch: str = "sm_86",
                 sm_count: int = PLANNING_SM_COUNT, capacity: tuple[int, ...] | None = None):
        """group: the ranks' all-reduce (nccl.Communicator, or a stand-in in tests); None to plan only."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in 0..{ranks - 1}, got {rank}")
        if why := data_parallel_reason(recipe.batch, ranks):
            raise ValueError(f"data parallelism cannot run here: {why}")
        self.ranks, self.rank, self.group = ranks, rank, group
        super().__init__(recipe, arch, sm_count, capacity)
        self.loss_total = self.arena.tensor("loss_sum_total", 1, np.float64)
        self.correct_total = self.arena.tensor("correct_total", 1, np.int32)
        self.regression_totals = (self.arena.tensor("regression_sums_total", self.regression_sums.shape[0],
                                                    np.float64) if self.regression_sums is not None else None)

    def step_rows(self) -> int:
        return self.recipe.batch // self.ranks

    def rank_order(self, perm: np.ndarray) -> np.ndarray:
        """This rank's rows of every step's batch, in the order one GPU takes `perm` (int32, steps x rows)."""
        r, rows = self.recipe, self.rows
        whole = np.asarray(perm[:r.steps_per_epoch * r.batch], dtype=np.int32).reshape(r.steps_per_epoch, r.batch)
        return np.ascontiguousarray(whole[:, self.rank * rows:(self.rank + 1) * rows]).reshape(-1)

    def set_permutation(self, perm: np.ndarray) -> None:
        """This epoch's order: this rank's rows of it (rank_order). Synchronises."""
        self.perm.upload(self.rank_order(perm))

    # --- the metrics, summed over the ranks ------------------------------------------------------------------------

    def metrics_launches(self) -> list[Launch]:
        """The training metrics' sums over the ranks, into loss_total and correct_total."""
        if self.regression_sums is not None:
            sums = self.regression_sums
            return [self.group.all_reduce(sums, self.regression_totals, sums.shape[0])]
        return [self.group.all_reduce(self.loss_sum, self.loss_total, 1),
                self.group.all_reduce(self.correct, self.correct_total, 1)]

    def train_metrics(self, stream: Stream | None = None) -> tuple:
        """MLP.train_metrics' sums over every rank since the last zero_metrics. With a stream, every rank calls it at
        the same point (its all-reduces run there, then it synchronises); without, the sums the last
        metrics_launches() left."""
        if stream is not None:
            for launch in self.metrics_launches():
                launch.run(stream)
            stream.synchronize()
        if self.regression_totals is not None:
            return tuple(float(v) for v in self.regression_totals.download())
        return float(self.loss_total.download()[0]), int(self.correct_total.download()[0])

    def set_train_metrics(self, *sums: float) -> None:
        """A resumed epoch's sums so far: rank 0 holds them, so that the sum over the ranks counts them once."""
        super().set_train_metrics(*(v if self.rank == 0 else type(v)(0) for v in sums))

    # --- checkpoints --------------------------------------------------------------------------------------------

    def join(self, parts: list[tuple[list, dict[str, np.ndarray]]]) -> tuple[list, dict[str, np.ndarray]]:
        """The whole model's (parameters(), state()) from every rank's: rank 0's, which every other rank's must
        equal bit for bit (the copies never part)."""
        weights, state = parts[0]
        for r, (w, s) in enumerate(parts[1:], 1):
            same = all(a.tobytes() == b.tobytes() for pw, pb in zip(weights, w) for a, b in zip(pw, pb))
            if not same or any(s[key].tobytes() != v.tobytes() for key, v in state.items()):
                raise ValueError(f"rank {r}'s copy of the model differs from rank 0's")
        return weights, state

