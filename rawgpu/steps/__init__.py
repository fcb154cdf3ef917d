"""Training-step kinds: one module each, and the one chooser every caller uses.

A step kind is how a training step runs on the GPU (the model's buffers and numerics are the same for all):
  cluster   one thread-block cluster keeps the whole model in shared memory (steps/cluster.py)
  layered   one kernel per layer and role, each overlapping the one before on sm_90 (steps/layered.py)
  fused     the whole step in one persistent cooperative kernel (steps/fused.py)
(tensor.py and data.py are one rank's step of a model on several GPUs: sharded.py and replicated.py build them,
`choose` never does.)
Each module owns its buffers, its parameter table, its launches, its support rule
`unsupported_reason(recipe, arch)` and how the fp32 masters are read back; `Step` is what they share.
`choose(recipe, arch, wanted)` is the only place that decides which kind runs, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import StepUnsupported
from ..recipe import Recipe
from . import cluster, fused, layered
from .base import Step, StepOptions

if TYPE_CHECKING:
    from ..mlp import MLP

KINDS = ("cluster", "fused", "layered")
CHOICES = ("auto",) + KINDS
MODULES = {"cluster": cluster, "fused": fused, "layered": layered}


@dataclass(frozen=True)
class Choice:
    """The step kind that runs, why, and why every kind before it in `auto`'s order was passed over."""

    kind: str
    reason: str
    passed_over: dict[str, str] = field(default_factory=dict)

    def explain(self) -> str:
        lines = [f"{self.kind}: {self.reason}"]
        lines += [f"  not {kind}: {why}" for kind, why in self.passed_over.items()]
        return "\n".join(lines)


def unsupported_reason(kind: str, recipe: Recipe, arch: str) -> str | None:
    """Why step `kind` cannot run `recipe` on `arch` at all; None when it can."""
    if kind not in MODULES:
        return f"unknown step kind {kind!r}: use one of {', '.join(CHOICES)}"
    return MODULES[kind].unsupported_reason(recipe, arch)


def choose(recipe: Recipe, arch: str, wanted: str = "auto") -> Choice:
    """The step for `recipe` on a GPU of `arch`. wanted: a kind from CHOICES; `auto` takes the first of
    cluster, layered in its short form, fused (where it is preferred), layered; a named kind is taken as
    long as it can run (StepUnsupported with its reason otherwise)."""
    if wanted not in CHOICES:
        raise StepUnsupported(f"unknown step kind {wanted!r}: use one of {', '.join(CHOICES)}")
    if wanted != "auto":
        if why := unsupported_reason(wanted, recipe, arch):
            raise StepUnsupported(f"{wanted} cannot run this recipe: {why}")
        return Choice(wanted, "asked for by name")
    passed: dict[str, str] = {}
    if (why := cluster.unsupported_reason(recipe, arch)) is None:
        return Choice("cluster", cluster.WHEN_AUTO, passed)
    passed["cluster"] = why
    if (why := layered.short_form_reason(recipe, arch)) is None:
        return Choice("layered", layered.WHEN_AUTO_SHORT, passed)
    passed["layered (short form)"] = why
    if (why := fused.unsupported_reason(recipe, arch) or fused.not_preferred_reason(recipe)) is None:
        return Choice("fused", fused.WHEN_AUTO, passed)
    passed["fused"] = why
    return Choice("layered", layered.WHEN_AUTO, passed)


def build(kind: str, model: "MLP", options: StepOptions | None = None) -> Step:
    """The step object of `kind` for a model being planned (it reserves its buffers in the model's arena)."""
    return MODULES[kind].build(model, options or StepOptions())


def help_text() -> str:
    """The `--step` help: every kind and the rule `auto` follows, from the modules' own words."""
    kinds = "; ".join(f"{kind}: {MODULES[kind].SUMMARY}" for kind in KINDS)
    rule = (f"auto (default) takes cluster where it runs ({cluster.RUNS_WHEN}), else layered in its short form "
            f"({layered.SHORT_WHEN}), else fused ({fused.PREFERRED_WHEN}), else layered")
    return f"{kinds}. {rule}"
