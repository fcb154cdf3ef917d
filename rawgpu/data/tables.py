"""Tables of your own: features and targets from NumPy arrays, .npy/.npz, CSV and Parquet, checked before any GPU work.

A table is numbers only: every feature column numeric and finite, every row as wide as the header, at least one row.
Whatever breaks that is one DataError naming the file, the row (1-based, the header not counted) and the column,
so a user fixes the data instead of reading a traceback or training on NaN. CSV and Parquet go through pyarrow
(the `tables` extra): its readers are multithreaded C++ and far faster than anything written here; .npy/.npz
need NumPy alone.

The target is a column (default: the last) or, in .npz files, the arrays y_train / y_test. What the target means
(class labels or regression values) is decided by the caller, with `labels` or `values`.
"""

from __future__ import annotations

import bisect
import io
import itertools
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..contract import COLUMNS_MAX
from ..contract.shapes import MAX_CLASSES, MAX_INPUTS, MAX_OUTPUTS
from ..runtime.errors import DataError
from ..runtime.host_rows import empty_rows, in_blocks, on_every_core, take_rows
from ..runtime.columns import COLUMN_DTYPES, Columns

MAX_FEATURES = MAX_INPUTS  # the widest input the first layer takes
FORMATS = (".npy", ".npz", ".csv", ".parquet")
# bytes per parsed CSV block, the progress step: 4 MB parse as fast as pyarrow's default 1 MB on 16 cores and leave a
# quarter as many chunks for the rows to cross (docs/perf.md: Your own data)
CSV_BLOCK = 4 << 20
# Formats whose float columns stay columns to the upload: Parquet's come in row groups of up to a million rows; a
# CSV's in a chunk per 4 MB block, thousands of pieces to copy up, and its read's bound is met with rows made here
KEPT_AS_COLUMNS = (".parquet",)

Progress = Callable[[int, int], None]  # (bytes done, total bytes)


@dataclass(frozen=True)
class Table:
    """Feature rows x [N, F] (float32, float16 or uint8 as read; a narrow table of float columns as Columns, rows of
    float32 made where they are needed) and the target y [N, K] (numbers as read, or float64 of several columns:
    `labels` and `values` check and convert it), with the columns' names and where they came from."""

    x: np.ndarray | Columns
    y: np.ndarray
    features: tuple[str, ...]
    targets: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return self.x.shape[0]

    def rows(self, index: np.ndarray) -> "Table":
        x = self.x.take(index) if isinstance(self.x, Columns) else take_rows(self.x, index)
        return Table(x, self.y[index], self.features, self.targets, self.source)


def read(path: str | Path, *, target: str | Sequence[str] | None = None, features: Sequence[str] | None = None,
         split: str = "train", progress: Progress | None = None) -> Table:
    """The table in `path` (.npy: a 2-D array whose target is its last column(s) unless `target` names column
    indices; .npz: the arrays x_<split>, y_<split>; .csv, .parquet: named columns). target: the target column(s),
    default the last; features: the feature columns, default all the others. progress(bytes done, total) is called
    while a CSV is read, from the thread that reads it."""
    path, suffix = _table_file(path)
    if suffix == ".npz":
        return _npz(path, split, target, features)
    if suffix == ".npy":
        columns, names = _npy(path)
    else:
        try:
            columns, names = _arrow(path, suffix, progress)
        except UnicodeDecodeError:  # pyarrow reads names and text as UTF-8 (when asked for them)
            raise DataError(f"{path}: not UTF-8 text") from None
    return _select(path, columns, names, target, features)


def _table_file(path: str | Path) -> tuple[Path, str]:
    """The path of a table file and its format (suffix), or one line: an unknown format, no such file, not a file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"{path}: unknown table format {path.suffix or '(no suffix)'!r}; use one of "
                        f"{', '.join(FORMATS)}")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    return path, suffix


def read_features(path: str | Path, features: Sequence[str] | None, width: int) -> np.ndarray:
    """The rows to predict on in `path`, [N, width]: a CSV or Parquet file's `features` columns (a trained model's,
    by name; any others, the target among them, are left out), an .npz's x_test (else x_train), or an .npy of
    `width` columns (or more: the target's, last, are left out)."""
    path, suffix = _table_file(path)
    if suffix == ".npz":
        arrays = _npz_arrays(path)
        key = "x_test" if "x_test" in arrays else "x_train" if "x_train" in arrays else None
        if key is None:
            raise DataError(f"{path}: no x_test or x_train array (it holds {', '.join(sorted(arrays)) or 'none'})")
        x = arrays[key]
        if x.ndim != 2:
            raise DataError(f"{path}: {key} must be rows x features, got shape {x.shape}")
        columns = [x[:, j] for j in range(x.shape[1])]
        names = [str(j) for j in range(len(columns))]
    elif suffix == ".npy":
        columns, names = _npy(path)
    else:
        try:
            columns, names = _arrow(path, suffix, None)
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None
    if suffix in (".npy", ".npz"):
        if len(columns) < width:
            raise DataError(f"{path}: {len(columns)} columns; the model takes {width} features")
        picked = names[:width]
    else:
        picked = list(features) if features else names[:width]
        missing = [f for f in picked if f not in names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r}, a feature of the model (columns: {_listed(names)})")
    if len(picked) != width:
        raise DataError(f"{path}: {len(picked)} feature columns; the model takes {width}")
    by_name = dict(zip(names, columns))
    for f in picked:
        if not isinstance(by_name[f], _Converted):
            _numeric(path, by_name[f], f"column {f!r}")
    if len(columns[0]) == 0:
        raise DataError(f"{path}: no rows")
    return np.asarray(_feature_rows(path, by_name, picked, len(columns[0])))


def labels(table: Table, classes: int | None = None) -> tuple[np.ndarray, int]:
    """The target as class labels (int32 [N]) and the number of classes (given, or the largest label + 1, at least
    2): one column of whole numbers in 0 .. classes - 1, classes at most MAX_CLASSES."""
    if table.y.shape[1] != 1:
        raise DataError(f"{table.source}: a classification target is one column, got {table.y.shape[1]} "
                        f"({', '.join(table.targets)})")
    y = table.y[:, 0]
    name = table.targets[0]
    whole = np.floor(y) == y if not np.issubdtype(y.dtype, np.integer) else np.ones(1, bool)
    if not whole.all():
        row = int(np.argmin(whole))
        raise DataError(f"{table.source}: row {row + 1}, column {name!r}: label {_shown(y[row])} is not a whole number "
                        "(for a regression target use --loss mse)")
    low, high = (int(y.min()), int(y.max())) if len(y) else (0, 0)
    limit = MAX_CLASSES if classes is None else classes
    if low < 0 or high >= limit:
        row = int(np.argmax((y < 0) | (y >= limit)))
        raise DataError(f"{table.source}: row {row + 1}, column {name!r}: label {int(y[row])} is out of range "
                        f"0..{limit - 1}" + ("" if classes is not None else f" (at most {MAX_CLASSES} classes)"))
    return y.astype(np.int32), classes if classes is not None else max(2, high + 1)


def values(table: Table) -> np.ndarray:
    """The target as regression values, float32 [N, K], 1 <= K <= MAX_OUTPUTS."""
    if not 1 <= table.y.shape[1] <= MAX_OUTPUTS:
        raise DataError(f"{table.source}: a regression target has 1 to {MAX_OUTPUTS} columns, got {table.y.shape[1]}")
    return table.y.astype(np.float32)


def same_columns(train: Table, other: Table, what: str) -> None:
    """A test or validation table must have the training table's feature and target columns, in order."""
    if (other.features, other.targets) != (train.features, train.targets):
        missing = [c for c in train.features + train.targets if c not in other.features + other.targets]
        extra = [c for c in other.features + other.targets if c not in train.features + train.targets]
        detail = (f"missing {', '.join(map(repr, missing))}" if missing else "") + \
                 ("; " if missing and extra else "") + (f"extra {', '.join(map(repr, extra))}" if extra else "")
        raise DataError(f"{other.source}: the {what} set's columns differ from the training set's "
                        f"({detail or 'another order'})")


def split(table: Table, fraction: float, seed: int, what: str) -> tuple[Table, Table]:
    """(the rest, a random `fraction` of the rows), the same rows for the same seed on every host."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"--{what}-fraction must be between 0 and 1, got {fraction}")
    n = len(table)
    take = int(round(n * fraction))
    if take < 1 or take >= n:
        raise DataError(f"{table.source}: {fraction} of {n} rows leaves no {what} rows or no training rows")
    held = np.zeros(n, bool)
    held[np.random.default_rng(seed).permutation(n)[:take]] = True  # the rows in order without a sort
    return table.rows(np.flatnonzero(~held)), table.rows(np.flatnonzero(held))


# --- readers -----------------------------------------------------------------------------------------------------

def _npy(path: Path) -> tuple[list[np.ndarray], list[str]]:
    try:
        a = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy file ({exc})") from None
    if a.ndim != 2:
        raise DataError(f"{path}: expected a 2-D array (rows x columns, the target last), got shape {a.shape}")
    _numeric(path, a, "the array")
    return [a[:, j] for j in range(a.shape[1])], [str(j) for j in range(a.shape[1])]


def npz_keys(path: Path) -> list[str]:
    """The arrays an .npz file holds (none read), or one line where it is not a readable .npz file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return list(z.files)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None


def _npz_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None


def _npz(path: Path, split_name: str, target, features) -> Table:
    if target is not None or features is not None:
        raise DataError(f"{path}: --target and --features pick columns of .npy, CSV and Parquet files; an .npz holds "
                        "x_train and y_train")
    arrays = _npz_arrays(path)
    xk, yk = f"x_{split_name}", f"y_{split_name}"
    if xk not in arrays or yk not in arrays:
        raise DataError(f"{path}: no {xk} and {yk} arrays (it holds {', '.join(sorted(arrays)) or 'none'})")
    x, y = arrays[xk], arrays[yk]
    if x.ndim != 2 or y.ndim not in (1, 2) or len(x) != len(y):
        raise DataError(f"{path}: {xk} must be rows x features and {yk} one value (or row) per row; got shapes "
                        f"{x.shape} and {y.shape}")
    _numeric(path, x, xk)
    _numeric(path, y, yk)
    y2 = y.reshape(len(y), -1).astype(np.float64)
    _finite(path, y2, [yk] * y2.shape[1])
    x = _feature_dtype(path, x, xk)
    _finite(path, x, [f"{xk}[:, {j}]" for j in range(x.shape[1])])
    _check_shape(path, x)
    return Table(x, y2, tuple(str(j) for j in range(x.shape[1])), (yk,) if y.ndim == 1 else
                 tuple(f"{yk}[:, {j}]" for j in range(y2.shape[1])), str(path))


def _arrow(path: Path, suffix: str, progress: Progress | None) -> tuple[list[np.ndarray], list[str]]:
    try:
        import pyarrow as pa
        import pyarrow.csv as pcsv
    except ImportError:
        from ..runtime.install import hint

        raise DataError(f"{path}: reading {suffix[1:].upper()} needs pyarrow: {hint('tables')}") from None
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    try:
        if suffix == ".parquet":
            table = _parquet(path, pa, progress)
        else:
            table = _csv(path, size, pa, pcsv, progress)
    except pa.ArrowInvalid as exc:
        if suffix == ".parquet":
            raise DataError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
        raise DataError(f"{path}: {_arrow_reason(path, exc)}") from None
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read it ({str(exc).splitlines()[0]})") from None
    names = [str(n) for n in table.column_names]
    if suffix == ".csv" and all(_is_number(n) for n in names):  # a file without a header: its first row is data
        raise DataError(f"{path}: the first row holds numbers, not column names: add a header row naming the columns")
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DataError(f"{path}: column {dup!r} appears twice")
    return [_Converted(lambda i=i, name=name: _column(path, table.column(i), name, pa), table.num_rows,
                       _direct(table.column(i), pa)) for i, name in enumerate(names)], names


class _Converted:
    """An Arrow column turned into numbers when first asked for: columns no run picks (an id, a text label) are
    never converted, so they cannot fail the read. `direct`: the column itself where its values are numbers
    NumPy takes as they are (integers or floats, none missing), so that a block of rows can be read from it straight
    into the rows the GPU takes (`part`), with no whole-column copy first."""

    def __init__(self, convert: Callable[[], np.ndarray], rows: int, direct=None):
        self._convert, self._array, self.rows, self.direct = convert, None, rows, direct
        self._chunks: list[np.ndarray] | None = None
        self._starts: list[int] = []

    def __len__(self) -> int:
        return self.rows

    @property
    def dtype(self) -> np.dtype:
        if self.direct is not None:
            return np.dtype(self.direct.type.to_pandas_dtype())
        return self.get().dtype

    def get(self) -> np.ndarray:
        if self._array is None:
            self._array = self._convert()
        return self._array

    def part(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 as numbers (`direct`: views of Arrow's own buffers, copied only across a chunk's
        end)."""
        if self.direct is None:
            return self.get()[start:stop]
        if self._chunks is None:  # once, before the threads ask (views: no copy, and no Arrow call per block)
            self.views()
        pieces, at = [], start
        while at < stop:
            i = bisect.bisect_right(self._starts, at) - 1
            end = min(stop, self._starts[i] + len(self._chunks[i]))
            pieces.append(self._chunks[i][at - self._starts[i]:end - self._starts[i]])
            at = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def views(self) -> None:
        """The direct column's chunks as NumPy views, and where each starts."""
        if self.direct is not None and self._chunks is None:
            chunks = [c.to_numpy(zero_copy_only=False) for c in self.direct.chunks if len(c)]
            self._starts = list(itertools.accumulate((len(c) for c in chunks[:-1]), initial=0))
            self._chunks = chunks

    def chunks(self) -> list[np.ndarray]:
        """The direct column's chunks as NumPy views of Arrow's buffers."""
        self.views()
        return self._chunks


def _direct(column, pa):
    """The column where its values are integers or floats with none missing (`_Converted.direct`), else None."""
    kind = column.type
    if column.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return None
    return column


def _csv(path: Path, size: int, pa, pcsv, progress: Progress | None):
    """The CSV file as one Arrow table, by pyarrow's multithreaded reader; the bytes it has taken say how far it is."""
    read = pcsv.ReadOptions(block_size=CSV_BLOCK, use_threads=True)
    # only an empty field is missing: "nan" and "inf" are read as the numbers, which the checks then name
    convert = pcsv.ConvertOptions(null_values=[""], strings_can_be_null=True)
    with open(path, "rb", buffering=0) as f:
        table = pcsv.read_csv(_Counted(f, size, progress), read_options=read, convert_options=convert)
    if progress is not None:
        progress(size, size)
    return table


def _parquet(path: Path, pa, progress: Progress | None):
    """The Parquet file as one Arrow table, read whole by pyarrow's threads (a row group at a time is slower, and
    a Parquet file reads at GB/s: its progress is its start and its end)."""
    import pyarrow.parquet as pq

    size = path.stat().st_size
    if progress is not None:
        progress(0, size)
    table = pq.read_table(path)
    if progress is not None:
        progress(size, size)
    return table


class _Counted(io.RawIOBase):
    """A file that tells `progress` how many of its bytes have been read (pyarrow reads it in large blocks)."""

    def __init__(self, f, size: int, progress: Progress | None):
        self.f, self.size, self.progress, self.done = f, size, progress, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.f.readinto(buffer) or 0
        self.done += n
        if self.progress is not None and n:
            self.progress(min(self.done, self.size), self.size)
        return n


def _arrow_reason(path: Path, exc: Exception) -> str:
    """pyarrow's parse error as one line; for a ragged CSV row, which row (pyarrow does not say)."""
    text = str(exc).splitlines()[0]
    if "Expected" in text and "columns" in text and path.suffix.lower() == ".csv":
        row = _ragged_row(path)
        if row is not None:
            return f"row {row[0]}: {row[1]} values where the header has {row[2]} columns"
    if "Empty CSV file" in text or "no columns" in text.lower():
        return "the file is empty"
    return text.removeprefix("CSV parse error: ")


def _ragged_row(path: Path) -> tuple[int, int, int] | None:
    """(1-based data row, its values, the header's columns) of the first row as wide as the header is not; read
    again with the standard library (an error path: speed does not matter)."""
    import csv

    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            return None
        for i, row in enumerate(rows, 1):
            if row and len(row) != len(header):
                return i, len(row), len(header)
    return None


def _array(column) -> np.ndarray:
    """A column's numbers: an array as it is, an Arrow column converted (and checked) now."""
    return column.get() if isinstance(column, _Converted) else column


def _column(path: Path, column, name: str, pa) -> np.ndarray:
    """One column as a NumPy array of numbers, or the error naming its first bad row."""
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_dictionary(kind):
        column, kind = column.cast(kind.value_type), kind.value_type
    if column.null_count:
        row = int(pc.index(pc.is_null(column), True).as_py())
        raise DataError(f"{path}: row {row + 1}, column {name!r}: empty value")
    if pa.types.is_boolean(kind):
        return column.to_numpy(zero_copy_only=False).astype(np.uint8)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return column.to_numpy(zero_copy_only=False)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        text = column.to_numpy(zero_copy_only=False)
        for start in range(0, len(text), 1 << 16):  # the first value that is no number
            chunk = text[start:start + (1 << 16)]
            try:
                chunk.astype(np.float64)
            except ValueError:
                for i, v in enumerate(chunk):
                    try:
                        float(v)
                    except ValueError:
                        raise DataError(f"{path}: row {start + i + 1}, column {name!r}: {v!r} is not a number "
                                        "(every column must be numeric; pick columns with --features)") from None
        return text.astype(np.float64)
    raise DataError(f"{path}: column {name!r} holds {kind}, not numbers (pick columns with --features)")


def _select(path: Path, columns: list[np.ndarray], names: list[str], target, features) -> Table:
    if not columns or len(columns[0]) == 0:
        raise DataError(f"{path}: no rows")
    if len(columns) < 2:
        raise DataError(f"{path}: one column; a table needs feature columns and a target column")
    wanted = [target] if isinstance(target, str) else list(target) if target is not None else [names[-1]]
    for t in wanted:
        if t not in names:
            raise DataError(f"{path}: no column {t!r} for --target (columns: {_listed(names)})")
    picked = list(features) if features is not None else [n for n in names if n not in wanted]
    for f in picked:
        if f not in names:
            raise DataError(f"{path}: no column {f!r} for --features (columns: {_listed(names)})")
        if f in wanted:
            raise DataError(f"{path}: column {f!r} is both a feature and the target")
    if not picked:
        raise DataError(f"{path}: no feature columns left beside the target")
    by_name = dict(zip(names, columns))
    sources = [_array(by_name[t]) for t in wanted]
    y = (sources[0].reshape(-1, 1) if len(sources) == 1  # as read: `labels` and `values` convert it
         else np.stack([a.astype(np.float64) for a in sources], axis=1))
    if not all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in sources):  # else all finite
        _finite(path, y, wanted)
    x = _feature_rows(path, by_name, picked, len(y))
    _check_shape(path, x)
    return Table(x, y, tuple(picked), tuple(wanted), str(path))


def _feature_rows(path: Path, by_name: dict, picked: list[str], n: int) -> np.ndarray | Columns:
    """The picked columns as the rows the GPU takes [n, len(picked)]: uint8 or float16 where every column is, else
    float32 (a Parquet file's kept as Columns where every column is float32, or every one float64, and there are at
    most COLUMNS_MAX: the GPU makes their rows); every value finite (else the first bad one named by row and
    column)."""
    for f in picked:  # a column of text or with a missing value: converted (and checked, naming its row) first
        if isinstance(by_name[f], _Converted) and by_name[f].direct is None:
            by_name[f].get()
    dtypes = {by_name[f].dtype for f in picked}
    if path.suffix.lower() in KEPT_AS_COLUMNS and len(picked) <= COLUMNS_MAX and len(dtypes) == 1 and \
            dtypes <= set(COLUMN_DTYPES) and \
            all(isinstance(by_name[f], _Converted) and by_name[f].direct is not None for f in picked):
        columns = Columns([by_name[f].chunks() for f in picked])
        if not _all_held([by_name[f].direct for f in picked]) and (bad := columns.first_bad()) is not None:
            _bad_value(path, bad[0], picked[bad[1]], columns.part(bad[1], bad[0], bad[0] + 1)[0], np.float32)
        return columns
    dtype = np.uint8 if dtypes == {np.dtype(np.uint8)} else np.float16 if dtypes == {np.dtype(np.float16)} \
        else np.float32
    x, finite = _rows(n, [by_name[f] for f in picked], dtype)
    if not finite:
        row, j = np.argwhere(~np.isfinite(x))[0]
        _bad_value(path, row, picked[j], _part(by_name[picked[j]], row, row + 1)[0], x.dtype)
    return x


def _all_held(columns: list) -> bool:
    """Whether float32 rows hold every value of these Arrow float columns: pyarrow's compute, a column per thread
    (NumPy's reductions over the same columns kept the GIL and took 2.5x as long on 16 cores: docs/perf.md, Reading
    tables); where one does not, NumPy finds which value. A float32 column's sum in float64 is finite exactly when
    every value is (it cannot overflow): one pass; a float64 column's values are compared with float32's largest."""
    import pyarrow as pa
    import pyarrow.compute as pc

    most = float(np.finfo(np.float32).max)

    def held(column) -> bool:
        if pa.types.is_float32(column.type):
            total = pc.sum(column).as_py()  # float64; NaN or inf where a value is
            return total is not None and math.isfinite(total)
        return bool(pc.all(pc.less_equal(pc.abs(column), most)).as_py())  # NaN compares False
    return all(on_every_core(held, columns))


def _bad_value(path: Path, row: int, name: str, value, dtype) -> None:
    """Raise the one line naming a feature value the rows cannot hold: not finite, or beyond dtype's range."""
    why = "every value must be finite" if not np.isfinite(float(value)) else f"too large for {np.dtype(dtype)}"
    raise DataError(f"{path}: row {row + 1}, column {name!r}: {_shown(value)} ({why})")


def _rows(n: int, columns: list, dtype) -> tuple[np.ndarray, bool]:
    """The columns (arrays, or Arrow columns: _Converted) as rows [n, len(columns)] of dtype (what the GPU takes),
    and whether every value is finite: a block of rows per thread, checked as soon as the thread has written it."""
    x = empty_rows((n, len(columns)), dtype)
    for c in columns:
        if isinstance(c, _Converted):
            c.views()

    def fill(a: int, b: int) -> bool:
        with np.errstate(over="ignore", invalid="ignore"):
            for j, c in enumerate(columns):
                x[a:b, j] = _part(c, a, b)
        return dtype == np.uint8 or bool(np.isfinite(x[a:b]).all())
    return x, all(in_blocks(n, fill))


def _part(column, start: int, stop: int) -> np.ndarray:
    return column.part(start, stop) if isinstance(column, _Converted) else column[start:stop]


# --- checks ------------------------------------------------------------------------------------------------------

def _numeric(path: Path, a: np.ndarray, what: str) -> None:
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise DataError(f"{path}: {what} holds {a.dtype}, not numbers")


def too_large(a: np.ndarray, dtype) -> tuple[int, int] | None:
    """(row, column) of the first value of `a` [N, F] that the float type `dtype` cannot hold, or None."""
    big = np.abs(a) > np.finfo(dtype).max
    return divmod(int(big.argmax()), a.shape[1]) if big.any() else None


def _feature_dtype(path: Path, x: np.ndarray, what: str) -> np.ndarray:
    """uint8, float16 and float32 stay as they are; other numbers become float32 (checked to fit)."""
    if x.dtype in (np.uint8, np.float16, np.float32):
        return x
    wide = x.astype(np.float64)
    if (at := too_large(wide, np.float32)) is not None:
        raise DataError(f"{path}: row {at[0] + 1}, column {at[1]}: {_shown(wide[at])} in {what} does not fit float32")
    return wide.astype(np.float32)


def _finite(path: Path, a: np.ndarray, names: Sequence[str]) -> None:
    if np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
        return
    bad = ~np.isfinite(a)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise DataError(f"{path}: row {r + 1}, column {names[c]!r}: {_shown(a[r, c])} (every value must be finite)")


def _check_shape(path: Path, x: np.ndarray) -> None:
    if x.shape[0] == 0:
        raise DataError(f"{path}: no rows")
    if not 1 <= x.shape[1] <= MAX_FEATURES:
        raise DataError(f"{path}: {x.shape[1]} feature columns; rawgpu takes 1 to {MAX_FEATURES}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _shown(v) -> str:
    v = float(v)
    return "NaN" if np.isnan(v) else ("inf" if v > 0 else "-inf") if np.isinf(v) else f"{v:g}"


def _listed(names: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")
