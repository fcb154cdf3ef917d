"""The layered step: one kernel per layer and role (gather, GEMMs with fused epilogues, softmax, bias updates).

At 3 hidden layers it is 17 kernels, with any optimiser, where the head's forward and softmax are one launch (up to
16 classes from a layer up to 512 wide, kernels/loss.py's logits_xent), 18 elsewhere. Its short form, on sm_90 at
batch <= 256 with fp32 accumulation, is 8: each layer's backward, optimiser step and bias update is one pass over
its weights (kernels/dx_sgd.py at batch <= 32 with plain SGD, kernels/dx_update.py with any optimiser; a narrow
first layer's update and bias alone, kernels/narrow_update.py), the head's forward, loss, backward and step one
cluster kernel that also moves the step counter (kernels/head.py), and the gather writes the step's optimiser
values. A narrow table's gather and first layer are one launch where kernels/gather_forward.py's `folds` allows
and the head kernel does not come next: one dependent launch fewer. On sm_90 every kernel starts while the one
before still runs (programmatic dependent launch, ptx/pdl.cuh), and the weight streams carry L2 cache hints
(kernels/l2.py). Runs every recipe on every GPU: the step for fp16 accumulation, for GPUs before sm_90 at widths the
fused step does not take, and for batches above 512 (above 256 at large widths).

Outside the short form the chain a step waits on is the forward and the dx GEMMs: nothing later in a step reads a
layer's updated weight or bias, so each layer's dW GEMM with its update and its bias update run on side streams
(driver.SideStream), forked from the chain where their inputs are ready, one side for the weights and one for the
biases, each with its own split-K and exact-sum scratch, and joined before the step counter moves. The first layer's
dW GEMM forks where the second layer's does (after the last dx GEMM), so it has a third side of its own rather than
queueing behind that one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kernels import gather as kd
from ..kernels import gather_forward as kgf
from ..kernels import dx_sgd as kb
from ..kernels import dx_update as ku
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..kernels import head as kh
from ..kernels import l2 as kl2
from ..kernels import narrow_update as kn
from ..runtime.driver import SideStream
from ..model.mlp import MLP
from ..model.optimizer import update_family
from ..model.recipe import Recipe, loss_scale
from .base import ChainStep, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch

MODEL = MLP  # the buffers it runs over
SEVERAL_GPUS = False
SUMMARY = "one kernel per layer and role (18 at 3 hidden layers; 8 in its short form), overlapping on sm_90"
SHORT_WHEN = "sm_90, batch <= 256, fp32 accumulation"
WHEN_AUTO_SHORT = (f"the short form (8 kernels at 3 hidden layers) runs here ({SHORT_WHEN}), and beats the fused "
                   "step's grid barriers")
WHEN_AUTO = "the step that runs every recipe"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """The layered step runs every recipe on every GPU rawgpu supports."""
    return None


def one_pass_reason(recipe: Recipe, arch: str) -> str | None:
    """Why a layer's backward is not one pass over its weights here (kernels/dx_sgd.py for batch <= 32 with plain
    SGD, kernels/dx_update.py otherwise); None when it is."""
    if kb.supported(recipe.batch, recipe._plain_sgd, recipe._kernel_accum):
        return None
    return ku.unsupported_reason(recipe.batch, recipe.optimizer, recipe._kernel_accum, arch)


def short_form_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the layered step is not its short form here (every layer's backward one pass, the head one cluster
    kernel, overlapping launches); None when it is."""
    if not kg.sm90_or_later(arch):
        return f"the short form needs sm_90 (clusters, overlapping launches), this GPU is {arch}"
    return one_pass_reason(recipe, arch) or head_reason(recipe, arch)


def head_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the head's forward, loss, backward and update are not one cluster kernel here (kernels/head.py); None
    when they are."""
    return kh.unsupported_reason(recipe.batch, recipe._kernel_accum, recipe._padded_classes, arch)


@dataclass
class LayerPlans:
    """One layer's launches in the layered step: GEMM plans, or the one-pass backward."""

    fwd: kg.GemmPlan
    dx: kg.GemmPlan | None  # None for the first layer: nothing below it needs a gradient
    dw: kg.GemmPlan
    bwd: kb.DxSgdPlan | ku.DxUpdatePlan | None  # dx and the update in one pass (replaces dx + dw + the bias's)


class LayeredStep(ChainStep):

    def __init__(self, model: "MLP", overlap: bool, short: bool, l2_bytes: int, l2_budget: float,
                 branches: bool = True, fold: bool = True, fuse_loss: bool = True):
        """overlap, short, branches, l2_bytes, l2_budget, fold, fuse_loss: see StepOptions."""
        super().__init__(model, overlap)
        r, arch, B = model.recipe, model.arch, model.recipe.batch
        padded = r._padded_widths
        plain, accum = r._plain_sgd, r._kernel_accum
        plan = functools.partial(kg.plan_gemm, accum=accum, sm_count=model.sm_count, arch=arch,
                                 capacity=model.cluster_capacity)
        # the head's forward, loss, backward and update as one cluster kernel where it runs (sm_90)
        self.head = (kh.plan_head(B, padded[-2], r.optimizer, loss=r.loss) if short and head_reason(r, arch) is None
                     else None)
        # a table's gather and first hidden layer as one launch (gather_forward.cu), unless the head kernel would
        # come next: it reads the batch's targets and the step's optimiser values before its wait (head.cu), so the
        # kernel that writes them must be at least two launches back
        self.fold = (fold and not r._pixels and len(padded) - (self.head is not None) > 2
                     and kgf.folds(B, padded[0], padded[1], accum))
        # elsewhere, the head's forward and softmax cross-entropy as one launch where they fuse (loss.logits_xent)
        self.fused_loss = fuse_loss and self.head is None and model.head_loss_fuses
        one_pass = short and one_pass_reason(r, arch) is None
        n = len(padded) - 1
        self.plans: list[LayerPlans] = []
        for i in range(n):
            pin, pout, last = padded[i], padded[i + 1], i == n - 1
            bwd = None
            if one_pass and not (last and self.head is not None):
                cap, dx = model.cluster_capacity, i > 0  # the first layer's input needs no gradient
                # a narrow first layer's update alone: narrow_update.cu, where dx_update's pipeline is all start-up
                bwd = (kn.plan_narrow_update(B, pin, pout, r.optimizer, model.sm_count) if i == 0 else None) or (
                    kb.plan_dx_sgd(B, pin, pout, model.sm_count, arch=arch, capacity=cap, dx=dx)
                    if kb.supported(B, plain, accum)
                    else ku.plan_dx_update(B, pin, pout, r.optimizer, arch, model.sm_count, capacity=cap, dx=dx))
            self.plans.append(LayerPlans(
                fwd=plan(B, pout, pin, "rr", "bias" if last else "bias_act"),
                dx=plan(B, pin, pout, "rc", "dact") if i else None,
                dw=plan(pin, pout, B, "cr", update_family(r.optimizer), states=r._state_tensors),
                bwd=bwd))
        self.l2 = kl2.plan_l2([lay.w16.nbytes for lay in model.layers], [p.bwd is not None for p in self.plans],
                              l2_bytes, l2_budget)
        # Outside the short form every layer's dW GEMM and bias update run apart from its dx (no one-pass backward,
        # no head kernel: step_increment joins the sides where the head kernel would move the counter).
        apart = all(lp.bwd is None for lp in self.plans) and self.head is None
        self.sides = _Sides(model, [lp.dw for lp in self.plans]) if branches and apart else None

    def counters(self) -> list:
        return self.sides.counters() if self.sides else []

    def close(self) -> None:
        if self.sides:
            self.sides.close()

    def kernel_units(self) -> set:
        layers = self.plans[:len(self.plans) - (self.head is not None)]  # the head kernel runs the last one's
        forwards = layers[self.fold:len(layers) - self.fused_loss]  # logits_xent (loss.cu) runs the head's forward
        gemms = [lp.fwd for lp in forwards] + [p for lp in layers if lp.bwd is None for p in (lp.dx, lp.dw)]
        one_pass = {lp.bwd.unit for lp in layers if lp.bwd is not None}
        fold = {(kgf.SRC, None)} if self.fold else set()
        return kg.plan_units(gemms, self.model.arch) | one_pass | ({self.head.unit} if self.head else set()) | fold

    def split_plans(self) -> list:
        return [p for lp in self.plans for p in (lp.fwd, lp.dx, lp.dw, lp.bwd) if p is not None]

    def kernel_count(self) -> int:
        """Launches per step, from the plans alone (no tensor needs an address): gather, the forward GEMMs (the first
        one with the gather where they fold, the head's with the loss where they fuse), the head kernel or the loss,
        per layer the one-pass backward or dx + dW + bias, and the counter where no head kernel moves it."""
        n = len(self.plans) - (self.head is not None)
        backward = sum(1 if p.bwd is not None else (p.dx is not None) + 2 for p in self.plans[:n])
        return 1 + n - self.fold - self.fused_loss + 1 + backward + (self.head is None)

    def describe(self) -> str:
        how = ", each overlapping the one before (programmatic dependent launch)" if self.overlap else ""
        beside = f", the weight and bias updates on {len(self.sides.streams)} side streams" if self.sides else ""
        return f"layered: {self.kernel_count()} kernels{how}{beside}"

    def _one_step(self) -> list["Launch"]:
        """gather (+ the step's optimiser values), forward, loss, backward with fused updates, step counter += 1."""
        m = self.model
        r, k = m.recipe, m.k
        scale = loss_scale(r.batch)
        lr0, lr_min = r._scaled_lr
        schedule = kd.Schedule(lr0, lr_min, r.total_steps, r.warmup_steps, r.schedule)
        n = len(m.layers) - (self.head is not None)  # layers with a forward GEMM (or the gather's, folded)
        early = self.head is not None
        if self.fold:
            out = [m.gather_forward(r.batch, r.steps_per_epoch, optim=m.optim, schedule=schedule, early=early)]
        else:
            out = [m.gather(m.images, m.labels, m.perm, m.counter, m.acts[0], m.y, r.batch, r.steps_per_epoch,
                            optim=m.optim, schedule=schedule, early=early)]
        f = int(self.fold)  # the first layer with a forward GEMM of its own
        g = n - self.fused_loss  # the layers up to the head's, where logits_xent runs the head's forward
        out += m.forward(m.acts[f], m.acts[f + 1:g + 1], [p.fwd for p in self.plans[f:g]],
                         [pol.forward for pol in self.l2[f:g]], slopes=m.slopes[f + 1:g + 1], first=f)
        if self.fused_loss:  # the head's forward and the loss in one launch
            out.append(m.head_forward_loss(r.batch, grad_scale=scale))
        elif self.head is not None:  # the head's forward, loss, backward and update in one launch
            lay = m.layers[n]
            sums, correct = (m.regression_sums, None) if r.regression else (m.loss_sum, m.correct)
            out.append(kh.head_step(k, self.head, m.acts[n], m.y, lay.wlo, lay.w16, lay.b, m.optim, m.acts[-1],
                                    m.grads[-1], m.grads[n], sums, correct, r.classes, scale,
                                    step=m.counter,  # the step counter moves here
                                    mw=lay.mw, vw=lay.vw, mb=lay.mb, vb=lay.vb, slope=m.slopes[n], loss=r.loss))
        else:
            out.append(m.loss(m.acts[-1], m.y, m.grads[-1], r.batch, grad_scale=scale))
        sd = self.sides  # where the updates run beside the chain: their streams, and scratch of their own
        exact = sd or m  # the bias updates' exact-sum scratch
        dy = m.grads[n]
        for i in range(n - 1, -1, -1):
            lay, p, x = m.layers[i], self.plans[i], m.acts[i]
            if isinstance(p.bwd, kn.NarrowPlan):  # a narrow first layer: its update and the bias's
                out.append(kn.narrow_update(k, p.bwd, x, dy, lay.wlo, lay.w16, m.optim, mw=lay.mw, vw=lay.vw,
                                            bias=lay.b, mb=lay.mb, vb=lay.vb))
            elif isinstance(p.bwd, kb.DxSgdPlan):  # the bias too; the first layer's input needs no gradient
                out.append(kb.dx_sgd(k, p.bwd, x, dy, lay.wlo, lay.w16, m.grads[i], m.optim, m.workspace, m.tickets,
                                     self.l2[i], bias=lay.b, slope=m.slopes[i]))
            elif p.bwd is not None:  # the same with the optimiser's state
                out.append(ku.dx_update(k, p.bwd, x, dy, lay.wlo, lay.w16, lay.mw, lay.vw, m.grads[i], m.optim,
                                        m.workspace, m.tickets, self.l2[i], bias=lay.b, mb=lay.mb, vb=lay.vb,
                                        slope=m.slopes[i]))
            else:
                bias = ke.bias_update(k, dy, lay.b, lay.mb, lay.vb, m.optim, r.batch, exact.exact_sums,
                                      exact.exact_tickets)
                if sd:  # forked here, as soon as its dy is written
                    out.append(bias.beside(sd.biases))
                if p.dx is not None:  # reads W16 before this layer's update rewrites it
                    out.append(kg.gemm(k, p.dx, dy, lay.w16, m.grads[i], act=m.saved_for_backward(i),
                                       workspace=m.workspace, tickets=m.tickets))
                side = sd and (sd.first if i == 0 else sd.weights)
                workspace, tickets = sd.splitk[side] if sd else (m.workspace, m.tickets)
                dw = kg.gemm(k, p.dw, x, dy, lay.wlo, mom=lay.mw, var=lay.vw, w16=lay.w16, optim=m.optim,
                             workspace=workspace, tickets=tickets)
                out += [dw.beside(side)] if sd else [dw, bias]  # beside: after the dx GEMM has read W16
            dy = m.grads[i]
        if self.head is None:
            counter = kd.step_increment(k, m.counter)
            out.append(counter.after(*sd.streams) if sd else counter)
        return out


class _Sides:
    """The layered step's side streams (the weight updates, the first layer's weight update, the bias updates) and
    the scratch each needs of its own, as they run beside the chain's GEMMs and softmax and beside each other, named
    as the model names its own: split-K partials and tickets for the dW GEMMs, exact sums and tickets for the bias
    updates (every launch leaves them zero)."""

    def __init__(self, model: "MLP", dw_plans: list):
        self.weights, self.first = SideStream("weight updates"), SideStream("first layer's weight update")
        self.biases = SideStream("bias updates")
        self.streams = (self.weights, self.first, self.biases)
        self.splitk = {self.weights: model.splitk_scratch("side_", dw_plans[1:]),  # by the stream its dW GEMMs run on
                       self.first: model.splitk_scratch("side_first_", dw_plans[:1])}
        self.exact_sums, self.exact_tickets = model.exact_scratch("side_")

    def counters(self) -> list:
        return [t for pair in self.splitk.values() for t in pair] + [self.exact_sums, self.exact_tickets]

    def close(self) -> None:
        for side in self.streams:
            side.close()


def build(model: "MLP", options: StepOptions) -> LayeredStep:
    return LayeredStep(model, options.overlap, options.short, options.l2_bytes, options.l2_budget, options.branches,
                       options.fold, options.fuse_loss)
