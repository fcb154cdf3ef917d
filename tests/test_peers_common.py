"""CPU tests for scripts/peers: the batch order and recipe every peer trains on, and the JAX peer's optimiser."""

from __future__ import annotations

import numpy as np
import pytest

from peers.common import OPTIMIZERS, TRAIN_ROWS, Workload, step_indices  # scripts/ is on pytest's pythonpath


def test_length_and_dtype():
    idx = step_indices(5000, 32, 0)
    assert idx.shape == (5000 * 32,) and idx.dtype == np.int32
    assert step_indices(0, 32).shape == (0,)


@pytest.mark.parametrize("batch", [32, 7, TRAIN_ROWS])
def test_each_epoch_is_a_permutation_cut_to_whole_batches(batch):
    per_epoch = TRAIN_ROWS // batch * batch
    extra = min(5, per_epoch // batch - 1)
    steps = 3 * (per_epoch // batch) + extra  # three full epochs and a bit of a fourth
    idx = step_indices(steps, batch, 1)
    rng = np.random.default_rng(1)
    for e in range(3):
        epoch = idx[e * per_epoch:(e + 1) * per_epoch]
        assert len(np.unique(epoch)) == per_epoch and epoch.min() >= 0 and epoch.max() < TRAIN_ROWS
        np.testing.assert_array_equal(epoch, rng.permutation(TRAIN_ROWS)[:per_epoch])  # rawgpu's trainer order
    np.testing.assert_array_equal(idx[3 * per_epoch:], rng.permutation(TRAIN_ROWS)[:extra * batch])


def test_deterministic_and_seeded():
    np.testing.assert_array_equal(step_indices(100, 32, 3), step_indices(100, 32, 3))
    assert not np.array_equal(step_indices(100, 32, 3), step_indices(100, 32, 4))


def test_longer_runs_extend_shorter_ones():
    """Warm-up and timed runs index one buffer sized for the longer of the two, so prefixes must agree."""
    np.testing.assert_array_equal(step_indices(2000, 32)[:50 * 32], step_indices(50, 32))


def test_bad_arguments():
    with pytest.raises(ValueError):
        step_indices(10, 0)
    with pytest.raises(ValueError):
        step_indices(-1, 32)
    with pytest.raises(ValueError, match="warmup_steps"):
        Workload(hidden=256, warmup_steps=0)


def test_mnist_arrays_flattens_and_copies(monkeypatch):
    """Images come back [N, 784] and writable even when the loader hands out read-only views."""
    from types import SimpleNamespace

    from peers.common import mnist_arrays

    import rawgpu.data.datasets

    def ro(a):
        a.setflags(write=False)
        return a

    fake = SimpleNamespace(train_images=ro(np.zeros((3, 28, 28), np.uint8)), train_labels=ro(np.arange(3, dtype=np.uint8)),
                           test_images=ro(np.ones((2, 784), np.uint8)), test_labels=ro(np.arange(2, dtype=np.uint8)))
    seen = []
    monkeypatch.setattr(rawgpu.data.datasets, "load_mnist", lambda d=None: seen.append(d) or fake)
    arrays = mnist_arrays("somewhere")
    assert seen == ["somewhere"]
    assert [a.shape for a in arrays] == [(3, 784), (3,), (2, 784), (2,)]
    assert all(a.dtype == np.uint8 and a.flags.writeable for a in arrays)


def test_learning_rates_are_rawgpus_step_for_step():
    from rawgpu.kernels.gather import lr_at

    w = Workload(hidden=256, steps=3744, batch=128, lr=0.05, momentum=0.9, schedule="cosine")
    lrs = w.learning_rates()
    assert lrs.dtype == np.float32 and len(lrs) == w.index_steps
    assert [float(lrs[s]) for s in (0, 1000, 3743)] == [lr_at(s, 0.05, 0.0, 3744, 0, "cosine") for s in (0, 1000, 3743)]
    assert lrs[0] == np.float32(0.05) and 0 < lrs[-1] < 1e-6 and np.all(np.diff(lrs) <= 0)
    assert np.all(Workload(hidden=256).learning_rates() == np.float32(0.003))


@pytest.mark.parametrize("fields, message", [
    ({"momentum": 1.0}, "momentum"), ({"momentum": -0.1}, "momentum"), ({"schedule": "step"}, "schedule"),
    ({"optimizer": "lamb"}, "optimizer must be one of sgd, adam, adamw"),
    ({"nesterov": True}, "nesterov needs optimizer 'sgd' with momentum > 0"),
    ({"nesterov": True, "momentum": 0.9, "optimizer": "adam"}, "nesterov"),
    ({"betas": (0.9, 1.0)}, "betas"), ({"betas": (-0.1, 0.999)}, "betas"), ({"betas": (0.9,)}, "betas"),
    ({"eps": 0.0}, "eps must be > 0"), ({"weight_decay": -1e-4}, "weight_decay must be >= 0")])
def test_bad_recipes(fields, message):
    with pytest.raises(ValueError, match=message):
        Workload(hidden=256, **fields)


def test_optimizer_recipes():
    assert OPTIMIZERS == ("sgd", "adam", "adamw")
    w = Workload(hidden=256)
    assert (w.optimizer, w.nesterov, w.betas, w.eps, w.weight_decay) == ("sgd", False, (0.9, 0.999), 1e-8, 0.0)
    Workload(hidden=256, momentum=0.9, nesterov=True, weight_decay=5e-4)
    # momentum is sgd's: a recipe's value passes through adam and adamw untouched, as the bench hands it over
    assert Workload(hidden=256, optimizer="adamw", momentum=0.9, betas=[0.8, 0.99]).betas == (0.8, 0.99)
    assert [Workload(hidden=256, **f).state_bytes_per_weight() for f in
            ({}, {"momentum": 0.9}, {"optimizer": "adam", "momentum": 0.9}, {"optimizer": "adamw"})] == [0, 4, 8, 8]


def _torch_reference(w: Workload, params, grads, lrs):
    """float64 numpy of torch.optim's SGD / Adam / AdamW step (step_t counted from 1), over len(grads) steps."""
    mu, wd, (b1, b2), eps = w.momentum, w.weight_decay, w.betas, w.eps
    p = [x.astype(np.float64) for x in params]
    buf = [np.zeros_like(x) for x in p]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        for i, g in enumerate(gs):
            g = g.astype(np.float64)
            if w.optimizer == "adamw":
                p[i] = p[i] * (1 - lr * wd)
            elif wd:
                g = g + wd * p[i]
            if w.optimizer == "sgd":
                if mu:
                    buf[i] = g if t == 1 else mu * buf[i] + g
                    g = g + mu * buf[i] if w.nesterov else buf[i]
                p[i] = p[i] - lr * g
            else:
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                p[i] = p[i] - lr * (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps)
    return p


RECIPES = [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=5e-4), dict(weight_decay=0.01),
           dict(optimizer="adam"), dict(optimizer="adam", weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6),
           dict(optimizer="adamw", weight_decay=0.01), dict(optimizer="adamw", weight_decay=0.1, momentum=0.9)]


@pytest.mark.parametrize("use_optax", [True, False], ids=["optax", "jax.numpy"])
@pytest.mark.parametrize("fields", RECIPES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "sgd")
def test_jax_optimizer_is_torchs(fields, use_optax):
    """Three jitted steps of the JAX peer's update, lr changing per step, against torch's formulas in float64."""
    jax = pytest.importorskip("jax", reason="jax is not installed: the JAX peer's optimiser cannot be tested")
    # A CPU test: on a GPU, JAX would take most of the GPU's memory up front and keep it until this process ends,
    # and the GPU tests beside it (pytest-xdist's other workers) would run out of memory.
    jax.config.update("jax_platforms", "cpu")
    if use_optax:
        pytest.importorskip("optax", reason="optax is not installed: only the jax.numpy optimiser can be tested")
    import jax.numpy as jnp

    from peers.jax_peers import _optimizer

    w = Workload(hidden=4, **fields)
    rng = np.random.default_rng(7)
    shapes = [(5, 4), (4,), (4, 3), (3,)]
    params = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [[rng.normal(scale=0.1, size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    lrs = np.array([0.05, 0.03, 0.01], np.float32)
    init_state, update = _optimizer(jax, jnp, w, use_optax=use_optax)
    step = jax.jit(update)
    ps, state = [jnp.asarray(x) for x in params], init_state([jnp.asarray(x) for x in params])
    for gs, lr in zip(grads, lrs):
        ps, state = step(ps, state, [jnp.asarray(g) for g in gs], jnp.asarray(lr))
    want = _torch_reference(w, params, grads, lrs.astype(np.float64))
    for got, ref, p0 in zip(ps, want, params):
        assert got.dtype == jnp.float32 and not np.allclose(ref, p0, rtol=0, atol=1e-4)  # the steps moved it
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_a_workload_of_a_width_per_layer_names_its_layers():
    assert Workload(hidden=256).widths == (784, 256, 256, 256, 10)  # the benchmark's 784-H-H-H-10
    w = Workload(hidden=[1024, 512, 256])
    assert w.hidden == (1024, 512, 256) and w.widths == (784, 1024, 512, 256, 10)
    with pytest.raises(ValueError, match="hidden must be >= 1, got 0"):
        Workload(hidden=(512, 0))
    with pytest.raises(ValueError, match="at least one width"):
        Workload(hidden=())


def test_bench_train_times_each_size_or_the_one_hidden_architecture():
    from argparse import Namespace

    import bench  # scripts/bench.py

    assert bench.train_sizes(Namespace(sizes=[128, 256], hidden=None)) == [128, 256]
    assert bench.train_sizes(Namespace(sizes=[128], hidden=[1024, 512, 256])) == [(1024, 512, 256)]
    assert bench.train_sizes(Namespace(sizes=[128], hidden=[512])) == [512]
    assert bench.rawgpu_recipe((1024, 512, 256), bench.RECIPES["default"], 10, 0).name == "784-1024-512-256-10"
