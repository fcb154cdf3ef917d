"""A table's columns made into rows on the GPU (model/upload.py, gather.cu's columns_to_rows): fresh random columns
of float32 and float64, cut into chunks, through a staging buffer of a few tiles (so many chunks), into fp16 and fp32
rows poisoned first: bit for bit the host's rows (runtime/columns.py, then mlp.kept_features' rounding), within one
rounding of float64; the first value fp16 cannot hold named as the host names it; a model trained from a Parquet
file equals the one trained from the same rows as arrays, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.contract import COLUMNS_TILE_ROWS
from rawgpu.data.datasets import Dataset
from rawgpu.model.mlp import kept_features
from rawgpu.model.recipe import Recipe
from rawgpu.model.upload import upload_columns
from rawgpu.runtime.columns import Columns
from rawgpu.runtime.errors import DataError
from rawgpu.runtime.memory import Arena
from rawgpu.training.trainer import Trainer

gpu = pytest.mark.gpu
ROWS = {"fp16": np.float16, "fp32": np.float32}


def random_columns(rng, rows: int, features: int, dtype) -> Columns:
    """Columns of their own scale each (some values near fp16's smallest and largest), cut where row groups would."""
    scale = np.exp(rng.uniform(-18.0, 10.0, features))
    full = (rng.standard_normal((rows, features)) * scale).astype(dtype)
    cuts = np.sort(rng.choice(np.arange(1, rows), size=min(4, rows - 1), replace=False)) if rows > 1 else []
    return Columns([np.split(full[:, j].copy(), cuts) for j in range(features)])


def upload(kernels, x: Columns, row: str, tiles: int) -> tuple[np.ndarray, Exception | None]:
    """x's rows as the GPU makes them through a staging buffer of `tiles` tiles of rows (poisoned first)."""
    with Arena() as arena:
        out = arena.tensor("rows", x.shape, ROWS[row])
        staging = arena.tensor("staging", tiles * COLUMNS_TILE_ROWS * x.shape[1] * x.column_dtype.itemsize, np.uint8)
        first = arena.tensor("first", 1, np.uint64)
        arena.allocate()
        out.fill_bytes(0xFF)
        staging.fill_bytes(0xFF)
        try:
            upload_columns(kernels, x, out, staging, first, "the training set")
        except DataError as exc:
            return out.download(), exc
        return out.download(), None


@gpu
@pytest.mark.parametrize("column", [np.float32, np.float64])
@pytest.mark.parametrize("row", ["fp16", "fp32"])
@pytest.mark.parametrize("rows,features,tiles", [(1, 1, 1), (127, 3, 1), (129, 29, 1), (5000, 64, 3),
                                                 (70001, 7, 40), (200000, 29, 500)])
def test_columns_become_the_hosts_rows_on_the_gpu(device, kernels_for, rng, column, row, rows, features, tiles):
    x = random_columns(rng, rows, features, column)
    host = np.asarray(x)
    if row == "fp16":
        host = np.clip(host, -60000, 60000)  # in fp16's range: the values beyond it are the next test's
        x = Columns([[host[:, j].astype(column)] for j in range(features)])
    got, error = upload(kernels_for(), x, row, tiles)
    assert error is None
    expect = kept_features(np.asarray(x), row, "x")
    assert got.dtype == expect.dtype and np.array_equal(got.view(np.uint8), expect.view(np.uint8))
    exact = np.stack([np.concatenate(c) for c in x.columns], axis=1).astype(np.float64)
    if row == "fp16":  # one rounding of the float32 value: half an fp16 ulp, or of fp16's smallest step
        bound = np.maximum(np.abs(exact) * 2.0 ** -11, 2.0 ** -25) * (1 + 2.0 ** -12)
    else:  # one rounding of float64 to float32 (none of a float32 column)
        bound = np.abs(exact) * 2.0 ** -24
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all()


@gpu
@pytest.mark.parametrize("column", [np.float32, np.float64])
def test_the_first_value_beyond_fp16_is_named_as_the_host_names_it(device, kernels_for, rng, column):
    x = random_columns(rng, 30000, 11, np.float64)
    full = np.clip(np.stack([np.concatenate(c) for c in x.columns], axis=1), -1e4, 1e4).astype(column)
    full[25000, 2] = -7e4  # later: not the first
    full[20000, 9] = 65520.0  # rounds to inf in fp16
    full[20000, 10] = 1e6
    cut = Columns([[full[:12345, j], full[12345:, j]] for j in range(11)])
    _, error = upload(kernels_for(), cut, "fp16", 7)
    with pytest.raises(DataError) as host:
        kept_features(np.asarray(cut), "fp16", "the training set")
    assert error is not None and str(error) == str(host.value)
    assert str(error).startswith("the training set: row 20000, column 9: 65520 is beyond fp16's range (65504)")
    full[20000, 9] = 65519.0  # rounds to 65504: held
    full[20000, 10] = 60000.0
    full[25000, 2] = 1.0
    got, error = upload(kernels_for(), Columns([[full[:, j]] for j in range(11)]), "fp16", 7)
    assert error is None and got[20000, 9] == np.float16(65504)


@gpu
@pytest.mark.parametrize("input_dtype,standardize", [("fp16", True), ("fp32", False)])
def test_a_model_trained_from_parquet_columns_equals_the_one_from_its_rows(device, rng, tmp_path, input_dtype,
                                                                            standardize):
    """Dataset.from_tables keeps a Parquet file's float columns (made into rows on the GPU); the same rows handed over
    as arrays (made on the host): the same features on the GPU, parameters and metrics, bit for bit."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows, features = 6000, 13
    x = (rng.standard_normal((rows, features)) * rng.uniform(0.5, 30.0, features)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + (x[:, 3] > 1)
    table = pa.table({**{f"f{j}": x[:, j] for j in range(features)}, "label": y})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=1000)
    columns = Dataset.from_tables(tmp_path / "t.parquet", test_fraction=0.15, seed=2)
    assert isinstance(columns.train_images, Columns)
    rows_data = Dataset.from_arrays(np.asarray(columns.train_images), columns.train_labels,
                                    np.asarray(columns.test_images), columns.test_labels, classes=columns.classes)
    recipe = Recipe(hidden=64, layers=2, batch=100, seed=7, input_dtype=input_dtype, standardize=standardize)
    with Trainer(recipe, data=columns, epochs=2) as a, Trainer(recipe, data=rows_data, epochs=2) as b:
        for t in ("images", "test_images"):
            assert np.array_equal(getattr(a.model, t).download().view(np.uint8),
                                  getattr(b.model, t).download().view(np.uint8))
        ha, hb = a.fit(), b.fit()
        for (w1, b1), (w2, b2) in zip(a.parameters(), b.parameters()):
            assert np.array_equal(w1, w2) and np.array_equal(b1, b2)
        assert [(h.train_loss, h.test_loss, h.test_accuracy) for h in ha] == \
               [(h.train_loss, h.test_loss, h.test_accuracy) for h in hb]
        assert all(np.isfinite(h.train_loss) for h in ha)
