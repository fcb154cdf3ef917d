"""What every peer shares: the workload, the batch order, the data, and the result record.

Fairness lives here: every system trains from the same batch sequence (step_indices), the same MNIST
arrays, and reports the same fields, so the benchmark compares runtimes, not recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TRAIN_ROWS = 60000
INPUTS = 784
CLASSES = 10
LOSS_TAIL = 100  # final_loss is the mean training loss over this many last steps


@dataclass
class PeerResult:
    """One peer's measurement: speed of the timed steps, and proof that they trained."""

    system: str
    hidden: int | tuple[int, ...]
    steps: int
    us_per_step: float
    test_accuracy: float
    final_loss: float
    note: str = ""


SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("sgd", "adam", "adamw")
# torch's nn.ReLU, GELU (the erf form; approximate="tanh"), SiLU, Tanh
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh")


@dataclass
class Workload:
    """A benchmark recipe: MLP 784-H-H-H-10 (hidden an int), or 784-H1-...-Hn-10 (hidden a width per layer), an optimiser as torch.optim defines it, a learning-rate schedule over
    the timed steps, fp16 compute with fp32 master weights. The defaults are the seed recipe (plain SGD, constant
    lr, batch 32).

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

    def __post_init__(self) -> None:
        # Warm-up is where compilation and graph capture happen; without it they would be timed.
        if isinstance(self.hidden, (list, tuple)):
            self.hidden = tuple(int(h) for h in self.hidden)
            if not self.hidden:
                raise ValueError("Workload.hidden needs at least one width")
        checks = [*(("hidden", h, 1) for h in self.hidden_widths), ("steps", self.steps, 1), ("batch", self.batch, 1),
                  ("warmup_steps", self.warmup_steps, 1)]
        for name, value, least in checks:
            if value < least:
                raise ValueError(f"Workload.{name} must be >= {least}, got {value}")
        if self.batch > TRAIN_ROWS:
            raise ValueError(f"Workload.batch must be <= {TRAIN_ROWS}, got {self.batch}")
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

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """Every hidden layer's width: three of H, or the list given."""
        return self.hidden if isinstance(self.hidden, tuple) else (self.hidden,) * 3

    @property
    def widths(self) -> tuple[int, ...]:
        """The MLP's layer widths, inputs to classes."""
        return (INPUTS, *self.hidden_widths, CLASSES)

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


def step_indices(steps: int, batch: int, seed: int = 0) -> np.ndarray:
    """Training-row index of every sample of every step, int32 [steps * batch].

    One fresh permutation of the 60000 rows per epoch (np.random.default_rng(seed)), each cut to whole
    batches, concatenated and truncated: the same order rawgpu's trainer draws, so all systems see the
    same batches.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 1 <= batch <= TRAIN_ROWS:
        raise ValueError(f"batch must be in 1..{TRAIN_ROWS}, got {batch}")
    per_epoch = TRAIN_ROWS // batch * batch
    need = steps * batch
    rng = np.random.default_rng(seed)
    epochs = [rng.permutation(TRAIN_ROWS)[:per_epoch] for _ in range(-(-need // per_epoch))]
    if not epochs:
        return np.empty(0, dtype=np.int32)
    return np.concatenate(epochs)[:need].astype(np.int32)


def mnist_arrays(data_dir=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x [60000,784], train_y [60000], test_x [10000,784], test_y [10000]), all uint8.

    Writable copies: rawgpu.data.datasets returns read-only views, and torch.from_numpy warns on those.
    """
    from rawgpu.data.datasets import load_mnist  # lazy: importing this module must not need the data

    m = load_mnist(data_dir)
    return (np.array(m.train_images, dtype=np.uint8).reshape(-1, INPUTS), np.array(m.train_labels, dtype=np.uint8),
            np.array(m.test_images, dtype=np.uint8).reshape(-1, INPUTS), np.array(m.test_labels, dtype=np.uint8))
