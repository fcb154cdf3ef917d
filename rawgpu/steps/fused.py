"""The fused step: the whole training step (or several) in one persistent cooperative kernel, cu/fused_step.cu.

One block per SM stays resident; the step's phases (forward per layer, head, backward per layer) are separated
by grid-wide barriers. A backward phase reads the fp16 working copy while other warps update it, so each weight
has two fp16 copies: step s reads copy s & 1 and writes copy (s + 1) & 1, and the fp32 master is
(copy (steps done) & 1, lo). Runs on every GPU rawgpu supports, with fp32 accumulation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import contract
from ..model import optimizer
from ..kernels import dx_sgd as kb
from ..kernels import elementwise as ke
from ..kernels import fused as kf
from ..kernels import gemm as kg
from ..model.mlp import MLP
from ..model.recipe import Recipe, data_kind, loss_scale
from .base import Step, StepOptions

if TYPE_CHECKING:
    from ..runtime.driver import Launch, Stream
    from ..runtime.memory import Tensor

# The widest padded hidden layer `auto` gives the fused step, by what the layered step would be instead: with the
# one-pass backward (batch <= 32, plain SGD) its per-layer kernels win above 512, in 18 kernels above 1024, where
# the fused step's 32x32 blocks stream the weights slower (`python scripts/bench.py train --recipe seed
# --sizes 512 1024 2048 --rawgpu-variants fused layered long`).
MAX_HIDDEN_VS_ONE_PASS = 512
MAX_HIDDEN = 1024
# On sm_90 above the short form's batches the layered step's GEMMs run on warpgroup MMA, its updates beside the chain
# of dx GEMMs, and beat the fused step above this width or this batch (`python scripts/bench.py train --batch 300
# --sizes 128 256 512 --rawgpu-variants fused layered --peers jax-fori`, and `--batch 384 512`).
MAX_HIDDEN_VS_WGMMA = 256
MAX_BATCH_VS_WGMMA = 320
# The largest batch `auto` gives it: above, the layered step's GEMM tiles beat its per-block row loops at every width
# (`python scripts/bench.py train --batch 1024 --sizes 256 1024 --rawgpu-variants fused layered`).
MAX_BATCH = 512

MODEL = MLP  # the buffers it runs over
SEVERAL_GPUS = False
SUMMARY = "the whole step in one persistent cooperative kernel (grid-wide barriers between phases; ReLU only)"
PREFERRED_WHEN = (f"fp32 accumulation, batch <= {MAX_BATCH}, hidden <= {MAX_HIDDEN}, or <= {MAX_HIDDEN_VS_ONE_PASS} at "
                  f"batch <= 32 with plain SGD, and on sm_90 above batch {kg.BATCH_STREAM_ROWS} batch <= "
                  f"{MAX_BATCH_VS_WGMMA} and hidden <= {MAX_HIDDEN_VS_WGMMA}")
WHEN_AUTO = "one kernel beats a chain of latency-bound launches at this width"


def unsupported_reason(recipe: Recipe, arch: str) -> str | None:
    """Why the fused step cannot run this recipe; None when it can (any GPU rawgpu supports)."""
    if recipe.accum != "fp32":
        return "the fused step accumulates in fp32 only"
    if recipe.activation != "relu":
        return f"the fused step applies ReLU only, not {recipe.activation}"
    if recipe.inputs != contract.FS_INPUTS:
        return f"the fused step is built for images of {contract.FS_INPUTS} pixels, these have {recipe.inputs}"
    if recipe.classes > contract.HEAD_TILE_CLASSES:
        return f"the fused step's head is one tile of {contract.HEAD_TILE_CLASSES} classes, not {recipe.classes}"
    if not recipe._pixels:
        return f"the fused step reads uint8 images and their labels, not this data ({data_kind(recipe)})"
    if recipe.layers + 1 > kf.MAX_LINEAR_LAYERS:
        return f"the fused step takes at most {kf.MAX_LINEAR_LAYERS - 1} hidden layers"
    return None


def not_preferred_reason(recipe: Recipe, arch: str) -> str | None:
    """Why `auto` passes the fused step over on a GPU of `arch` although it could run; None when `auto` takes it."""
    if recipe.batch > MAX_BATCH:
        return (f"batch {recipe.batch} > {MAX_BATCH}: the layered step's GEMM tiles run batches this large faster than "
                "the fused step's per-block rows")
    wgmma = recipe.batch > kg.BATCH_STREAM_ROWS and kg.has_wgmma(arch)
    if wgmma and recipe.batch > MAX_BATCH_VS_WGMMA:
        return (f"batch {recipe.batch} > {MAX_BATCH_VS_WGMMA}: the layered step on warpgroup MMA runs batches this "
                "large faster than the fused step's per-block rows")
    one_pass = kb.supported(recipe.batch, recipe._plain_sgd, recipe._kernel_accum)
    limit, how = (MAX_HIDDEN_VS_ONE_PASS, "with its one-pass backward") if one_pass else (MAX_HIDDEN, "in 18 kernels")
    if wgmma and MAX_HIDDEN_VS_WGMMA < limit:
        limit, how = MAX_HIDDEN_VS_WGMMA, "on warpgroup MMA"
    if (widest := max(recipe._padded_widths[1:-1])) > limit:
        return (f"hidden {widest} > {limit}: the layered step {how} runs weights this wide faster than the fused "
                "step's 32x32 blocks")
    return None


class FusedStep(Step):

    def __init__(self, model: "MLP", grid: int | None):
        super().__init__(model)
        a, B = model.arena, model.recipe.batch
        self.grid_request = grid
        self.w16_next = [a.tensor(f"w16b_{i}", lay.w16.shape, np.float16) for i, lay in enumerate(model.layers)]
        self.row_loss = a.tensor("row_loss", B, np.float32)  # per-row metrics, summed by one warp
        self.row_hit = a.tensor("row_hit", B, np.int32)
        self.barrier = a.tensor("grid_barrier", 1, np.int64)
        self.table = a.tensor("fused_params", kf.table_words(len(model.layers)), np.uint64)

    @property
    def adam(self) -> bool:
        return self.model.recipe.optimizer != "sgd"

    def kernel_units(self) -> set:
        return {(kf.SOURCE, kf.kernel_name(self.adam))}

    def counters(self) -> list["Tensor"]:
        return [self.barrier]

    def allocated(self) -> None:
        self.table.upload(self.param_table())

    def parameters_set(self, stream: "Stream") -> None:
        """The second fp16 copy = the first."""
        for lay, nxt in zip(self.model.layers, self.w16_next):
            ke.copy_f16_if_odd(self.model.k, nxt, lay.w16, None).run(stream)
        stream.synchronize()

    def before_eval(self) -> list["Launch"]:
        """Evaluation reads copy 0; the current copy is copy (steps done) & 1."""
        m = self.model
        return [ke.copy_f16_if_odd(m.k, lay.w16, nxt, m.counter) for lay, nxt in zip(m.layers, self.w16_next)]

    def working_copies(self, steps_done: int | None = None) -> list["Tensor"]:
        odd = (self.model.step_count() if steps_done is None else steps_done) % 2 == 1
        return self.w16_next if odd else [lay.w16 for lay in self.model.layers]

    def grid(self) -> int:
        return kf.resident_grid(self.model.k, self.model.sm_count, self.grid_request, self.adam)

    def launches(self, steps: int) -> list["Launch"]:
        return [kf.fused_steps(self.model.k, self.table, steps, self.grid(), self.adam)]

    def describe(self) -> str:
        return f"fused: 1 persistent kernel, {self.grid()} blocks x {kf.THREADS} threads"

    def phases(self) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
        rows = [(name, str(blocks), str(warps))
                for name, blocks, warps in kf.phase_tasks(self.model.recipe.batch, self.model.padded)]
        return ("phases of the fused step kernel, each ending in a grid-wide barrier",
                ("phase", "block tasks", "warp tasks"), rows)

    def param_table(self) -> np.ndarray:
        """The FsParams table (contract/fused.py; pointers are device addresses) as uint64 words, up to the model's last
        layer. The rates are rounded to fp32 first: the kernel computes in fp32."""
        m = self.model
        r = m.recipe
        lr0, lr_min = r._scaled_lr
        f32 = lambda x: float(np.float32(x))  # noqa: E731
        p = contract.FsParams(
            images=m.images.ptr, labels=m.labels.ptr, perm=m.perm.ptr, step=m.counter.ptr, loss_sum=m.loss_sum.ptr,
            correct=m.correct.ptr, row_loss=self.row_loss.ptr, row_hit=self.row_hit.ptr, barrier=self.barrier.ptr,
            batch=r.batch, steps_per_epoch=r.steps_per_epoch, layers=len(m.layers), schedule=r._schedule_code,
            total_steps=r.total_steps, warmup_steps=r.warmup_steps, classes=r.classes,
            lr0=f32(lr0), lr_min=f32(lr_min), dlogit_scale=f32(loss_scale(r.batch) / r.batch),
            optim=optimizer.hyperparameters(r))
        for i, (lay, nxt) in enumerate(zip(m.layers, self.w16_next)):
            t = p.layer[i]
            t.wlo, t.w16[0], t.w16[1], t.b = lay.wlo.ptr, lay.w16.ptr, nxt.ptr, lay.b.ptr
            t.mw, t.mb = (lay.mw.ptr, lay.mb.ptr) if lay.mw else (0, 0)
            t.vw, t.vb = (lay.vw.ptr, lay.vb.ptr) if lay.vw else (0, 0)
            t.x, t.dy = m.acts[i].ptr, m.grads[i + 1].ptr
            t.y = m.acts[i + 1].ptr if i + 1 < len(m.layers) else 0  # the last layer's output: the logits, unused
            t.dx = m.grads[i].ptr if i else 0
            t.in_p, t.out_p = lay.wlo.shape
        return np.frombuffer(contract.table_bytes(p, len(m.layers)), np.uint64)


def build(model: "MLP", options: StepOptions) -> FusedStep:
    return FusedStep(model, options.fused_grid)
