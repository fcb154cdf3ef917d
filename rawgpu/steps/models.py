"""The models step: every model of a sweep (one architecture and batch, each its own seed, order, schedule and
optimiser row) in one chain of launches, each launch the layered step's long-form kernel with a model axis
(kernels/models.py): gather, the forward GEMMs, softmax cross-entropy, per layer the input gradient, the weight
gradient with the fused update, and the bias step, then the one step counter. 4L + 2 launches for N models, not N
times that; on sm_90 each overlaps the one before. Runs on every GPU rawgpu supports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kernels import data as kd
from ..kernels import models as km
from ..optimizer import update_family
from ..recipe import Recipe, loss_scale
from ..stack import ModelStack
from .base import ChainStep, StepOptions

if TYPE_CHECKING:
    from ..driver import Launch

MODEL = ModelStack
SEVERAL_GPUS = False
MANY_MODELS = True  # a sweep's kind: never a single model's (train's --step does not offer it)
SUMMARY = "every model of a sweep in one chain of launches, each kernel with a model axis"
WHEN_AUTO = "a sweep of one architecture trains all its models in each step"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the models step cannot run models of `recipe` here; None when it can."""
    if recipe.kernel_accum != "f32":
        return "the models step accumulates in fp32; this recipe asks for fp16 accumulation"
    return None


class ModelsStep(ChainStep):
    kind = "models"

    def __init__(self, stack: ModelStack, overlap: bool):
        super().__init__(stack, overlap)
        r, B, padded = stack.recipe, stack.recipe.batch, stack.recipe.padded_widths
        n_layers = len(padded) - 1
        plan = stack.plan_gemm
        self.fwd = [plan(B, padded[i + 1], padded[i], "rr", "bias" if i == n_layers - 1 else "bias_relu")
                    for i in range(n_layers)]
        self.dx = [plan(B, padded[i], padded[i + 1], "rc", "drelu") if i else None for i in range(n_layers)]
        self.dw = [plan(padded[i], padded[i + 1], B, "cr", update_family(r.optimizer), states=r.state_tensors)
                   for i in range(n_layers)]

    def plans(self) -> list:
        return [p for p in self.fwd + self.dx + self.dw if p is not None]

    def kernel_units(self) -> set:
        from ..contract import DATA_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE, GEMM_MODELS_SOURCE, LOSS_MODELS_SOURCE

        m = self.model
        eval_plans = m.eval_fwd + m.tail_fwd
        return ({(GEMM_MODELS_SOURCE, p.kernel) for p in self.plans() + eval_plans}
                | {(s, None) for s in (DATA_MODELS_SOURCE, LOSS_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE)})

    def kernel_count(self) -> int:
        """Launches per step: gather, L forward GEMMs, the loss, per layer dx (not the first), dW and bias, the
        counter."""
        n = len(self.fwd)
        return 1 + n + 1 + (n - 1) + 2 * n + 1

    def describe(self) -> str:
        how = ", each overlapping the one before (programmatic dependent launch)" if self.overlap else ""
        return f"models: {self.model.n} models in {self.kernel_count()} kernels{how}"

    def _one_step(self) -> list["Launch"]:
        m = self.model
        k, n, r = m.k, m.n, m.recipe
        out = [km.gather(k, n, m.images, m.labels, m.perm, m.counter, m.acts[0], m.y, r.batch, r.steps_per_epoch,
                         m.optim, m.schedules, r.total_steps)]
        out += m.forward(m.acts[0], m.acts[1:], self.fwd, shared_input=False)
        out.append(km.softmax_xent(k, n, m.acts[-1], m.y, m.grads[-1], m.loss_sum, m.correct, r.batch, r.classes,
                                   loss_scale(r.batch), scratch=m.xent_sums, ticket=m.xent_tickets))
        for i in range(len(m.layers) - 1, -1, -1):
            lay, x, dy = m.layers[i], m.acts[i], m.grads[i + 1]
            if self.dx[i] is not None:  # reads W16 before this layer's update rewrites it
                out.append(km.gemm(k, n, self.dx[i], dy, lay.w16, m.grads[i], act=x))
            out.append(km.gemm(k, n, self.dw[i], x, dy, lay.wlo, mom=lay.mw, var=lay.vw, w16=lay.w16, optim=m.optim))
            out.append(km.bias_update(k, n, dy, lay.b, lay.mb, lay.vb, m.optim, r.batch, m.bias_sums,
                                      m.bias_tickets))
        out.append(kd.step_increment(k, m.counter))
        return out


def build(stack: ModelStack, options: StepOptions) -> ModelsStep:
    return ModelsStep(stack, options.overlap)
