"""CPU tests for scripts/peers/common.py: the batch order every peer trains on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from peers.common import TRAIN_ROWS, Workload, step_indices


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

    import rawgpu.data

    def ro(a):
        a.setflags(write=False)
        return a

    fake = SimpleNamespace(train_images=ro(np.zeros((3, 28, 28), np.uint8)), train_labels=ro(np.arange(3, dtype=np.uint8)),
                           test_images=ro(np.ones((2, 784), np.uint8)), test_labels=ro(np.arange(2, dtype=np.uint8)))
    seen = []
    monkeypatch.setattr(rawgpu.data, "load_mnist", lambda d=None: seen.append(d) or fake)
    arrays = mnist_arrays("somewhere")
    assert seen == ["somewhere"]
    assert [a.shape for a in arrays] == [(3, 784), (3,), (2, 784), (2,)]
    assert all(a.dtype == np.uint8 and a.flags.writeable for a in arrays)


def test_learning_rates_are_rawgpus_step_for_step():
    from rawgpu.kernels.data import lr_at

    w = Workload(hidden=256, steps=3744, batch=128, lr=0.05, momentum=0.9, schedule="cosine")
    lrs = w.learning_rates()
    assert lrs.dtype == np.float32 and len(lrs) == w.index_steps
    assert [float(lrs[s]) for s in (0, 1000, 3743)] == [lr_at(s, 0.05, 0.0, 3744, 0, "cosine") for s in (0, 1000, 3743)]
    assert lrs[0] == np.float32(0.05) and 0 < lrs[-1] < 1e-6 and np.all(np.diff(lrs) <= 0)
    assert np.all(Workload(hidden=256).learning_rates() == np.float32(0.003))


@pytest.mark.parametrize("field, value, message", [("momentum", 1.0, "momentum"), ("momentum", -0.1, "momentum"),
                                                   ("schedule", "step", "schedule")])
def test_bad_recipes(field, value, message):
    with pytest.raises(ValueError, match=message):
        Workload(hidden=256, **{field: value})
