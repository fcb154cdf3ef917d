"""The tensor-parallel step: one rank's part of a training step over a model split across GPUs
(steps/sharded.py).

The layered step over the rank's slices, with the ranks' sums where the split puts them: after each row-split layer's
forward GEMM (its output) and after each column-split layer's input gradient (steps/split.py: one all-reduce per
pair of layers each way). Where the layered step's short form runs (layered.one_pass_reason), each layer's backward
is its one pass over the weights and their state, writing a column-split layer's input gradient, a partial sum, as
raw fp32 sums. The head stays a GEMM, the loss and its backward apart: its logits are a sum over the ranks.
Elsewhere (and with StepOptions(short=False)) it is the long form, one kernel per layer and role. The collectives are
launches like the kernels, so the CUDA graph of a step holds them. steps.choose picks it for a model on several GPUs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..kernels import gather as kd
from ..kernels import dx_sgd as kb
from ..kernels import dx_update as ku
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..kernels import l2 as kl2
from ..model.optimizer import update_family
from .sharded import ShardedMLP
from ..model.recipe import Recipe, loss_scale
from . import layered
from .base import ChainStep, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch


@dataclass
class ShardPlans:
    """One layer's launches on this rank: its forward GEMM, and its backward as the layered step runs it (dx and
    dW GEMMs, or one pass over the weights)."""

    fwd: kg.GemmPlan
    dx: kg.GemmPlan | None  # None for the first layer, and where the one pass writes dx
    dw: kg.GemmPlan | None  # None where the one pass updates
    bwd: kb.DxSgdPlan | ku.DxUpdatePlan | None


MODEL = ShardedMLP  # one rank's buffers
SEVERAL_GPUS = True
SUMMARY = "a model split over several GPUs by its layers: one rank's slices, the activations summed over the ranks"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """On one GPU, never: it is one rank's step of a model on several (--gpus)."""
    return "it is one rank's step of a model on several GPUs (--gpus N)"


class TensorStep(ChainStep):

    def __init__(self, model: "ShardedMLP", options: StepOptions):
        super().__init__(model, options.overlap)
        r, arch, B, padded = model.recipe, model.arch, model.recipe.batch, model.padded
        plan = functools.partial(kg.plan_gemm, accum=r._kernel_accum, sm_count=model.sm_count, arch=arch,
                                 capacity=model.cluster_capacity)
        one_pass = options.short and layered.one_pass_reason(r, arch) is None and kg.sm90_or_later(arch)
        self.plans = []
        for i, shard in enumerate(model.plan.shards):
            pin, pout, reduced = padded[i], padded[i + 1], shard.reduce_input_grad
            bwd = None
            if one_pass:
                cap, dx = model.cluster_capacity, i > 0
                bwd = (kb.plan_dx_sgd(B, pin, pout, model.sm_count, arch=arch, capacity=cap, dx=dx)
                       if kb.supported(B, r._plain_sgd, r._kernel_accum)
                       else ku.plan_dx_update(B, pin, pout, r.optimizer, arch, model.sm_count, capacity=cap, dx=dx))
            self.plans.append(ShardPlans(
                fwd=plan(B, pout, pin, "rr", model.forward_epilogue(i)),
                dx=plan(B, pin, pout, "rc", "store32" if reduced else "dact") if i and bwd is None else None,
                dw=(plan(pin, pout, B, "cr", update_family(r.optimizer), states=r._state_tensors)
                    if bwd is None else None),
                bwd=bwd))
        self.l2 = kl2.plan_l2([lay.w16.nbytes for lay in model.layers], [p.bwd is not None for p in self.plans],
                              options.l2_bytes, options.l2_budget)
        # the partial sums: a forward output's into its activation's shape, an input gradient's into its gradient's
        shapes = {model.acts[i + 1].shape for i, s in enumerate(model.plan.shards) if s.reduce_output}
        shapes |= {model.grads[i].shape for i, s in enumerate(model.plan.shards) if s.reduce_input_grad}
        self.sums = {shape: model.arena.tensor(f"partial_sum_{shape[1]}", shape, np.float32) for shape in shapes}

    def kernel_units(self) -> set:
        gemms = kg.plan_units([p for lp in self.plans for p in (lp.fwd, lp.dx, lp.dw)], self.model.arch)
        return gemms | {lp.bwd.unit for lp in self.plans if lp.bwd is not None}

    def split_plans(self) -> list:
        return [p for lp in self.plans for p in (lp.fwd, lp.dx, lp.dw, lp.bwd) if p is not None]

    def kernel_count(self) -> int:
        """Kernels per step: gather, per layer its forward, its input gradient (a GEMM of its own or in the one
        pass) and its update (one pass, or dW with the update and the bias's), an epilogue after each sum over the
        ranks; the loss and the counter."""
        backward = sum((p.dx is not None) + (1 if p.bwd is not None else 2) for p in self.plans)
        return 1 + len(self.plans) + backward + len(self.model.plan.collectives()) + 2

    def describe(self) -> str:
        plan = self.model.plan
        gpus = f"{plan.ranks} GPU{'s' if plan.ranks > 1 else ''}"
        return (f"tensor parallel over {gpus}: {self.kernel_count()} kernels and {len(plan.collectives())} "
                f"all-reduces per step ({self.model.choice.reason})")

    def _one_step(self) -> list["Launch"]:
        """gather (+ the step's optimiser values), forward, loss, backward with fused updates, step counter += 1."""
        m = self.model
        r, k, B = m.recipe, m.k, m.recipe.batch
        lr0, lr_min = r._scaled_lr
        schedule = kd.Schedule(lr0, lr_min, r.total_steps, r.warmup_steps, r.schedule)
        out = [m.gather(m.images, m.labels, m.perm, m.counter, m.acts[0], m.y, B, r.steps_per_epoch, optim=m.optim,
                        schedule=schedule)]
        for i, p in enumerate(self.plans):
            out += m.layer_forward(i, m.acts[i], m.acts[i + 1], p.fwd, self.sums.get(m.acts[i + 1].shape),
                                   self.l2[i].forward, slope=m.slopes[i + 1])
        out.append(m.loss(m.acts[-1], m.y, m.grads[-1], B, grad_scale=loss_scale(B)))
        for i in range(len(self.plans) - 1, -1, -1):
            lay, p, x, dy = m.layers[i], self.plans[i], m.acts[i], m.grads[i + 1]
            # dx: fp16 times act', or, where it is a partial sum, the raw fp32 sums, then their sum over the ranks
            # and act' (after the update, so the ranks' skew meets the collective last)
            reduced = m.plan.shards[i].reduce_input_grad
            total = self.sums[m.grads[i].shape] if reduced else None
            dx = (total if reduced else m.grads[i]) if i else None
            if p.dx is not None:  # reads W16 before this layer's update rewrites it
                out.append(kg.gemm(k, p.dx, dy, lay.w16, dx, act=None if reduced else m.saved_for_backward(i),
                                   workspace=m.workspace, tickets=m.tickets))
            if isinstance(p.bwd, kb.DxSgdPlan):  # dx in the same pass
                out.append(kb.dx_sgd(k, p.bwd, x, dy, lay.wlo, lay.w16, dx, m.optim, m.workspace, m.tickets,
                                     self.l2[i], bias=lay.b, slope=None if reduced else m.slopes[i]))
            elif p.bwd is not None:
                out.append(ku.dx_update(k, p.bwd, x, dy, lay.wlo, lay.w16, lay.mw, lay.vw, dx, m.optim,
                                        m.workspace, m.tickets, self.l2[i], bias=lay.b, mb=lay.mb, vb=lay.vb,
                                        slope=None if reduced else m.slopes[i]))
            else:
                out.append(kg.gemm(k, p.dw, x, dy, lay.wlo, mom=lay.mw, var=lay.vw, w16=lay.w16, optim=m.optim,
                                   workspace=m.workspace, tickets=m.tickets))
                out.append(ke.bias_update(k, dy, lay.b, lay.mb, lay.vb, m.optim, B, m.exact_sums, m.exact_tickets))
            if reduced:
                out += [m.group.all_reduce(total, total, B * total.shape[1]),
                        ke.finish_sum(k, total, m.grads[i], B, "dact", act=m.saved_for_backward(i))]
        out.append(kd.step_increment(k, m.counter))
        return out


def build(model: "ShardedMLP", options: StepOptions) -> TensorStep:
    return TensorStep(model, options)
