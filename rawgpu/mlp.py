"""The model: an MLP 784 -> hidden x layers -> 10 whose every buffer lives in one arena, and its training step
as a plain list of launches (gather, forward, loss, backward with fused updates, step counter).

The list runs eagerly (`--no-graph`) or is captured once into a CUDA graph; nothing in it depends on the
host after start-up: the step counter, the batch position and the learning rate live on the device.

Three step implementations, same buffers and numerics: `layered` (one kernel per layer and role: gather,
GEMMs with fused epilogues, softmax, bias updates; 19 kernels at 3 hidden layers; 8 on sm_90 at batch <= 32 with
plain SGD, where each layer's backward and bias update is one pass over its weights, kernels/dx_sgd.py, the
head's whole step is one cluster kernel, kernels/head.py, which also moves the step counter, and the gather writes
the step's learning rate), `fused` (the whole step
in one persistent kernel, cu/fused_step.cu, for widths up to kernels.fused.MAX_HIDDEN) and `cluster` (sm_90, batch
<= 32, plain SGD, small models: one thread-block cluster keeps the weights in shared memory for a whole launch,
cu/cluster_step.cu). The fp32 master weights are stored as two 16-bit halves (rawgpu/master.py): W16, the fp16
working copy every GEMM reads, and lo, the rest; a step moves 10 bytes per weight instead of 12. The fused step
keeps two fp16 working copies of each weight (step s reads copy s & 1), so its master is (copy (steps done) & 1,
lo); the cluster step writes the master and the biases back when a launch ends.

Widths are padded to multiples of 8 (the GEMM's contiguous dimensions) and the 10 classes to 16; padded
weights, biases and activations start at zero and stay zero, because their gradients are exactly zero.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import master
from .driver import Launch, Stream
from .kernels import Kernels
from .kernels import cluster as kc
from .kernels import data as kd
from .kernels import dx_sgd as kb
from .kernels import elementwise as ke
from .kernels import fused as kf
from .kernels import gemm as kg
from .kernels import head as kh
from .kernels import l2 as kl2
from .kernels import loss as kl
from .memory import Arena, Tensor

INPUTS = 784
CLASSES = 10
TRAIN_ROWS = 60000
TEST_ROWS = 10000
EVAL_BATCHES = (10000, 5000, 2000, 1000, 500, 250, 100)  # divisors of the test set, largest first
EVAL_ACTIVATION_BUDGET = 512 << 20  # bytes of evaluation activations before the test set is split further
GRAD_SCALE_PER_SAMPLE = 16  # see loss_scale()
STEP_KINDS = ("auto", "cluster", "fused", "layered")


def pad8(n: int) -> int:
    return -(-n // 8) * 8


def loss_scale(batch: int) -> float:
    """The static loss scale S: gradients flow backward in fp16 as S x the gradient of the mean loss, and the
    updates use lr / S, so the arithmetic is that of the mean loss. Without it, d(logits) = (softmax - onehot) / B
    shrinks with the batch and with every layer, and deep-layer gradients fall into fp16's subnormals (below
    6e-5), where they lose precision (measured: 3.5% error in the first layer's update at batch 32). With S =
    16 x 2^ceil(log2 B), d(logits) lies within 16..32 x (softmax - onehot): normal, far from fp16's 65504. A power
    of two, so scaling and unscaling are exact."""
    return float(GRAD_SCALE_PER_SAMPLE * (1 << max(0, (batch - 1).bit_length())))


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes a run: model, batch and optimiser. The defaults are the CLI's default recipe."""

    hidden: int = 256
    layers: int = 3
    batch: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    schedule: str = "cosine"
    warmup_steps: int = 0
    lr_min: float = 0.0
    total_steps: int = 0  # the schedule's length; 0: no decay
    accum: str = "fp32"
    seed: int = 0

    def __post_init__(self):
        if self.hidden < 1 or self.layers < 1:
            raise ValueError(f"hidden ({self.hidden}) and layers ({self.layers}) must be >= 1")
        if not 1 <= self.batch <= TRAIN_ROWS:
            raise ValueError(f"batch must be in 1..{TRAIN_ROWS}, got {self.batch}")
        if self.accum not in ("fp32", "fp16"):
            raise ValueError(f"accum must be fp32 or fp16, got {self.accum!r}")
        if self.schedule not in kd.SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(kd.SCHEDULES)}, got {self.schedule!r}")

    @property
    def widths(self) -> list[int]:
        return [INPUTS] + [self.hidden] * self.layers + [CLASSES]

    @property
    def steps_per_epoch(self) -> int:
        return TRAIN_ROWS // self.batch

    @property
    def parameters(self) -> int:
        w = self.widths
        return sum(a * b + b for a, b in zip(w, w[1:]))

    @property
    def name(self) -> str:
        return "-".join(map(str, self.widths))

    def step_flops(self) -> int:
        """Useful FLOPs of one step: forward, weight gradient, and input gradient below the first layer."""
        w = self.widths
        return sum(2 * self.batch * a * b * (3 if i else 2) for i, (a, b) in enumerate(zip(w, w[1:])))

    def step_bytes(self, bytes_per_weight: int = 10) -> int:
        """The weight traffic of one step: 10 B per weight with the split master (master.py: the forward reads
        W16; the update reads and writes W16 and lo), 8 more with momentum (fp32 read and write). DESIGN.md's
        floor is 12 B (an fp32 master beside the fp16 copy): bytes_per_weight=12."""
        w = self.widths
        weights = sum(a * b for a, b in zip(w, w[1:]))
        return weights * (bytes_per_weight + (8 if self.momentum > 0 else 0))


@dataclass
class Layer:
    """One linear layer's buffers (padded shapes) and GEMM plans."""

    fan_in: int
    fan_out: int
    wlo: Tensor  # int16 low half of the fp32 master weights [in_p, out_p], x @ W orientation (master.py)
    w16: Tensor  # fp16 working copy and the master's high half, same shape (the fused step: copy 0 of two)
    b: Tensor  # fp32 bias [out_p]
    mw: Tensor | None  # momentum buffers (None without momentum)
    mb: Tensor | None
    fwd: kg.GemmPlan
    dx: kg.GemmPlan | None  # None for the first layer: nothing below it needs a gradient
    dw: kg.GemmPlan
    eval_fwd: kg.GemmPlan
    w16_next: Tensor | None = None  # the fused step's second fp16 copy
    bwd: kb.DxSgdPlan | None = None  # dx and the update in one pass (replaces dx + dw in the layered step)


class MLP:
    """Plan (`__init__`, no GPU needed) -> `allocate()` -> `upload_data()` + `init_parameters()` -> launches."""

    def __init__(self, kernels: Kernels | None, recipe: Recipe, sm_count: int = 132, step: str = "auto",
                 fused_grid: int | None = None, arch: str | None = None, overlap: bool = True, l2_bytes: int = 0,
                 l2_budget: float = kl2.DEFAULT_BUDGET):
        """step: one of STEP_KINDS. `auto` takes the cluster step where it runs, else the layered step where it
        is short (`short_layered`), else the fused step where kernels.fused.preferred, else the layered step;
        naming one insists (ValueError with the reason when it cannot run the recipe). fused_grid: blocks of the
        fused kernel (default one per SM). arch: the GPU to plan for when there is no `kernels` (CPU tests; default
        sm_86). overlap: on sm_90+, each kernel of the layered step starts while the one before still runs
        (programmatic dependent launch, ptx/pdl.cuh). l2_bytes, l2_budget: the GPU's L2 size and the share of it the
        layered step keeps one weight in between two reads (kernels/l2.py; budget 0 or no size: no cache hints)."""
        self.k, self.recipe, self.sm_count, self.fused_grid = kernels, recipe, sm_count, fused_grid
        r, accum = recipe, ("f32" if recipe.accum == "fp32" else "f16")
        self.arena = a = Arena()
        B = r.batch
        self.eval_batch = self._eval_batch(r)
        EB = self.eval_batch
        widths = r.widths
        padded = [pad8(w) for w in widths[:-1]] + [max(16, pad8(CLASSES))]
        self.padded = padded
        arch = kernels.arch if kernels is not None else (arch or "sm_86")  # no GPU: the smallest shared memory
        self.step_kind = self._step_kind(step, r, arch)
        self.fused, self.cluster = self.step_kind == "fused", self.step_kind == "cluster"
        self.overlap = overlap and self.step_kind == "layered" and kg.has_tma(arch)  # griddepcontrol: sm_90+
        # dataset and input pipeline
        self.images = a.tensor("train_images", (TRAIN_ROWS, INPUTS), np.uint8)
        self.labels = a.tensor("train_labels", TRAIN_ROWS, np.uint8)
        self.test_images = a.tensor("test_images", (TEST_ROWS, INPUTS), np.uint8)
        self.test_labels = a.tensor("test_labels", TEST_ROWS, np.uint8)
        self.perm = a.tensor("perm", r.steps_per_epoch * B, np.int32)
        self.eval_perm = a.tensor("eval_perm", TEST_ROWS, np.int32)
        # device scalars: the step counter, the learning rate, the metrics
        self.step = a.tensor("step", 1, np.int64)
        self.eval_step = a.tensor("eval_step", 1, np.int64)
        self.lr = a.tensor("lr", 1, np.float32)
        self.loss_sum = a.tensor("loss_sum", 1, np.float64)
        self.correct = a.tensor("correct", 1, np.int32)
        self.eval_loss_sum = a.tensor("eval_loss_sum", 1, np.float64)
        self.eval_correct = a.tensor("eval_correct", 1, np.int32)
        # activations (saved for backward) and their gradients
        self.acts = [a.tensor(f"act{i}", (B, p), np.float16) for i, p in enumerate(padded)]  # acts[-1]: logits
        self.grads = [None] + [a.tensor(f"grad{i}", (B, p), np.float16) for i, p in enumerate(padded) if i]
        self.y = a.tensor("y", B, np.int32)
        hidden_p = max(padded[1:-1])
        self.eval_x = a.tensor("eval_x", (EB, padded[0]), np.float16)
        self.eval_h = [a.tensor(f"eval_h{i}", (EB, hidden_p), np.float16) for i in range(2)]  # ping-pong
        self.eval_logits = a.tensor("eval_logits", (EB, padded[-1]), np.float16)
        self.eval_y = a.tensor("eval_y", EB, np.int32)
        # parameters
        self.layers: list[Layer] = []
        plan = functools.partial(kg.plan_gemm, accum=accum, sm_count=sm_count, arch=arch,
                                 capacity=kg.cluster_capacity(kernels) if kernels is not None else None)
        # the layered step's head (forward, loss, backward, update) as one cluster kernel where it runs (sm_90)
        self.head = (kh.plan_head(B, padded[-2]) if self.step_kind == "layered"
                     and kh.supported(B, r.momentum > 0, accum, padded[-1], arch) else None)
        for i in range(len(widths) - 1):
            pin, pout = padded[i], padded[i + 1]
            mom, head = r.momentum > 0, i == len(widths) - 2
            one_pass = kb.supported(B, mom, accum) and not (head and self.head is not None)  # the head: head.cu
            self.layers.append(Layer(
                widths[i], widths[i + 1],
                a.tensor(f"wlo_{i}", (pin, pout), np.int16), a.tensor(f"w16_{i}", (pin, pout), np.float16),
                a.tensor(f"b_{i}", pout, np.float32),
                a.tensor(f"mw_{i}", (pin, pout), np.float32) if mom else None,
                a.tensor(f"mb_{i}", pout, np.float32) if mom else None,
                w16_next=a.tensor(f"w16b_{i}", (pin, pout), np.float16) if self.fused else None,
                fwd=plan(B, pout, pin, "rr", "bias_relu" if i < len(widths) - 2 else "bias"),
                dx=plan(B, pin, pout, "rc", "drelu") if i else None,
                dw=plan(pin, pout, B, "cr", "sgd", momentum=mom),
                eval_fwd=plan(EB, pout, pin, "rr", "bias_relu" if i < len(widths) - 2 else "bias"),
                bwd=kb.plan_dx_sgd(B, pin, pout, sm_count) if one_pass else None))
        self.l2 = kl2.plan_l2([lay.w16.nbytes for lay in self.layers], [lay.bwd is not None for lay in self.layers],
                              l2_bytes, l2_budget if self.step_kind == "layered" else 0.0)
        # split-K scratch: GEMMs run one after another, and each leaves its tickets at zero, so all share one
        layered = self.step_kind == "layered"
        roles = (lambda lay: (lay.fwd, lay.dx, lay.dw, lay.eval_fwd)) if layered else (lambda lay: (lay.eval_fwd,))
        plans = [p for lay in self.layers for p in roles(lay) if p is not None]
        if layered:
            plans += [lay.bwd for lay in self.layers if lay.bwd is not None]
        self.workspace = a.tensor("splitk_workspace", max(1, max(p.workspace_floats for p in plans)), np.float32)
        self.tickets = a.tensor("splitk_tickets", max(1, max(p.tickets for p in plans)), np.int32)
        if self.fused:  # the fused kernel's per-row metrics, grid barrier counter and parameter table
            self.row_loss = a.tensor("row_loss", B, np.float32)
            self.row_hit = a.tensor("row_hit", B, np.int32)
            self.barrier = a.tensor("grid_barrier", 1, np.int64)
            self.table = a.tensor("fused_params", kf.table_words(len(self.layers)), np.uint64)
        if self.cluster:  # the cluster kernel's shared-memory layout and parameter table
            self.cluster_plan = kc.plan(r.hidden, r.layers)
            self.table = a.tensor("cluster_params", kc.table_words(len(self.layers)), np.uint64)

    @staticmethod
    def _step_kind(step: str, r: Recipe, arch: str) -> str:
        if step not in STEP_KINDS:
            raise ValueError(f"step must be one of {', '.join(STEP_KINDS)}, got {step!r}")
        if step == "cluster" and (why := kc.unsupported_reason(r, arch)):
            raise ValueError(why)
        if step == "fused" and (why := kf.unsupported_reason(r)):
            raise ValueError(why)
        if step != "auto":
            return step
        if kc.unsupported_reason(r, arch) is None:
            return "cluster"
        if MLP.short_layered(r, arch):
            return "layered"
        return "fused" if kf.preferred(r, pad8(r.hidden)) else "layered"

    @staticmethod
    def short_layered(r: Recipe, arch: str) -> bool:
        """Whether the layered step is its short form here: sm_90 (overlapping launches), batch <= 32, plain SGD and
        fp32 accumulation, so every layer's backward is one pass (kernels/dx_sgd.py) and the head's whole step one
        cluster kernel: 8 kernels at 3 hidden layers. That beats the fused step's grid barriers from hidden 256 on
        (docs/perf.md, Version 12), so `auto` takes it wherever the cluster step does not run."""
        accum, mom = ("f32" if r.accum == "fp32" else "f16"), r.momentum > 0
        return (kg.has_tma(arch) and kb.supported(r.batch, mom, accum)
                and kh.supported(r.batch, mom, accum, max(16, pad8(CLASSES)), arch))

    @staticmethod
    def _eval_batch(r: Recipe) -> int:
        per_row = 2 * (pad8(INPUTS) + 2 * pad8(r.hidden) + 16)
        return next((b for b in EVAL_BATCHES if b * per_row <= EVAL_ACTIVATION_BUDGET), EVAL_BATCHES[-1])

    # --- start-up ---------------------------------------------------------------------------------------------

    def allocate(self) -> "MLP":
        """The one device allocation (OutOfMemoryError with needed vs free before anything runs), zeroed."""
        self.arena.allocate()
        self.arena.zero()
        if self.fused:
            self.table.upload(kf.param_table(self))
        if self.cluster:
            kc.check_schedulable(self.k, self.cluster_plan)
            self.table.upload(kc.param_table(self, self.cluster_plan))
        return self

    def upload_data(self, mnist) -> None:
        self.images.upload(mnist.train_images.reshape(TRAIN_ROWS, INPUTS))
        self.labels.upload(mnist.train_labels)
        self.test_images.upload(mnist.test_images.reshape(TEST_ROWS, INPUTS))
        self.test_labels.upload(mnist.test_labels)
        self.eval_perm.upload(np.arange(TEST_ROWS, dtype=np.int32))

    def init_parameters(self, stream: Stream) -> None:
        """PyTorch's nn.Linear default (Kaiming-uniform, a = sqrt(5)): W and b ~ U(+-1/sqrt(fan_in)), from
        the seed, W as its master halves; the fused step's second fp16 copy made equal to the first; momentum,
        counters and tickets zeroed."""
        for i, lay in enumerate(self.layers):
            bound = 1.0 / math.sqrt(lay.fan_in)
            true_shape = (lay.fan_in, lay.fan_out)
            if lay.w16.shape == true_shape:
                ke.init_uniform_master(self.k, lay.w16, lay.wlo, bound, self._seed(i, 0)).run(stream)
            else:
                self._set_master(lay, self._padded_uniform(lay.w16.shape, true_shape, bound, self._seed(i, 0)))
            self._init_uniform(lay.b, (lay.fan_out,), bound, self._seed(i, 1), stream)
        self.sync_working_copies(stream)
        counters = [self.step, self.workspace, self.tickets] + ([self.barrier] if self.fused else [])
        for t in counters + [t for lay in self.layers for t in (lay.mw, lay.mb) if t]:
            t.fill_bytes(0)

    def _seed(self, layer: int, which: int) -> int:
        return (self.recipe.seed * 1_000_003 + layer * 2 + which) & (2**64 - 1)

    def _init_uniform(self, t: Tensor, true_shape: tuple[int, ...], bound: float, seed: int, stream: Stream) -> None:
        """Unpadded tensors are filled on the device; padded ones on the host (same bits) with zero padding."""
        if tuple(t.shape) == true_shape:
            ke.init_uniform(self.k, t, bound, seed).run(stream)
            return
        t.upload(self._padded_uniform(t.shape, true_shape, bound, seed))

    @staticmethod
    def _padded_uniform(shape: tuple[int, ...], true_shape: tuple[int, ...], bound: float, seed: int) -> np.ndarray:
        values = ke.init_uniform_reference(math.prod(true_shape), bound, seed).reshape(true_shape)
        full = np.zeros(shape, np.float32)
        full[tuple(slice(0, n) for n in true_shape)] = values
        return full

    def _set_master(self, lay: Layer, w: np.ndarray) -> None:
        hi, lo = master.split(w)
        lay.w16.upload(hi)
        lay.wlo.upload(lo)

    def sync_working_copies(self, stream: Stream) -> None:
        """The fused step's second fp16 copy = the first (after the master was set)."""
        for lay in self.layers:
            if lay.w16_next is not None:
                ke.copy_f16_if_odd(self.k, lay.w16_next, lay.w16, None).run(stream)
        stream.synchronize()

    def set_permutation(self, perm: np.ndarray) -> None:
        """This epoch's sample order (the first steps_per_epoch x batch entries are used). Synchronises: call it
        between epochs, never inside one."""
        need = self.perm.shape[0]
        self.perm.upload(np.ascontiguousarray(perm[:need], dtype=np.int32))

    # --- the step ----------------------------------------------------------------------------------------------

    def _forward(self, x: Tensor, outs: list[Tensor], plans: list[kg.GemmPlan],
                 keep: list[float] | None = None) -> list[Launch]:
        launches, inp, keep = [], x, keep or [kl2.NORMAL] * len(self.layers)
        for lay, out, plan, keep_w in zip(self.layers, outs, plans, keep):
            launches.append(kg.gemm(self.k, plan, inp, lay.w16, out, bias=lay.b, workspace=self.workspace,
                                    tickets=self.tickets, keep_b=keep_w))
            inp = out
        return launches

    def step_launches(self, steps: int = 1) -> list[Launch]:
        """`steps` training steps: the cluster or fused kernel once, or per step the layered list (lr for this step,
        gather the batch, forward, loss, backward + updates, step += 1)."""
        if self.cluster:
            return [kc.cluster_steps(self.k, self.table, self.cluster_plan, steps)]
        if self.fused:
            grid = kf.resident_grid(self.k, self.sm_count, self.fused_grid)
            return [kf.fused_steps(self.k, self.table, steps, grid)]
        step = self._layered_step()
        return [launch.overlapping() for launch in step] * steps if self.overlap else step * steps

    def _layered_step(self) -> list[Launch]:
        r, k = self.recipe, self.k
        mu, scale = float(r.momentum), loss_scale(r.batch)
        schedule = kd.Schedule(r.lr / scale, r.lr_min / scale, r.total_steps, r.warmup_steps, r.schedule)
        out = [kd.gather_batch(k, self.images, self.labels, self.perm, self.step, self.acts[0], self.y, r.batch,
                               r.steps_per_epoch, lr=self.lr, schedule=schedule, early=self.head is not None)]
        n = len(self.layers) - (self.head is not None)  # layers with a forward GEMM
        out += self._forward(self.acts[0], self.acts[1:n + 1], [lay.fwd for lay in self.layers[:n]],
                             [pol.forward for pol in self.l2[:n]])
        if self.head is not None:  # the head's forward, loss, backward and update in one launch
            lay = self.layers[n]
            out.append(kh.head_step(k, self.head, self.acts[n], self.y, lay.wlo, lay.w16, lay.b, self.lr,
                                    self.acts[-1], self.grads[-1], self.grads[n], self.loss_sum, self.correct,
                                    CLASSES, scale, step=self.step))  # the step counter moves here
        else:
            out.append(kl.softmax_xent(k, self.acts[-1], self.y, self.grads[-1], self.loss_sum, self.correct,
                                       r.batch, CLASSES, grad_scale=scale))
        dy = self.grads[n]
        for i in range(n - 1, -1, -1):
            lay, x = self.layers[i], self.acts[i]
            if lay.bwd is not None:  # the bias too; the first layer's input needs no gradient: its update alone
                out.append(kb.dx_sgd(k, lay.bwd, x, dy, lay.wlo, lay.w16, self.grads[i], self.lr, self.workspace,
                                     self.tickets, self.l2[i], bias=lay.b))
            else:
                if lay.dx is not None:  # reads W16 before this layer's update rewrites it
                    out.append(kg.gemm(k, lay.dx, dy, lay.w16, self.grads[i], act=x, workspace=self.workspace,
                                       tickets=self.tickets))
                out.append(kg.gemm(k, lay.dw, x, dy, lay.wlo, mom=lay.mw, w16=lay.w16, lr=self.lr, mu=mu,
                                   workspace=self.workspace, tickets=self.tickets))
                out.append(ke.bias_grad_sgd(k, dy, lay.b, lay.mb, self.lr, mu, r.batch))
            dy = self.grads[i]
        if self.head is None:
            out.append(kd.step_increment(k, self.step))
        return out

    def eval_launches(self) -> list[Launch]:
        """The whole test set, eval_batch rows at a time: forward and metrics only (no gradients, no updates)."""
        k, EB = self.k, self.eval_batch
        chunks = TEST_ROWS // EB
        hidden = [self.eval_h[i % 2] for i in range(len(self.layers) - 1)] + [self.eval_logits]
        out = [kd.set_i64(k, self.eval_step, 0), kl.zero_metrics(k, self.eval_loss_sum, self.eval_correct)]
        if self.fused:  # the current fp16 copy is copy (steps done) & 1; evaluation reads copy 0
            out = [ke.copy_f16_if_odd(k, lay.w16, lay.w16_next, self.step) for lay in self.layers] + out
        for _ in range(chunks):
            out.append(kd.gather_batch(k, self.test_images, self.test_labels, self.eval_perm, self.eval_step,
                                       self.eval_x, self.eval_y, EB, chunks))
            out += self._forward(self.eval_x, hidden, [lay.eval_fwd for lay in self.layers])
            out.append(kl.softmax_xent(k, self.eval_logits, self.eval_y, None, self.eval_loss_sum,
                                       self.eval_correct, EB, CLASSES))
            out.append(kd.step_increment(k, self.eval_step))
        return out

    def zero_metrics(self) -> Launch:
        return kl.zero_metrics(self.k, self.loss_sum, self.correct)

    # --- reading back ------------------------------------------------------------------------------------------

    def train_metrics(self) -> tuple[float, int]:
        """(loss sum, correct count) accumulated since the last zero_metrics."""
        return float(self.loss_sum.download()[0]), int(self.correct.download()[0])

    def eval_metrics(self) -> tuple[float, float]:
        """(mean test loss, test accuracy) of the last evaluation."""
        return float(self.eval_loss_sum.download()[0]) / TEST_ROWS, int(self.eval_correct.download()[0]) / TEST_ROWS

    def step_count(self) -> int:
        return int(self.step.download()[0])

    def master_weights(self, lay: Layer, odd_step: bool | None = None) -> np.ndarray:
        """A layer's fp32 master weights (padded shape), joined from its halves (master.py). odd_step: whether the
        step count is odd (the fused step's current copy is then the second); None reads the counter."""
        if odd_step is None:
            odd_step = self.fused and self.step_count() % 2 == 1
        hi = lay.w16_next if lay.w16_next is not None and odd_step else lay.w16
        return master.join(hi.download(), lay.wlo.download())

    def parameters(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The fp32 master (W [fan_in, fan_out], b) of every layer, padding cut off."""
        odd = self.fused and self.step_count() % 2 == 1
        return [(self.master_weights(lay, odd)[:lay.fan_in, :lay.fan_out].copy(),
                 lay.b.download()[:lay.fan_out].copy()) for lay in self.layers]

    def velocity(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The momentum (same layout as parameters()) in units of the mean-loss gradient, or None without
        momentum. The buffers hold it times the loss scale, because they accumulate scaled gradients."""
        if self.recipe.momentum <= 0:
            return None
        s = loss_scale(self.recipe.batch)
        return [(lay.mw.download()[:lay.fan_in, :lay.fan_out] / s, lay.mb.download()[:lay.fan_out] / s)
                for lay in self.layers]

    def padding_is_zero(self) -> bool:
        """True when every padded weight/bias entry is still exactly zero (they must never move)."""
        odd = self.fused and self.step_count() % 2 == 1
        for lay in self.layers:
            w, b = self.master_weights(lay, odd), lay.b.download()
            if w[lay.fan_in:].any() or w[:, lay.fan_out:].any() or b[lay.fan_out:].any():
                return False
        return True


def run_launches(launches: list[Launch], stream: Stream) -> Callable[[], None]:
    """A function that issues `launches` in order on `stream` (what graph capture records)."""
    def issue() -> None:
        for launch in launches:
            launch.run(stream)
    return issue
