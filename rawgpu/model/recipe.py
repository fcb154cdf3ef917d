"""The recipe: everything that shapes a run (model, batch, optimiser, schedule, numerics), stated once.

Defaults, limits and choices live in `OPTIONS`; `Recipe` validates against them and the CLIs build their
argparse options from them (`add_options`), so a default or a limit is written in one place. A run's settings
beyond the recipe (its length, the GPU index) are checked here too (`plan_run`, `check_setting`), for the Python
API and the CLIs alike: a bad one raises `SettingError` naming the parameter ("epochs: must be >= 1, got 0"), which
a CLI words as its flag ("argument --epochs: ..."). The padding rule, the schedule codes the kernels read, the
accumulator spelling and the loss-scaled learning rate are here too, as underscore names (the kernels' business,
not the API's). It imports only the contract (the facts the kernels are built around).
"""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping

# The facts the kernels are built around live in the contract (shared with the CUDA sources); the recipe's rules use
# them and hand them on, so `recipe.X` names every setting's limit and code.
from ..contract.loss import REGRESSION_LOSSES
from ..contract.activation import ACTIVATIONS, DEFAULT_ACTIVATION, SLOPE_SAVED  # noqa: F401
from ..contract.optim import OPTIMIZERS, SCHEDULES  # noqa: F401
from ..contract.shapes import (HEAD_TILE_CLASSES, IDX_MAX_CLASSES, INPUTS, MAX_CLASSES, MAX_INPUTS,  # noqa: F401
                               MAX_OUTPUTS, cdiv, pad8, padded_classes)

CLASSES = 10
TRAIN_ROWS = 60000
TEST_ROWS = 10000
ACCUMS = {"fp32": "f32", "fp16": "f16"}  # the CLI's spelling -> the kernels' instance suffix
# How the training set's features are kept on the GPU (the CLI's spelling -> numpy's): u8 is read as pixels (/ 255)
INPUT_DTYPES = {"u8": "uint8", "fp16": "float16", "fp32": "float32"}
GRAD_SCALE_PER_SAMPLE = 16  # see loss_scale()
# Per optimiser: the defaults of the settings whose usual value depends on it (torch.optim's, and the lr the CLI's
# default recipe reaches >= 98% with). The CLIs leave these unset (None) unless given, and Recipe resolves them.
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
                      "adam": {"lr": 1e-3, "weight_decay": 0.0},
                      "adamw": {"lr": 1e-3, "weight_decay": 0.01}}
SGD_ONLY = ("momentum", "nesterov")  # settings that mean something to SGD alone
ADAM_ONLY = ("betas", "eps")


def loss_scale(batch: int) -> float:
    """The static loss scale S: gradients flow backward in fp16 as S x the gradient of the mean loss, and the
    updates use lr / S, so the arithmetic is that of the mean loss. Without it, d(logits) = (softmax - onehot) / B
    shrinks with the batch and with every layer, and deep-layer gradients fall into fp16's subnormals, where they
    lose precision (docs/design.md, Numerics). With S = 16 x 2^ceil(log2 B), d(logits) lies within 16..32 x
    (softmax - onehot): normal, far from fp16's 65504. A power of two, so scaling and unscaling are exact."""
    return float(GRAD_SCALE_PER_SAMPLE * (1 << max(0, (batch - 1).bit_length())))


# The Python API's names that a CLI spells otherwise (the rest: --NAME with "_" as "-").
FLAG_NAMES = {"warmup_steps": "warmup", "beta1": "betas", "beta2": "betas"}


class SettingError(ValueError):
    """A setting of a run that cannot be, in one line naming the parameter as the Python API names it:
    str() is "NAME: REASON" ("epochs: must be >= 1, got 0"). `usage()` words it for a CLI, naming the flag
    ("argument --epochs: must be >= 1, got 0"); cli_reason: the reason as a CLI says it, where it names other
    settings by their flags (default: the reason)."""

    def __init__(self, name: str, reason: str, cli_reason: str | None = None):
        super().__init__(f"{name}: {reason}")
        self.name, self.reason, self.cli_reason = name, reason, cli_reason or reason

    def flag(self, flags: Mapping[str, str] | None = None) -> str:
        """The CLI's flag for the parameter: flags[name] where given, else --NAME (FLAG_NAMES' spelling)."""
        if flags and self.name in flags:
            return flags[self.name]
        return "--" + FLAG_NAMES.get(self.name, self.name).replace("_", "-")

    def usage(self, flags: Mapping[str, str] | None = None) -> str:
        """The error as a CLI's usage line says it: 'argument --FLAG: REASON'."""
        return f"argument {self.flag(flags)}: {self.cli_reason}"


class SettingTypeError(SettingError, TypeError):
    """A setting of the wrong type (a string where a number goes, an int where a Recipe goes): a TypeError, and a
    SettingError (so a ValueError too) with the same one line."""


@dataclass(frozen=True)
class Option:
    """One recipe setting as the CLI offers it: default, type, range (low_open: low itself is excluded),
    choices and help."""

    default: Any
    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    help: str = ""
    metavar: str | tuple[str, ...] | None = None
    nargs: int | str | None = None  # a tuple of this many values (--betas B1 B2), or "+" (--hidden: one or more)

    def check(self, name: str, value: Any, shown: str | None = None) -> None:
        """SettingError 'NAME: must be ...' when value is out of range or not a choice (SettingTypeError when it is
        not of this option's type). shown: the value as the user typed it, for the message."""
        got = shown if shown is not None else value
        if not self.has_kind(value):
            raise SettingTypeError(name, f"must be {self.describe()}, got {got!r}")
        if self.choices is not None:
            if value not in self.choices:
                raise SettingError(name, f"must be one of {', '.join(self.choices)}, got {got!r}")
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise SettingError(name, f"must be finite, got {got!r}")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise SettingError(name, f"must be {'>' if self.low_open else '>='} {self.low:g}, got {got}")
        if self.high is not None and value > self.high:
            raise SettingError(name, f"must be <= {self.high:g}, got {got}")

    def has_kind(self, value: Any) -> bool:
        """Whether value is of this option's type (a bool is no number here, and an int is a float)."""
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if self.kind is int:
            return isinstance(value, numbers.Integral)  # numpy's integers too
        if self.kind is float:
            return isinstance(value, numbers.Real)
        return isinstance(value, self.kind)

    def describe(self) -> str:
        """What the option takes, for messages: 'an integer in 1..64', 'one of sgd, adam, adamw', 'true or false'."""
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        if self.kind is bool:
            return "True or False"
        what = {int: "an integer", float: "a number"}.get(self.kind, self.kind.__name__)
        if self.low is not None and self.high is not None and not self.low_open:
            return f"{what} in {self.low:g}..{self.high:g}"
        low = f" {'>' if self.low_open else '>='} {self.low:g}" if self.low is not None else ""
        high = f"{' and' if low else ''} <= {self.high:g}" if self.high is not None else ""
        return what + low + high


OPTIONS: dict[str, Option] = {
    "hidden": Option(256, int, 1, nargs="+",
                     help="hidden layer width for --layers layers, or one width per layer (1024 512 256); multiples "
                          "of 64 are the fast path"),
    "layers": Option(3, int, 1, 64, help="number of hidden layers of one width (a width list sets its own)"),
    "batch": Option(128, int, 1, TRAIN_ROWS, help=f"batch size, 1..{TRAIN_ROWS}"),
    "epochs": Option(8, int, 1, help="passes over the training images"),
    "optimizer": Option("sgd", str, choices=tuple(OPTIMIZERS),
                        help="sgd (torch.optim.SGD), adam or adamw (torch.optim.Adam, AdamW: decoupled decay)"),
    "lr": Option(None, float, 0.0, low_open=True, help="peak learning rate; 0.05 with sgd, 0.001 with adam, adamw"),
    "momentum": Option(None, float, 0.0, 0.999,
                       help="SGD momentum (v = mu v + g; w -= lr v), 0 for plain SGD; 0.9 unless given"),
    "nesterov": Option(False, bool, help="SGD: Nesterov momentum (w -= lr (g + mu v))"),
    "betas": Option((0.9, 0.999), float, 0.0, 0.999999, nargs=2, metavar=("B1", "B2"),
                    help="Adam's moment decay rates"),
    "eps": Option(1e-8, float, 0.0, low_open=True, help="Adam's denominator term"),
    "weight_decay": Option(None, float, 0.0, 1.0,
                           help="L2 decay added to the gradient (sgd, adam) or decoupled (adamw); 0.01 with adamw, "
                                "else 0, unless given"),
    "schedule": Option("cosine", str, choices=tuple(SCHEDULES),
                       help="learning-rate schedule over the run; cosine and linear decay to 0"),
    "warmup": Option(0, int, 0, help="linear warm-up steps for cosine/linear"),
    "activation": Option(DEFAULT_ACTIVATION, str, choices=tuple(ACTIVATIONS),
                         help="the hidden layers' activation: relu, gelu (torch's erf form), gelu_tanh (GELU's tanh "
                              "approximation), silu or tanh"),
    "accum": Option("fp32", str, choices=tuple(ACCUMS), help="GEMM accumulator precision"),
    "seed": Option(0, int, 0, 2**63 - 1, help="seed for the initial weights and the shuffles"),
    "loss": Option("xent", str, choices=("xent", *REGRESSION_LOSSES),
                   help="xent: classification (softmax cross-entropy); mse, l1 or huber (delta 1): regression of "
                        "1 to 64 values"),
    "input_dtype": Option(None, str, choices=tuple(INPUT_DTYPES),
                          help="how the features are kept on the GPU: u8 (bytes / 255, as pixels), fp16 or fp32; "
                               "default u8 for bytes, else fp16"),
    "standardize": Option(False, bool, help="scale each feature to mean 0 and std 1 (the training split's)"),
}
DEFAULTS = {name: opt.default for name, opt in OPTIONS.items()}
# The recipe's fields that are no CLI option (the dataset sets the shape; the run sets total_steps), with their ranges.
SHAPE_OPTIONS: dict[str, Option] = {
    "inputs": Option(INPUTS, int, 1, MAX_INPUTS, help="pixels per image"),
    "classes": Option(CLASSES, int, 1, MAX_CLASSES, help="classes, or a regression's outputs"),
    "train_rows": Option(TRAIN_ROWS, int, 1, help="training images"),
    "test_rows": Option(TEST_ROWS, int, 1, help="test images"),
    "total_steps": Option(0, int, 0, help="the schedule's length (0: no decay)"),
    "lr_min": Option(0.0, float, 0.0, help="the schedule's floor"),
}
MAX_WIDTH_LIST = 16  # hidden layers a width list may give (one width for all: up to OPTIONS["layers"].high)


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes a run: model, batch and optimiser, and the data's shape (pixels per image, classes,
    images in the training and test sets), which the dataset sets. The defaults are the CLI's default recipe on
    MNIST (it reaches >= 98% test accuracy at hidden 256). total_steps: the schedule's length (0: no decay)."""

    hidden: int | tuple[int, ...] = DEFAULTS["hidden"]  # one width for every hidden layer, or one per layer
    layers: int | None = None  # hidden layers: DEFAULTS' with one width, the list's length with a list
    batch: int = DEFAULTS["batch"]
    optimizer: str = DEFAULTS["optimizer"]
    lr: float | None = None  # None: the optimiser's default (OPTIMIZER_DEFAULTS), as are momentum and weight_decay
    momentum: float | None = None
    nesterov: bool = False
    beta1: float = DEFAULTS["betas"][0]
    beta2: float = DEFAULTS["betas"][1]
    eps: float = DEFAULTS["eps"]
    weight_decay: float | None = None
    schedule: str = DEFAULTS["schedule"]
    warmup_steps: int = DEFAULTS["warmup"]
    lr_min: float = 0.0
    total_steps: int = 0
    accum: str = DEFAULTS["accum"]
    activation: str = DEFAULTS["activation"]
    seed: int = DEFAULTS["seed"]
    loss: str = DEFAULTS["loss"]
    input_dtype: str | None = None  # None: the data's own (u8 for bytes, else fp16), set when the data is known
    standardize: bool = False
    inputs: int = INPUTS
    classes: int = CLASSES  # classification: the classes; regression: the values per row (1..MAX_OUTPUTS)
    train_rows: int = TRAIN_ROWS
    test_rows: int = TEST_ROWS

    def __post_init__(self):
        self._resolve_widths()
        OPTIONS["optimizer"].check("optimizer", self.optimizer)
        if (error := optimizer_conflict(self.optimizer, self._given())) is not None:
            if error.name == "betas":  # the API's fields: beta1 and beta2
                error = SettingError("beta1" if self.beta1 != DEFAULTS["betas"][0] else "beta2", error.reason,
                                     error.cli_reason)
            raise error
        for name, default in {"momentum": 0.0, **OPTIMIZER_DEFAULTS[self.optimizer]}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # frozen: resolved once, here
        for f in fields(self):
            name = {"warmup_steps": "warmup", "beta1": "betas", "beta2": "betas"}.get(f.name, f.name)
            option = OPTIONS.get(name) or SHAPE_OPTIONS.get(name)
            if option is not None and name != "hidden" and not (name == "input_dtype" and self.input_dtype is None):
                option.check(f.name, getattr(self, f.name))
        if self.nesterov and not self.momentum > 0:
            raise SettingError("nesterov", "needs momentum > 0")
        if self.regression and self.classes > MAX_OUTPUTS:
            raise SettingError("classes", f"a regression has 1 to {MAX_OUTPUTS} outputs, got {self.classes}")
        if not self.regression and self.classes < 2:
            raise SettingError("classes", f"a classification has 2 to {MAX_CLASSES} classes, got {self.classes}")
        if self.batch > self.train_rows:
            raise SettingError("batch", f"must be <= the {self.train_rows} training images, got {self.batch}")
        if why := model_size_problem(self.widths):
            raise SettingError("hidden", f"{self.hidden_label}: {why}")

    def _given(self) -> dict[str, Any]:
        """The optimiser settings as given, before the optimiser's defaults fill them in: for optimizer_conflict,
        which refuses those of another optimiser (betas and eps count as given where they are not the defaults)."""
        betas = (self.beta1, self.beta2)
        return {"momentum": self.momentum, "nesterov": self.nesterov,
                "betas": None if betas == DEFAULTS["betas"] else betas,
                "eps": None if self.eps == DEFAULTS["eps"] else self.eps}

    def _resolve_widths(self) -> None:
        """hidden as a width list (any sequence) or one width; layers from the list, else DEFAULTS'. A list of one
        width for every layer becomes that width (one recipe, one name for one model). Frozen: set once, here."""
        hidden, layers = self.hidden, self.layers
        if isinstance(hidden, (list, tuple)):
            widths = tuple(hidden)
            if not widths:
                raise SettingError("hidden", "needs at least one width")
            if len(widths) > MAX_WIDTH_LIST:
                raise SettingError("hidden",
                                   f"takes at most {MAX_WIDTH_LIST} widths (one per layer), got {len(widths)}")
            for w in widths:
                OPTIONS["hidden"].check("hidden", w)
            if layers is not None and layers != len(widths):
                raise SettingError("layers",
                                   f"a width list sets the layer count: {len(widths)} widths, layers {layers}")
            hidden, layers = (int(widths[0]) if len(set(widths)) == 1 else tuple(int(w) for w in widths)), len(widths)
        else:
            OPTIONS["hidden"].check("hidden", hidden)
            layers = DEFAULTS["layers"] if layers is None else layers
        object.__setattr__(self, "hidden", hidden)
        object.__setattr__(self, "layers", layers)

    @property
    def regression(self) -> bool:
        """A regression (loss mse, l1 or huber) rather than a classification (xent)."""
        return self.loss != "xent"

    @property
    def _pixels(self) -> bool:
        """Whether the step reads its data as today's images (gather_batch: uint8 pixels / 255 and byte labels, the
        path the fused and cluster steps compile in) rather than through the table gather."""
        return (self._input_dtype == "u8" and not self.standardize and not self.regression
                and self.classes <= IDX_MAX_CLASSES)

    @property
    def _input_dtype(self) -> str:
        """The features' dtype on the GPU: as set, else u8 (MNIST's)."""
        return self.input_dtype or "u8"

    @property
    def hidden_widths(self) -> tuple[int, ...]:
        """Every hidden layer's width, first to last."""
        return layer_widths(self.hidden, self.layers)

    @property
    def uniform(self) -> bool:
        """One width for every hidden layer (what the cluster and fused steps take)."""
        return not isinstance(self.hidden, tuple)

    @property
    def hidden_label(self) -> str:
        """The hidden layers as messages name them: '256 x 3' or '1024-512-256'."""
        return f"{self.hidden} x {self.layers}" if self.uniform else "-".join(map(str, self.hidden))

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: what a checkpoint records (from_dict reads it back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Recipe":
        """The recipe a checkpoint recorded; ValueError on unknown or badly typed fields."""
        known = {f.name: f.type for f in fields(cls)}
        if unknown := sorted(set(values) - set(known)):
            raise ValueError(f"unknown recipe fields {', '.join(unknown)}")
        values = dict(values)
        for name, value in values.items():
            want = {"int": int, "float": (int, float), "str": str, "bool": bool, "float | None": (int, float),
                    "int | None": int, "str | None": (str, type(None)), "int | tuple[int, ...]": (int, list, tuple)}[known[name]]
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool) or (
                    isinstance(value, (list, tuple)) and not all(type(w) is int for w in value)):
                raise ValueError(f"recipe field {name} has a bad value {value!r}")
        if isinstance(values.get("hidden"), list):  # a JSON array: a width list
            values["hidden"] = tuple(values["hidden"])
        return cls(**values)

    @property
    def widths(self) -> list[int]:
        return [self.inputs, *self.hidden_widths, self.classes]

    @property
    def _padded_widths(self) -> list[int]:
        """What the buffers hold: every width padded to 8, the classes as contract.shapes.padded_classes says."""
        return [pad8(w) for w in self.widths[:-1]] + [self._padded_classes]

    @property
    def _padded_classes(self) -> int:
        """The head's width in the buffers: the one-tile heads' 16 up to 16 classes, else padded to 8."""
        return padded_classes(self.classes)

    @property
    def steps_per_epoch(self) -> int:
        return self.train_rows // self.batch

    @property
    def parameters(self) -> int:
        w = self.widths
        return sum(a * b + b for a, b in zip(w, w[1:]))

    @property
    def name(self) -> str:
        """The architecture: the widths, and the activation where it is not the default ('784-256-10 gelu')."""
        widths = "-".join(map(str, self.widths))
        return widths if self.activation == DEFAULTS["activation"] else f"{widths} {self.activation}"

    @property
    def _kernel_accum(self) -> str:
        """The accumulator as the kernels spell it (instance suffix)."""
        return ACCUMS[self.accum]

    @property
    def _activation_code(self) -> int:
        return ACTIVATIONS[self.activation]

    @property
    def _saves_slope(self) -> bool:
        """Whether the forward keeps each hidden layer's slope act'(z) for the backward (SLOPE_SAVED)."""
        return self.activation in SLOPE_SAVED

    @property
    def _schedule_code(self) -> int:
        return SCHEDULES[self.schedule]

    @property
    def _optimizer_code(self) -> int:
        return OPTIMIZERS[self.optimizer]

    @property
    def _uses_momentum(self) -> bool:
        """SGD with a momentum buffer."""
        return self.optimizer == "sgd" and self.momentum > 0

    @property
    def _plain_sgd(self) -> bool:
        """SGD without momentum or weight decay: w -= lr g, the update the batch-32 fast steps fuse."""
        return self.optimizer == "sgd" and self.momentum == 0 and self.weight_decay == 0

    @property
    def _state_tensors(self) -> int:
        """fp32 optimiser values per weight: 0 (plain SGD), 1 (SGD's momentum), 2 (Adam's two moments)."""
        return 2 if self.optimizer != "sgd" else int(self._uses_momentum)

    @property
    def optimizer_text(self) -> str:
        """The optimiser and its settings as a person writes them, for headers and reports."""
        wd = f", weight decay {self.weight_decay:g}" if self.weight_decay else ""
        if self.optimizer == "sgd":
            mom = f" with{' Nesterov' if self.nesterov else ''} momentum {self.momentum:g}" if self.momentum else ""
            return f"SGD{mom}{wd}"
        name = {"adam": "Adam", "adamw": "AdamW"}[self.optimizer]
        return f"{name} (betas {self.beta1:g}, {self.beta2:g}, eps {self.eps:g}{wd})"

    @property
    def _scaled_lr(self) -> tuple[float, float]:
        """(lr, lr_min) / loss_scale(batch): what the updates multiply the scaled gradients by."""
        s = loss_scale(self.batch)
        return self.lr / s, self.lr_min / s

    def _step_flops(self) -> int:
        """Useful FLOPs of one step: forward, weight gradient, and input gradient below the first layer."""
        w = self.widths
        return sum(2 * self.batch * a * b * (3 if i else 2) for i, (a, b) in enumerate(zip(w, w[1:])))

    def _step_bytes(self, bytes_per_weight: int = 10) -> int:
        """The weight traffic of one step: 10 B per weight with the split master (master.py: the forward reads
        W16; the update reads and writes W16 and lo), 8 more per fp32 optimiser value (read and write): 18 with
        momentum, 26 with Adam."""
        w = self.widths
        weights = sum(a * b for a, b in zip(w, w[1:]))
        return weights * (bytes_per_weight + 8 * self._state_tensors)


def data_kind(recipe: Recipe) -> str:
    """What a recipe's data is, for the reasons a step gives where it takes images alone: 'regression (mse)',
    'fp16 features', 'standardized features', '300 classes'."""
    if recipe.regression:
        return f"regression ({recipe.loss})"
    if recipe._input_dtype != "u8":
        return f"{recipe._input_dtype} features"
    if recipe.standardize:
        return "standardized features"
    return f"{recipe.classes} classes"


def argument_type(name: str, option: Option) -> Callable[[str], Any]:
    """An argparse type: parse, then check the range with the Option's own rule, so errors read 'must be ...'."""
    def parse(text: str):
        try:
            value = option.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if option.kind is int else 'a number'}, got {text!r}") from None
        try:
            option.check(name, value, shown=text)
        except SettingError as exc:
            raise argparse.ArgumentTypeError(exc.reason) from None
        return value
    parse.__name__ = name  # argparse names the type in some messages
    return parse


def add_options(parser: argparse.ArgumentParser | Any, names: list[str] | tuple[str, ...],
                defaults: dict[str, Any] | None = None) -> None:
    """Add `--NAME` for each recipe option named, with its default, range check, choices and help from OPTIONS.
    defaults: overrides of the shown defaults (e.g. a tool whose own default differs)."""
    for name in names:
        option = OPTIONS[name]
        default = (defaults or {}).get(name, option.default)
        flag = f"--{name.replace('_', '-')}"
        if option.kind is bool:
            parser.add_argument(flag, action="store_true", default=default, help=option.help)
            continue
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        kw: dict[str, Any] = dict(default=default, help=option.help if default is None else
                                  f"{option.help} (default {shown})")
        if name in UNSET_UNLESS_GIVEN:
            kw["default"] = None  # unset unless given: Recipe resolves it, from_args rejects it where it means nothing
        if option.choices is not None:
            kw["choices"] = option.choices
        else:
            kw["type"] = argument_type(name, option)
            kw["metavar"] = option.metavar or name.upper()
        if option.nargs:
            kw["nargs"] = option.nargs
        parser.add_argument(flag, dest=name, **kw)


OPTIONAL_BY_OPTIMIZER = ("betas", "eps")  # parsed as None when not given, so giving them to SGD can be refused
UNSET_UNLESS_GIVEN = OPTIONAL_BY_OPTIMIZER + ("layers",)  # layers too: a width list refuses it (hidden_of)


def run_length(batch: int, epochs: int, steps: int | None, train_rows: int = TRAIN_ROWS) -> tuple[int, int]:
    """(total steps, epochs) of a run of `epochs` epochs, or of `steps` steps when given (then the epochs are as
    many as those steps need; the last may be partial)."""
    per_epoch = train_rows // batch
    total = steps if steps is not None else epochs * per_epoch
    return total, cdiv(total, per_epoch)


def run_total(recipe: Recipe, epochs: int | None, steps: int | None) -> int:
    """The training steps of a run of `recipe` given `epochs` or `steps` (steps win); with neither, the recipe's
    total_steps, else DEFAULTS' epochs (plan_run checks them first)."""
    if epochs is None and steps is None and recipe.total_steps:
        steps = recipe.total_steps
    total, _ = run_length(recipe.batch, epochs or DEFAULTS["epochs"], steps, recipe.train_rows)
    return total


# A run's settings beyond the recipe, with their ranges (the CLIs' flags of the same names take the same).
RUN_OPTIONS: dict[str, Option] = {
    "epochs": OPTIONS["epochs"],
    "steps": Option(None, int, 1, help="training steps of the run; overrides epochs"),
    "device": Option(0, int, 0, help="GPU index"),
    "steps_per_graph": Option(None, int, 1, help="training steps captured into one CUDA graph"),
    "graphs": Option(True, bool, help="replay CUDA graphs (False: launch the kernels one by one)"),
}


def check_setting(name: str, value: Any, none_ok: bool = True) -> None:
    """SettingError naming `name` when `value` is not what the run setting `name` (RUN_OPTIONS, else OPTIONS)
    takes; None passes where none_ok (the setting left to its default)."""
    if value is None and none_ok:
        return
    (RUN_OPTIONS.get(name) or OPTIONS[name]).check(name, value)


def shown(value: Any, limit: int = 40) -> str:
    """A value as a message shows it: its repr, or its type where the repr is long."""
    text = repr(value)
    return text if len(text) <= limit else f"a {type(value).__name__}"


def recipe_or_default(recipe: Any, name: str = "recipe") -> Recipe:
    """`recipe`, or the default Recipe for None; SettingTypeError naming `name` for anything else."""
    if recipe is None:
        return Recipe()
    if not isinstance(recipe, Recipe):
        raise SettingTypeError(name, f"must be a Recipe (rawgpu.Recipe(hidden=..., ...)), got {shown(recipe)}")
    return recipe


def plan_run(recipe: Recipe, epochs: int | None = None, steps: int | None = None) -> Recipe:
    """`recipe` with its run's length as total_steps: `epochs` epochs, or `steps` steps (steps win); with neither,
    the recipe's total_steps, else DEFAULTS' epochs. The one owner of a run's rules, for Trainer, Sweep's trainers
    and the CLIs: SettingError naming the parameter where epochs or steps is not >= 1, or a warm-up goes with the
    constant schedule or is not shorter than the run."""
    check_setting("epochs", epochs)
    check_setting("steps", steps)
    total = run_total(recipe, epochs, steps)
    if recipe.warmup_steps and recipe.schedule == "constant":
        raise SettingError("warmup_steps", "a warm-up ramps up to a decaying schedule: use schedule cosine or linear",
                           "a warm-up ramps up to a decaying schedule: use --schedule cosine or linear")
    if recipe.warmup_steps >= total:
        raise SettingError("warmup_steps", f"{recipe.warmup_steps} steps is not shorter than the run ({total} steps)")
    return replace(recipe, total_steps=total)


def optimizer_conflict(optimizer: str, given: dict[str, Any]) -> SettingError | None:
    """The SettingError of settings given (name -> value, None or False when not given) that do not go with
    `optimizer` (momentum and nesterov are SGD's, betas and eps Adam's), naming the first; None when they all go.
    Recipe raises it; the CLIs, which see what was typed, word it as "argument --momentum: ..." (usage())."""
    only = SGD_ONLY if optimizer != "sgd" else ADAM_ONLY
    wrong = [name for name in only if given.get(name) not in (None, False)]
    if wrong:
        name = wrong[0]
        takes = "sgd" if optimizer != "sgd" else "adam and adamw"
        leave = "; leave it unset (None)" if name == "momentum" else ""
        return SettingError(name, f"applies to optimizer {takes}, not {optimizer}{leave}",
                            f"applies to --optimizer {takes}, not {optimizer}")
    if given.get("nesterov") and given.get("momentum") == 0:
        return SettingError("nesterov", "needs momentum > 0")
    return None


# No machine holds more: 8 GPUs of 141 GB (the largest this runtime splits a model over, --gpus 8 on H200s).
MAX_MODEL_BYTES = 8 * 141 * 10**9
MIN_BYTES_PER_WEIGHT = 10  # what a step keeps per weight at the least: the split master (hi + lo) and its update


def model_size_problem(widths: list[int]) -> str | None:
    """Why no machine could hold an MLP of these layer widths (too many parameters for MAX_MODEL_BYTES), or None.
    Checked before any GPU work, so a mistyped width fails at once rather than at the allocation."""
    parameters = sum(a * b + b for a, b in zip(widths, widths[1:]))
    need = parameters * MIN_BYTES_PER_WEIGHT
    if need <= MAX_MODEL_BYTES:
        return None
    return (f"{parameters:,} parameters need at least {need / 1e9:,.0f} GB ({MIN_BYTES_PER_WEIGHT} bytes per "
            f"weight), more than any machine holds ({MAX_MODEL_BYTES / 1e9:,.0f} GB on 8 of the largest GPUs)")


def layer_widths(hidden: int | tuple[int, ...], layers: int) -> tuple[int, ...]:
    """Every hidden layer's width: `layers` of one width, or the list itself."""
    return tuple(hidden) if isinstance(hidden, (list, tuple)) else (hidden,) * layers


def hidden_of(values: int | list[int], layers: int | None) -> tuple[int | tuple[int, ...], int]:
    """--hidden and --layers as the CLIs take them: one width for --layers layers (default DEFAULTS'), or a width
    per layer (then --layers is refused: the list sets it). ValueError naming the option."""
    widths = list(values) if isinstance(values, (list, tuple)) else [values]
    if len(widths) == 1:
        return widths[0], DEFAULTS["layers"] if layers is None else layers
    if layers is not None:
        raise ValueError(f"argument --layers: a width list sets the layer count ({len(widths)} widths given to "
                         "--hidden); leave --layers out")
    if len(widths) > MAX_WIDTH_LIST:
        raise ValueError(f"argument --hidden: at most {MAX_WIDTH_LIST} widths (one per layer), got {len(widths)}")
    return tuple(widths), len(widths)


def from_args(args: argparse.Namespace, total_steps: int = 0, **shape: int) -> Recipe:
    """The recipe of parsed CLI arguments (options missing from `args` keep their defaults; optimiser settings
    left unset take the optimiser's). SettingError (usage() names the flag) where a setting does not go with the
    optimiser or the others; ValueError "argument --NAME: ..." for --hidden and --layers (hidden_of). shape: the
    data's inputs, classes, train_rows and test_rows (default MNIST's)."""
    get = lambda name: getattr(args, name, DEFAULTS[name])  # noqa: E731
    optimizer = get("optimizer")
    given = {name: getattr(args, name, None) for name in SGD_ONLY + ADAM_ONLY}
    given["momentum"] = getattr(args, "momentum", None)
    if (error := optimizer_conflict(optimizer, given)) is not None:  # what was typed, defaults or not
        raise error
    betas, eps = get("betas") or DEFAULTS["betas"], get("eps") or DEFAULTS["eps"]
    hidden, layers = hidden_of(get("hidden"), getattr(args, "layers", None))
    return Recipe(hidden=hidden, layers=layers, batch=get("batch"), optimizer=optimizer, lr=get("lr"),
                  momentum=get("momentum"), nesterov=bool(get("nesterov")), beta1=betas[0], beta2=betas[1], eps=eps,
                  weight_decay=get("weight_decay"), schedule=get("schedule"), warmup_steps=get("warmup"),
                  lr_min=0.0, total_steps=total_steps, accum=get("accum"), activation=get("activation"),
                  seed=get("seed"), loss=get("loss"), standardize=bool(get("standardize")),
                  input_dtype=getattr(args, "input_dtype", None), **shape)
