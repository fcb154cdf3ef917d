"""JAX peers: the same training step jitted and driven from Python, and all steps in one jitted fori_loop.

Parameters are fp32 masters cast to fp16 for the forward (what autocast does in torch); the loss is taken in
fp32. The dataset, the batch order and the learning rate of every step live on the GPU and each step gathers its
batch inside the compiled code, so the timed loop copies nothing from the host and never waits for the GPU. The
optimiser (SGD, Adam or AdamW, as torch.optim defines them) is built from optax's transforms where optax is
importable, else the same update in jax.numpy.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import NamedTuple

import numpy as np

from .common import LOSS_TAIL, PeerResult, Workload, features, step_indices

SYSTEMS = ("jax-jit", "jax-fori")


def _jax():
    """Import jax without letting it grab 75% of GPU memory, so torch peers in the same process still fit."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # only effective before the backend starts
    import jax
    import jax.numpy as jnp

    return jax, jnp


def available() -> str | None:
    """None if jax can run on a GPU here, else why not."""
    try:
        jax, _ = _jax()
    except ImportError as exc:
        return f"jax is not importable: {exc}"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:  # no CUDA plugin / jaxlib, or it failed to start
        return f"jax {jax.__version__} has no GPU backend: {exc}"
    return None if gpus else f"jax {jax.__version__} sees no GPU"


def run(system: str, w: Workload, data) -> PeerResult:
    """Warm up, re-initialise, then time w.steps steps of `system`; data is common.mnist_arrays(), or a table's
    (x_train, y_train, x_test, y_test) of w's shape."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown jax system {system!r}; expected one of {', '.join(SYSTEMS)}")
    w.check_data(data)
    if (reason := available()) is not None:
        raise RuntimeError(f"{system}: {reason}")
    jax, jnp = _jax()
    dev = jax.devices("gpu")[0]
    train_x, train_y, test_x, test_y = data
    order = step_indices(w.index_steps, w.batch, w.seed, w.train_rows)
    # labels converted once (a regression's values standardized as rawgpu's); the learning rate of every step, as
    # rawgpu computes it; the features' standardization, () for none
    targets = (lambda y: w.targets(y)) if w.regression else (lambda y: y.astype(np.int32))
    scaling = w.scaling or ()
    arrays = jax.device_put((train_x, targets(train_y), order, w.learning_rates(), scaling), dev)
    params0 = (_init_params(jax, jnp, w.widths, w.seed) if w.init is None
               else [(jnp.asarray(wt), jnp.asarray(b)) for wt, b in w.init])
    init = jax.device_put(params0, dev)
    progs = _programs(jax, jnp, w)

    def fresh():
        """A private copy of the seeded init and a fresh optimiser state: the step donates (consumes) both."""
        params = jax.tree_util.tree_map(jnp.copy, init)
        return jax.block_until_ready((params, progs.init_state(params)))

    driver = {"jax-jit": _time_jit, "jax-fori": _time_fori}[system]
    (params, _), us, final_loss = driver(jax, dev, progs, fresh, arrays, w)
    score = progs.score(params, *jax.device_put((test_x, targets(test_y), scaling), dev))
    if w.regression:  # the squared errors' sum over every test value, in standardized units
        rmse = math.sqrt(float(score) / (len(test_y) * w.classes)) * w.target_scale
        return PeerResult(system, w.hidden, w.steps, us, None, final_loss, f"jax {jax.__version__}", test_rmse=rmse)
    return PeerResult(system, w.hidden, w.steps, us, int(score) / len(test_y), final_loss, f"jax {jax.__version__}")


def _init_params(jax, jnp, widths: tuple[int, ...], seed: int):
    """[(W [fan_in, fan_out], b [fan_out])] fp32 for layers of these widths (inputs ... classes), W and b ~
    U(±1/sqrt(fan_in)): torch nn.Linear's distribution."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * (len(widths) - 1))
    params = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        bound = 1.0 / math.sqrt(fan_in)
        params.append((jax.random.uniform(keys[2 * i], (fan_in, fan_out), jnp.float32, -bound, bound),
                       jax.random.uniform(keys[2 * i + 1], (fan_out,), jnp.float32, -bound, bound)))
    return params


def model_functions(jax, jnp, activation: str = "relu", loss: str = "xent"):
    """(forward(params, x) -> fp32 logits, loss(params, x, y) -> mean cross-entropy): fp16 compute from the fp32
    masters, the logits in fp32 for the softmax, as autocast does for cross_entropy (the sweep peer shares them);
    the activation between the hidden layers as torch defines it (gelu: the erf form, gelu_tanh: the tanh one).
    loss "mse": the mean squared error of the fp32 outputs against values y [B, outputs] instead."""
    f16, f32 = jnp.float16, jnp.float32
    act = {"relu": jax.nn.relu, "gelu": lambda h: jax.nn.gelu(h, approximate=False),
           "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True), "silu": jax.nn.silu, "tanh": jnp.tanh}[activation]

    def forward(params, x):
        h = x.astype(f16)
        for i, (wt, b) in enumerate(params):
            h = h @ wt.astype(f16) + b.astype(f16)
            if i < len(params) - 1:
                h = act(h)
        return h.astype(f32)

    def xent(params, x, y):
        logp = jax.nn.log_softmax(forward(params, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def mse(params, x, y):
        return jnp.mean(jnp.square(forward(params, x) - y))
    return forward, {"xent": xent, "mse": mse}[loss]


class _Programs(NamedTuple):
    step: object  # jitted ((params, state), s, arrays) -> ((params, state), s + 1, loss); both donated
    train: object  # jitted ((params, state), arrays) -> ((params, state), mean loss of the last LOSS_TAIL steps)
    score: object  # jitted (params, x, y, scaling) -> right predictions, or a regression's sum of squared errors
    init_state: object  # params -> the optimiser's initial state


def _programs(jax, jnp, w: Workload) -> _Programs:
    """The compiled functions. Arrays are always arguments, never closed over: closed-over arrays would be
    baked into the program as constants (a 47 MB dataset in every compile)."""
    f32, batch, steps = jnp.float32, w.batch, w.steps
    forward, loss_fn = model_functions(jax, jnp, w.activation, w.loss)

    init_state, update = _optimizer(jax, jnp, w)

    def one_step(carry, s, arrays):
        params, state = carry
        train_x, train_y, order, lrs, scaling = arrays
        idx = jax.lax.dynamic_slice(order, (s * batch,), (batch,))
        x = features(jnp, train_x[idx], scaling)  # float32: bytes / 255, standardized where the workload is
        loss, grads = jax.value_and_grad(loss_fn)(params, x, train_y[idx])
        return update(params, state, grads, lrs[s]), loss  # in fp32

    def step(carry, s, arrays):
        carry, loss = one_step(carry, s, arrays)
        return carry, s + 1, loss

    def train(carry, arrays):
        # A static trip count (steps is a Python int) makes fori_loop a scan, whose loop XLA runs without
        # reading the loop condition back to the host every iteration, as it must for a traced bound.
        first_tail = steps - min(steps, LOSS_TAIL)

        def body(s, loop):
            carry, acc = loop
            carry, loss = one_step(carry, s, arrays)
            return carry, acc + jnp.where(s >= first_tail, loss, 0.0)

        carry, acc = jax.lax.fori_loop(0, steps, body, (carry, jnp.zeros((), f32)))
        return carry, acc / min(steps, LOSS_TAIL)

    def score(params, x, y, scaling):
        out = forward(params, features(jnp, x, scaling))
        if w.regression:
            return jnp.sum(jnp.square(out - y))
        return jnp.sum(jnp.argmax(out, axis=1) == y)

    return _Programs(jax.jit(step, donate_argnums=0), jax.jit(train, donate_argnums=0), jax.jit(score), init_state)


def _optimizer(jax, jnp, w: Workload, use_optax: bool | None = None):
    """(init_state(params), update(params, state, grads, lr) -> (params, state)): w's optimiser with torch.optim's
    arithmetic (see Workload), lr the step's value. Built from optax's transforms as its users chain them where
    optax is importable (use_optax None; True insists, False takes the jax.numpy version of the same update).
    Adam's step count lives in the state, so the jitted step and the fori_loop carry it."""
    optax = None
    if use_optax is not False:
        try:
            import optax
        except ImportError:
            if use_optax:
                raise
    tmap = jax.tree_util.tree_map
    mu, wd, (b1, b2), eps = w.momentum, w.weight_decay, w.betas, w.eps
    sgd = w.optimizer == "sgd"
    l2 = wd > 0 and w.optimizer != "adamw"  # added to the gradient; adamw's decay is decoupled

    if optax is not None:
        parts = [optax.add_decayed_weights(wd)] if l2 else []
        if sgd:
            parts += [optax.trace(decay=mu, nesterov=w.nesterov)] if mu else []
        else:
            parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
            if wd > 0 and not l2:
                parts.append(optax.add_decayed_weights(wd))  # -lr (adam + wd w): torch's w *= 1 - lr wd, then adam
        tx = optax.chain(*parts) if parts else optax.identity()  # plain SGD: chain() wants one at least

        def update(params, state, grads, lr):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, tmap(lambda u: -lr * u, updates)), state
        return tx.init, update

    def init_state(params):
        if sgd:
            return tmap(jnp.zeros_like, params) if mu else ()
        return jnp.zeros((), jnp.int32), tmap(jnp.zeros_like, params), tmap(jnp.zeros_like, params)

    def update(params, state, grads, lr):
        if l2:
            grads = tmap(lambda g, p: g + wd * p, grads, params)
        if sgd:
            step = grads
            if mu:
                state = tmap(lambda v, g: mu * v + g, state, grads)
                step = tmap(lambda g, v: g + mu * v, grads, state) if w.nesterov else state
        else:
            count, m, v = state
            t = count + 1
            m = tmap(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
            v = tmap(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
            c1, c2 = 1 - b1 ** t, 1 - b2 ** t
            step = tmap(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), m, v)
            if wd > 0 and not l2:
                step = tmap(lambda u, p: u + wd * p, step, params)
            state = (t, m, v)
        return tmap(lambda p, u: p - lr * u, params, step), state
    return init_state, update


def _time_jit(jax, dev, progs: _Programs, fresh, arrays, w: Workload):
    """Python loop over the jitted step; the step counter stays on the device, so each call copies nothing in."""

    def loop(steps: int):
        carry, s, tail = fresh(), jax.device_put(np.int32(0), dev), []
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        for i in range(steps):
            carry, s, loss = progs.step(carry, s, arrays)
            if i >= steps - LOSS_TAIL:
                tail.append(loss)  # device arrays: no host read inside the loop
        jax.block_until_ready((carry, tail))
        return carry, time.perf_counter() - t0, tail

    loop(w.warmup_steps)  # compiles on the first call
    carry, seconds, tail = loop(w.steps)
    return carry, seconds * 1e6 / w.steps, float(jax.numpy.mean(jax.numpy.stack(tail)))


def _time_fori(jax, dev, progs: _Programs, fresh, arrays, w: Workload):
    """One call runs all steps. The program is compiled for exactly w.steps, so the warm-up is one full run
    (compile included); the timed run starts again from the seeded init."""
    jax.block_until_ready(progs.train(fresh(), arrays))
    carry0 = fresh()
    t0 = time.perf_counter()
    carry, tail_loss = jax.block_until_ready(progs.train(carry0, arrays))
    return carry, (time.perf_counter() - t0) * 1e6 / w.steps, float(tail_loss)
