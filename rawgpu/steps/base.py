"""What every step kind provides to the model (`Step`), with the defaults most kinds keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kernels.l2 import DEFAULT_BUDGET

if TYPE_CHECKING:
    from ..runtime.driver import Launch, Stream
    from ..runtime.memory import Tensor
    from ..model.mlp import MLP


@dataclass(frozen=True)
class StepOptions:
    """Settings of particular kinds, for comparisons and tests; the defaults are what training uses.

    overlap: layered step on sm_90+, each kernel starts while the one before still runs (programmatic dependent
    launch). short: layered step, its short form wherever it runs (False: one kernel per layer and role, as where it
    does not). branches: layered step outside its short form, each layer's weight and bias updates on streams beside
    the chain of dx GEMMs (False: all in one chain). l2_bytes, l2_budget: layered step, the GPU's L2 size and the
    share of it one weight may keep between two reads (budget 0 or no size: no cache hints). fused_grid: blocks of
    the fused kernel (default one per SM). fold: layered step, a narrow table's gather and first layer in one launch
    where gather_forward.folds says so (False: the gather and a forward GEMM). fuse_loss: layered and data-parallel
    steps, the head's forward and softmax cross-entropy in one launch where the model says they fuse
    (MLP.head_loss_fuses; False: the head's GEMM and softmax_xent, as a tensor-parallel head summed over the ranks
    runs them)."""

    overlap: bool = True
    short: bool = True
    branches: bool = True
    l2_bytes: int = 0
    l2_budget: float = DEFAULT_BUDGET
    fused_grid: int | None = None
    fold: bool = True
    fuse_loss: bool = True


class Step:
    """One way of running the training step over a model's shared buffers.

    A kind's module defines `build(model, options)`, which plans the kind's own buffers in the model's arena
    while the model is being planned (no GPU needed), and returns the Step. After the arena is allocated the model
    calls `allocated()`; after the parameters are set, `parameters_set(stream)`."""

    @property
    def kind(self) -> str:
        """The step kind: the name of the module in steps/ that defines the step (steps.KINDS' key), said once."""
        return type(self).__module__.rsplit(".", 1)[-1]

    def __init__(self, model: "MLP"):
        self.model = model

    def launches(self, steps: int) -> list["Launch"]:
        """`steps` training steps, in order, ready to run eagerly or to be captured into one graph."""
        raise NotImplementedError

    def describe(self) -> str:
        """How a step runs, for headers: the kernel count or the one kernel's geometry."""
        raise NotImplementedError

    def kernel_units(self) -> set:
        """The units of compilation (compiler.unit_of) this kind's launches need, from its plans alone."""
        raise NotImplementedError

    def phases(self) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]] | None:
        """The phases inside a step that is one kernel, for the graph inspector: (title, column names, rows); None
        for a chain of kernels, whose graph shows every launch."""
        return None

    def split_plans(self) -> list[Any]:
        """Plans whose split-K partials go through the model's shared workspace and tickets (sized by the model)."""
        return []

    def counters(self) -> list["Tensor"]:
        """Device counters of this kind that start at zero with every new set of parameters."""
        return []

    def allocated(self) -> None:
        """The arena exists: upload parameter tables, check the GPU can run the launches."""

    def close(self) -> None:
        """Free what the kind made on the GPU beside the arena (streams); the session calls it before the context
        goes."""

    def parameters_set(self, stream: "Stream") -> None:
        """The master weights were just written: derive whatever copies of them this kind keeps."""

    def before_eval(self) -> list["Launch"]:
        """Launches that make `working_copies(0)` current before an evaluation reads the fp16 weights."""
        return []

    def working_copies(self, steps_done: int | None = None) -> list["Tensor"]:
        """Each layer's fp16 working copy, the high half of its master (master.py), after `steps_done` steps.
        Kinds that keep one copy ignore the count; None: the count does not matter or is read when needed."""
        return [lay.w16 for lay in self.model.layers]


class ChainStep(Step):
    """A step that is a chain of kernels (the layered step, and the steps of a rank on several GPUs): `steps` copies
    of one step's launches, each launch starting while the one before still runs where the GPU can (programmatic
    dependent launch, sm_90+) and the options allow."""

    def __init__(self, model: "MLP", overlap: bool):
        super().__init__(model)
        from ..kernels.gemm import sm90_or_later

        self.overlap = overlap and sm90_or_later(model.arch)  # griddepcontrol: sm_90+

    def launches(self, steps: int) -> list["Launch"]:
        step = self._one_step()
        return [launch.overlapping() for launch in step] * steps if self.overlap else step * steps

    def _one_step(self) -> list["Launch"]:
        """One training step's launches, in order."""
        raise NotImplementedError

