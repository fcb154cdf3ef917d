"""A table's feature columns as its reader holds them, standing for the rows [N, F] of float32 the model trains on.

A Parquet file's float columns (at most COLUMNS_MAX of them, all float32 or all float64; data/tables.py) stay columns
from the read to the upload, and the GPU makes the rows (model/upload.py, kernels/gather.py: columns_to_rows): making
them on the host took longer than pyarrow's read of the file (docs/perf.md: Reading tables). Whatever asks for host
rows (np.asarray: predictions, a digest, a sweep's upload) gets them made on every core, once.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

import numpy as np

from .host_rows import empty_rows, in_blocks, on_every_core

COLUMN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # what columns_to_rows reads


class Columns:
    """Columns of equal length, each a list of chunks (1-D float32, or each float64; views, never written), as rows
    [N, F] of float32 (`dtype`)."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, columns: Sequence[Sequence[np.ndarray]]):
        self.columns = [[c for c in chunks if len(c)] for chunks in columns]
        kinds = {c.dtype for chunks in self.columns for c in chunks}
        if not self.columns or len(kinds) > 1 or not kinds <= set(COLUMN_DTYPES):
            raise ValueError(f"Columns: one or more columns of float32 or float64 alike, got {sorted(map(str, kinds))}")
        self.column_dtype = kinds.pop() if kinds else np.dtype(np.float32)
        lengths = {sum(len(c) for c in chunks) for chunks in self.columns}
        if len(lengths) != 1:
            raise ValueError(f"Columns: columns of different lengths {sorted(lengths)}")
        self.rows = lengths.pop()
        self._starts = [list(itertools.accumulate((len(c) for c in chunks[:-1]), initial=0)) for chunks in self.columns]
        self._host: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, len(self.columns)

    def __len__(self) -> int:
        return self.rows

    def pieces(self, j: int, start: int, stop: int) -> list[np.ndarray]:
        """Rows start..stop-1 of column j as views of its chunks, in order."""
        chunks, starts, out, at = self.columns[j], self._starts[j], [], start
        while at < stop:
            i = bisect.bisect_right(starts, at) - 1
            end = min(stop, starts[i] + len(chunks[i]))
            out.append(chunks[i][at - starts[i]:end - starts[i]])
            at = end
        return out

    def part(self, j: int, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 of column j (a view unless they cross a chunk's end)."""
        pieces = self.pieces(j, start, stop)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else self.columns[j][0][:0]

    def first_bad(self) -> tuple[int, int] | None:
        """(row, column) of the first value, in row order, that float32 rows cannot hold (NaN, +-inf, or a float64
        beyond float32's range), or None: a pass over every value (data/tables.py asks only once pyarrow's faster
        check has found one)."""
        most = np.float64(np.finfo(np.float32).max)

        def check(j: int) -> tuple[int, int] | None:
            for i, chunk in enumerate(self.columns[j]):
                ok = np.isfinite(chunk) if self.column_dtype == np.float32 else np.abs(chunk) <= most  # NaN: False
                if not ok.all():
                    return self._starts[j][i] + int(np.argmin(ok)), j
            return None
        found = [bad for bad in on_every_core(check, list(range(len(self.columns)))) if bad is not None]
        return min(found) if found else None

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._host is None:
            x = empty_rows(self.shape, np.float32)

            def fill(a: int, b: int) -> None:
                for j in range(len(self.columns)):
                    x[a:b, j] = self.part(j, a, b)
            in_blocks(self.rows, fill)
            self._host = x
        return self._host if dtype is None or np.dtype(dtype) == self.dtype else self._host.astype(dtype)

    def __iter__(self):
        return iter(np.asarray(self))

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def __getitem__(self, index):
        """Rows by a slice of step 1 or an index array (a split's rows): Columns; anything else: of the host rows."""
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.rows)
            return Columns([self.pieces(j, start, max(start, stop)) or [c[0][:0]] for j, c in enumerate(self.columns)])
        if isinstance(index, (np.ndarray, list)) and np.asarray(index).ndim == 1:
            index = np.asarray(index)
            return self.take(np.flatnonzero(index) if index.dtype == np.bool_ else index)
        return np.asarray(self)[index]

    def take(self, index: np.ndarray) -> "Columns":
        """The rows `index` (0 <= i < N) as Columns of one chunk each: a column per thread, each made whole and
        gathered in one call (NumPy's take lets go of the GIL; thousands of calls on small pieces did not scale)."""
        index = np.asarray(index, np.int64)
        if len(index) and not (0 <= index.min() and index.max() < self.rows):
            raise IndexError(f"Columns.take: an index outside 0..{self.rows - 1}")
        out = [np.empty(len(index), self.column_dtype) for _ in self.columns]

        def gather(j: int) -> None:  # mode clip: NumPy buffers `out` under the default mode (raise), not here
            chunks = self.columns[j]
            np.take(chunks[0] if len(chunks) == 1 else np.concatenate(chunks), index, out=out[j], mode="clip")
        on_every_core(gather, list(range(len(self.columns))))
        return Columns([[o] for o in out])

    def __repr__(self) -> str:
        return f"Columns({self.rows} rows x {len(self.columns)} {self.column_dtype} columns)"
