"""The optimisers' update in float64 (cu/optim.cuh's rules, from the table contract.Optim that rawgpu/model/optimizer.py
makes), the recipes the update kernels are checked with, and the check of an update on the split master weights."""

from __future__ import annotations

import numpy as np

from rawgpu.model import master, optimizer
from rawgpu.model.recipe import Recipe

# Optimisers the update kernels are checked with.
OPTIMIZERS = {"plain": Recipe(momentum=0.0), "momentum": Recipe(momentum=0.9),
              "nesterov": Recipe(momentum=0.9, nesterov=True, weight_decay=1e-3),
              "adam": Recipe(optimizer="adam", weight_decay=1e-3), "adamw": Recipe(optimizer="adamw", weight_decay=0.1)}
TABLE_STEP = 3  # Adam's bias corrections of a step past the first


def table(opt: str, lr: float = 0.05, step: int = TABLE_STEP):
    """The optimiser table of OPTIMIZERS[opt] at step `step` with the scaled learning rate lr."""
    return optimizer.step_values(optimizer.hyperparameters(OPTIMIZERS[opt]), step, lr)


def update_reference(o, w, g, m, v):
    """optim.cuh's update in float64 from the table `o` (contract.Optim): (w, m, v) after one step."""
    w, g, m, v = (np.asarray(a, np.float64) for a in (w, g, m, v))
    if o.kind == 0:
        g = g + o.l2 * w
        if o.beta1 > 0:
            m = o.beta1 * m + g
            g = g + o.beta1 * m if o.nesterov else m
        return w - o.lr * g, m, v
    decay = w * o.decay_rate if o.kind == 2 else 0.0
    if o.kind != 2:
        g = g + o.l2 * w
    m = m + o.m_rate * (g - m)
    v = o.beta2 * v + o.v_rate * g * g
    return w - decay - o.step_size * m / (np.sqrt(v) * o.bias2 + o.eps), m, v


def random_state(rng, shape, states: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Fresh optimiser state of `shape`: m uniform in +-scale, v (Adam's second moment, positive) up to scale^2;
    zeros where the optimiser keeps fewer states."""
    m = rng.uniform(-scale, scale, shape).astype(np.float32) if states else np.zeros(shape, np.float32)
    v = rng.uniform(0, scale * scale, shape).astype(np.float32) if states > 1 else np.zeros(shape, np.float32)
    return m, v


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "output has NaN/inf: not every element was written"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check_master_update(w: np.ndarray, w16: np.ndarray, wlo: np.ndarray, w_ref: np.ndarray, bound: float = 2e-3,
                        what: str = "update") -> None:
    """The split master (W16, lo) after one step from fp32 w against the float64 reference w_ref: the change within
    `bound`, every weight whose change is not tiny moved (the master is updated in place, so it cannot be
    poisoned), W16 = fp16(master) exactly (but where the master's 2^-39 grid below 2^-16 rounds to a midpoint
    between two fp16 subnormals, cu/master.cuh), lo within its range."""
    joined = master.join(w16, wlo)
    change, ref_change = joined.astype(np.float64) - w.astype(np.float64), w_ref - w.astype(np.float64)
    err = rel(change, ref_change)
    assert err <= bound, f"{what}: rel err {err:.2e}"
    big = np.abs(ref_change) > 1e-3 * np.abs(ref_change).max()
    assert (joined[big] != w[big]).all(), f"{what}: weights left unwritten"
    tie = (np.abs(joined) < 2.0**-16) & (np.abs(wlo.astype(np.int32)) == 2**14)
    off = (joined.astype(np.float16).view(np.uint16) != w16.view(np.uint16)) & ~tie
    assert not off.any(), f"{what}: W16 must be fp16(master) exactly ({int(off.sum())} differ)"
    assert np.abs(wlo.astype(np.int32)).max() <= 2**14, f"{what}: lo out of its range"


def fresh_layer(rng, opt: str, B: int, IN: int, N: int) -> tuple:
    """A layer's update case of OPTIMIZERS[opt]: (its table at lr 0.05 / 64, w [IN, N], b [N] and the state it keeps
    as (name, array) pairs of mw, mb, vw, vb), fresh from rng."""
    states = OPTIMIZERS[opt]._state_tensors
    w = rng.uniform(-1, 1, (IN, N)).astype(np.float32)
    b = rng.uniform(-1, 1, N).astype(np.float32)
    mw, vw = random_state(rng, (IN, N), states, np.sqrt(B))
    mb, vb = random_state(rng, N, states, np.sqrt(B))
    return table(opt, lr=0.05 / 64), w, b, [("mw", mw), ("mb", mb), ("vw", vw), ("vb", vb)][:2 * states]


def check_layer_update(o, x, dy, w, b, held: list, wlo, w16, b_new, got_state: list) -> None:
    """One run's master, bias and state after the step of x^T @ dy (fp16 [B, IN], [B, N]) from fresh_layer's w, b and
    held state, against float64 (the update kernels' tolerances: x^T @ dy summed in fp32)."""
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    values = dict(held)
    w_ref, mw_ref, vw_ref = update_reference(o, w, x64.T @ dy64, values.get("mw", 0.0), values.get("vw", 0.0))
    b_ref, mb_ref, vb_ref = update_reference(o, b, dy64.sum(axis=0), values.get("mb", 0.0), values.get("vb", 0.0))
    assert rel(b_new - b, b_ref - b) <= 1e-5, "bias update"
    check_master_update(w, w16, wlo, w_ref)
    got = dict(zip([name for name, _ in held], got_state))
    if "mw" in got:
        assert rel(got["mw"], mw_ref) <= 2e-3 and rel(got["mb"], mb_ref) <= 1e-5, "first state"
    if "vw" in got:
        assert rel(got["vw"], vw_ref) <= 4e-3 and rel(got["vb"], vb_ref) <= 1e-5, "second moment"
