"""Training-step kinds: one module each, the one registry of them, the one chooser and the one planner.

A step kind is how a training step runs on the GPU (the model's numerics are the same for all):
  cluster   one thread-block cluster keeps the whole model in shared memory (steps/cluster.py)
  layered   one kernel per layer and role, each overlapping the one before on sm_90 (steps/layered.py)
  fused     the whole step in one persistent cooperative kernel (steps/fused.py)
  tensor    one rank's part of a model split over several GPUs by its layers (steps/tensor.py)
  data      one rank's part of a model copied on several GPUs, each taking part of the batch (steps/data.py)
  models    every model of a sweep in each launch, the kernels with a model axis (steps/models.py)
Each module registers in KINDS and owns its support rule `unsupported_reason(recipe, arch)`, the model class whose
buffers it runs over (`MODEL`), its own buffers and launches (`build(model, options) -> Step`) and how the fp32
masters are read back; `Step` is what they share.

`choose` is the only place that decides which kind runs, and says why; `plan_model` is the only place that plans a
model: the kind's model class, then its step over the model's buffers. Callers ask these, never a kind's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING

from . import split as parallel
from ..runtime.errors import StepUnsupported
from ..kernels import PLANNING_SM_COUNT
from ..model.recipe import DEFAULT_ACTIVATION, Recipe
from . import cluster, data, fused, layered, models, tensor
from .base import Step, StepOptions

if TYPE_CHECKING:
    from ..kernels import Kernels
    from ..model.mlp import MLP

# each kind is named by its module, here and in Step.kind
KINDS: dict[str, ModuleType] = {m.__name__.rsplit(".", 1)[-1]: m for m in (cluster, fused, layered, tensor, data, models)}
ONE_GPU = tuple(kind for kind, module in KINDS.items()
                if not module.SEVERAL_GPUS and not getattr(module, "MANY_MODELS", False))
SWEEP_KIND = "models"  # what a sweep of many models in one step runs
SHORT_FORM = "layered (short form)"  # how a choice names the layered step's short form
CHOICES = ("auto",) + ONE_GPU  # what a one-GPU run may ask for (--step)
MODES = parallel.MODES  # what a run on several GPUs may ask for (--parallel)


@dataclass(frozen=True)
class Choice:
    """The step kind that runs, why, why every kind before it in `auto`'s order was passed over, and the ranks of
    a model on several GPUs (0: one GPU's model). fallbacks: the kinds passed over that would run the same model
    with one width and ReLU (the architecture alone ruled them out), with why: what the launch line says."""

    kind: str
    reason: str
    passed_over: dict[str, str] = field(default_factory=dict)
    ranks: int = 0
    fallbacks: dict[str, str] = field(default_factory=dict)

    def explain(self) -> str:
        lines = [f"{self.kind}: {self.reason}"]
        lines += [f"  not {kind}: {why}" for kind, why in self.passed_over.items()]
        return "\n".join(lines)

    def fallback_note(self) -> str:
        """'; not fused: the fused step applies ReLU only' for each fallback ('' for none)."""
        return "".join(f"; not {kind}: {why}" for kind, why in self.fallbacks.items())


def unsupported_reason(kind: str, recipe: Recipe, arch: str) -> str | None:
    """Why step `kind` cannot run `recipe` on one GPU of `arch`; None when it can."""
    if kind not in KINDS:
        return f"unknown step kind {kind!r}: use one of {', '.join(CHOICES)}"
    return KINDS[kind].unsupported_reason(recipe, arch)


def choose(recipe: Recipe, arch: str, wanted: str = "auto", ranks: int = 0, models: int = 0) -> Choice:
    """The step for `recipe` on a GPU of `arch`, StepUnsupported with the reason where `wanted` cannot run.

    models: a sweep of that many models of `recipe`'s architecture in one step (wanted "auto"): the models kind, or
    StepUnsupported with why not (the sweep then trains them one after another).

    One GPU (ranks 0): wanted is one of CHOICES; `auto` takes the first of cluster, layered in its short form,
    fused (where it is preferred), layered. A model on `ranks` GPUs: wanted is one of MODES, and the split that
    moves fewer bytes (parallel.choose) names the kind: data, or tensor (also for one rank)."""
    if models:
        if why := models_reason(recipe, arch):
            raise StepUnsupported(why)
        return Choice(SWEEP_KIND, KINDS[SWEEP_KIND].WHEN_AUTO)
    if ranks:
        try:
            pick = parallel.choose(recipe.widths, recipe.batch, ranks, wanted)
        except ValueError as exc:
            raise StepUnsupported(str(exc)) from None
        return Choice("data" if pick.kind == "data" else "tensor", pick.reason, ranks=ranks)
    if wanted not in CHOICES:
        raise StepUnsupported(f"unknown step kind {wanted!r}: use one of {', '.join(CHOICES)}")
    if wanted != "auto":
        if why := unsupported_reason(wanted, recipe, arch):
            raise StepUnsupported(f"{wanted} cannot run this recipe: {why}")
        return Choice(wanted, "asked for by name")
    choice = _auto(recipe, arch)  # and what it would be for this model with one width and ReLU: the fallback, if any
    if recipe.uniform and recipe.activation == DEFAULT_ACTIVATION:
        return choice
    plain = _auto(replace(recipe, hidden=max(recipe.hidden_widths), layers=recipe.layers,
                          activation=DEFAULT_ACTIVATION), arch)
    label = SHORT_FORM if plain.reason == layered.WHEN_AUTO_SHORT else plain.kind  # as passed_over names it
    if label not in choice.passed_over:
        return choice
    return replace(choice, fallbacks={label: choice.passed_over[label]})


def _auto(recipe: Recipe, arch: str) -> Choice:
    """`auto`'s pick: the first of cluster, layered in its short form, fused (where preferred), layered."""
    passed: dict[str, str] = {}
    if (why := cluster.unsupported_reason(recipe, arch)) is None:
        return Choice("cluster", cluster.WHEN_AUTO, passed)
    passed["cluster"] = why
    if (why := layered.short_form_reason(recipe, arch)) is None:
        return Choice("layered", layered.WHEN_AUTO_SHORT, passed)
    passed[SHORT_FORM] = why
    if (why := fused.unsupported_reason(recipe, arch) or fused.not_preferred_reason(recipe, arch)) is None:
        return Choice("fused", fused.WHEN_AUTO, passed)
    passed["fused"] = why
    return Choice("layered", layered.WHEN_AUTO, passed)


def models_reason(recipe: Recipe, arch: str) -> str | None:
    """Why models of `recipe` cannot train all in one step here (one line); None when they can."""
    return KINDS[SWEEP_KIND].unsupported_reason(recipe, arch)


def resumed(saved_kind: str, ranks: int = 0) -> str:
    """What a run resumed from a checkpoint asks `choose` for: the kind that saved it where one GPU can ask for it
    by name, else `auto` (a parallel kind's checkpoint, or a run on several GPUs, which choose their split anew)."""
    return saved_kind if saved_kind in ONE_GPU and not ranks else "auto"


def plan_model(recipe: Recipe, wanted: str | Choice = "auto", *, kernels: "Kernels | None" = None,
               arch: str | None = None, sm_count: int = PLANNING_SM_COUNT, capacity: tuple[int, ...] | None = None,
               options: StepOptions | None = None, ranks: int = 0, rank: int = 0, group=None,
               models: "list[Recipe] | None" = None) -> "MLP":
    """The model of `recipe` and its step, planned once (no GPU needed): the kind `choose` picks for `wanted` (or
    the Choice given), its model class over this GPU's part of the buffers, then its step, attached.

    kernels: bind them (launches need them) and plan for their arch and their GPU's cluster capacity; without,
    plan for `arch` (default sm_86, the smallest shared memory) and `capacity` (default the planning estimate).
    ranks, rank, group: rank `rank` of a model on `ranks` GPUs and the ranks' all-reduce (None to plan only)."""
    if kernels is not None:
        from ..kernels.gemm import cluster_capacity

        arch, capacity = kernels.arch, cluster_capacity(kernels)
    arch = arch or "sm_86"
    choice = (wanted if isinstance(wanted, Choice)
              else choose(recipe, arch, wanted, ranks, models=len(models) if models else 0))
    module = KINDS[choice.kind]
    if module.SEVERAL_GPUS != bool(choice.ranks):
        raise ValueError(f"the {choice.kind} step runs " + ("a model on several GPUs: give ranks" if choice.ranks == 0
                                                            else "on one GPU: ranks must be 0"))
    if getattr(module, "MANY_MODELS", False) != (models is not None):
        raise ValueError(f"the {choice.kind} step runs " + ("a sweep's models: give models" if models is None
                                                            else "one model: models must be None"))
    where = dict(ranks=choice.ranks, rank=rank, group=group) if choice.ranks else {}
    first = models if models is not None else recipe
    model = module.MODEL(first, arch=arch, sm_count=sm_count, capacity=capacity, **where)
    model.choice = choice
    model.attach(module.build(model, options or StepOptions()))
    return model.bind(kernels) if kernels is not None else model


def help_text() -> str:
    """The `--step` help: every one-GPU kind and the rule `auto` follows, from the modules' own words."""
    kinds = "; ".join(f"{kind}: {KINDS[kind].SUMMARY}" for kind in ONE_GPU)
    rule = (f"auto (default) takes cluster where it runs ({cluster.RUNS_WHEN}), else layered in its short form "
            f"({layered.SHORT_WHEN}), else fused ({fused.PREFERRED_WHEN}), else layered")
    return f"{kinds}. {rule}"


__all__ = ["CHOICES", "KINDS", "MODES", "ONE_GPU", "SWEEP_KIND", "Choice", "Step", "StepOptions", "choose", "help_text",
           "models_reason", "plan_model", "resumed", "unsupported_reason"]
