"""Host arrays of rows made on every core: the work over blocks of rows, a thread per core (NumPy's copies, casts,
gathers and checks let go of the GIL), into arrays on huge pages where they are large.

A table of hundreds of MB goes through several such passes before its upload (columns into rows, the test split's
gather, the fp16 features); on one thread each took longer than pyarrow's read of the whole file (docs/perf.md:
Your own data)."""

from __future__ import annotations

import mmap
import os
from typing import Callable, Sequence

import numpy as np

# Rows a thread takes at a time: about two blocks a core, from ROW_BLOCK_LEAST to ROW_BLOCK_MOST rows. Every block
# costs Python calls (a table's fill: one per column), which the threads take in turn, so smaller blocks lose; far
# larger ones leave cores idle.
ROW_BLOCK_LEAST, ROW_BLOCK_MOST = 1 << 14, 1 << 16
HUGE_PAGES_FROM = 64 << 20  # bytes: rows this large are written on 2 MB pages


def block_rows(n: int) -> int:
    cores = os.cpu_count() or 1
    return min(ROW_BLOCK_MOST, max(ROW_BLOCK_LEAST, -(-n // (2 * cores))))


def on_every_core(work: Callable[[object], object], units: Sequence) -> list:
    """work(unit) for every unit on a thread per core (inline where there is one), the results in order."""
    from concurrent.futures import ThreadPoolExecutor

    if len(units) < 2:
        return [work(u) for u in units]
    with ThreadPoolExecutor(max_workers=min(len(units), os.cpu_count() or 1)) as pool:
        return list(pool.map(work, units))


def in_blocks(n: int, work: Callable[[int, int], object]) -> list:
    """work(start, stop) over blocks of block_rows(n) of n rows on a thread per core, the results in order."""
    rows = block_rows(n)
    if n <= rows:
        return [work(0, n)]
    return on_every_core(lambda a: work(a, min(a + rows, n)), range(0, n, rows))


def empty_rows(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty, on transparent huge pages where Linux gives them on request (madvise): the threads' first writes to
    hundreds of MB otherwise fault them in 4 KB at a time, which took longer than the writes themselves."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or size < HUGE_PAGES_FROM or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        pages.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, as np.empty's
        pass
    return np.frombuffer(pages, dtype).reshape(shape)


def take_rows(a: np.ndarray, index: np.ndarray) -> np.ndarray:
    """a[index] for a 1-D index of rows 0 <= i < len(a) (the rows of a split), gathered on every core."""
    if len(index) and not (0 <= index.min() and index.max() < len(a)):
        raise IndexError(f"take_rows: an index outside 0..{len(a) - 1}")
    out = empty_rows((len(index),) + a.shape[1:], a.dtype)

    def gather(i: int, j: int) -> None:  # mode clip: NumPy buffers `out` under the default mode (raise), not here
        np.take(a, index[i:j], axis=0, out=out[i:j], mode="clip")
    in_blocks(len(index), gather)
    return out
