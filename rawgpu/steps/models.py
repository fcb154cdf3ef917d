"""The models step: every model of a sweep (one architecture and batch, each its own seed, order, schedule and
optimiser row) in one chain of launches, each launch the layered step's kernel with a model axis (kernels/model_axis.py).

Its short form, where the layered step's runs (sm_90, batch <= 256, fp32 accumulation), is the layered short form's
kernels: the gather, the hidden layers' forward GEMMs, the head's forward, loss, backward and update as one cluster
per model (which also moves the shared step counter), and each hidden layer's backward, update and bias step as one
pass over its weights: 2H + 2 launches at H hidden layers, for any N. Elsewhere the long form: the gather, the forward
GEMMs, softmax cross-entropy, per layer the input gradient, the weight gradient with the fused update and the bias
step, and the counter (4H + 6). On sm_90 each launch overlaps the one before."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kernels import gather as kd
from ..kernels import dx_update as ku
from ..kernels import gemm as kg
from ..kernels import head as kh
from ..kernels import model_axis as km
from ..model.optimizer import update_family
from ..model.recipe import Recipe, data_kind, loss_scale
from ..model.stack import ModelStack
from .base import ChainStep, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch

MODEL = ModelStack
SEVERAL_GPUS = False
MANY_MODELS = True  # a sweep's kind: never a single model's (train's --step does not offer it)
SUMMARY = "every model of a sweep in one chain of launches, each kernel with a model axis"
WHEN_AUTO = "a sweep of one architecture trains all its models in each step"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the models step cannot run models of `recipe` here; None when it can."""
    if recipe._kernel_accum != "f32":
        return "the models step accumulates in fp32; this recipe asks for fp16 accumulation"
    if recipe.regression:
        return f"the models step scores class labels, not this data ({data_kind(recipe)})"
    return None


def short_form_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the models step is not its short form here (the head one cluster per model, every other layer's backward
    one pass over its weights); None when it is."""
    if not kg.sm90_or_later(arch):
        return f"the short form needs sm_90 (clusters, overlapping launches), this GPU is {arch}"
    return (ku.unsupported_reason(recipe.batch, recipe.optimizer, recipe._kernel_accum, arch)
            or kh.unsupported_reason(recipe.batch, recipe._kernel_accum, recipe._padded_classes, arch))


class ModelsStep(ChainStep):

    def __init__(self, stack: ModelStack, overlap: bool, short: bool):
        super().__init__(stack, overlap)
        r, B, padded, arch = stack.recipe, stack.recipe.batch, stack.recipe._padded_widths, stack.arch
        n_layers = len(padded) - 1
        short = short and short_form_reason(r, arch) is None
        self.head = self.plan_head(r) if short else None
        # N models fill the GPU: each model's one pass gets its share of the SMs, and no column ranges whose dx
        # would meet in a workspace (nor would the bits then depend on N); the first layer has no dx to add
        # the first layer's update streams where its tile has a streamed instance (about one block an SM walks a run
        # of every model's chunks: one column range), else takes column ranges to its share of the SMs
        share = max(1, stack.sm_count // stack.n)
        self.stream_first = short and n_layers > 1 and km.streams_update(arch, B, update_family(r.optimizer))
        self.bwd = [ku.plan_dx_update(B, padded[i], padded[i + 1], r.optimizer, arch, share,
                                      splits=None if i == 0 and not self.stream_first else 1, cluster=False,
                                      dx=i > 0, roles=1)
                    if short and i < n_layers - 1 else None for i in range(n_layers)]
        plan = stack.plan_gemm
        n_fwd = n_layers - (self.head is not None)
        self.fwd = [plan(B, padded[i + 1], padded[i], "rr", "bias" if i == n_layers - 1 else "bias_act")
                    for i in range(n_fwd)]
        long = [i for i in range(n_layers) if self.bwd[i] is None and not (i == n_layers - 1 and self.head)]
        self.dx = {i: plan(B, padded[i], padded[i + 1], "rc", "dact") for i in long if i}
        self.dw = {i: plan(padded[i], padded[i + 1], B, "cr", update_family(r.optimizer), states=r._state_tensors)
                   for i in long}

    @staticmethod
    def plan_head(r: Recipe) -> kh.HeadPlan | None:
        """The head's clusters by its width alone: 2 CTAs up to 512 inputs, 4 above (over 8 to 128 models the
        fastest or nearly, `python dev/sweep/models_step.py --head-ctas 2 4 8`), more only where those rows of W do
        not fit. Never by N: the logits add the CTAs' partial sums, so a model's bits would depend on the count it
        trains with."""
        B, K = r.batch, r._padded_widths[-2]
        ctas = kh.MIN_CTAS if K <= 512 else 2 * kh.MIN_CTAS
        return kh.plan_head(B, K, r.optimizer, ctas=ctas) or kh.plan_head(B, K, r.optimizer)

    def plans(self) -> list:
        return self.fwd + list(self.dx.values()) + list(self.dw.values())

    def kernel_units(self) -> set:
        from ..contract import (GATHER_MODELS_SOURCE, DX_UPDATE_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE,
                                GEMM_MODELS_SOURCE, HEAD_MODELS_SOURCE, LOSS_MODELS_SOURCE)

        m = self.model
        units = {(GEMM_MODELS_SOURCE, p.kernel) for p in self.plans() + m.eval_fwd + m.tail_fwd}
        units |= {(DX_UPDATE_MODELS_SOURCE, p.stream_kernel if i == 0 and self.stream_first else p.kernel)
                  for i, p in enumerate(self.bwd) if p is not None}
        units |= {(HEAD_MODELS_SOURCE, self.head.kernel)} if self.head else set()
        # the loss and the counter: evaluation's, and the long form's; the bias step: the long form's
        units |= {(GATHER_MODELS_SOURCE, None), (LOSS_MODELS_SOURCE, None)}
        return units | ({(ELEMENTWISE_MODELS_SOURCE, None)} if self.dw else set())

    def kernel_count(self) -> int:
        """Launches per step: gather, the forward GEMMs, the head kernel or the loss, per layer the one pass or dx
        (not the first layer), dW and the bias, and the counter where no head kernel moves it."""
        return 1 + len(self.fwd) + 1 + sum(p is not None for p in self.bwd) + len(self.dx) + 2 * len(self.dw) + (
            self.head is None)

    def describe(self) -> str:
        how = ", each overlapping the one before (programmatic dependent launch)" if self.overlap else ""
        form = " (short form)" if self.head else ""
        return f"models{form}: {self.model.n} models in {self.kernel_count()} kernels{how}"

    def _one_step(self) -> list["Launch"]:
        m = self.model
        k, n, r = m.k, m.n, m.recipe
        scale = loss_scale(r.batch)
        out = [m.gather(early=self.head is not None)]
        top = len(self.fwd)  # layers with a forward GEMM
        out += m.forward(m.acts[0], m.acts[1:top + 1], self.fwd, shared_input=False, slopes=m.slopes[1:top + 1])
        if self.head is not None:
            lay = m.layers[top]
            out.append(km.head_step(k, n, self.head, m.acts[top], m.y, lay.wlo, lay.w16, lay.b, m.optim, m.acts[-1],
                                    m.grads[-1], m.grads[top], m.loss_sum, m.correct, r.classes, scale, m.counter,
                                    mw=lay.mw, vw=lay.vw, mb=lay.mb, vb=lay.vb, slope=m.slopes[top]))
        else:
            out.append(km.softmax_xent(k, n, m.acts[-1], m.y, m.grads[-1], m.loss_sum, m.correct, r.batch, r.classes,
                                       scale, scratch=m.xent_sums, ticket=m.xent_tickets))
        for i in range(top - 1, -1, -1):  # every layer with a forward GEMM (all but the head where it has its own)
            lay, x, dy = m.layers[i], m.acts[i], m.grads[i + 1]
            if i == 0 and self.stream_first:
                out.append(km.update_stream(k, n, self.bwd[0], x, dy, lay.wlo, lay.w16, lay.mw, lay.vw, m.optim,
                                            lay.b, lay.mb, lay.vb, m.sm_count))
                continue
            if self.bwd[i] is not None:
                out.append(km.dx_update(k, n, self.bwd[i], x, dy, lay.wlo, lay.w16, lay.mw, lay.vw,
                                        m.grads[i] if i else None, m.optim, lay.b, lay.mb, lay.vb, slope=m.slopes[i]))
                continue
            if i in self.dx:  # reads W16 before this layer's update rewrites it
                out.append(km.gemm(k, n, self.dx[i], dy, lay.w16, m.grads[i], act=m.saved_for_backward(i)))
            out.append(km.gemm(k, n, self.dw[i], x, dy, lay.wlo, mom=lay.mw, var=lay.vw, w16=lay.w16, optim=m.optim))
            out.append(km.bias_update(k, n, dy, lay.b, lay.mb, lay.vb, m.optim, r.batch, m.bias_sums,
                                      m.bias_tickets))
        if self.head is None:
            out.append(kd.step_increment(k, m.counter))
        return out


def build(stack: ModelStack, options: StepOptions) -> ModelsStep:
    return ModelsStep(stack, options.overlap, options.short)
