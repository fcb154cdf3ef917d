"""The data-parallel step: one rank's part of a training step where every GPU holds the whole model and 1/N of each
batch (steps/replicated.py).

The layered step's long form over the rank's rows, with the updates moved after a sum: each layer's weight gradient
is written in fp32 by a GEMM on the tile one GPU's update of that layer runs (epilogue store32), its bias gradient by
bias_update's sums, all into one buffer; one all-reduce adds them up over the ranks inside the step's CUDA graph;
then each layer's optimiser step runs from the sums (elementwise.apply_update, the GEMM's own update epilogue). The
loss is the mean over the whole batch (softmax_xent's and logits_xent's mean_over), so the sums are one GPU's
gradient, and with one rank every bit is the layered step's long form. steps.choose picks it for a model on several
GPUs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ..kernels import gather as kd
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..model.optimizer import update_family
from .replicated import ReplicatedMLP
from ..model.recipe import Recipe, loss_scale
from .base import ChainStep, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch


MODEL = ReplicatedMLP  # one rank's buffers
SEVERAL_GPUS = True
SUMMARY = "a model copied on every GPU, each taking part of the batch: the gradients summed over the ranks"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """On one GPU, never: it is one rank's step of a model on several (--gpus)."""
    return "it is one rank's step of a model on several GPUs (--gpus N)"


class DataStep(ChainStep):

    def __init__(self, model: "ReplicatedMLP", options: StepOptions):
        super().__init__(model, options.overlap)
        r, arch, rows, padded = model.recipe, model.arch, model.rows, model.padded
        self.fused_loss = options.fuse_loss and model.head_loss_fuses  # as the layered step's long form
        self.family = update_family(r.optimizer)
        plan = functools.partial(kg.plan_gemm, accum=r._kernel_accum, sm_count=model.sm_count, arch=arch,
                                 capacity=model.cluster_capacity)
        self.fwd, self.dx, self.dw = [], [], []
        for i, (pin, pout) in enumerate(zip(padded, padded[1:])):
            self.fwd.append(plan(rows, pout, pin, "rr", model.forward_epilogue(i)))
            self.dx.append(plan(rows, pin, pout, "rc", "dact") if i else None)
            update = plan(pin, pout, rows, "cr", self.family, states=r._state_tensors)  # one GPU's fused update
            # its tile, or for the ping-pong tile (which stores no fp32 sum) the planner's tile of the same sums
            tile = None if update.config.pingpong else update.config.name
            self.dw.append(plan(pin, pout, rows, "cr", "store32", config=tile, splits=update.splits,
                                cluster=update.cluster))
        # every gradient in one buffer, so that one all-reduce sums them all: per layer W's, then b's
        sizes = [(pin * pout, pout) for pin, pout in zip(padded, padded[1:])]
        self.gradients = model.arena.tensor("gradients", sum(w + b for w, b in sizes), np.float32)
        self.grad_w, self.grad_b, at = [], [], 0
        for i, (w, b) in enumerate(sizes):
            self.grad_w.append(self.gradients.view((padded[i], padded[i + 1]), offset_bytes=4 * at,
                                                   name=f"grad_w{i}"))
            self.grad_b.append(self.gradients.view((b,), offset_bytes=4 * (at + w), name=f"grad_b{i}"))
            at += w + b

    def kernel_units(self) -> set:
        fwd = self.fwd[:len(self.fwd) - self.fused_loss]  # logits_xent (loss.cu) runs the head's forward
        return kg.plan_units(fwd + self.dx + self.dw, self.model.arch)

    def split_plans(self) -> list:
        return [p for p in self.fwd + self.dx + self.dw if p is not None]

    def kernel_count(self) -> int:
        """Kernels per step: gather, the forwards, the loss (with the head's forward where they fuse), per layer its
        input gradient (not the first's), weight gradient, bias gradient and update, and the counter."""
        n = len(self.fwd)
        return 1 + n - self.fused_loss + 1 + (n - 1) + 3 * n + 1

    def describe(self) -> str:
        m = self.model
        gpus = f"{m.ranks} GPU{'s' if m.ranks > 1 else ''}"
        return (f"data parallel over {gpus}: {m.rows} of the batch's {m.recipe.batch} rows each, {self.kernel_count()} "
                f"kernels and one all-reduce of {self.gradients.size} gradients per step ({m.choice.reason})")

    def _one_step(self) -> list["Launch"]:
        """gather (+ the step's optimiser values), forward, loss, gradients, their sum over the ranks, the updates,
        step counter += 1."""
        m = self.model
        r, k, rows = m.recipe, m.k, m.rows
        lr0, lr_min = r._scaled_lr
        schedule = kd.Schedule(lr0, lr_min, r.total_steps, r.warmup_steps, r.schedule)
        out = [m.gather(m.images, m.labels, m.perm, m.counter, m.acts[0], m.y, rows, r.steps_per_epoch,
                        optim=m.optim, schedule=schedule)]
        g = len(self.fwd) - self.fused_loss  # the layers up to the head's, where logits_xent runs the head's forward
        out += m.forward(m.acts[0], m.acts[1:g + 1], self.fwd[:g], slopes=m.slopes[1:g + 1])
        if self.fused_loss:
            out.append(m.head_forward_loss(rows, grad_scale=loss_scale(r.batch), mean_over=r.batch))
        else:
            out.append(m.loss(m.acts[-1], m.y, m.grads[-1], rows, grad_scale=loss_scale(r.batch), mean_over=r.batch))
        for i in range(len(m.layers) - 1, -1, -1):
            lay, x, dy = m.layers[i], m.acts[i], m.grads[i + 1]
            if self.dx[i] is not None:
                out.append(kg.gemm(k, self.dx[i], dy, lay.w16, m.grads[i], act=m.saved_for_backward(i),
                                   workspace=m.workspace, tickets=m.tickets))
            out.append(kg.gemm(k, self.dw[i], x, dy, self.grad_w[i], workspace=m.workspace, tickets=m.tickets))
            out.append(ke.bias_grad(k, dy, self.grad_b[i], rows, m.exact_sums, m.exact_tickets))
        out.append(m.group.all_reduce(self.gradients, self.gradients, self.gradients.size))
        for i, lay in enumerate(m.layers):
            out.append(ke.apply_update(k, self.grad_w[i], self.grad_b[i], lay.w16, lay.wlo, lay.mw, lay.vw, lay.b,
                                       lay.mb, lay.vb, m.optim, self.family))
        out.append(kd.step_increment(k, m.counter))
        return out


def build(model: "ReplicatedMLP", options: StepOptions) -> DataStep:
    return DataStep(model, options)
