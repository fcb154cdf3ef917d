"""The cluster step: training steps by one thread-block cluster whose shared memory holds the model,
cu/cluster_step.cu (sm_90).

Each of the 16 CTAs keeps a column slice of every layer for a whole launch; activations and partial sums move
between CTAs through distributed shared memory, and the master weights and biases are written back to the arena
when a launch ends. Small models only: batch <= 32, plain SGD, fp32 accumulation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import contract
from ..runtime.compiler import unit_of
from ..kernels import cluster as kc
from ..model.mlp import MLP
from ..model.recipe import Recipe, data_kind, loss_scale
from .base import Step, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch

MODEL = MLP  # the buffers it runs over
SEVERAL_GPUS = False
SUMMARY = "one thread-block cluster keeps the whole model in shared memory (1 kernel)"
RUNS_WHEN = (f"sm_90, batch <= {kc.ROWS}, plain SGD, ReLU, fp32 accumulation, and the model fits {kc.CTAS} SMs' shared "
             "memory: hidden <= 128 at 3 hidden layers")
WHEN_AUTO = "the model fits one thread-block cluster's shared memory: no launch or DRAM round trip inside a step"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the cluster step cannot run this recipe on this arch; None when it can."""
    if int(arch.removeprefix("sm_")) < 90:
        return f"the cluster step needs thread-block clusters (sm_90 or newer), this GPU is {arch}"
    if recipe.inputs != contract.CS_INPUTS:
        return f"the cluster step is built for images of {contract.CS_INPUTS} pixels, these have {recipe.inputs}"
    if recipe.classes > contract.HEAD_TILE_CLASSES:
        return f"the cluster step's head is one tile of {contract.HEAD_TILE_CLASSES} classes, not {recipe.classes}"
    if not recipe._pixels:
        return f"the cluster step reads uint8 images and their labels, not this data ({data_kind(recipe)})"
    if recipe.batch > kc.ROWS:
        return f"the cluster step takes batches of at most {kc.ROWS}, got {recipe.batch}"
    if not recipe._plain_sgd:
        return f"the cluster step runs plain SGD (no momentum, weight decay or Adam), not {recipe.optimizer_text}"
    if recipe.accum != "fp32":
        return "the cluster step accumulates in fp32 only"
    if recipe.activation != "relu":
        return f"the cluster step applies ReLU only, not {recipe.activation}"
    if not recipe.uniform:
        return f"the cluster step keeps one width for every hidden layer, not {recipe.hidden_label}"
    try:
        p = kc.plan(recipe.hidden, recipe.layers)
    except ValueError as exc:
        return str(exc)
    if p.smem_bytes + kc.PARAM_BYTES > kc.SHARED_LIMIT:
        return (f"the model does not fit in the shared memory of {kc.CTAS} SMs: {p.smem_bytes // 1024} KB per SM, "
                f"{(kc.SHARED_LIMIT - kc.PARAM_BYTES) // 1024} KB available")
    return None


class ClusterStep(Step):

    def __init__(self, model: "MLP"):
        super().__init__(model)
        r = model.recipe
        self.plan = kc.plan(r.hidden, r.layers)
        self.table = model.arena.tensor("cluster_params", kc.table_words(len(model.layers)), np.uint64)

    def kernel_units(self) -> set:
        return {unit_of(kc.SOURCE, self.plan.kernel)}

    def allocated(self) -> None:
        kc.check_schedulable(self.model.k, self.plan)
        self.table.upload(self.param_table())

    def launches(self, steps: int) -> list["Launch"]:
        return [kc.cluster_steps(self.model.k, self.table, self.plan, steps)]

    def describe(self) -> str:
        p = self.plan
        return f"cluster: 1 kernel, {p.ctas} CTAs sharing the model in shared memory ({p.smem_bytes // 1024} KB each)"

    def phases(self) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
        """Most phases end in a receive: an mbarrier wait for the partner CTAs' parts."""
        p = self.plan
        return (f"phases of the cluster step kernel ({p.ctas} CTAs x {p.n} columns, {p.smem_bytes // 1024} KB of "
                f"shared memory each)", ("phase", "ends in"), [tuple(x) for x in kc.phases(self.model.recipe.layers)])

    def param_table(self) -> np.ndarray:
        """The CsParams table (contract/cluster.py; pointers are device addresses, offsets from the shared-memory
        plan) as uint64 words, up to the model's last layer. Rates rounded to fp32 first."""
        m, plan = self.model, self.plan
        r, o = m.recipe, plan.offsets
        lr0, lr_min = r._scaled_lr
        f32 = lambda x: float(np.float32(x))  # noqa: E731
        p = contract.CsParams(
            images=m.images.ptr, labels=m.labels.ptr, perm=m.perm.ptr, step=m.counter.ptr, loss_sum=m.loss_sum.ptr,
            correct=m.correct.ptr, batch=r.batch, steps_per_epoch=r.steps_per_epoch,
            layers=len(m.layers), schedule=r._schedule_code, total_steps=r.total_steps, warmup_steps=r.warmup_steps,
            classes=r.classes, hs=plan.hs, n=plan.n, act_off=o["act"], raw_off=o["raw"], x_off=o["x"], dy_off=o["dy"],
            dlogit_off=o["dlogits"], rs_off=o["rs"], scratch_off=o["scratch"], misc_off=o["misc"],
            smem_bytes=plan.smem_bytes, lr0=f32(lr0), lr_min=f32(lr_min),
            dlogit_scale=f32(loss_scale(r.batch) / r.batch))
        for i, lay in enumerate(m.layers):
            t = p.layer[i]
            t.wlo, t.w16, t.b = lay.wlo.ptr, lay.w16.ptr, lay.b.ptr
            t.in_p, t.out_p = lay.wlo.shape
            t.rows, t.w_off, t.b_off = plan.rows[i], plan.w_off[i], plan.b_off[i]
        return np.frombuffer(contract.table_bytes(p, len(m.layers)), np.uint64)


def build(model: "MLP", options: StepOptions) -> ClusterStep:
    return ClusterStep(model)
