"""The model: an MLP pixels -> hidden x layers -> classes (784 -> ... -> 10 on MNIST) whose every buffer lives in
one arena, and what every training step kind shares: the dataset on the device, the weights and optimiser state,
activations, metrics, evaluation.

How a training step runs is its step kind's business (rawgpu/steps/), chosen by `steps.choose`; `steps.plan_model`
plans the model and attaches its step, which the model then asks for the step's launches. Nothing in a step depends
on the host after start-up: the step counter, the batch position and the learning rate live on the device.

The fp32 master weights are stored as two 16-bit halves (rawgpu/model/master.py): W16, the fp16 working copy every
GEMM reads, and lo, the rest; a step moves 10 bytes per weight instead of 12. Widths are padded to multiples of 8
and the classes to 16 (recipe.py); padded weights, biases and activations start at zero and stay zero, because
their gradients are exactly zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import master, optimizer
from ..runtime.columns import Columns
from ..runtime.dlpack import DeviceArray
from ..runtime import driver as drv
from ..runtime.driver import Launch, Stream
from ..kernels import PLANNING_SM_COUNT, Kernels
from ..kernels import gather as kd
from ..kernels import gather_forward as kgf
from ..kernels import elementwise as ke
from ..kernels import gemm as kg
from ..kernels import l2 as kl2
from ..contract import OPTIM_WORDS
from ..kernels import loss as kl
from ..runtime.errors import DataError, OutOfMemoryError
from ..runtime.host_rows import empty_rows, in_blocks
from ..runtime.memory import Arena, Tensor, format_bytes
from .upload import beyond_fp16, staging_bytes, upload_columns
from .recipe import INPUT_DTYPES, Recipe, cdiv, loss_scale, pad8

EVAL_ACTIVATION_BUDGET = 512 << 20  # bytes of evaluation activations before the test set is split further


@dataclass
class Layer:
    """One linear layer's shared buffers (padded shapes) and its evaluation GEMM plan."""

    fan_in: int
    fan_out: int
    wlo: Tensor  # int16 low half of the fp32 master weights [in_p, out_p], x @ W orientation (master.py)
    w16: Tensor  # fp16 working copy and the master's high half, same shape
    b: Tensor  # fp32 bias [out_p]
    mw: Tensor | None  # the optimiser's first state: SGD's momentum or Adam's first moment (None for plain SGD)
    mb: Tensor | None
    vw: Tensor | None  # Adam's second moment (None for SGD)
    vb: Tensor | None
    eval_fwd: kg.GemmPlan


class MLP:
    """Plan (`__init__`, no GPU needed; steps.plan_model attaches the step) -> `bind(kernels)` -> `allocate()` ->
    `upload_data()` + `init_parameters()` -> launches."""

    def __init__(self, recipe: Recipe, arch: str = "sm_86", sm_count: int = PLANNING_SM_COUNT,
                 capacity: tuple[int, ...] | None = None):
        """The shared buffers and the evaluation's plans for a GPU of `arch` with `sm_count` SMs. capacity: the
        GPU's cluster capacity (gemm.cluster_capacity; None: the planning estimate). arch defaults to sm_86, the
        smallest shared memory."""
        self.k: Kernels | None = None
        self.recipe, self.sm_count, self.arch, self.cluster_capacity = recipe, sm_count, arch, capacity
        self.choice: Any = None  # the steps.Choice that picked the step, and the steps.Step: both set by
        self.step: Any = None  # steps.plan_model (the model never imports the steps that run over it)
        r = recipe
        self.arena = a = Arena()
        B = self.rows = self.step_rows()
        self.eval_batch = eval_batch(r)
        EB = self.eval_batch
        self.eval_chunks, self.eval_tail = divmod(r.test_rows, EB)  # whole chunks of EB rows, then the rest
        widths, padded = self.layer_widths()
        self.padded = padded
        # dataset and input pipeline: features as the recipe keeps them, targets as the task reads them (targets())
        x_dtype = np.dtype(INPUT_DTYPES[r._input_dtype])
        self.images = a.tensor("train_images", (r.train_rows, r.inputs), x_dtype)
        self.labels = a.tensor("train_labels", *self.targets(r.train_rows))
        self.test_images = a.tensor("test_images", (r.test_rows, r.inputs), x_dtype)
        self.test_labels = a.tensor("test_labels", *self.targets(r.test_rows))
        # standardization: per feature (v - mean) * inv_std, from the training split (set_scaling)
        # features handed over on the GPU are checked there: the first value that is not finite (_upload_features)
        self.nonfinite = a.tensor("nonfinite", 1, np.uint64) if r._input_dtype != "u8" else None
        # a table read as columns (runtime/columns.py) goes up through a few MB of staging, its rows made there
        staging = staging_bytes(max(r.train_rows, r.test_rows), r.inputs) if r._input_dtype != "u8" else 0
        self.column_staging = a.tensor("column_staging", staging, np.uint8) if staging else None
        self.mean = a.tensor("feature_mean", r.inputs, np.float32) if r.standardize else None
        self.inv_std = a.tensor("feature_inv_std", r.inputs, np.float32) if r.standardize else None
        self.scaling_partial = (a.tensor("scaling_partial", (kd.column_chunks(r.train_rows, r.inputs, sm_count), 2,
                                                             r.inputs), np.float64) if r.standardize else None)
        self.test_sst = 0.0  # a regression's test targets' sum of squares about their mean (R^2's denominator)
        # A regression trains on its targets standardized, (y - target_mean) / target_scale (fp16 outputs stay in
        # range whatever the targets' units); predictions and errors are given back in the targets' own units.
        self.target_mean, self.target_scale = np.zeros(r.classes), 1.0
        self.perm = a.tensor("perm", r.steps_per_epoch * B, np.int32)
        self.eval_perm = a.tensor("eval_perm", EB * self.eval_chunks, np.int32) if self.eval_chunks else None
        self.tail_perm = a.tensor("eval_tail_perm", self.eval_tail, np.int32) if self.eval_tail else None
        # prediction: up to EB images at a time, in order, through the evaluation's buffers
        self.predict_images = a.tensor("predict_images", (EB, r.inputs), x_dtype)
        self.predict_labels = a.tensor("predict_labels", *self.targets(EB))
        self.predict_perm = a.tensor("predict_perm", EB, np.int32)
        # device scalars: the step counter, the optimiser table (the step's lr among its values), the metrics
        self.counter = a.tensor("step", 1, np.int64)
        self.eval_counter = a.tensor("eval_step", 1, np.int64)
        self.zero_counter = a.tensor("zero_step", 1, np.int64)  # stays 0: one-chunk gathers
        self.optim = a.tensor("optim", OPTIM_WORDS, np.float32)
        self.loss_sum = a.tensor("loss_sum", 1, np.float64)
        self.correct = a.tensor("correct", 1, np.int32)
        self.eval_loss_sum = a.tensor("eval_loss_sum", 1, np.float64)
        self.eval_correct = a.tensor("eval_correct", 1, np.int32)
        # a regression's sums (loss, squared error, absolute error) in place of loss_sum and correct
        sums = kl.REGRESSION_SUMS
        self.regression_sums = a.tensor("regression_sums", sums, np.float64) if r.regression else None
        self.eval_regression_sums = a.tensor("eval_regression_sums", sums, np.float64) if r.regression else None
        # activations (saved for backward) and their gradients
        self.acts = [a.tensor(f"act{i}", (B, p), np.float16) for i, p in enumerate(padded)]  # acts[-1]: logits
        self.grads = [None] + [a.tensor(f"grad{i}", (B, p), np.float16) for i, p in enumerate(padded) if i]
        # the hidden layers' slopes act'(z), where the activation's backward reads them (recipe.SLOPE_SAVED)
        self.slopes = [a.tensor(f"slope{i}", (B, p), np.float16) if r._saves_slope and 0 < i < len(padded) - 1
                       else None for i, p in enumerate(padded)]
        self.y = a.tensor("y", *self.batch_targets(B))
        hidden_p = max(padded[1:-1])
        self.eval_x = a.tensor("eval_x", (EB, padded[0]), np.float16)
        self.eval_h = [a.tensor(f"eval_h{i}", (EB, hidden_p), np.float16) for i in range(2)]  # ping-pong
        self.eval_logits = a.tensor("eval_logits", (EB, padded[-1]), np.float16)
        self.eval_y = a.tensor("eval_y", *self.batch_targets(EB))
        self.tail_fwd: list[kg.GemmPlan] = []  # the last, shorter chunk's forward plans
        self.exact_sums, self.exact_tickets = self.exact_scratch("")
        # parameters and optimiser state
        self.layers: list[Layer] = []
        for i in range(len(widths) - 1):
            pin, pout, states = padded[i], padded[i + 1], r._state_tensors
            self.layers.append(Layer(
                widths[i], widths[i + 1],
                a.tensor(f"wlo_{i}", (pin, pout), np.int16), a.tensor(f"w16_{i}", (pin, pout), np.float16),
                a.tensor(f"b_{i}", pout, np.float32),
                a.tensor(f"mw_{i}", (pin, pout), np.float32) if states else None,
                a.tensor(f"mb_{i}", pout, np.float32) if states else None,
                a.tensor(f"vw_{i}", (pin, pout), np.float32) if states > 1 else None,
                a.tensor(f"vb_{i}", pout, np.float32) if states > 1 else None,
                eval_fwd=kg.plan_gemm(EB, pout, pin, "rr", self.forward_epilogue(i), accum=r._kernel_accum,
                                      sm_count=sm_count, arch=self.arch, capacity=self.cluster_capacity)))
            if self.eval_tail:
                self.tail_fwd.append(kg.plan_gemm(self.eval_tail, pout, pin, "rr", self.forward_epilogue(i),
                                                  accum=r._kernel_accum, sm_count=sm_count, arch=self.arch,
                                                  capacity=self.cluster_capacity))

    def targets(self, rows: int) -> tuple[tuple[int, ...], Any]:
        """The shape and dtype of a data set's targets on the device: bytes for images' labels (gather_batch), int32
        labels for the table gather, float32 values [rows, outputs] for a regression."""
        r = self.recipe
        if r.regression:
            return (rows, r.classes), np.float32
        return rows, np.uint8 if r._pixels else np.int32

    def batch_targets(self, rows: int) -> tuple[tuple[int, ...], Any]:
        """The shape and dtype of a gathered batch's targets: int32 labels, or float32 values [rows, outputs]."""
        r = self.recipe
        return ((rows, r.classes), np.float32) if r.regression else ((rows,), np.int32)

    def attach(self, step: Any) -> "MLP":
        """The step its kind planned over this model's buffers (it reserved its own in the arena); then the split-K
        scratch both need: GEMMs run one after another, each leaves its tickets at zero, so all share one."""
        self.step = step
        self.workspace, self.tickets = self.splitk_scratch("", self.eval_plans + self.tail_fwd + step.split_plans())
        return self

    def exact_scratch(self, prefix: str) -> tuple[Tensor, Tensor]:
        """Scratch for sums over blocks that meet exactly (ptx/exact_sum.cuh: the loss over many rows, a bias's row
        ranges), for launches that run one after another: a word per column of the widest layer and a ticket per
        column tile; every launch leaves them zero."""
        widest = max(self.padded)
        return (self.arena.tensor(f"{prefix}exact_sums", max(2, widest), np.int64),
                self.arena.tensor(f"{prefix}exact_tickets", max(1, cdiv(widest, 8)), np.int32))

    def splitk_scratch(self, prefix: str, plans: list) -> tuple[Tensor, Tensor]:
        """The split-K partials and tickets of `plans`' GEMMs, for launches that run one after another: each leaves
        its tickets at zero, so all share one."""
        return (self.arena.tensor(f"{prefix}splitk_workspace", max([1] + [p.workspace_floats for p in plans]),
                                  np.float32),
                self.arena.tensor(f"{prefix}splitk_tickets", max([1] + [p.tickets for p in plans]), np.int32))

    def bind(self, kernels: Kernels) -> "MLP":
        """The compiled kernels the launches use (of the arch this model was planned for)."""
        kernels.check_serves(self.arch, self.recipe.activation, "the model")
        self.k = kernels
        return self

    def kernel_units(self) -> set:
        """The units of compilation (compiler.unit_of) a session of this model launches, from the plans alone: the
        step's, the evaluation's GEMMs, and the small sources every session uses (the data gather, the parameter
        initialisation and copies, the loss and metrics)."""
        return (common_units(self.arch) | kg.plan_units(self.eval_plans + self.tail_fwd, self.arch)
                | self.step.kernel_units())

    # --- what a model on several GPUs (steps/sharded.py, steps/replicated.py) changes ---------------------

    def step_rows(self) -> int:
        """The rows of a step's batch this GPU holds (its buffers' and its training permutation's)."""
        return self.recipe.batch

    def layer_widths(self) -> tuple[list[int], list[int]]:
        """The layers' true widths (inputs, hidden ..., classes) and the padded ones the buffers hold."""
        return self.recipe.widths, self.recipe._padded_widths

    def forward_epilogue(self, i: int) -> str:
        """Layer i's forward GEMM epilogue: bias and the activation, the head's bias alone."""
        return "bias_act" if i < len(self.padded) - 2 else "bias"

    @property
    def eval_plans(self) -> list[kg.GemmPlan]:
        """Each layer's forward GEMM over a whole evaluation chunk."""
        return [lay.eval_fwd for lay in self.layers]

    @property
    def kind(self) -> str:
        """The step kind that runs (steps.KINDS)."""
        return self.step.kind

    # --- start-up ---------------------------------------------------------------------------------------------

    def allocate(self) -> "MLP":
        """The one device allocation (OutOfMemoryError with needed vs free before anything runs, and what to do
        where the data set is much of it), zeroed."""
        try:
            self.arena.allocate()
        except OutOfMemoryError as exc:
            data = self.images.nbytes + self.test_images.nbytes
            if data * 4 < self.arena.peak_bytes:
                raise
            fp16 = " keep float features as fp16 (input_dtype fp16, --input-dtype fp16)," \
                if self.images.dtype == np.float32 else ""
            raise OutOfMemoryError(f"{exc}; the data set takes {format_bytes(data)} of it: train on fewer rows,"
                                   f"{fp16} or use a GPU with more memory") from None
        self.arena.zero()
        self.step.allocated()
        return self

    def upload_data(self, data) -> None:
        """The training and test images and labels (a data.Dataset, or anything with its four arrays), of the
        recipe's shape; then the evaluation's and prediction's orders."""
        r = self.recipe
        self._upload_features(self.images, data.train_images, "the training set")
        self.labels.upload(self.device_targets(data.train_labels, r.train_rows))
        self.upload_test_data(data.test_images, data.test_labels)
        self.prepare_predict()

    def prepare_predict(self) -> None:
        """The prediction's order (the arena starts zeroed: the labels it gathers are 0); no dataset needed."""
        self.predict_perm.upload(np.arange(self.eval_batch, dtype=np.int32))

    def upload_test_data(self, images: np.ndarray, labels: np.ndarray) -> None:
        """A test set of the recipe's test_rows images (evaluation reads it in order)."""
        r = self.recipe
        self._upload_features(self.test_images, images, "the test set")
        self.test_labels.upload(self.device_targets(labels, r.test_rows))
        if r.regression:
            y = np.asarray(labels, np.float64).reshape(r.test_rows, r.classes)
            self.test_sst = float(((y - y.mean(axis=0)) ** 2).sum())
        whole = self.eval_chunks * self.eval_batch
        if self.eval_perm is not None:
            self.eval_perm.upload(np.arange(whole, dtype=np.int32))
        if self.tail_perm is not None:
            self.tail_perm.upload(np.arange(whole, r.test_rows, dtype=np.int32))

    def _upload_features(self, tensor: Tensor, x: Any, what: str) -> None:
        """Features into the arena: a table's columns made into rows on the GPU (model/upload.py); a host array as
        kept_features converts it; one on the GPU (runtime/dlpack.py) copied device to device as it is, then checked
        there: DataError naming the row and column of a value that is not finite."""
        if isinstance(x, Columns) and self.column_staging is not None:
            upload_columns(self.k, x, tensor, self.column_staging, self.nonfinite, what)
            return
        if not isinstance(x, DeviceArray):
            tensor.upload(self.device_features(x, what))
            return
        x = x.reshape(len(x), -1)
        if x.shape != tensor.shape or x.dtype != tensor.dtype:
            raise DataError(f"{what}: a GPU array of {x.shape} {x.dtype}, the model keeps {tensor.shape} {tensor.dtype}")
        x.copy_to_device(tensor.ptr)
        if x.dtype == np.uint8:
            return  # bytes are always finite
        self.nonfinite.upload(np.array([tensor.shape[0] * tensor.shape[1]], np.uint64))
        stream = Stream()
        try:
            kd.first_nonfinite(self.k, tensor, self.nonfinite, self.sm_count).run(stream)
            stream.synchronize("the features' check")
        finally:
            stream.close()
        first = int(self.nonfinite.download()[0])
        if first < tensor.shape[0] * tensor.shape[1]:
            row, col = divmod(first, tensor.shape[1])
            value = np.empty(1, tensor.dtype)
            drv.copy_device_to_host(value, tensor.ptr + first * tensor.dtype.itemsize)
            raise DataError(f"{what}: row {row}, column {col}: {value[0]} (every value must be finite)")

    def device_features(self, x: np.ndarray, what: str) -> np.ndarray:
        """Features [N, inputs] as this model keeps them (kept_features)."""
        return kept_features(np.asarray(x).reshape(len(x), self.recipe.inputs), self.recipe._input_dtype, what)

    def device_targets(self, y: np.ndarray, rows: int) -> np.ndarray:
        """Labels or values as `targets` keeps them (a regression's standardized: set_target_scaling)."""
        shape, dtype = self.targets(rows)
        y = np.asarray(y).reshape(shape)
        if self.recipe.regression:
            return ((y.astype(np.float64) - self.target_mean) / self.target_scale).astype(dtype)
        return y.astype(dtype, copy=False)

    def set_target_scaling(self, mean: np.ndarray, scale: float) -> None:
        """A regression's targets as it trains on them, (y - mean) / scale: as target_scaling computes them from
        the training targets, or as a checkpoint kept them. Before upload_data."""
        self.target_mean = np.asarray(mean, np.float64).reshape(self.recipe.classes)
        self.target_scale = float(scale)

    def in_target_units(self, out: np.ndarray) -> np.ndarray:
        """A regression's outputs (float64) in the targets' own units."""
        return out.astype(np.float64) * self.target_scale + self.target_mean

    def set_scaling(self, mean: np.ndarray, inv_std: np.ndarray) -> None:
        """The standardization's per-feature mean and 1 / std (float32 [inputs]), as `feature_scaling` computes them
        or a checkpoint kept them."""
        self.mean.upload(np.asarray(mean, np.float32).reshape(self.recipe.inputs))
        self.inv_std.upload(np.asarray(inv_std, np.float32).reshape(self.recipe.inputs))

    def compute_scaling(self, stream: Stream) -> None:
        """The standardization from the training set on the device (kernels/gather.py: column_scaling; its host
        twin: feature_scaling), once, before training."""
        for launch in kd.column_scaling(self.k, self.images, self.mean, self.inv_std, self.scaling_partial):
            launch.run(stream)
        stream.synchronize("the features' standardization")

    def scaling(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(mean, inv_std) where the model standardizes its features, else None."""
        return None if self.mean is None else (self.mean.download(), self.inv_std.download())

    def init_parameters(self, stream: Stream) -> None:
        """PyTorch's nn.Linear default (Kaiming-uniform, a = sqrt(5)): W and b ~ U(+-1/sqrt(fan_in)), from
        the seed, W as its master halves; then whatever copies the step kind keeps of them; the optimiser's table
        set and its state, the counters and tickets zeroed."""
        self.set_initial_weights(stream)
        self.step.parameters_set(stream)
        self.optim.upload(optimizer.words(optimizer.hyperparameters(self.recipe)))
        for t in self._counters() + [t for lay in self.layers for t in self._state_tensors(lay).values()]:
            t.fill_bytes(0)

    def set_initial_weights(self, stream: Stream) -> None:
        """Every layer's W (as its master halves) and b drawn from the seed on the device, layer i's W from seed
        (i, 0), b from (i, 1), at their places in the whole layer (init_windows)."""
        for i, lay in enumerate(self.layers):
            bound = 1.0 / math.sqrt(self.recipe.widths[i])
            w, b = self.init_windows(i)
            ke.init_uniform_master(self.k, lay.w16, lay.wlo, bound, self.seed_of(i, 0), w).run(stream)
            ke.init_uniform(self.k, lay.b, bound, self.seed_of(i, 1), b).run(stream)

    def init_windows(self, i: int) -> tuple[ke.Window, ke.Window]:
        """Where layer i's W and b sit in the whole layer the seed draws: on one GPU, all of it (padding zero)."""
        lay = self.layers[i]
        return ke.Window((lay.fan_in, lay.fan_out)), ke.Window((1, lay.fan_out))

    def _state_tensors(self, lay: Layer) -> dict[str, Tensor]:
        """A layer's optimiser state by its checkpoint name (state(): names as torch.optim calls them)."""
        tensors = ((lay.mw, lay.mb), (lay.vw, lay.vb))
        return {f"{name}_{part}": t for name, pair in zip(optimizer.state_names(self.recipe), tensors)
                for part, t in zip(("weight", "bias"), pair)}

    def _counters(self) -> list[Tensor]:
        return ([self.counter, self.zero_counter, self.workspace, self.tickets, self.exact_sums, self.exact_tickets]
                + self.step.counters())

    def state(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
        """(parameters(), the exact device state), padding cut off: per layer the master halves as the step holds
        them now ("layers.{i}.w16", "layers.{i}.wlo") and the optimiser's state as it is ("layers.{i}.momentum_weight",
        "..._bias" with SGD's momentum; "exp_avg_weight", "exp_avg_sq_weight", ... with Adam's: times the loss scale,
        its square for exp_avg_sq). What set_state takes."""
        copies, state = self.step.working_copies(), {}
        for i, lay in enumerate(self.layers):
            cut = (slice(0, lay.fan_in), slice(0, lay.fan_out))
            state[f"layers.{i}.w16"] = copies[i].download()[cut].copy()
            state[f"layers.{i}.wlo"] = lay.wlo.download()[cut].copy()
            for name, t in self._state_tensors(lay).items():
                state[f"layers.{i}.{name}"] = t.download()[cut if len(t.shape) == 2 else cut[1]].copy()
        return self.parameters(), state


    def set_state(self, biases: list[np.ndarray], state: dict[str, np.ndarray], steps_done: int,
                  stream: Stream) -> None:
        """Continue a run: the biases, the master halves and the optimiser's state as state() returned them, and the
        step counter at steps_done (it drives the schedule and the batch position); padding zero, counters reset."""
        def padded(t: Tensor, values: np.ndarray) -> np.ndarray:
            full = np.zeros(t.shape, t.dtype)
            full[tuple(slice(0, n) for n in values.shape)] = values
            return full
        for i, lay in enumerate(self.layers):
            lay.w16.upload(padded(lay.w16, state[f"layers.{i}.w16"]))
            lay.wlo.upload(padded(lay.wlo, state[f"layers.{i}.wlo"]))
            lay.b.upload(padded(lay.b, biases[i]))
            for name, t in self._state_tensors(lay).items():
                t.upload(padded(t, state[f"layers.{i}.{name}"]))
        self.step.parameters_set(stream)
        self.optim.upload(optimizer.words(optimizer.hyperparameters(self.recipe)))
        for t in self._counters():
            t.fill_bytes(0)
        self.counter.upload(np.array([steps_done], np.int64))

    def set_train_metrics(self, *sums: float) -> None:
        """Restore the metrics a resumed epoch had summed before it was saved (as train_metrics returned them)."""
        if self.regression_sums is not None:
            self.regression_sums.upload(np.array(sums, np.float64))
            return
        loss_sum, correct = sums
        self.loss_sum.upload(np.array([loss_sum], np.float64))
        self.correct.upload(np.array([correct], np.int32))

    def seed_of(self, layer: int, which: int) -> int:
        return seed_of(self.recipe, layer, which)

    def _set_master(self, lay: Layer, w: np.ndarray) -> None:
        hi, lo = master.split(w)
        lay.w16.upload(hi)
        lay.wlo.upload(lo)

    def set_permutation(self, perm: np.ndarray) -> None:
        """This epoch's sample order (the first steps_per_epoch x batch entries are used). Synchronises: call it
        between epochs, never inside one."""
        need = self.perm.shape[0]
        self.perm.upload(np.ascontiguousarray(perm[:need], dtype=np.int32))

    # --- the step ----------------------------------------------------------------------------------------------

    def forward(self, x: Tensor, outs: list[Tensor], plans: list[kg.GemmPlan],
                keep: list[float] | None = None, slopes: list[Tensor | None] | None = None,
                first: int = 0) -> list[Launch]:
        """The forward GEMMs (bias and activation fused) from x through outs, of the layers from `first` on; keep:
        each weight's L2 policy; slopes: where each layer's slope act'(z) goes for the backward (training; None:
        nowhere)."""
        layers = self.layers[first:]
        launches, inp, keep = [], x, keep or [kl2.NORMAL] * len(layers)
        for lay, out, plan, keep_w, slope in zip(layers, outs, plans, keep, slopes or [None] * len(layers)):
            launches.append(kg.gemm(self.k, plan, inp, lay.w16, out, bias=lay.b, act=slope, workspace=self.workspace,
                                    tickets=self.tickets, keep_b=keep_w))
            inp = out
        return launches

    def saved_for_backward(self, i: int) -> Tensor:
        """What the backward of the activation of layer i's input reads (activation.cuh): the slope act'(z) where
        the activation needs it, else the activation itself."""
        return self.slopes[i] if self.slopes[i] is not None else self.acts[i]

    def step_launches(self, steps: int = 1) -> list[Launch]:
        """`steps` training steps, as the step kind runs them."""
        return self.step.launches(steps)

    def eval_launches(self) -> list[Launch]:
        """The whole test set, eval_batch rows at a time, then the shorter last chunk: forward and metrics only (no
        gradients, no updates)."""
        k, EB, chunks = self.k, self.eval_batch, self.eval_chunks
        out = self.step.before_eval()
        out += [kd.set_i64(k, self.eval_counter, 0), self.zero_metrics(evaluation=True)]
        for _ in range(chunks):
            out.append(self.gather(self.test_images, self.test_labels, self.eval_perm, self.eval_counter,
                                   self.eval_x, self.eval_y, EB, chunks))
            out += self._eval_forward(self.eval_plans)
            out.append(self.loss(self.eval_logits, self.eval_y, None, EB, evaluation=True))
            out.append(kd.step_increment(k, self.eval_counter))
        if self.eval_tail:
            out.append(self.gather(self.test_images, self.test_labels, self.tail_perm, self.zero_counter,
                                   self.eval_x, self.eval_y, self.eval_tail, 1))
            out += self._eval_forward(self.tail_fwd)
            out.append(self.loss(self.eval_logits, self.eval_y, None, self.eval_tail, evaluation=True))
        return out

    def gather(self, x: Tensor, targets: Tensor, perm: Tensor, step: Tensor, x_out: Tensor, y_out: Tensor,
               batch: int, steps_per_epoch: int, **options) -> Launch:
        """The batch gather for this model's data, the one place that chooses it: gather_batch for images (uint8
        pixels and byte labels), else the table gather (its dtype, labels or values, the standardization).
        options: optim, schedule, early, blocks, as both take them."""
        if self.recipe._pixels:
            return kd.gather_batch(self.k, x, targets, perm, step, x_out, y_out, batch, steps_per_epoch, **options)
        return kd.gather_table(self.k, x, targets, perm, step, x_out, y_out, batch, steps_per_epoch, mean=self.mean,
                               inv_std=self.inv_std, **options)

    def gather_forward(self, batch: int, steps_per_epoch: int, **options) -> Launch:
        """A table's training gather and the first layer's forward in one launch (kernels/gather_forward.py: where
        `folds` says the layered step takes it): the gather's rows, targets and optimiser values as `gather` writes
        them, and the first hidden layer's output and slope. options: optim, schedule, early."""
        lay = self.layers[0]
        return kgf.gather_forward(self.k, self.images, self.labels, self.perm, self.counter, self.acts[0], self.y,
                                  batch, steps_per_epoch, lay.w16, lay.b, self.acts[1], slope=self.slopes[1],
                                  mean=self.mean, inv_std=self.inv_std, **options)

    def loss(self, out: Tensor, y: Tensor, grad: Tensor | None, rows: int, evaluation: bool = False,
             grad_scale: float = 1.0, mean_over: int | None = None, scratch: Tensor | None = None,
             ticket: Tensor | None = None) -> Launch:
        """The loss of `rows` rows of the head's output, the one place that chooses it: softmax cross-entropy (loss
        sum and hits) or the regression loss (its sums), into the training's metrics or the evaluation's; grad None
        for evaluation, else the output's gradient (loss.py's grad_scale, mean_over). scratch and ticket: the
        exact-sum scratch (default the model's)."""
        r, k = self.recipe, self.k
        scratch = self.exact_sums if scratch is None else scratch
        ticket = self.exact_tickets if ticket is None else ticket
        if r.regression:
            sums = self.eval_regression_sums if evaluation else self.regression_sums
            return kl.regression_loss(k, out, y, grad, sums, rows, r.classes, r.loss, grad_scale, mean_over,
                                      scratch=scratch, ticket=ticket)
        loss_sum, correct = (self.eval_loss_sum, self.eval_correct) if evaluation else (self.loss_sum, self.correct)
        return kl.softmax_xent(k, out, y, grad, loss_sum, correct, rows, r.classes, grad_scale=grad_scale,
                               mean_over=mean_over, scratch=scratch, ticket=ticket)

    @property
    def head_loss_fuses(self) -> bool:
        """Whether a training step's head forward and loss are one launch (loss.logits_xent): softmax cross-entropy
        over the head tile's classes, from a layer at most loss.FUSE_MAX_K wide. A step takes it where its head's
        forward is a plain GEMM whose output is whole on this GPU."""
        return (not self.recipe.regression and self.padded[-1] == kl.LX_CLASSES
                and self.padded[-2] <= kl.FUSE_MAX_K)

    def head_forward_loss(self, rows: int, grad_scale: float = 1.0, mean_over: int | None = None) -> Launch:
        """The head's forward (from the top hidden layer's output) and the training loss in one launch, where
        head_loss_fuses: logits and their gradient where the GEMM and `loss` would write them."""
        lay, n = self.layers[-1], len(self.layers) - 1
        return kl.logits_xent(self.k, self.acts[n], lay.w16, lay.b, self.y, self.acts[-1], self.grads[-1],
                              self.loss_sum, self.correct, rows, self.recipe.classes, grad_scale, mean_over,
                              scratch=self.exact_sums, ticket=self.exact_tickets)

    def _eval_forward(self, plans: list[kg.GemmPlan]) -> list[Launch]:
        hidden = [self.eval_h[i % 2] for i in range(len(self.layers) - 1)] + [self.eval_logits]
        return self.forward(self.eval_x, hidden, plans)

    def predict_launches(self) -> list[Launch]:
        """Logits of the eval_batch images in predict_images, into eval_logits: the evaluation's gather and forward."""
        out = self.step.before_eval()
        out.append(self.gather(self.predict_images, self.predict_labels, self.predict_perm, self.zero_counter,
                               self.eval_x, self.eval_y, self.eval_batch, 1))
        return out + self._eval_forward(self.eval_plans)

    def logits(self, images: np.ndarray, stream: Stream) -> np.ndarray:
        """float32 outputs [N, classes] (logits, or a regression's values) of features [N, inputs] (uint8 images, or
        numbers device_features converts), eval_batch at a time through predict_launches (synchronises)."""
        r, EB = self.recipe, self.eval_batch
        launches, out = self.predict_launches(), np.empty((len(images), r.classes), np.float32)
        for start in range(0, len(images), EB):
            chunk = np.zeros((EB, r.inputs), self.predict_images.dtype)
            part = self.device_features(images[start:start + EB], "the rows to predict")
            chunk[:len(part)] = part
            self.predict_images.upload(chunk)
            for launch in launches:
                launch.run(stream)
            stream.synchronize()
            out[start:start + len(part)] = self.eval_logits.download()[:len(part), :r.classes]
        return out

    def zero_metrics(self, evaluation: bool = False) -> Launch:
        """The training's metrics (or the evaluation's) reset, as a launch."""
        if self.regression_sums is not None:
            return kl.zero_sums(self.k, self.eval_regression_sums if evaluation else self.regression_sums)
        if evaluation:
            return kl.zero_metrics(self.k, self.eval_loss_sum, self.eval_correct)
        return kl.zero_metrics(self.k, self.loss_sum, self.correct)

    # --- reading back ------------------------------------------------------------------------------------------

    def train_metrics(self, stream: Stream | None = None) -> tuple:
        """The sums accumulated since the last zero_metrics: (loss sum, correct count), or a regression's (loss sum,
        squared error sum, absolute error sum). stream: where a model on several GPUs sums them over the ranks
        (steps/replicated.py); one GPU's need none."""
        if self.regression_sums is not None:
            return tuple(float(v) for v in self.regression_sums.download())
        return float(self.loss_sum.download()[0]), int(self.correct.download()[0])

    def eval_metrics(self) -> tuple[float, float]:
        """(mean test loss, test accuracy) of the last evaluation; a regression's accuracy is NaN (eval_errors)."""
        n = self.recipe.test_rows
        if self.eval_regression_sums is not None:
            return float(self.eval_regression_sums.download()[0]) / n, math.nan
        return float(self.eval_loss_sum.download()[0]) / n, int(self.eval_correct.download()[0]) / n

    def eval_errors(self) -> tuple[float, float, float] | None:
        """A regression's test RMSE, MAE and R^2 (over every value) from the last evaluation; None for a
        classification."""
        if self.eval_regression_sums is None:
            return None
        return regression_errors(self.eval_regression_sums.download(),
                                 self.recipe.test_rows * self.recipe.classes, self.test_sst, self.target_scale)

    def step_count(self) -> int:
        return int(self.counter.download()[0])

    def master_weights(self, i: int, copies: list[Tensor] | None = None) -> np.ndarray:
        """Layer i's fp32 master weights (padded shape), joined from its halves (master.py). copies: the step's
        current fp16 working copies (Step.working_copies), asked for when None."""
        hi = (copies or self.step.working_copies())[i]
        return master.join(hi.download(), self.layers[i].wlo.download())

    def parameters(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The fp32 master (W [fan_in, fan_out], b) of every layer, padding cut off."""
        copies = self.step.working_copies()
        return [(self.master_weights(i, copies)[:lay.fan_in, :lay.fan_out].copy(),
                 lay.b.download()[:lay.fan_out].copy()) for i, lay in enumerate(self.layers)]

    def optimizer_state(self) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
        """The optimiser's state per layer (same layout as parameters()) in units of the mean-loss gradient, float64:
        {"m": SGD's momentum or Adam's first moment, "v": Adam's second moment}, as many as it keeps. The buffers hold
        them times the loss scale (its square for v), because they accumulate scaled gradients."""
        s, out = float(loss_scale(self.recipe.batch)), {}
        for key, power, pick in (("m", 1, lambda lay: (lay.mw, lay.mb)), ("v", 2, lambda lay: (lay.vw, lay.vb))):
            if pick(self.layers[0])[0] is None:
                continue
            out[key] = [(pick(lay)[0].download()[:lay.fan_in, :lay.fan_out].astype(np.float64) / s ** power,
                         pick(lay)[1].download()[:lay.fan_out].astype(np.float64) / s ** power) for lay in self.layers]
        return out

    def padding_is_zero(self) -> bool:
        """True when every padded weight/bias entry is still exactly zero (they must never move)."""
        copies = self.step.working_copies()
        for i, lay in enumerate(self.layers):
            w, b = self.master_weights(i, copies), lay.b.download()
            if w[lay.fan_in:].any() or w[:, lay.fan_out:].any() or b[lay.fan_out:].any():
                return False
        return True


def kept_features(x: np.ndarray, input_dtype: str, what: str) -> np.ndarray:
    """Features [N, F] as the device keeps them (recipe.input_dtype): bytes stay bytes (as pixels), numbers become
    fp16 or fp32 (bytes / 255 in fp32 first, as the gather scales pixels); DataError where a finite value is beyond
    fp16's range or bytes are asked of floats."""
    want = np.dtype(INPUT_DTYPES[input_dtype])
    if x.dtype == want:
        return x
    if want == np.uint8:
        raise DataError(f"{what}: {x.dtype} features cannot be kept as bytes (input_dtype u8 is for 0..255 "
                        "pixels); use fp16 or fp32")
    out = empty_rows(x.shape, want)  # converted a block of rows per core (host_rows)

    def convert(a: int, b: int) -> bool:
        if x.dtype == np.uint8:
            out[a:b] = x[a:b] * np.float32(1.0 / 255.0)
            return False
        with np.errstate(over="ignore"):
            out[a:b] = x[a:b]
        return want == np.float16 and bool(np.isinf(out[a:b]).any())
    if any(in_blocks(len(x), convert)):  # an inf: a finite feature beyond fp16's range, or an inf given
        big = np.isinf(out) & np.isfinite(x)
        if big.any():
            row, col = np.argwhere(big)[0]
            raise beyond_fp16(what, row, col, x[row, col])
    return out


def regression_errors(sums, values: int, sst: float | None = None, scale: float = 1.0) -> tuple[float, float, float]:
    """(RMSE, MAE, R^2) in the targets' units from a regression's sums (loss, squared error, absolute error) over
    `values` standardized values (scale: the targets' standardization); R^2 needs the targets' sum of squares about
    their mean in their units (NaN without it, or where it is 0)."""
    sq, ab = float(sums[1]) * scale * scale, float(sums[2]) * scale
    r2 = 1.0 - sq / sst if sst else math.nan
    return math.sqrt(sq / values), ab / values, r2


SCALING_CHUNK = 1 << 20  # rows summed at a time: a large table never has a float64 copy


def feature_scaling(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The host twin of the device's standardization (MLP.compute_scaling), for references and peers: of features
    as the device keeps them (bytes / 255 in fp32, fp16, fp32), per column the mean and 1 / std (population std,
    float64 sums; a constant column gets 1), float32 [inputs] each."""
    def part(start: int) -> np.ndarray:
        rows = x[start:start + SCALING_CHUNK]
        if x.dtype == np.uint8:
            return (rows.astype(np.float32) * np.float32(1.0 / 255.0)).astype(np.float64)
        return rows.astype(np.float64)

    n = len(x)
    total, squares = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for start in range(0, n, SCALING_CHUNK):
        total += part(start).sum(axis=0)
    mean = total / n
    for start in range(0, n, SCALING_CHUNK):
        squares += ((part(start) - mean) ** 2).sum(axis=0)
    std = np.sqrt(squares / n)
    inv = 1.0 / np.where(std > 0, std, 1.0)
    return mean.astype(np.float32), inv.astype(np.float32)


def target_scaling(y: np.ndarray) -> tuple[np.ndarray, float]:
    """A regression's target standardization from its training targets [N, K]: each output's mean, and one scale
    for all (the root of their mean variance; 1 where that is 0), so that the squared and absolute errors summed
    over every output come back in the targets' units by one factor."""
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    mean = y.mean(axis=0)
    scale = math.sqrt(float(((y - mean) ** 2).mean()))
    # float32 values, which a checkpoint keeps exactly: a resumed run scales its targets to the same bits
    return mean.astype(np.float32).astype(np.float64), float(np.float32(scale)) if scale > 0 else 1.0


def eval_batch(r: Recipe, models: int = 1) -> int:
    """Rows per evaluation chunk of `models` models of r reading one shared input: the whole test set when their
    activations fit EVAL_ACTIVATION_BUDGET, else equal chunks (padded to 8 rows) of at most the budget; the last
    chunk may be shorter."""
    per_row = 2 * (pad8(r.inputs) + models * (2 * max(r._padded_widths[1:-1]) + r._padded_classes))
    chunks = cdiv(r.test_rows, max(8, EVAL_ACTIVATION_BUDGET // per_row // 8 * 8))
    return min(r.test_rows, pad8(cdiv(r.test_rows, chunks)))


def seed_of(recipe: Recipe, layer: int, which: int) -> int:
    """The seed of layer `layer`'s weights (which 0) or bias (1) in a model of `recipe`."""
    return (recipe.seed * 1_000_003 + layer * 2 + which) & (2**64 - 1)


def common_units(arch: str) -> set:
    """The units every session of a GPU of `arch` launches, whatever its plan: the small sources (the data gather,
    the parameter initialisation and copies, the loss and metrics) and, on sm_90, the probe of the GPU's cluster
    capacity that the plan itself needs (gemm.cluster_capacity)."""
    return {(source, None) for source in (kd.SRC, ke.SRC, kl.SRC)} | kg.plan_units([], arch)


def run_launches(launches: list[Launch], stream: Stream) -> Callable[[], None]:
    """A function that issues `launches` in order on `stream` (what graph capture records)."""
    def issue() -> None:
        for launch in launches:
            launch.run(stream)
    return issue
