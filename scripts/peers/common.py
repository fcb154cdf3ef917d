"""What every peer shares: the workload, the batch order, the data, and the result record.

Fairness lives here: every system trains from the same batch sequence (step_indices), the same arrays (MNIST's, or a
table of scripts/benchmarks/workloads.py) preprocessed the same way (features: bytes / 255, then the shared
standardization; a regression's targets standardized as rawgpu's), and reports the same fields, so the benchmark
compares runtimes, not recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TRAIN_ROWS = 60000
INPUTS = 784
CLASSES = 10
LOSS_TAIL = 100  # final_loss is the mean training loss over this many last steps
LOSSES = ("xent", "mse")  # mean softmax cross-entropy over class labels; mean squared error over values


@dataclass
class PeerResult:
    """One peer's measurement: speed of the timed steps, and proof that they trained."""

    system: str
    hidden: int | tuple[int, ...]
    steps: int
    us_per_step: float
    test_accuracy: float | None  # None for a regression
    final_loss: float
    note: str = ""
    test_rmse: float | None = None  # a regression's, in the targets' units; None for a classification


SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("sgd", "adam", "adamw")
# torch's nn.ReLU, GELU (the erf form; approximate="tanh"), SiLU, Tanh
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh")


@dataclass
class Workload:
    """A benchmark recipe: MLP 784-H-H-H-10 (hidden an int), or 784-H1-...-Hn-10 (hidden a width per layer), an
    optimiser as torch.optim defines it, a learning-rate schedule over the timed steps, fp16 compute with fp32 master
    weights. The defaults are the seed recipe (plain SGD, constant lr, batch 32) on MNIST; a table sets inputs,
    classes (a regression's values per row), train_rows, loss and its standardizations.

    sgd: torch.optim.SGD (v = mu v + g; w -= lr v; nesterov: w -= lr (g + mu v)). adam: torch.optim.Adam (bias
    corrected moments, update m_hat / (sqrt(v_hat) + eps)). weight_decay is L2 added to the gradient for both
    (g += wd w); adamw: torch.optim.AdamW, decay decoupled (w *= 1 - lr wd before the Adam step). momentum and
    nesterov mean something to sgd only, betas and eps to adam and adamw only; the others are ignored, so a caller
    can pass a whole recipe's settings."""

    hidden: int | tuple[int, ...]
    steps: int = 5000
    batch: int = 32
    lr: float = 0.003
    seed: int = 0
    warmup_steps: int = 50
    momentum: float = 0.0
    optimizer: str = "sgd"
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"  # over the timed steps, decaying to 0 (rawgpu's lr_at, value for value)
    activation: str = "relu"  # between the hidden layers, as torch names it (ACTIVATIONS)
    # Initial parameters [(W [fan_in, fan_out], b [fan_out]) float32] shared by every system, so accuracy
    # differences come from numerics, not from one lucky draw of the init; None: each framework's own init.
    init: list | None = None
    # The data's shape, MNIST's unless a table's: features per row, classes (a regression's values per row), rows.
    inputs: int = INPUTS
    classes: int = CLASSES
    train_rows: int = TRAIN_ROWS
    loss: str = "xent"  # LOSSES
    # The features' standardization on the device, (x - mean) * inv_std after the bytes' / 255: (mean, inv_std),
    # float32 [inputs] each (rawgpu.model.mlp.feature_scaling's); None: none
    scaling: tuple | None = None
    # A regression's target standardization (mean [classes], scale; rawgpu.model.mlp.target_scaling's): the peers train
    # on (y - mean) / scale, as rawgpu does, and report the RMSE in the targets' units; None: the values as they are
    target_scaling: tuple | None = None

    def __post_init__(self) -> None:
        # Warm-up is where compilation and graph capture happen; without it they would be timed.
        if isinstance(self.hidden, (list, tuple)):
            self.hidden = tuple(int(h) for h in self.hidden)
            if not self.hidden:
                raise ValueError("Workload.hidden needs at least one width")
        if self.loss not in LOSSES:
            raise ValueError(f"Workload.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        checks = [*(("hidden", h, 1) for h in self.hidden_widths), ("steps", self.steps, 1), ("batch", self.batch, 1),
                  ("warmup_steps", self.warmup_steps, 1), ("inputs", self.inputs, 1),
                  ("classes", self.classes, 2 if self.loss == "xent" else 1), ("train_rows", self.train_rows, 1)]
        for name, value, least in checks:
            if value < least:
                raise ValueError(f"Workload.{name} must be >= {least}, got {value}")
        if self.batch > self.train_rows:
            raise ValueError(f"Workload.batch must be <= {self.train_rows}, got {self.batch}")
        self._check_scalings()
        if not self.lr > 0:
            raise ValueError(f"Workload.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"Workload.momentum must be in [0, 1), got {self.momentum}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Workload.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Workload.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Workload.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.nesterov and not (self.optimizer == "sgd" and self.momentum > 0):
            # torch.optim.SGD refuses nesterov without momentum; Adam has no such switch
            raise ValueError(f"Workload.nesterov needs optimizer 'sgd' with momentum > 0, got optimizer "
                             f"{self.optimizer!r} with momentum {self.momentum}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"Workload.betas must be two values in [0, 1), got {self.betas}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.eps > 0:
            raise ValueError(f"Workload.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"Workload.weight_decay must be >= 0, got {self.weight_decay}")

    def _check_scalings(self) -> None:
        """scaling and target_scaling as float32 / float64 arrays of the data's shape, or ValueError in one line."""
        if self.scaling is not None:
            parts = tuple(np.asarray(a, np.float32) for a in self.scaling)
            if len(parts) != 2 or any(a.shape != (self.inputs,) or not np.isfinite(a).all() for a in parts):
                raise ValueError(f"Workload.scaling must be (mean, inv_std) of {self.inputs} finite values each, got "
                                 f"shapes {[a.shape for a in parts]}")
            self.scaling = parts
        if self.target_scaling is not None:
            if self.loss == "xent":
                raise ValueError("Workload.target_scaling is a regression's (loss mse); class labels are not scaled")
            mean, scale = (self.target_scaling if len(self.target_scaling) == 2 else ((), 0.0))
            mean = np.asarray(mean, np.float64).reshape(-1)
            if mean.shape != (self.classes,) or not np.isfinite(mean).all() or not float(scale) > 0:
                raise ValueError(f"Workload.target_scaling must be (mean of {self.classes} values, scale > 0), got "
                                 f"{mean.shape[0]} values and scale {scale}")
            self.target_scaling = (mean, float(scale))

    @property
    def regression(self) -> bool:
        return self.loss != "xent"

    @property
    def target_scale(self) -> float:
        """What turns an error in the standardized targets into one in the targets' units."""
        return self.target_scaling[1] if self.target_scaling is not None else 1.0

    def targets(self, y: np.ndarray) -> np.ndarray:
        """The targets as the peers train on them: class labels as given (each framework converts them), a
        regression's values float32 [N, classes], standardized as rawgpu's MLP.device_targets does."""
        if not self.regression:
            return y
        y = np.asarray(y).reshape(len(y), self.classes).astype(np.float64)
        if self.target_scaling is not None:
            y = (y - self.target_scaling[0]) / self.target_scaling[1]
        return y.astype(np.float32)

    def check_data(self, data) -> None:
        """ValueError in one line where (train_x, train_y, test_x, test_y) is not of this workload's shape."""
        train_x, train_y, test_x, test_y = data
        if np.shape(train_x) != (self.train_rows, self.inputs) or np.shape(test_x)[1:] != (self.inputs,):
            raise ValueError(f"the data's features are {np.shape(train_x)} and {np.shape(test_x)}; the workload "
                             f"wants {self.train_rows} training rows of {self.inputs}")

        def fits(y, rows: int) -> bool:
            if not self.regression:
                return np.shape(y) == (rows,)
            return np.shape(y) == (rows, self.classes) or (self.classes == 1 and np.shape(y) == (rows,))

        if not (fits(train_y, self.train_rows) and fits(test_y, len(test_x))):
            what = f"{self.classes} value(s)" if self.regression else "a label"
            raise ValueError(f"the data's targets are {np.shape(train_y)} and {np.shape(test_y)}; the workload wants "
                             f"{what} per row")

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """Every hidden layer's width: three of H, or the list given."""
        return self.hidden if isinstance(self.hidden, tuple) else (self.hidden,) * 3

    @property
    def widths(self) -> tuple[int, ...]:
        """The MLP's layer widths, inputs to classes (a regression's values)."""
        return (self.inputs, *self.hidden_widths, self.classes)

    def state_bytes_per_weight(self) -> int:
        """Bytes of optimiser state per weight, all fp32: sgd's momentum buffer (none without momentum), or adam's
        and adamw's two moments. The per-tensor step counts are left out."""
        if self.optimizer == "sgd":
            return 4 if self.momentum > 0 else 0
        return 8

    @property
    def index_steps(self) -> int:
        """Steps of batch indices a run needs: warm-up walks the same order as the timed run."""
        return max(self.steps, self.warmup_steps)

    def learning_rates(self) -> np.ndarray:
        """float32 [index_steps]: the lr of every step, the very values rawgpu's step computes on the GPU
        (rawgpu.kernels.gather.lr_at); the peers read step s's from this table on the device."""
        from rawgpu.kernels.gather import lr_at  # lazy: importing this module must not need rawgpu

        return np.array([lr_at(s, self.lr, 0.0, self.steps, 0, self.schedule) for s in range(self.index_steps)],
                        dtype=np.float32)


def step_indices(steps: int, batch: int, seed: int = 0, rows: int = TRAIN_ROWS) -> np.ndarray:
    """Training-row index of every sample of every step, int32 [steps * batch].

    One fresh permutation of the `rows` training rows (MNIST's 60000 unless given) per epoch
    (np.random.default_rng(seed)), each cut to whole batches, concatenated and truncated: the same order rawgpu's
    trainer draws, so all systems see the same batches.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if not 1 <= batch <= rows:
        raise ValueError(f"batch must be in 1..{rows}, got {batch}")
    per_epoch = rows // batch * batch
    need = steps * batch
    rng = np.random.default_rng(seed)
    epochs = [rng.permutation(rows)[:per_epoch] for _ in range(-(-need // per_epoch))]
    if not epochs:
        return np.empty(0, dtype=np.int32)
    return np.concatenate(epochs)[:need].astype(np.int32)


def features(xp, x, scaling=None):
    """A batch of features as every peer's model reads them, float32: bytes / 255 (pixels), then (x - mean) * inv_std
    where the workload standardizes (scaling: (mean, inv_std) arrays of xp, or None / () for none), as rawgpu's
    gather does. xp: numpy or jax.numpy (torch_peers writes the same with torch's names)."""
    pixels = x.dtype == xp.uint8
    x = x.astype(xp.float32)
    if pixels:
        x = x / 255.0
    if scaling:
        mean, inv_std = scaling
        x = (x - mean) * inv_std
    return x


def mnist_arrays(data_dir=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x [60000,784], train_y [60000], test_x [10000,784], test_y [10000]), all uint8.

    Writable copies: rawgpu.data.datasets returns read-only views, and torch.from_numpy warns on those.
    """
    from rawgpu.data.datasets import load_mnist  # lazy: importing this module must not need the data

    m = load_mnist(data_dir)
    return (np.array(m.train_images, dtype=np.uint8).reshape(-1, INPUTS), np.array(m.train_labels, dtype=np.uint8),
            np.array(m.test_images, dtype=np.uint8).reshape(-1, INPUTS), np.array(m.test_labels, dtype=np.uint8))
