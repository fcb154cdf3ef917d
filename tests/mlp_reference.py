"""Float64 numpy reference of one rawgpu MLP training step.

GPU tests compare the device's parameters after 1 and 10 steps against this, so it follows the
device's conventions exactly: W is [fan_in, fan_out] (forward is ``x @ W + b``), the hidden layers
apply the recipe's activation (ReLU by default), the loss is the batch-mean softmax cross-entropy,
and the activation's derivative is taken from what the device saves for it: the output for relu
(``h > 0``, so 0 at the kink) and tanh (``1 - h^2``), and for gelu, gelu_tanh and silu the slope f'(z) the
device's forward computes and stores.
Everything runs in float64 so the reference's own rounding is negligible next to the device's float32.

``fp16_storage=True`` rounds to fp16 exactly where the device stores fp16 (working weights, activations,
logits, and the backward's d(activation) scaled by the loss scale ``grad_scale``), and computes everything
else in float64. With it the reference is the device's step up to summation order; without it, the pure
float64 math, from which the device differs by fp16 rounding amplified by cancellation in the gradient sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import math

import numpy as np

Params = list[tuple[np.ndarray, np.ndarray]]
_erf = np.vectorize(math.erf, otypes=[np.float64])
_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh_t(z):
    return np.tanh(_C * (z + 0.044715 * z ** 3))


# name -> (f(z), f'(z) from (z, h = f(z) as stored)): torch's definitions, in float64
ACTIVATIONS = {
    "relu": (lambda z: np.maximum(z, 0.0), lambda z, h: (h > 0).astype(np.float64)),
    "gelu": (lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
             lambda z, h: 0.5 * (1.0 + _erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)),
    "gelu_tanh": (lambda z: 0.5 * z * (1.0 + _gelu_tanh_t(z)),
                  lambda z, h: 0.5 * (1.0 + _gelu_tanh_t(z))
                  + 0.5 * z * (1.0 - _gelu_tanh_t(z) ** 2) * _C * (1.0 + 3 * 0.044715 * z * z)),
    "silu": (lambda z: z / (1.0 + np.exp(-z)),
             lambda z, h: (1.0 / (1.0 + np.exp(-z))) * (1.0 + z * (1.0 - 1.0 / (1.0 + np.exp(-z))))),
    "tanh": (np.tanh, lambda z, h: 1.0 - h * h),
}
FROM_OUTPUT = ("relu", "tanh")  # the derivative from the stored output h; the others' from z, stored itself


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _rounder(fp16_storage: bool) -> Callable[[np.ndarray], np.ndarray]:
    if not fp16_storage:
        return _f64
    return lambda a: _f64(np.asarray(a, dtype=np.float64).astype(np.float16))


KINK_MARGIN = 2.0 ** -9  # of sum |h w|: the layer's inputs, rounded to fp16 (2^-11 each), move z by less


def forward(params: Params, x, fp16_storage: bool = False, activation: str = "relu",
            slopes: list | None = None, device_hidden: list | None = None) -> list[np.ndarray]:
    """Return ``[x, h1, ..., h_{L-1}, logits]``: every layer's input, plus the logits.

    Backprop needs each layer's input (for dW) and the activation's slope; slopes, when given, gets each hidden
    layer's f'(z) as the device's backward reads it (slopes[i]: at layer i's input, slopes[0] None): from the stored
    h for relu and tanh, else computed from z and stored as the forward does.
    device_hidden ([h1, ..., h_{L-1}] as the device stored them): where a ReLU's z lies within KINK_MARGIN x
    sum_k |h_k w_k| of 0, the slope the device took (its h > 0). There an input on the other fp16 neighbour, or the
    summation order, turns the unit on or off: a different function, not a rounding error (docs/design.md, Numerics).
    """
    store = _rounder(fp16_storage)
    act, derivative = ACTIVATIONS[activation]
    acts = [store(x)]
    if slopes is not None:
        slopes[:] = [None]
    for i, (w, b) in enumerate(params):
        z = acts[-1] @ store(w) + _f64(b)
        acts.append(store(z if i == len(params) - 1 else act(z)))
        if i < len(params) - 1 and slopes is not None:
            slope = derivative(None, acts[-1]) if activation in FROM_OUTPUT else store(derivative(z, None))
            if device_hidden is not None and activation == "relu":
                near = np.abs(z) < KINK_MARGIN * (np.abs(acts[-2]) @ np.abs(store(w)))
                slope = np.where(near, _f64(device_hidden[i])[:, :slope.shape[1]] > 0, slope)
            slopes.append(slope)
    return acts


REGRESSION = {  # loss name -> (l(e), l'(e)) of the error e = prediction - target, as cu/loss.cu computes them
    "mse": (lambda e: e * e, lambda e: 2.0 * e),
    "l1": (lambda e: np.abs(e), lambda e: np.sign(e)),
    "huber": (lambda e: np.where(np.abs(e) <= 1.0, 0.5 * e * e, np.abs(e) - 0.5), lambda e: np.clip(e, -1.0, 1.0)),
}


def regression_metrics(pred, targets, loss: str) -> tuple[float, float, float]:
    """(sum over rows of the mean loss over the outputs, sum of squared errors, sum of absolute errors)."""
    e = _f64(pred) - _f64(targets)
    return float(REGRESSION[loss][0](e).mean(axis=1).sum()), float((e * e).sum()), float(np.abs(e).sum())


def loss_and_grads(params: Params, x, labels, fp16_storage: bool = False,
                   grad_scale: float = 1.0, activation: str = "relu", loss: str = "xent",
                   device_hidden: list | None = None) -> tuple[float, int, Params]:
    """Mean softmax cross-entropy, argmax hit count, and d(mean loss)/d(W, b) for every layer. loss mse, l1 or
    huber: a regression on the values `labels` [n, K] (the loss a row's mean over its K outputs; hits 0).
    device_hidden: as forward takes it."""
    store = _rounder(fp16_storage)
    slopes: list = []
    acts = forward(params, x, fp16_storage, activation, slopes, device_hidden)
    logits = acts[-1]
    n = logits.shape[0]
    rows = np.arange(n)
    if loss != "xent":
        targets = _f64(labels).reshape(n, -1)
        e = logits - targets
        value, derivative = REGRESSION[loss]
        mean_loss = float(value(e).mean())
        delta = store(derivative(e) * (grad_scale / (n * e.shape[1])))
        return mean_loss, 0, _backward(params, acts, slopes, delta, grad_scale, store)
    labels = np.asarray(labels, dtype=np.int64)

    # Log-sum-exp shifted by the row max so large logits cannot overflow.
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss_value = float(-log_probs[rows, labels].mean())
    correct = int((logits.argmax(axis=1) == labels).sum())  # argmax returns the first max on ties

    # d(mean CE)/d(logits) = (softmax - onehot) / n, carried as grad_scale x that (the device's loss scale).
    delta = np.exp(log_probs)
    delta[rows, labels] -= 1.0
    delta = store(delta * (grad_scale / n))
    return loss_value, correct, _backward(params, acts, slopes, delta, grad_scale, store)


def _backward(params: Params, acts, slopes, delta, grad_scale: float, store) -> Params:
    """d(mean loss)/d(W, b) of every layer from the head's scaled output gradient `delta`."""

    grads: Params = [None] * len(params)  # type: ignore[list-item]
    for i in range(len(params) - 1, -1, -1):
        grads[i] = (acts[i].T @ delta / grad_scale, delta.sum(axis=0) / grad_scale)
        if i > 0:
            # slopes[i]: the activation's derivative at layer i-1's output, as the device reads it
            delta = store((delta @ store(params[i][0]).T) * slopes[i])
    return grads


def sgd_step(
    params: Params, grads: Params, lr: float, momentum: float = 0.0, velocity: Params | None = None
) -> tuple[Params, Params | None]:
    """One SGD update, returning new arrays (inputs are never modified).

    momentum == 0: ``W - lr*G`` and the velocity is passed through unchanged.
    momentum > 0: ``V = momentum*V + G; W - lr*V`` (PyTorch's form, no dampening), V starting at 0.
    """
    if momentum == 0.0:
        new = [(_f64(w) - lr * _f64(gw), _f64(b) - lr * _f64(gb)) for (w, b), (gw, gb) in zip(params, grads)]
        return new, velocity
    if velocity is None:
        velocity = [(np.zeros_like(_f64(w)), np.zeros_like(_f64(b))) for w, b in params]
    new_v = [
        (momentum * _f64(vw) + _f64(gw), momentum * _f64(vb) + _f64(gb)) for (vw, vb), (gw, gb) in zip(velocity, grads)
    ]
    new_p = [(_f64(w) - lr * vw, _f64(b) - lr * vb) for (w, b), (vw, vb) in zip(params, new_v)]
    return new_p, new_v


def optimizer_step(params: Params, grads: Params, recipe, lr: float, state: dict[str, Params] | None, step: int
                   ) -> tuple[Params, dict[str, Params]]:
    """One update by the recipe's optimiser, torch.optim's arithmetic in float64: SGD (momentum, Nesterov, L2 weight
    decay), Adam (L2) and AdamW (decoupled), with Adam's bias corrections of step `step` (from 0). state: {"m":
    momentum or first moment, "v": second moment} per layer as (W, b), None before the first step."""
    opt, wd = recipe.optimizer, recipe.weight_decay
    state = state or {}
    zeros = [(np.zeros_like(_f64(w)), np.zeros_like(_f64(b))) for w, b in params]
    new_p, new_m, new_v = [], [], []
    for i, ((w, b), (gw, gb)) in enumerate(zip(params, grads)):
        out_p, out_m, out_v = [], [], []
        for k, (p, g) in enumerate(((w, gw), (b, gb))):
            p, g = _f64(p), _f64(g)
            m = _f64(state.get("m", zeros)[i][k])
            v = _f64(state.get("v", zeros)[i][k])
            if opt == "adamw":
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
            if opt == "sgd":
                if recipe.momentum > 0:
                    m = recipe.momentum * m + g
                    g = g + recipe.momentum * m if recipe.nesterov else m
                p = p - lr * g
            else:
                t = step + 1
                m = recipe.beta1 * m + (1 - recipe.beta1) * g
                v = recipe.beta2 * v + (1 - recipe.beta2) * g * g
                denom = np.sqrt(v / (1 - recipe.beta2 ** t)) + recipe.eps
                p = p - lr * (m / (1 - recipe.beta1 ** t)) / denom
            out_p.append(p), out_m.append(m), out_v.append(v)
        new_p.append(tuple(out_p)), new_m.append(tuple(out_m)), new_v.append(tuple(out_v))
    kept = {"m": new_m, "v": new_v} if opt != "sgd" else {"m": new_m} if recipe.momentum > 0 else {}
    return new_p, kept


def adam_apply(params: Params, state: dict[str, Params], recipe, lr: float, step: int) -> Params:
    """The parameters after Adam's step of `step` (from 0) given its new moments `state` ({"m", "v"}): what the
    optimiser does with the moments, in float64 (AdamW's decoupled decay first)."""
    t, decay = step + 1, (1 - lr * recipe.weight_decay) if recipe.optimizer == "adamw" else 1.0
    out = []
    for (w, b), mw, vw in zip(params, state["m"], state["v"]):
        out.append(tuple(_f64(p) * decay - lr / (1 - recipe.beta1 ** t) * _f64(m)
                         / (np.sqrt(_f64(v) / (1 - recipe.beta2 ** t)) + recipe.eps)
                         for p, m, v in zip((w, b), mw, vw)))
    return out


def train_steps(
    params: Params,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    lr: float,
    momentum: float = 0.0,
    lr_fn: Callable[[int], float] | None = None,
) -> tuple[Params, Params | None, list[float]]:
    """Run one SGD step per ``(x, labels)`` batch; ``lr_fn(step)`` replaces ``lr`` when given.

    Returns the final params, the final velocity (None without momentum) and each step's loss,
    computed on that step's batch before its update.
    """
    params = [(_f64(w), _f64(b)) for w, b in params]
    velocity: Params | None = None
    losses: list[float] = []
    for step, (x, labels) in enumerate(batches):
        loss, _, grads = loss_and_grads(params, x, labels)
        losses.append(loss)
        params, velocity = sgd_step(params, grads, lr_fn(step) if lr_fn else lr, momentum, velocity)
    return params, velocity, losses


def relative(a, b) -> float:
    """||a - b|| / ||b|| (b's norm at least 1e-30)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def update_errors(got: Params, expect: Params, start: Params) -> list[float]:
    """Per layer, the relative error of the parameter change from `start` (W and b, the worse of the two)."""
    return [max(relative(w - w0, ew - w0), relative(b - b0, eb - b0))
            for (w, b), (ew, eb), (w0, b0) in zip(got, expect, start)]


ADAM_ARITHMETIC = 1e-5  # Adam's weight change against float64 arithmetic on the GPU's own new moments


def applied_errors(got: Params, expect: Params, start: Params) -> list[float]:
    """Per layer, Adam's applied change against float64 arithmetic (W's and b's worse), as a fraction of what
    ADAM_ARITHMETIC allows: the change's relative error, where the float64 result rounded to fp32 (what any fp32
    parameter can hold) meets ADAM_ARITHMETIC; where even that misses it (a change of only some thousand ulps of its
    parameter: the bias of a nearly fitted output), the error over that correctly rounded result's own, so that no
    fp32 update can do better than the check asks."""
    def err(g, e, s):
        e, change = _f64(e), np.linalg.norm(_f64(e) - s)
        rounded = np.linalg.norm(e.astype(np.float32).astype(np.float64) - e) / max(change, 1e-30)
        return relative(g - s, e - s) * min(1.0, ADAM_ARITHMETIC / max(rounded, 1e-300))
    return [max(err(w, ew, w0), err(b, eb, b0)) for (w, b), (ew, eb), (w0, b0) in zip(got, expect, start)]


def applied_detail(before: Params, after: Params, state: dict, recipe, step: int) -> str:
    """Where Adam's applied change differs most from float64 on the GPU's moments: per layer, W's and b's relative
    errors, and at the worst element its change, the expected change, m, v and the parameter (a failure's message)."""
    expect = adam_apply(before, state, recipe, recipe.lr, step)
    parts = []
    for i, ((w, b), (ew, eb), (w0, b0)) in enumerate(zip(after, expect, before)):
        for name, got, want, start, m, v in (("W", w, ew, w0, state["m"][i][0], state["v"][i][0]),
                                             ("b", b, eb, b0, state["m"][i][1], state["v"][i][1])):
            d = np.abs(_f64(got) - want).ravel()
            k = int(d.argmax())
            rounded = relative(want.astype(np.float32).astype(np.float64) - start, want - start)
            parts.append(f"layer {i} {name}: {relative(got - start, want - start):.2e}, fp32's own {rounded:.2e} "
                         f"(worst: change "
                         f"{(_f64(got) - start).ravel()[k]:.3e} vs {(want - start).ravel()[k]:.3e}, m "
                         f"{_f64(m).ravel()[k]:.3e}, v {_f64(v).ravel()[k]:.3e}, p {_f64(start).ravel()[k]:.4g})")
    return "; ".join(parts)


def step_errors(before: Params, after: Params, state_before: dict, state_after: dict, expect: Params,
                expect_state: dict, recipe, lr: float, step: int) -> tuple[list[float], list[float] | None]:
    """One GPU step against the reference's, per layer: with SGD the weights' change; with Adam the moments' change
    (the second's halved: it is quadratic in the gradient) and, second, the weights' change against float64
    arithmetic on the GPU's own new moments (applied_errors, bounded by ADAM_ARITHMETIC; tests/test_mlp.py's
    docstring says why; None for SGD)."""
    if recipe.optimizer == "sgd":
        return update_errors(after, expect, before), None
    moments = [update_errors(state_after[k], expect_state[k], state_before[k]) for k in ("m", "v")]
    applied = applied_errors(after, adam_apply(before, state_after, recipe, lr, step), before)
    return [max(m, v / 2) for m, v in zip(*moments)], applied
