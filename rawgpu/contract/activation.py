"""The hidden layers' activation (cu/activation.cuh): its codes, and the one a build applies."""

from __future__ import annotations

from ..recipe import ACTIVATIONS, DEFAULT_ACTIVATION, SLOPE_SAVED


def activation_facts(arch: str, activation: str = DEFAULT_ACTIVATION):
    """ACT_<NAME> for every activation, ACTIVATION: the one this build applies (a kernel is built for one), and
    ACT_SAVES_SLOPE: whether the forward saves act'(z) for its backward (recipe.SLOPE_SAVED)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: use one of {', '.join(ACTIVATIONS)}")
    codes = {f"ACT_{name.upper()}": code for name, code in ACTIVATIONS.items()}
    return {**codes, "ACTIVATION": ACTIVATIONS[activation],
            "ACT_SAVES_SLOPE": int(activation in SLOPE_SAVED)}, {}
