"""Experiment (no GPU): the ways to turn a Parquet file's columns into the rows the GPU takes, on this host's cores.

    PYTHONPATH=.:scripts python dev/read_fill.py [--gigabytes G] [--dir D] [--trials N]

tables.read spends what pyarrow's read does not on one pass: a thread per block of rows writes each column into the
rows (a strided write) and checks the block. Timed here, medians of --trials, on bench.py read's Parquet file:
- pyarrow: pq.read_table alone (the target's reference; 1.5x of it is the issue's bound);
- rows SUB: the product's fill (tables._rows' blocks and threads) into a fresh array, each block in sub-blocks of SUB
  rows (0: whole blocks, as the product does), on 4 KB pages (np.empty) or huge pages (host_rows.empty_rows);
- columns: each column copied whole into a column-major array and checked (a transposing upload's host side: the
  GPU would turn them into rows);
- after the read, what a run without --test does on the host before the upload: the seeded test split (a gather of
  rows; its parts too: the permutation, the gather as NumPy's and on the threads) and the features kept as fp16
  (model.mlp.kept_features).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import reading
from rawgpu.data import tables
from rawgpu.runtime import host_rows


def median_seconds(fn, trials: int) -> float:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def rows_fill(cols: list[np.ndarray], alloc, sub: int):
    n = len(cols[0])

    def run():
        x = alloc((n, len(cols)), np.float32)

        def fill(a: int, b: int) -> bool:
            step = sub or b - a
            for s in range(a, b, step):
                e = min(s + step, b)
                for j, c in enumerate(cols):
                    x[s:e, j] = c[s:e]
            return bool(np.isfinite(x[a:b]).all())
        assert all(host_rows.in_blocks(n, fill))
        return x
    return run


def columns_fill(cols: list[np.ndarray], alloc):
    n = len(cols[0])

    def run():
        xt = alloc((len(cols), n), np.float32)  # [F, n]: each column contiguous

        def fill(a: int, b: int) -> bool:
            for j, c in enumerate(cols):
                xt[j, a:b] = c[a:b]
            return bool(np.isfinite(xt[:, a:b]).all())
        assert all(host_rows.in_blocks(n, fill))
        return xt
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/tables")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    import pyarrow.parquet as pq

    path = reading.make_files(Path(args.dir), args.gigabytes)["parquet"]
    table = pq.read_table(path)
    cols = [c.to_numpy() for c in table.columns[:-1]]  # the float features (the label last)
    print(f"{path}: {table.num_rows} rows x {len(cols)} features, {table.column(0).num_chunks} chunks a column")
    print(f"pyarrow read_table            {median_seconds(lambda: pq.read_table(path), args.trials):.4f} s")
    print(f"tables.read                   {median_seconds(lambda: tables.read(path), args.trials):.4f} s")
    for pages, alloc in (("4 KB pages", np.empty), ("huge pages", host_rows.empty_rows)):
        for sub in (0, 4096, 16384):
            t = median_seconds(rows_fill(cols, alloc, sub), args.trials)
            print(f"rows, sub-blocks {sub or 'none':>5}, {pages}  {t:.4f} s")
        print(f"columns, {pages}              {median_seconds(columns_fill(cols, alloc), args.trials):.4f} s")
    from rawgpu.model.mlp import kept_features

    read = tables.read(path)
    split = median_seconds(lambda: tables.split(read, 0.1, 0, "test"), args.trials)
    print(f"split 10% (rows gathered)     {split:.4f} s")
    n = len(read)  # the split's parts: its seeded permutation, and the training rows' gather as NumPy and threaded
    order = np.sort(np.random.default_rng(0).permutation(n)[n // 10:])
    for name, fn in (("the permutation", lambda: np.random.default_rng(0).permutation(n)),
                     ("the gather, x[index]", lambda: read.x[order]),
                     ("the gather, take_rows", lambda: host_rows.take_rows(read.x, order))):
        print(f"  {name:<27} {median_seconds(fn, args.trials):.4f} s")
    print(f"features as fp16              "
          f"{median_seconds(lambda: kept_features(read.x, 'fp16', 'x'), args.trials):.4f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
