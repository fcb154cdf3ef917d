"""A table's columns standing for its rows (runtime/columns.py) and the tables that stay columns (data/tables.py):
the rows they stand for, slices and splits, the first value float32 rows cannot hold, the launcher's refusals and the
staging the model plans (model/upload.py). No GPU: tests/test_columns_gpu.py makes the rows there."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import contract
from rawgpu.contract import COLUMNS_MAX, COLUMNS_TILE_ROWS
from rawgpu.data import tables
from rawgpu.data.arrays import from_tables
from rawgpu.kernels import gather as kd
from rawgpu.model.upload import STAGING_BYTES, staging_bytes
from rawgpu.runtime.columns import Columns
from rawgpu.runtime.errors import DataError
from rawgpu.runtime.memory import Arena

pa = pytest.importorskip("pyarrow", reason="the tables extra (pyarrow) reads CSV and Parquet")
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


def chunked(rng, rows: int, features: int, dtype, cuts: int = 3) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """Columns cut at random places (as row groups cut them), and the float32 rows they stand for (float64 values
    rounded once)."""
    full = (rng.standard_normal((rows, features)) * 100).astype(dtype)
    columns = []
    for j in range(features):
        at = np.sort(rng.choice(np.arange(1, rows), size=min(cuts, rows - 1), replace=False)) if rows > 1 else []
        columns.append(np.split(full[:, j].copy(), at))
    return columns, full.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,features", [(1, 1), (7, 3), (5000, 29), (70000, 5)])
def test_columns_stand_for_their_float32_rows(rng, dtype, rows, features):
    columns, expect = chunked(rng, rows, features, dtype)
    whole = np.stack([np.concatenate(c) for c in columns], axis=1)
    x = Columns(columns)
    assert x.shape == (rows, features) and len(x) == rows and x.dtype == np.float32 and x.column_dtype == dtype
    rows_made = np.asarray(x)
    assert rows_made.dtype == np.float32 and np.array_equal(rows_made.view(np.uint32), expect.view(np.uint32))
    assert np.asarray(x) is rows_made  # made once
    assert np.array_equal(np.asarray(x, np.float64), expect.astype(np.float64))
    a, b = rows // 3, rows - rows // 4
    assert np.array_equal(np.asarray(x[a:b]), expect[a:b]) and x[a:b].shape == (b - a, features)
    for j in range(features):
        assert np.array_equal(np.concatenate(x.pieces(j, a, b)), whole[a:b, j])
    index = np.sort(rng.choice(rows, size=max(1, rows // 2), replace=False))
    taken = x.take(index)
    assert isinstance(taken, Columns) and np.array_equal(np.asarray(taken), expect[index])
    mask = np.zeros(rows, bool)
    mask[index] = True
    assert np.array_equal(np.asarray(x[mask]), expect[index])
    assert np.array_equal(x[:, 0], expect[:, 0])  # anything else: of the host rows


def test_columns_refuse_mixed_dtypes_lengths_and_indices_outside():
    with pytest.raises(ValueError, match="float32 or float64 alike"):
        Columns([[np.zeros(3, np.float32)], [np.zeros(3, np.float64)]])
    with pytest.raises(ValueError, match="float32 or float64 alike"):
        Columns([[np.zeros(3, np.int32)]])
    with pytest.raises(ValueError, match="different lengths"):
        Columns([[np.zeros(3, np.float32)], [np.zeros(4, np.float32)]])
    with pytest.raises(IndexError, match="outside 0..2"):
        Columns([[np.zeros(3, np.float32)]]).take(np.array([0, 3]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_first_bad_value_is_found_in_row_order(rng, dtype):
    columns, _ = chunked(rng, 200000, 6, dtype, cuts=5)
    assert Columns(columns).first_bad() is None
    full = [np.concatenate(c) for c in columns]
    full[4][150001] = np.inf
    full[1][150001] = np.nan  # the same row, an earlier column: found first
    full[0][190000] = np.nan  # a later row, an earlier column: not first
    assert Columns([np.split(c, [1000, 150001]) for c in full]).first_bad() == (150001, 1)
    if dtype == np.float64:
        full[5][3] = 4e38  # finite, beyond float32's range
        assert Columns([[c] for c in full]).first_bad() == (3, 5)
        full[5][3] = float(np.finfo(np.float32).max)  # the largest float32 fits
        assert Columns([[c] for c in full]).first_bad() == (150001, 1)


def _table(rng, rows: int, features: int, dtype, label=True) -> "pa.Table":
    cols = {f"f{j}": (rng.standard_normal(rows) * (j + 1)).astype(dtype) for j in range(features)}
    if label:
        cols["y"] = rng.integers(0, 3, rows)
    return pa.table(cols)


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_narrow_float_parquet_table_is_read_as_columns_with_the_rows_it_had(rng, tmp_path, suffix):
    t = _table(rng, 3000, 9, np.float32)
    path = tmp_path / f"t{suffix}"
    pq.write_table(t, path, row_group_size=700) if suffix == ".parquet" else pcsv.write_csv(t, path)
    table = tables.read(path)
    if suffix == ".csv":  # a CSV's float64 columns come in a chunk per block: rows made on the host
        assert isinstance(table.x, np.ndarray) and table.x.dtype == np.float32
    else:
        assert isinstance(table.x, Columns) and table.x.column_dtype == np.float32
    expect = np.stack([t.column(f"f{j}").to_numpy().astype(np.float64).astype(np.float32) for j in range(9)], axis=1)
    assert np.array_equal(np.asarray(table.x), expect)
    fields = from_tables(path, test_fraction=0.2, seed=4)
    assert all(isinstance(fields[k], Columns) == (suffix == ".parquet") for k in ("train_images", "test_images"))
    train, test = np.asarray(fields["train_images"]), np.asarray(fields["test_images"])
    assert len(train) == 2400 and len(test) == 600
    assert sorted(map(bytes, np.concatenate([train, test]))) == sorted(map(bytes, expect))


def test_wide_mixed_and_half_tables_are_read_as_rows(rng, tmp_path):
    wide = _table(rng, 50, COLUMNS_MAX + 1, np.float32)
    pq.write_table(wide, tmp_path / "wide.parquet")
    assert isinstance(tables.read(tmp_path / "wide.parquet").x, np.ndarray)
    mixed = _table(rng, 50, 3, np.float32).append_column("n", pa.array(np.arange(50, dtype=np.int32)))
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    x = tables.read(tmp_path / "mixed.parquet", target="y").x
    assert isinstance(x, np.ndarray) and x.dtype == np.float32 and x[:, 3].tolist() == list(range(50))
    half = _table(rng, 50, 3, np.float16)
    pq.write_table(half, tmp_path / "half.parquet")
    assert tables.read(tmp_path / "half.parquet").x.dtype == np.float16


def test_a_float64_parquet_table_is_read_as_float64_columns(rng, tmp_path):
    t = _table(rng, 2000, 5, np.float64)
    pq.write_table(t, tmp_path / "t64.parquet", row_group_size=600)
    x = tables.read(tmp_path / "t64.parquet").x
    assert isinstance(x, Columns) and x.column_dtype == np.float64 and len(x.columns[0]) == 4
    expect = np.stack([t.column(f"f{j}").to_numpy().astype(np.float32) for j in range(5)], axis=1)
    assert np.array_equal(np.asarray(x), expect)


@pytest.mark.parametrize("suffix,dtype", [(".parquet", np.float32), (".parquet", np.float64), (".csv", np.float64)])
def test_a_bad_value_in_a_column_is_one_line_naming_its_row_and_column(rng, tmp_path, suffix, dtype):
    for value, why in [(np.nan, "NaN (every value must be finite)"), (np.inf, "inf (every value must be finite)"),
                       (-np.inf, "-inf (every value must be finite)"), (5e38, "5e+38 (too large for float32)")]:
        if dtype == np.float32 and value == 5e38:
            continue  # a float32 column cannot hold it
        t = _table(rng, 900, 4, dtype)
        col = t.column("f2").to_numpy().copy()
        col[700] = value
        t = t.set_column(2, "f2", pa.array(col))
        path = tmp_path / f"bad{suffix}"
        pq.write_table(t, path, row_group_size=300) if suffix == ".parquet" else pcsv.write_csv(t, path)
        with pytest.raises(DataError) as exc:
            tables.read(path)
        assert str(exc.value) == f"{path}: row 701, column 'f2': {why}"


def test_the_contract_names_every_columns_kernel_the_source_builds():
    from rawgpu.runtime import compiler

    built = compiler.compile_source("gather.cu", "sm_90").signatures
    assert sorted(n for n in built if n.startswith("columns_to_rows")) == sorted(contract.columns_kernels())
    assert len(contract.columns_kernels()) == 4


class _Recorder:
    """Kernels that record the launch instead of running it (no GPU)."""

    def get(self, source, name):
        recorder = self

        class K:
            def bind(self, grid, block, shared, *args):
                recorder.launch = (source, name, grid, block, args)
                return self
        return K()


def test_the_launcher_binds_a_chunk_and_refuses_what_the_kernel_cannot_take():
    a = Arena()
    cols = a.tensor("cols", (29, 1024), np.float32)
    cols64 = a.tensor("cols64", (29, 1024), np.float64)
    out = a.tensor("out", (5000, 29), np.float16)
    out32 = a.tensor("out32", (5000, 29), np.float32)
    first = a.tensor("first", (1,), np.uint64)
    k = _Recorder()
    kd.columns_to_rows(k, cols64, 1000, out32, 3840, first)
    source, name, grid, block, args = k.launch
    assert (source, name, grid, block) == ("gather.cu", "columns_to_rows_f64_f32", 8, 256)
    assert args[1:5] == (1024, 1000, 29, 3840) and args[5].offset == out32.offset + 3840 * 29 * 4
    kd.columns_to_rows(k, cols, 1, out, 0, first)
    assert k.launch[1] == "columns_to_rows_f32_f16" and k.launch[2] == 1
    bad = [
        (dict(cols=a.tensor("i", (29, 1024), np.int32)), TypeError, "float32 or float64 columns"),
        (dict(out=a.tensor("o8", (5000, 29), np.uint8)), TypeError, "into fp16 or fp32 rows"),
        (dict(first=a.tensor("f32", (1,), np.uint32)), TypeError, "first: expected dtype uint64"),
        (dict(out=a.tensor("o28", (5000, 28), np.float16)), ValueError, r"expected \[features, stride\]"),
        (dict(rows=1025), ValueError, "of a chunk of 1024"),
        (dict(rows=0), ValueError, "of a chunk of 1024"),
        (dict(row0=100), ValueError, f"row0 a multiple of {COLUMNS_TILE_ROWS}"),
        (dict(row0=4096), ValueError, "into 5000 rows"),
        (dict(cols=a.tensor("w", (65, 8), np.float32), out=a.tensor("w65", (10, 65), np.float16), rows=8),
         ValueError, f"65 columns, it takes 1 to {COLUMNS_MAX}"),
    ]
    for change, kind, match in bad:
        args = {**dict(cols=cols, rows=1000, out=out, row0=0, first=first), **change}
        with pytest.raises(kind, match=match):
            kd.columns_to_rows(k, args["cols"], args["rows"], args["out"], args["row0"], args["first"])


def test_the_staging_holds_whole_tiles_of_every_column_at_most_its_bound():
    per_tile = COLUMNS_TILE_ROWS * 29 * 8
    assert staging_bytes(3_000_000, 29) == STAGING_BYTES // per_tile * per_tile <= STAGING_BYTES
    assert staging_bytes(1, 29) == per_tile and staging_bytes(300, 1) == 3 * COLUMNS_TILE_ROWS * 8
    assert staging_bytes(10**9, COLUMNS_MAX) >= COLUMNS_TILE_ROWS * COLUMNS_MAX * 8
    assert staging_bytes(1000, COLUMNS_MAX + 1) == 0 and staging_bytes(0, 5) == 0
