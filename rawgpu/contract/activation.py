"""The hidden layers' activation (cu/activation.cuh): its codes, and the one a build applies."""

from __future__ import annotations

# The hidden layers' activation, named as PyTorch names it -> the code the kernels are built for
# (ACT_*: activation_facts; cu/activation.cuh). gelu is torch's default erf form, gelu_tanh approximate="tanh".
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "tanh": 4}
# Those whose derivative needs the pre-activation z (the others' comes from their output, which the next layer reads
# anyway): the forward saves the slope act'(z) beside the output for the backward.
SLOPE_SAVED = ("gelu", "gelu_tanh", "silu")
DEFAULT_ACTIVATION = "relu"  # what a build applies unless told (the compiler, Kernels, the recipe's default)


def activation_facts(arch: str, activation: str = DEFAULT_ACTIVATION):
    """ACT_<NAME> for every activation, ACTIVATION: the one this build applies (a kernel is built for one), and
    ACT_SAVES_SLOPE: whether the forward saves act'(z) for its backward (recipe.SLOPE_SAVED)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: use one of {', '.join(ACTIVATIONS)}")
    codes = {f"ACT_{name.upper()}": code for name, code in ACTIVATIONS.items()}
    return {**codes, "ACTIVATION": ACTIVATIONS[activation],
            "ACT_SAVES_SLOPE": int(activation in SLOPE_SAVED)}, {}
