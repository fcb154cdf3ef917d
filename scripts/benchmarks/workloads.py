"""The benchmark's workloads of real shapes (issue 64's table), generated deterministically: no download, the same
arrays on every machine for the same seed.

Each is a table of float (or uint8) features with a target a small MLP can learn but not memorise: a random teacher
network (one hidden layer of 64 tanh units) maps the features to logits or values, and the labels are its argmax
(classes) or its output plus noise (regression). Feature columns carry their own scale and offset, so that
standardization matters as it does on real tables. The test set is the first 10% of the rows (at most 100,000), the
training set the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TEACHER_HIDDEN = 64
CHUNK = 1 << 18  # rows generated at a time: an 11M-row table never holds a float64 copy


@dataclass(frozen=True)
class Workload:
    """One row of the table: `rows` x `features` of `dtype`, `classes` labels or `outputs` values."""

    name: str
    rows: int
    features: int
    dtype: str  # float32, float16 or uint8
    classes: int = 0  # 0: regression
    outputs: int = 1
    hidden: tuple[int, ...] = (256,)
    recipe: str = "default"
    batch: int | None = None
    loss: str = "xent"

    @property
    def test_rows(self) -> int:
        return min(100_000, self.rows // 10)


WORKLOADS = {w.name: w for w in (
    Workload("covertype-like", 581_012, 54, "float32", classes=7, hidden=(256, 1024)),
    Workload("higgs-like", 11_000_000, 28, "float32", classes=2, hidden=(512,), batch=1024),
    Workload("embeddings", 1_000_000, 768, "float16", classes=1000, hidden=(1024,), recipe="adam"),
    Workload("cifar100-like", 50_000, 3072, "uint8", classes=100, hidden=(1024,)),
    Workload("regression", 1_000_000, 8, "float32", classes=0, outputs=1, hidden=(256,), loss="mse"),
)}


def generate(w: Workload, seed: int = 0, rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray]:
    """(x_train, y_train, x_test, y_test) of workload `w` (rows: fewer rows, for tests), the same for the same seed.
    y: int32 labels [N], or float32 values [N, outputs]."""
    total = w.rows if rows is None else rows
    n_test = max(1, min(100_000, total // 10))
    rng = np.random.default_rng([seed, w.features, w.classes, w.outputs])
    scale = rng.uniform(0.5, 4.0, w.features)
    offset = rng.normal(0.0, 2.0, w.features)
    w1 = rng.normal(0.0, 1.0 / np.sqrt(w.features), (w.features, TEACHER_HIDDEN))
    w2 = rng.normal(0.0, 1.0, (TEACHER_HIDDEN, max(w.classes, w.outputs)))
    x = np.empty((total, w.features), np.dtype(w.dtype))
    y = np.empty(total, np.int32) if w.classes else np.empty((total, w.outputs), np.float32)
    for start in range(0, total, CHUNK):
        n = min(CHUNK, total - start)
        z = rng.normal(0.0, 1.0, (n, w.features))
        out = np.tanh(z @ w1) @ w2
        if w.dtype == "uint8":  # pixels: the unit normal squashed into 0..255
            x[start:start + n] = np.clip(128 + 40 * z, 0, 255).astype(np.uint8)
        else:
            x[start:start + n] = (z * scale + offset).astype(w.dtype)
        if w.classes:
            y[start:start + n] = (out + rng.gumbel(0.0, 0.5, out.shape)).argmax(axis=1)
        else:
            y[start:start + n] = out + rng.normal(0.0, 0.1, out.shape)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]
