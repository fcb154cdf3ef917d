"""Tables of your own (rawgpu/data/tables.py): every reader on files made here, and every bad file refused in one line
naming the file, row and column, before any GPU work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rawgpu.data import tables
from rawgpu.runtime import host_rows
from rawgpu.runtime.errors import DataError

pa = pytest.importorskip("pyarrow", reason="pyarrow (the tables extra, in the test extra) reads CSV and Parquet")
import pyarrow.parquet as pq  # noqa: E402


def _csv(tmp_path, text: str, name: str = "t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_csv_reads_its_features_and_the_last_column_as_the_target(tmp_path, rng):
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = rng.integers(0, 4, 50)
    lines = ["a,b,c,label"] + [f"{r[0]!r},{r[1]!r},{r[2]!r},{v}" for r, v in zip(x.tolist(), y)]
    path = _csv(tmp_path, "\n".join(lines) + "\n")
    t = tables.read(path)
    assert t.features == ("a", "b", "c") and t.targets == ("label",) and t.x.dtype == np.float32
    np.testing.assert_array_equal(t.x, x)
    got, classes = tables.labels(t)
    np.testing.assert_array_equal(got, y) and classes == max(2, y.max() + 1)
    picked = tables.read(path, target="a", features=["c", "b"])
    np.testing.assert_array_equal(picked.x, x[:, [2, 1]])
    np.testing.assert_array_equal(picked.y[:, 0], x[:, 0].astype(np.float64))
    assert tables.values(tables.read(path, target=["a", "b"])).shape == (50, 2)


def test_progress_reaches_the_file_size(tmp_path):
    path = _csv(tmp_path, "a,b\n" + "1,2\n" * 1000)
    seen = []
    tables.read(path, progress=lambda done, total: seen.append((done, total)))
    size = path.stat().st_size
    assert seen[-1] == (size, size) and all(d <= t for d, t in seen)


@pytest.mark.parametrize("text, expected", [
    ("a,b,c\n1,2,3\n4,x,6\n", r"t\.csv: row 2, column 'b': 'x' is not a number"),
    ("a,b,c\n1,2,3\n4,,6\n", r"t\.csv: row 2, column 'b': empty value"),
    ("a,b,c\n1,2,3\n4,5\n7,8,9\n", r"t\.csv: row 2: 2 values where the header has 3 columns"),
    ("", r"t\.csv: the file is empty"),
    ("a,b,c\n", r"t\.csv: no rows"),
    ("a,b,c\n1,nan,3\n", r"t\.csv: row 1, column 'b': NaN \(every value must be finite\)"),
    ("a,b,c\n1,2,3\n1,-inf,3\n", r"t\.csv: row 2, column 'b': -inf \(every value must be finite\)"),
    ("a,b,c\n1,2,inf\n", r"t\.csv: row 1, column 'c': inf \(every value must be finite\)"),
    ("a,b,c\n1,1e300,3\n", r"t\.csv: row 1, column 'b': 1e\+300 \(too large for float32\)"),
    ("a,a,c\n1,2,3\n", r"t\.csv: column 'a' appears twice"),
    ("a\n1\n", r"t\.csv: one column"),
    ("1,2,3\n4,5,6\n", r"t\.csv: the first row holds numbers, not column names"),
])
def test_a_bad_csv_is_one_line_naming_the_row_and_column(tmp_path, text, expected):
    with pytest.raises(DataError, match=f"/{expected}") as info:
        tables.read(_csv(tmp_path, text))
    assert "\n" not in str(info.value)


def test_columns_that_are_not_there_are_named_with_the_ones_that_are(tmp_path):
    path = _csv(tmp_path, "a,b,c\n1,2,3\n")
    with pytest.raises(DataError, match=r"no column 'y' for --target \(columns: a, b, c\)"):
        tables.read(path, target="y")
    with pytest.raises(DataError, match=r"no column 'z' for --features"):
        tables.read(path, features=["a", "z"])
    with pytest.raises(DataError, match=r"column 'c' is both a feature and the target"):
        tables.read(path, features=["a", "c"])


def test_parquet_reads_its_columns_and_names_a_text_column(tmp_path, rng):
    x = rng.normal(size=(20, 2)).astype(np.float32)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"f0": x[:, 0], "f1": x[:, 1], "y": np.arange(20) % 3}), path)
    t = tables.read(path)
    np.testing.assert_array_equal(t.x, x)
    assert tables.labels(t)[1] == 3
    pq.write_table(pa.table({"f0": x[:, 0], "name": [f"n{i}" for i in range(20)], "y": np.arange(20)}), path)
    with pytest.raises(DataError, match=r"row 1, column 'name': 'n0' is not a number"):
        tables.read(path)
    pq.write_table(pa.table({"f0": pa.array([1.0, None]), "y": [0, 1]}), path)
    with pytest.raises(DataError, match=r"row 2, column 'f0': empty value"):
        tables.read(path)


def test_npy_and_npz_keep_uint8_and_float16_and_check_the_rest(tmp_path, rng):
    a = rng.normal(size=(10, 4))
    np.save(tmp_path / "t.npy", a)
    t = tables.read(tmp_path / "t.npy")
    assert t.x.dtype == np.float32 and t.x.shape == (10, 3) and t.y.shape == (10, 1)
    for dtype in (np.uint8, np.float16):
        x = rng.integers(0, 255, (10, 5)).astype(dtype)
        np.savez(tmp_path / "s.npz", x_train=x, y_train=np.arange(10) % 2, x_test=x[:3], y_test=np.zeros(3))
        t = tables.read(tmp_path / "s.npz")
        assert t.x.dtype == dtype and t.x.shape == (10, 5)
        assert len(tables.read(tmp_path / "s.npz", split="test")) == 3
    a[3, 1] = np.nan
    np.save(tmp_path / "t.npy", a)
    with pytest.raises(DataError, match=r"t\.npy: row 4, column '1': NaN"):
        tables.read(tmp_path / "t.npy")
    np.save(tmp_path / "t.npy", np.zeros(5))
    with pytest.raises(DataError, match=r"expected a 2-D array"):
        tables.read(tmp_path / "t.npy")
    big = np.zeros((3, 2))
    big[2, 1] = 1e300
    np.savez(tmp_path / "s.npz", x_train=big, y_train=np.zeros(3))
    with pytest.raises(DataError, match=r"s\.npz: row 3, column 1: 1e\+300 in x_train does not fit float32"):
        tables.read(tmp_path / "s.npz")
    np.savez(tmp_path / "s.npz", x=np.zeros((2, 2)))
    with pytest.raises(DataError, match=r"s\.npz: no x_train and y_train arrays \(it holds x\)"):
        tables.read(tmp_path / "s.npz")
    np.savez(tmp_path / "s.npz", x_train=np.zeros((2, 2)), y_train=np.zeros(3))
    with pytest.raises(DataError, match=r"one value \(or row\) per row"):
        tables.read(tmp_path / "s.npz")
    with pytest.raises(DataError, match=r"unknown table format '\.txt'"):
        tables.read(tmp_path / "t.txt")
    with pytest.raises(DataError, match=r"no such file"):
        tables.read(tmp_path / "none.csv")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(DataError, match=r"junk\.npz: not a readable \.npz file"):
        tables.read(tmp_path / "junk.npz")
    (tmp_path / "latin.csv").write_bytes(b"\xff\xfe\x00a,b\n1,2\n")
    with pytest.raises(DataError, match=r"latin\.csv: not UTF-8 text"):
        tables.read(tmp_path / "latin.csv")
    (tmp_path / "junk.parquet").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        tables.read(tmp_path / "junk.parquet")
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(DataError, match=r"dir\.csv: not a file"):
        tables.read(tmp_path / "dir.csv")


def test_labels_are_whole_numbers_in_range_and_at_most_1000_classes(tmp_path):
    def table(y):
        return tables.Table(np.zeros((len(y), 1), np.float32), np.asarray(y, np.float64)[:, None], ("f",), ("y",),
                            "t.csv")

    assert tables.labels(table([0, 0, 0]))[1] == 2  # one class seen: still a two-class head
    assert tables.labels(table([0, 999]))[1] == 1000
    with pytest.raises(DataError, match=r"t\.csv: row 2, column 'y': label 1000 is out of range 0\.\.999"):
        tables.labels(table([0, 1000]))
    with pytest.raises(DataError, match=r"row 1, column 'y': label -1 is out of range"):
        tables.labels(table([-1, 2]))
    with pytest.raises(DataError, match=r"row 2, column 'y': label 1\.5 is not a whole number"):
        tables.labels(table([1, 1.5]))
    with pytest.raises(DataError, match=r"label 7 is out of range 0\.\.4$"):
        tables.labels(table([7]), classes=5)
    with pytest.raises(DataError, match=r"a regression target has 1 to 64 columns, got 65"):
        tables.values(tables.Table(np.zeros((1, 1), np.float32), np.zeros((1, 65)), ("f",), ("y",) * 65, "t"))


def test_a_test_set_must_have_the_training_sets_columns(tmp_path):
    train = tables.read(_csv(tmp_path, "a,b,y\n1,2,0\n"))
    test = tables.read(_csv(tmp_path, "a,c,y\n1,2,0\n", "u.csv"))
    with pytest.raises(DataError, match=r"u\.csv: the test set's columns differ from the training set's \(missing "
                                        r"'b'; extra 'c'\)"):
        tables.same_columns(train, test, "test")


def test_a_split_is_the_same_for_the_same_seed_and_keeps_both_sides(tmp_path):
    t = tables.read(_csv(tmp_path, "a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(100))))
    rest, held = tables.split(t, 0.2, seed=3, what="test")
    again = tables.split(t, 0.2, seed=3, what="test")[1]
    assert len(held) == 20 and len(rest) == 80 and np.array_equal(held.x, again.x)
    assert sorted(np.concatenate([rest.x[:, 0], held.x[:, 0]]).tolist()) == list(range(100))
    with pytest.raises(DataError, match=r"leaves no test rows"):
        tables.split(t, 0.001, seed=0, what="test")
    with pytest.raises(DataError, match=r"--val-fraction must be between 0 and 1"):
        tables.split(t, 1.5, seed=0, what="val")


def test_rows_read_across_arrow_chunks_are_the_columns_own_values(rng, monkeypatch):
    """A column in uneven Arrow chunks (a CSV's blocks): every block of rows, within a chunk or across several, is
    the column's own values, and the rows the GPU takes are the columns side by side."""
    import pyarrow as pa

    monkeypatch.setattr(host_rows, "ROW_BLOCK_LEAST", 7)
    monkeypatch.setattr(host_rows, "ROW_BLOCK_MOST", 7)
    values = [rng.standard_normal(n) for n in (5, 1, 13, 0, 9)]
    whole = np.concatenate(values)
    column = tables._Converted(lambda: whole, len(whole), pa.chunked_array([pa.array(v) for v in values]))
    for start in range(len(whole)):
        for stop in range(start + 1, len(whole) + 1):
            assert np.array_equal(column.part(start, stop), whole[start:stop]), (start, stop)
    other = rng.standard_normal(len(whole)).astype(np.float32)
    x, finite = tables._rows(len(whole), [column, other], np.float32)
    assert finite and np.array_equal(x, np.stack([whole.astype(np.float32), other], axis=1))
    monkeypatch.setattr(host_rows, "HUGE_PAGES_FROM", 0)  # the same rows on pages mapped for huge pages
    y, finite = tables._rows(len(whole), [column, other], np.float32)
    assert finite and y.flags.writeable and y.dtype == np.float32 and np.array_equal(y, x)
    z, finite = tables._rows(len(whole), [column, np.where(np.arange(len(whole)) == 3, np.inf, other)], np.float32)
    assert not finite


def test_the_fill_experiments_make_the_rows_and_the_columns(rng, monkeypatch):
    """dev/read_fill.py's fills (sub-blocks, huge pages, column-major) are the columns side by side."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("read_fill", Path(__file__).parent.parent / "dev" / "read_fill.py")
    read_fill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(read_fill)
    monkeypatch.setattr(host_rows, "ROW_BLOCK_LEAST", 7)
    monkeypatch.setattr(host_rows, "ROW_BLOCK_MOST", 7)
    monkeypatch.setattr(host_rows, "HUGE_PAGES_FROM", 0)
    cols = [rng.standard_normal(30).astype(np.float32) for _ in range(3)]
    rows = np.stack(cols, axis=1)
    for alloc in (np.empty, host_rows.empty_rows):
        for sub in (0, 3):
            assert np.array_equal(read_fill.rows_fill(cols, alloc, sub)(), rows)
        assert np.array_equal(read_fill.columns_fill(cols, alloc)(), rows.T)
