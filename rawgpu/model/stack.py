"""N models of one architecture in one arena, model-major (model m's part of a buffer sits m parts after model 0's):
each its own weights, optimiser state and table, sample order and schedule; the data, the step counter and the
evaluation's input shared. The buffers the models step (steps/models.py) runs over; each model starts from its seed
as a model alone does (mlp.py), and is read back alone in the form a single model's checkpoint takes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import master, optimizer
from ..contract import OPTIM_WORDS
from ..runtime.driver import Launch, Stream
from ..kernels import PLANNING_SM_COUNT, Kernels
from ..kernels import gather as kd
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..kernels import model_axis as km
from ..runtime.memory import Arena, Tensor
from .mlp import common_units, eval_batch, kept_features, seed_of
from .recipe import INPUT_DTYPES, SCHEDULES, Recipe, cdiv

# What every model of one stack shares: the buffers' shapes, the kernels' families and build, the run's length.
SHARED_FIELDS = ("widths", "batch", "accum", "_state_tensors", "activation", "train_rows", "test_rows",
                 "total_steps", "steps_per_epoch", "loss", "_input_dtype", "standardize")


def stack_problem(recipes: Sequence[Recipe]) -> str | None:
    """Why these recipes cannot train as one stack (one line), or None."""
    if not recipes:
        return "a stack needs at least one model"
    if len({r.optimizer == "sgd" for r in recipes}) > 1:
        return "the models mix SGD with Adam: one stack runs one optimiser family"
    for field in SHARED_FIELDS:
        values = {repr(getattr(r, field)) for r in recipes}
        if len(values) > 1:
            return f"the models differ in {field.lstrip('_')} ({', '.join(sorted(values))}): one stack shares it"
    return None


@dataclass
class StackLayer:
    """One layer of every model: [N x in_p, out_p] master halves and state, [N x out_p] bias and state."""

    fan_in: int
    fan_out: int
    wlo: Tensor
    w16: Tensor
    b: Tensor
    mw: Tensor | None
    mb: Tensor | None
    vw: Tensor | None
    vb: Tensor | None


class ModelStack:
    """Plan (`__init__`, no GPU; steps.plan_model attaches the step) -> bind -> allocate -> upload_data +
    init_parameters -> launches; read back per model."""

    def __init__(self, recipes: Sequence[Recipe], arch: str = "sm_86", sm_count: int = PLANNING_SM_COUNT,
                 capacity: tuple[int, ...] | None = None):
        if why := stack_problem(recipes):
            raise ValueError(why)
        self.recipes = list(recipes)
        self.recipe = r = self.recipes[0]
        self.n = n = len(self.recipes)
        self.k: Kernels | None = None
        self.arch, self.sm_count, self.cluster_capacity = arch, sm_count, capacity
        self.choice: Any = None
        self.step: Any = None
        self.arena = a = Arena()
        B, widths, padded = r.batch, r.widths, r._padded_widths
        self.rows, self.padded = B, padded
        # shared: the data (images as bytes with byte labels, or a table's features as the recipe keeps them with
        # int32 labels, and its standardization), the step counter, the evaluation's input
        x_dtype, y_dtype = np.dtype(INPUT_DTYPES[r._input_dtype]), np.uint8 if r._pixels else np.int32
        self.images = a.tensor("train_images", (r.train_rows, r.inputs), x_dtype)
        self.labels = a.tensor("train_labels", r.train_rows, y_dtype)
        self.test_images = a.tensor("test_images", (r.test_rows, r.inputs), x_dtype)
        self.test_labels = a.tensor("test_labels", r.test_rows, y_dtype)
        self.mean = a.tensor("feature_mean", r.inputs, np.float32) if r.standardize else None
        self.inv_std = a.tensor("feature_inv_std", r.inputs, np.float32) if r.standardize else None
        self.scaling_partial = (a.tensor("scaling_partial", (kd.column_chunks(r.train_rows, r.inputs, sm_count), 2,
                                                             r.inputs), np.float64) if r.standardize else None)
        self.counter = a.tensor("step", 1, np.int64)
        self.eval_counter = a.tensor("eval_step", 1, np.int64)
        self.zero_counter = a.tensor("zero_step", 1, np.int64)
        self.eval_batch = EB = eval_batch(r, n)
        self.eval_chunks, self.eval_tail = divmod(r.test_rows, EB)
        self.eval_perm = a.tensor("eval_perm", EB * self.eval_chunks, np.int32)  # EB <= test_rows: >= 1 chunk
        self.tail_perm = a.tensor("eval_tail_perm", self.eval_tail, np.int32) if self.eval_tail else None
        self.eval_x = a.tensor("eval_x", (EB, padded[0]), np.float16)
        self.eval_y = a.tensor("eval_y", EB, np.int32)
        # per model
        self.perm = a.tensor("perm", (n, r.steps_per_epoch * B), np.int32)
        self.optim = a.tensor("optim", (n, OPTIM_WORDS), np.float32)
        self.schedules = a.tensor("schedules", (n, km.SCHEDULE_WORDS), np.float64)
        self.loss_sum = a.tensor("loss_sum", n, np.float64)
        self.correct = a.tensor("correct", n, np.int32)
        self.eval_loss_sum = a.tensor("eval_loss_sum", n, np.float64)
        self.eval_correct = a.tensor("eval_correct", n, np.int32)
        self.acts = [a.tensor(f"act{i}", (n * B, p), np.float16) for i, p in enumerate(padded)]
        self.grads = [None] + [a.tensor(f"grad{i}", (n * B, p), np.float16) for i, p in enumerate(padded) if i]
        self.slopes = [a.tensor(f"slope{i}", (n * B, p), np.float16) if r._saves_slope and 0 < i < len(padded) - 1
                       else None for i, p in enumerate(padded)]  # as MLP's
        self.y = a.tensor("y", n * B, np.int32)
        hidden_p = max(padded[1:-1])
        self.eval_h = [a.tensor(f"eval_h{i}", (n * EB, hidden_p), np.float16) for i in range(2)]
        self.eval_logits = a.tensor("eval_logits", (n * EB, padded[-1]), np.float16)
        widest = max(padded)
        self.xent_sums = a.tensor("xent_sums", (n, 2), np.int64)
        self.xent_tickets = a.tensor("xent_tickets", (n, 1), np.int32)
        self.bias_sums = a.tensor("bias_sums", (n, widest), np.int64)
        self.bias_tickets = a.tensor("bias_tickets", (n, cdiv(widest, 8)), np.int32)
        self.layers: list[StackLayer] = []
        for i in range(len(widths) - 1):
            pin, pout, states = padded[i], padded[i + 1], r._state_tensors
            self.layers.append(StackLayer(
                widths[i], widths[i + 1],
                a.tensor(f"wlo_{i}", (n * pin, pout), np.int16), a.tensor(f"w16_{i}", (n * pin, pout), np.float16),
                a.tensor(f"b_{i}", n * pout, np.float32),
                a.tensor(f"mw_{i}", (n * pin, pout), np.float32) if states else None,
                a.tensor(f"mb_{i}", n * pout, np.float32) if states else None,
                a.tensor(f"vw_{i}", (n * pin, pout), np.float32) if states > 1 else None,
                a.tensor(f"vb_{i}", n * pout, np.float32) if states > 1 else None))
        plan = self.plan_gemm
        last = len(self.layers) - 1
        self.eval_fwd = [plan(EB, padded[i + 1], padded[i], "rr", "bias" if i == last else "bias_act")
                         for i in range(len(self.layers))]
        self.tail_fwd = [plan(self.eval_tail, padded[i + 1], padded[i], "rr", "bias" if i == last else "bias_act")
                         for i in range(len(self.layers))] if self.eval_tail else []

    def plan_gemm(self, M: int, N: int, K: int, layout: str, epilogue: str, states: int = 0) -> kg.GemmPlan:
        """One model's GEMM as a launch over every model takes it: whole tiles of 32 rows (M <= 32) or 64."""
        return kg.plan_gemm(M, N, K, layout, epilogue, "f32", self.sm_count, splits=1, arch=self.arch,
                            config="32x128" if M <= 32 else "64x128", states=states, cluster=False)

    def attach(self, step: Any) -> "ModelStack":
        self.step = step
        return self

    def bind(self, kernels: Kernels) -> "ModelStack":
        kernels.check_serves(self.arch, self.recipe.activation, "the stack")
        self.k = kernels
        return self

    def kernel_units(self) -> set:
        return common_units(self.arch) | self.step.kernel_units()

    @property
    def kind(self) -> str:
        return self.step.kind

    def part(self, t: Tensor, m: int) -> Tensor:
        """Model m's part of a per-model buffer."""
        return km.model_part(t, self.n, m)

    # --- start-up ---------------------------------------------------------------------------------------------

    def allocate(self) -> "ModelStack":
        self.arena.allocate()
        self.arena.zero()
        return self

    def upload_data(self, data) -> None:
        """The data every model trains on: images as they are, a table's features as the recipe keeps them
        (mlp.kept_features) with int32 labels; then the evaluation's orders."""
        r = self.recipe

        def kept(x, rows: int, what: str) -> np.ndarray:
            x = np.asarray(x).reshape(rows, r.inputs)
            return x if r._pixels else kept_features(x, r._input_dtype, what)
        self.images.upload(kept(data.train_images, r.train_rows, "the training set"))
        self.labels.upload(np.asarray(data.train_labels).astype(self.labels.dtype, copy=False))
        self.test_images.upload(kept(data.test_images, r.test_rows, "the test set"))
        self.test_labels.upload(np.asarray(data.test_labels).astype(self.labels.dtype, copy=False))
        whole = self.eval_chunks * self.eval_batch
        self.eval_perm.upload(np.arange(whole, dtype=np.int32))
        if self.tail_perm is not None:
            self.tail_perm.upload(np.arange(whole, r.test_rows, dtype=np.int32))

    def compute_scaling(self, stream: Stream) -> None:
        """The standardization from the training set on the device, as MLP.compute_scaling computes it: one for every
        model (they share the data)."""
        for launch in kd.column_scaling(self.k, self.images, self.mean, self.inv_std, self.scaling_partial):
            launch.run(stream)
        stream.synchronize("the features' standardization")

    def scaling(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(mean, inv_std) where the models standardize their features, else None (every model's checkpoint keeps
        it)."""
        return None if self.mean is None else (self.mean.download(), self.inv_std.download())

    def gather(self, early: bool) -> Launch:
        """Every model's batch of this step (model_axis.gather: images, or a table's rows standardized where the
        recipe says), with its optimiser row."""
        r = self.recipe
        return km.gather(self.k, self.n, self.images, self.labels, self.perm, self.counter, self.acts[0], self.y,
                         r.batch, r.steps_per_epoch, self.optim, self.schedules, r.total_steps, early=early,
                         sm_count=self.sm_count, mean=self.mean, inv_std=self.inv_std)

    def init_parameters(self, stream: Stream) -> None:
        """Every model's weights and biases from its own seed, drawn as a model alone draws them; its optimiser
        table and schedule; the state, counters and sums zero."""
        for m, r in enumerate(self.recipes):
            for i, lay in enumerate(self.layers):
                bound = 1.0 / math.sqrt(r.widths[i])
                ke.init_uniform_master(self.k, self.part(lay.w16, m), self.part(lay.wlo, m), bound, seed_of(r, i, 0),
                                       ke.Window((lay.fan_in, lay.fan_out))).run(stream)
                ke.init_uniform(self.k, self.part(lay.b, m), bound, seed_of(r, i, 1),
                                ke.Window((1, lay.fan_out))).run(stream)
        self.optim.upload(np.stack([optimizer.words(optimizer.hyperparameters(r)) for r in self.recipes]))
        self.schedules.upload(np.array([schedule_row(r) for r in self.recipes], np.float64))
        for t in [self.counter, self.zero_counter, self.xent_sums, self.xent_tickets, self.bias_sums,
                  self.bias_tickets] + [t for lay in self.layers for t in (lay.mw, lay.mb, lay.vw, lay.vb) if t]:
            t.fill_bytes(0)

    def set_permutations(self, perms: Sequence[np.ndarray]) -> None:
        """Every model's sample order of this epoch (synchronises: between epochs only)."""
        need = self.perm.shape[1]
        self.perm.upload(np.stack([np.asarray(p[:need], np.int32) for p in perms]))

    def zero_metrics(self) -> None:
        self.loss_sum.fill_bytes(0)
        self.correct.fill_bytes(0)

    # --- launches -------------------------------------------------------------------------------------------

    def step_launches(self, steps: int = 1) -> list[Launch]:
        return self.step.launches(steps)

    def forward(self, x: Tensor, outs: list[Tensor], plans: list[kg.GemmPlan], shared_input: bool,
                slopes: list[Tensor | None] | None = None) -> list[Launch]:
        """Every model's forward GEMMs from x (one input every model reads where shared_input) through outs; slopes
        as MLP.forward's."""
        launches, inp = [], x
        for i, (lay, out, plan) in enumerate(zip(self.layers, outs, plans)):
            launches.append(km.gemm(self.k, self.n, plan, inp, lay.w16, out, bias=lay.b,
                                    act=slopes[i] if slopes else None, shared_a=shared_input and i == 0))
            inp = out
        return launches

    def saved_for_backward(self, i: int) -> Tensor:
        """As MLP.saved_for_backward: what the backward of layer i's input activation reads."""
        return self.slopes[i] if self.slopes[i] is not None else self.acts[i]

    def eval_launches(self) -> list[Launch]:
        """Every model over the whole test set, eval_batch rows at a time, each chunk gathered once for all."""
        k, EB, chunks, classes = self.k, self.eval_batch, self.eval_chunks, self.recipe.classes
        out = [kd.set_i64(k, self.eval_counter, 0)]
        hidden = [self.eval_h[i % 2] for i in range(len(self.layers) - 1)] + [self.eval_logits]
        for rows, perm, counter, plans, times in ((EB, self.eval_perm, self.eval_counter, self.eval_fwd, chunks),
                                                  (self.eval_tail, self.tail_perm, self.zero_counter, self.tail_fwd,
                                                   1 if self.eval_tail else 0)):
            for _ in range(times):
                steps = chunks if rows == EB else 1
                out.append(kd.gather_batch(k, self.test_images, self.test_labels, perm, counter, self.eval_x,
                                           self.eval_y, rows, steps) if self.recipe._pixels else
                           kd.gather_table(k, self.test_images, self.test_labels, perm, counter, self.eval_x,
                                           self.eval_y, rows, steps, mean=self.mean, inv_std=self.inv_std))
                out += self.forward(self.eval_x, hidden, plans, shared_input=True)
                out.append(km.softmax_xent(k, self.n, self.eval_logits, self.eval_y, None, self.eval_loss_sum,
                                           self.eval_correct, rows, classes, shared_labels=True,
                                           scratch=self.xent_sums, ticket=self.xent_tickets))
                if rows == EB:
                    out.append(kd.step_increment(k, self.eval_counter))
        return out

    # --- reading back -----------------------------------------------------------------------------------------

    def train_metrics(self) -> tuple[np.ndarray, np.ndarray]:
        """Every model's (loss sum, correct count) since zero_metrics."""
        return self.loss_sum.download().astype(np.float64), self.correct.download().astype(np.int64)

    def eval_metrics(self) -> tuple[np.ndarray, np.ndarray]:
        """Every model's (mean test loss, test accuracy) of the last evaluation (zeroed before it by the caller)."""
        n = self.recipe.test_rows
        return self.eval_loss_sum.download() / n, self.eval_correct.download() / n

    def zero_eval_metrics(self) -> None:
        self.eval_loss_sum.fill_bytes(0)
        self.eval_correct.fill_bytes(0)

    def step_count(self) -> int:
        return int(self.counter.download()[0])

    def model_state(self, m: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
        """Model m as MLP.state() gives a model alone: (parameters, the exact device state), padding cut off."""
        r, weights, state = self.recipes[m], [], {}
        names = optimizer.state_names(r)
        for i, lay in enumerate(self.layers):
            cut = (slice(0, lay.fan_in), slice(0, lay.fan_out))
            hi, lo = self.part(lay.w16, m).download(), self.part(lay.wlo, m).download()
            state[f"layers.{i}.w16"], state[f"layers.{i}.wlo"] = hi[cut].copy(), lo[cut].copy()
            b = self.part(lay.b, m).download()
            weights.append((master.join(hi, lo)[cut].copy(), b[:lay.fan_out].copy()))
            for name, pair in zip(names, ((lay.mw, lay.mb), (lay.vw, lay.vb))):
                state[f"layers.{i}.{name}_weight"] = self.part(pair[0], m).download()[cut].copy()
                state[f"layers.{i}.{name}_bias"] = self.part(pair[1], m).download()[:lay.fan_out].copy()
        return weights, state


def schedule_row(r: Recipe) -> tuple[float, float, float, float]:
    """A model's row of the schedule table (kernels/model_axis.py: gather): lr0, lr_min, warmup steps, kind code."""
    lr0, lr_min = r._scaled_lr
    kind = SCHEDULES.get(r.schedule, r.schedule)
    return float(np.float32(lr0)), float(np.float32(lr_min)), float(r.warmup_steps), float(kind)
