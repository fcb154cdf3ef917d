"""Peers for many models at once: N copies of one MLP, each with its own seed (its init and its batch order) and its
own learning rate, trained together as their frameworks offer it.

  jax-vmap    the one-model step of jax_peers, vmapped over stacked parameters, optimiser states, batch orders and
              learning rates; every timed step in one jitted fori_loop
  torch-func  torch.func: stack_module_state, vmap(grad(loss)) through functional_call, and the optimiser's update
              over the stacked tensors (each model's lr a row of one tensor); the whole step one CUDA graph

Each model trains as the one-model peers train it (common.Workload: same batch order, same per-step learning rates,
fp16 compute, fp32 masters, torch.optim's arithmetic); its init is its framework's nn.Linear distribution from its
own seed. The other optimiser settings are one per sweep: optax's and torch.optim's transforms take them as Python
numbers, not per model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .common import CLASSES, INPUTS, LOSS_TAIL, Workload, step_indices

SYSTEMS = ("jax-vmap", "torch-func")


@dataclass(frozen=True)
class Sweep:
    """N models of `base`'s architecture and recipe: model i has seed seeds[i] and learning rate lrs[i]."""

    base: Workload
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seeds or len(self.seeds) != len(self.lrs):
            raise ValueError(f"a sweep needs one seed and one lr per model, got {len(self.seeds)} and {len(self.lrs)}")

    @property
    def models(self) -> int:
        return len(self.seeds)

    def workload(self, i: int) -> Workload:
        """Model i alone, as the one-model peers would train it."""
        return replace(self.base, seed=self.seeds[i], lr=self.lrs[i], init=None)

    def orders(self) -> np.ndarray:
        """int32 [N, index_steps, batch]: every model's rows of every step (common.step_indices of its seed)."""
        b = self.base
        return np.stack([step_indices(b.index_steps, b.batch, s).reshape(b.index_steps, b.batch) for s in self.seeds])

    def learning_rates(self) -> np.ndarray:
        """float32 [N, index_steps]: every model's lr of every step."""
        return np.stack([self.workload(i).learning_rates() for i in range(self.models)])


@dataclass
class SweepResult:
    system: str
    models: int
    hidden: int
    steps: int
    us_per_step: float  # all N models' step
    accuracies: list[float]  # test accuracy of each model
    note: str = ""


def available(system: str) -> str | None:
    from . import jax_peers, torch_peers

    return (jax_peers if system == "jax-vmap" else torch_peers).available()


def run(system: str, sweep: Sweep, data) -> SweepResult:
    """Warm up, start again from the init, then time sweep.base.steps steps of all N models."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown sweep system {system!r}; expected one of {', '.join(SYSTEMS)}")
    if (why := available(system)) is not None:
        raise RuntimeError(f"{system}: {why}")
    return (_jax_vmap if system == "jax-vmap" else _torch_func)(sweep, data)


# --- JAX ----------------------------------------------------------------------------------------------------------

def _jax_vmap(sweep: Sweep, data) -> SweepResult:
    import time

    from .jax_peers import _init_params, _jax, _optimizer, model_functions

    jax, jnp = _jax()
    dev = jax.devices("gpu")[0]
    w, f32 = sweep.base, jnp.float32
    train_x, train_y, test_x, test_y = data
    arrays = jax.device_put((train_x, train_y.astype(np.int32)), dev)
    per_model = jax.device_put((sweep.orders(), sweep.learning_rates()), dev)
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    init = jax.device_put(jax.tree_util.tree_map(stack, *[_init_params(jax, jnp, w.widths, s) for s in sweep.seeds]),
                          dev)
    init_state, update = _optimizer(jax, jnp, w)

    forward, loss_fn = model_functions(jax, jnp, w.activation)

    def one_model_step(params, state, order, lrs, s, train_x, train_y):
        idx = order[s]
        loss, grads = jax.value_and_grad(loss_fn)(params, train_x[idx].astype(f32) / 255.0, train_y[idx])
        params, state = update(params, state, grads, lrs[s])
        return params, state, loss

    step = jax.vmap(one_model_step, in_axes=(0, 0, 0, 0, None, None, None))
    steps, first_tail = w.steps, w.steps - min(w.steps, LOSS_TAIL)

    def train(carry, arrays, per_model):
        train_x, train_y = arrays
        order, lrs = per_model

        def body(s, loop):
            params, state, acc = loop
            params, state, loss = step(params, state, order, lrs, s, train_x, train_y)
            return params, state, acc + jnp.where(s >= first_tail, loss, 0.0)

        params, state = carry
        params, state, acc = jax.lax.fori_loop(0, steps, body, (params, state, jnp.zeros(sweep.models, f32)))
        return (params, state), acc / min(steps, LOSS_TAIL)

    train = jax.jit(train, donate_argnums=0)
    correct = jax.jit(jax.vmap(lambda p, x, y: jnp.sum(jnp.argmax(forward(p, x.astype(f32) / 255.0), axis=1) == y),
                               in_axes=(0, None, None)))

    def fresh():
        params = jax.tree_util.tree_map(jnp.copy, init)
        return jax.block_until_ready((params, jax.vmap(init_state)(params)))

    jax.block_until_ready(train(fresh(), arrays, per_model))  # compiles; the timed run starts again from the init
    carry = fresh()
    t0 = time.perf_counter()
    (params, _), _ = jax.block_until_ready(train(carry, arrays, per_model))
    us = (time.perf_counter() - t0) * 1e6 / steps
    hits = np.asarray(correct(params, jax.device_put(test_x, dev), jax.device_put(test_y.astype(np.int32), dev)))
    return SweepResult("jax-vmap", sweep.models, w.hidden, steps, us, (hits / len(test_y)).tolist(),
                       f"jax {jax.__version__}")


# --- PyTorch ------------------------------------------------------------------------------------------------------

def _torch_func(sweep: Sweep, data) -> SweepResult:
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    from .torch_peers import GRAPH_WARMUP, _time, _upload, mlp

    w, dev, N = sweep.base, torch.device("cuda"), sweep.models
    train_x, train_y, test_x, test_y = data
    x_all, y_all = _upload(train_x, dev), _upload(train_y, dev).long()
    orders = _upload(sweep.orders(), dev).long()  # [N, steps, batch]
    lrs = _upload(sweep.learning_rates(), dev)  # [N, steps]
    models = []
    for seed in sweep.seeds:
        torch.manual_seed(seed)
        models.append(mlp(nn, w.widths, w.activation).to(dev))
    stacked, buffers = stack_module_state(models)
    # every model's parameters as one row of a flat fp32 buffer [N, P], the dict's tensors views into it: the update
    # then runs over all parameters of all models in a few kernels, each model's lr broadcast along its row
    flat = torch.cat([v.detach().reshape(N, -1) for v in stacked.values()], dim=1)
    params, at = {}, 0
    for k, v in stacked.items():
        n = v[0].numel()
        params[k] = flat[:, at:at + n].view(v.shape)
        at += n
    init = flat.clone()
    base = copy.deepcopy(models[0]).to("meta")

    def loss_fn(p, b, x, y):
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            return F.cross_entropy(functional_call(base, (p, b), (x,)), y)

    grads_of = vmap(grad_and_value(loss_fn), in_dims=(0, 0, 0, 0))
    update = _FlatUpdate(w, flat)
    pos = torch.zeros(1, dtype=torch.long, device=dev)

    def one_step() -> None:
        idx = orders[:, pos].squeeze(1)  # [N, batch]
        grads, _ = grads_of(params, buffers, x_all[idx].float().div_(255), y_all[idx])
        update.step(torch.cat([g.reshape(N, -1) for g in grads.values()], dim=1), lrs[:, pos])
        pos.add_(1)

    def reset() -> None:
        flat.copy_(init)
        update.zero()
        pos.zero_()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(GRAPH_WARMUP):
            one_step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_step()
        for _ in range(max(0, w.warmup_steps - 1)):
            graph.replay()
        reset()
        us = _time(lambda n: [graph.replay() for _ in range(n)], w.steps)
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            test = _upload(test_x, dev).float().div_(255)
            logits = vmap(lambda p, b: functional_call(base, (p, b), (test,)))(params, buffers)
    accuracies = (logits.argmax(dim=2) == _upload(test_y, dev).long()).float().mean(dim=1).tolist()
    return SweepResult("torch-func", N, w.hidden, w.steps, us, accuracies, f"torch {torch.__version__}, CUDA graph")


class _FlatUpdate:
    """torch.optim's SGD (momentum, nesterov, L2 decay), Adam and AdamW over every model's parameters as one flat
    buffer [N, P], each model's lr [N, 1] broadcast along its row: common.Workload's arithmetic, in place, a few
    kernels per step, so a CUDA graph captures it."""

    def __init__(self, w: Workload, flat) -> None:
        import torch

        self.w, self.p, self.t = w, flat, torch.zeros((), device=flat.device)
        states = 0 if w.optimizer == "sgd" and not w.momentum else 1 if w.optimizer == "sgd" else 2
        self.m = torch.zeros_like(flat) if states >= 1 else None
        self.v = torch.zeros_like(flat) if states == 2 else None

    def zero(self) -> None:
        self.t.zero_()
        for t in (self.m, self.v):
            if t is not None:
                t.zero_()

    def step(self, g, lr) -> None:
        w, p = self.w, self.p
        mu, wd, (b1, b2), eps = w.momentum, w.weight_decay, w.betas, w.eps
        if wd and w.optimizer != "adamw":
            g = g.add(p, alpha=wd)
        if w.optimizer == "sgd":
            step = g
            if mu:
                self.m.mul_(mu).add_(g)
                step = g.add(self.m, alpha=mu) if w.nesterov else self.m
        else:
            self.t.add_(1)
            if wd:  # adamw: decoupled, before the moments
                p.mul_(1 - lr * wd)
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            step = (self.m / (1 - b1 ** self.t)) / ((self.v / (1 - b2 ** self.t)).sqrt_().add_(eps))
        p.sub_(lr * step)


def floor_bytes_per_weight(w: Workload) -> int:
    """What the weight-traffic floor counts per weight and step: an fp32 master read and written and its fp16 copy
    (12 B), and each fp32 optimiser value read and written."""
    return 12 + 2 * w.state_bytes_per_weight()


def parameters(hidden: int, layers: int = 3) -> int:
    widths = [INPUTS] + [hidden] * layers + [CLASSES]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def lr_grid(center: float, count: int) -> list[float]:
    """`count` learning rates spread log-evenly over [center / 4, center * 4] (center alone for one)."""
    if count == 1:
        return [center]
    return [center * 4 ** (2 * i / (count - 1) - 1) for i in range(count)]

