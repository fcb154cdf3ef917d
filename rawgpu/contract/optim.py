"""What every weight update reads: the schedule codes (step_math.cuh: lr_at_step) and the optimiser (optim.cuh)."""

from __future__ import annotations

import ctypes

from .abi import CStruct, declare, header

OPTIMIZERS = {"sgd": 0, "adam": 1, "adamw": 2}  # name -> the code the kernels switch on (OPT_*: optim_facts)
SCHEDULES = {"constant": 0, "cosine": 1, "linear": 2}  # name -> the code the kernels switch on (SCHEDULE_*: schedule_facts)

# The update rules compiled into a kernel (cu/optim.cuh): SGD's (its momentum, Nesterov and weight decay read from the
# table) and Adam's (AdamW's too). Every update kernel has one instance per family: dx_update's, the head's, the GEMM's
# update epilogues (EPI_SGD, EPI_ADAM) and apply_update's.
UPDATE_FAMILIES = ("sgd", "adam")


def update_family(optimizer: str) -> str:
    """The update rule an optimiser's kernels are compiled with: Adam's for adam and adamw, SGD's for sgd."""
    return "sgd" if optimizer == "sgd" else "adam"


def schedule_facts(arch: str):
    return {f"SCHEDULE_{name.upper()}": code for name, code in SCHEDULES.items()}, {}


class Optim(CStruct):
    """The optimiser, one copy in the arena that every update kernel reads: the hyperparameters, set once from the
    recipe, and the step's values, which the gather writes every step (the fused kernel computes its own). lr comes
    first: kernels that run plain SGD read it as a float*."""

    c_fields = (
        ("lr", "float", "this step's learning rate / the loss scale: what SGD multiplies scaled gradients by"),
        ("step_size", "float", "Adam: this step's lr / (1 - beta1^t), t = steps done + 1"),
        ("bias2", "float", "Adam: 1 / sqrt(1 - beta2^t)"),
        ("decay_rate", "float", "AdamW: lr x weight decay, the decoupled decay's rate (0 otherwise)"),
        ("kind", "int", "OPT_SGD, OPT_ADAM, OPT_ADAMW"),
        ("nesterov", "int", "SGD: w -= lr (g + mu v) instead of lr v"),
        ("beta1", "float", "SGD: the momentum mu (0: none); Adam: beta1"),
        ("beta2", "float"),
        ("m_rate", "float", "Adam: 1 - beta1, rounded once from double"),
        ("v_rate", "float", "Adam: 1 - beta2"),
        ("eps", "float", "Adam's eps x the loss scale (the moments hold scaled gradients)"),
        ("l2", "float", "SGD and Adam: weight decay x the loss scale, added to the scaled gradient"),
        ("wd", "float", "AdamW: the decoupled weight decay"),
        ("scale", "float", "the loss scale"),
        ("beta1_d", "double", "beta1 and beta2 in double, for the bias corrections"),
        ("beta2_d", "double"),
    )


OPTIM_WORDS = ctypes.sizeof(Optim) // 4  # the arena holds it as that many float32


def optim_facts(arch: str):
    return ({f"OPT_{name.upper()}": code for name, code in OPTIMIZERS.items()},
            {"optim_abi.cuh": header(__name__, "optim.cuh", declare(Optim))})
