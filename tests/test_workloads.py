"""The benchmark's generated workloads (scripts/benchmarks/workloads.py): their shapes, dtypes and targets, the same
arrays for the same seed, and targets a model can learn."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.workloads import WORKLOADS, generate


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_each_workload_has_its_shape_and_a_learnable_target(name):
    w = WORKLOADS[name]
    x, y, xt, yt = generate(w, seed=3, rows=4000)
    assert x.shape == (3600, w.features) and xt.shape == (400, w.features) and x.dtype == np.dtype(w.dtype)
    assert np.isfinite(x.astype(np.float64)).all()
    again = generate(w, seed=3, rows=4000)
    assert np.array_equal(again[0], x) and np.array_equal(again[1], y), "the same arrays for the same seed"
    assert not np.array_equal(generate(w, seed=4, rows=4000)[1], y)
    if w.classes:
        assert y.dtype == np.int32 and y.min() >= 0 and y.max() < w.classes
        if w.classes <= 100:
            assert len(np.unique(y)) > w.classes // 2, "labels spread over the classes"
    else:
        assert y.shape == (3600, w.outputs) and y.dtype == np.float32 and np.isfinite(y).all() and y.std() > 0.1


def test_the_table_rows_are_the_issues():
    assert {n: (w.rows, w.features, w.dtype, w.classes) for n, w in WORKLOADS.items()} == {
        "covertype-like": (581_012, 54, "float32", 7), "higgs-like": (11_000_000, 28, "float32", 2),
        "embeddings": (1_000_000, 768, "float16", 1000), "cifar100-like": (50_000, 3072, "uint8", 100),
        "regression": (1_000_000, 8, "float32", 0)}
