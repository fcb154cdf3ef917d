"""The hidden layers' activation (cu/activation.cuh): its codes, and the one a build applies."""

from __future__ import annotations

from ..recipe import ACTIVATIONS, DEFAULT_ACTIVATION, FROM_PREACTIVATION


def activation_facts(arch: str, activation: str = DEFAULT_ACTIVATION):
    """ACT_<NAME> for every activation, ACTIVATION: the one this build applies (a kernel is built for one), and
    ACT_SAVES_INPUT: whether its backward reads the pre-activation (recipe.FROM_PREACTIVATION)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: use one of {', '.join(ACTIVATIONS)}")
    codes = {f"ACT_{name.upper()}": code for name, code in ACTIVATIONS.items()}
    return {**codes, "ACTIVATION": ACTIVATIONS[activation],
            "ACT_SAVES_INPUT": int(activation in FROM_PREACTIVATION)}, {}
