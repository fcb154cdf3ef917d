"""Experiment: a Parquet table to the GPU's fp16 rows, the product's way beside a transposing upload.

    PYTHONPATH=.:scripts python dev/transpose_upload/run.py [--gigabytes G] [--dir D] [--trials N] [--chunk-rows R]

The product (data/tables.py, model/mlp.py) makes the rows on the host: tables.read (pyarrow's read, then a thread
per block of rows writes the columns into float32 rows and checks them), the features kept as fp16 (threads), one
upload. A transposing upload keeps pyarrow's columns: their buffers go to the GPU as they are (a chunk of rows of
every column at a time, into a staging area), and columns_to_rows.cu makes the fp16 rows there, with the host's
range check. Timed per stage (wall clock, the GPU synchronised; medians of --trials) on bench.py read's Parquet
file; the two results must be the same bytes. Only the staging area's chunk of rows is extra GPU memory. What the
issue's read bound (1.5x pyarrow's read) would measure is the host part before the upload. Not part of the product
(dev/README.md); its numbers go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import reading
from rawgpu.data import tables
from rawgpu.model.mlp import kept_features
from rawgpu.runtime import compiler, driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

TILE_ROWS, MAX_FEATURES = 128, 64  # columns_to_rows.cu's


def timed(fn, trials: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(trials):
        t0 = time.perf_counter()
        out = fn()
        driver.context_synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def column_views(table, names: list[str]) -> list[list[np.ndarray]]:
    """Each column's chunks as NumPy views of Arrow's buffers (no copy: float32, none missing)."""
    return [[c.to_numpy(zero_copy_only=True) for c in table.column(n).chunks if len(c)] for n in names]


def upload_columns(views: list[list[np.ndarray]], rows: int, staging_ptr: int, chunk_rows: int, launch,
                   copy=driver.copy_host_to_device) -> None:
    """Per chunk of rows: each column's rows into the staging area (column c at + c * chunk_rows floats, by
    copy(address, array)), then launch(row0, rows) over them; pieces of Arrow chunks are copied where they fall."""
    starts = [np.cumsum([0] + [len(v) for v in col]) for col in views]
    for row0 in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - row0)
        for c, col in enumerate(views):
            at, dst = row0, staging_ptr + c * chunk_rows * 4
            while at < row0 + n:
                i = int(np.searchsorted(starts[c], at, side="right")) - 1
                end = min(row0 + n, int(starts[c][i + 1]))
                piece = col[i][at - starts[c][i]:end - starts[c][i]]
                copy(dst, piece)
                dst += piece.nbytes
                at = end
        launch(row0, n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/tables")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--chunk-rows", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args), "transpose_upload")


def run(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    path = reading.make_files(Path(args.dir), args.gigabytes)["parquet"]
    device = driver.Device(0)
    module = driver.Module.of(compiler.compile_file(Path(__file__).with_name("columns_to_rows.cu"), device.arch))
    kernel = module.kernel("columns_to_rows")
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).name for i in range(meta.num_columns) if meta.schema.column(i).name != "label"]
    rows, features = meta.num_rows, len(names)
    ld = features  # the product's features tensor: [rows, inputs], unpadded (the gather pads)
    if features > MAX_FEATURES:
        print(f"transpose_upload: {features} features, the kernel takes {MAX_FEATURES}", file=sys.stderr)
        return 1
    chunk = min(args.chunk_rows, rows)
    print(f"{device.name}: {path}, {rows} rows x {features} float32 features, staging chunks of {chunk} rows")

    with Arena() as arena:
        x16 = arena.tensor("rows", (rows, ld), np.float16)
        staging = arena.tensor("staging", (features, chunk), np.float32)
        bad = arena.tensor("bad", (1,), np.uint64)
        arena.allocate()
        arena.zero()
        stream = driver.Stream()

        # the product's way
        t_read, table = timed(lambda: tables.read(path), args.trials)
        t_fp16, host16 = timed(lambda: kept_features(table.x, "fp16", "x"), args.trials)
        padded = np.ascontiguousarray(host16)
        t_up, _ = timed(lambda: driver.copy_host_to_device(x16.ptr, padded), args.trials)
        product = t_read + t_fp16 + t_up
        print(f"product:   tables.read {t_read:.4f} s, fp16 rows {t_fp16:.4f} s, upload {t_up:.4f} s: "
              f"{product:.4f} s")

        # the transposing upload
        def launch(row0: int, n: int) -> None:
            driver.context_synchronize()  # the chunk's pageable copies have landed (they are not ordered with `stream`)
            kernel.bind(-(-n // TILE_ROWS), 256, 0, staging, chunk, n, features, ld, row0,
                        x16.ptr + row0 * ld * 2, bad).run(stream)
            stream.synchronize()  # the staging area is reused by the next chunk

        t_arrow, arrow = timed(lambda: pq.read_table(path), args.trials)
        t_views, views = timed(lambda: column_views(arrow, names), args.trials)
        x16.fill_bytes(0xFF)
        bad.upload(np.array([np.iinfo(np.uint64).max], np.uint64))
        t_cols, _ = timed(lambda: upload_columns(views, rows, staging.ptr, chunk, launch), args.trials)
        transposing = t_arrow + t_views + t_cols
        print(f"transposing: pyarrow read {t_arrow:.4f} s, column views {t_views:.4f} s, chunks up + kernel "
              f"{t_cols:.4f} s: {transposing:.4f} s ({product / transposing:.2f}x the product's)")
        same = np.array_equal(x16.download().view(np.uint16), padded.view(np.uint16))
        first_bad = int(bad.download()[0])
        print(f"the same bytes as the product's rows: {same}; range check: "
              f"{'none bad' if first_bad == np.iinfo(np.uint64).max else f'first bad at {first_bad}'}")
        return 0 if same and first_bad == np.iinfo(np.uint64).max else 1


if __name__ == "__main__":
    raise SystemExit(main())
