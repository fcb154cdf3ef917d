"""`bench.py read`: reading a table file with rawgpu (data/tables.py: parse, check every value, features and targets
as the GPU takes them) against pyarrow's own read of the same file (the parse alone), CSV and Parquet of about
--gigabytes GB, generated once into --dir; the median of --trials reads each, and how often a CSV read reported its
progress (the console shows it for reads over 2 s)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

COLUMNS = 30  # 29 float features and an integer label
BYTES_PER_CSV_ROW = COLUMNS * 11  # about: "-1.2345678," per value


def make_files(folder: Path, gigabytes: float, seed: int = 0) -> dict[str, Path]:
    """A CSV and a Parquet file of the same table (float32 features f0.., an int label), written once."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = int(gigabytes * 1e9 / BYTES_PER_CSV_ROW)
    paths = {"csv": folder / f"table-{gigabytes:g}gb.csv", "parquet": folder / f"table-{gigabytes:g}gb.parquet"}
    if all(p.exists() for p in paths.values()):
        return paths
    rng = np.random.default_rng(seed)
    columns = {f"f{j}": rng.normal(0, 1 + j, rows).astype(np.float32) for j in range(COLUMNS - 1)}
    columns["label"] = rng.integers(0, 7, rows).astype(np.int32)
    table = pa.table(columns)
    pcsv.write_csv(table, paths["csv"])
    pq.write_table(table, paths["parquet"])
    return paths


def time_reads(path: Path, trials: int) -> dict:
    """Median seconds of pyarrow's read and of rawgpu's, and the progress calls of rawgpu's last CSV read."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from rawgpu.data import tables

    own = (lambda: pq.read_table(path)) if path.suffix == ".parquet" else (lambda: pcsv.read_csv(path))
    calls: list[int] = []
    ours = lambda: tables.read(path, progress=lambda done, total: calls.append(done))  # noqa: E731
    arrow, rawgpu = [], []
    for _ in range(trials):  # alternated, so the page cache and the clock treat both alike
        for fn, out in ((own, arrow), (ours, rawgpu)):
            calls.clear()
            t0 = time.perf_counter()
            result = fn()
            out.append(time.perf_counter() - t0)
            del result
    a, r = statistics.median(arrow), statistics.median(rawgpu)
    return dict(file=str(path), bytes=path.stat().st_size, pyarrow_s=a, rawgpu_s=r, ratio=r / a,
                progress_calls=len(calls))


def run(folder: Path, gigabytes: float, trials: int) -> list[dict]:
    paths = make_files(folder, gigabytes)
    rows = []
    for kind in ("csv", "parquet"):
        row = time_reads(paths[kind], trials)
        rows.append(row)
        print(f"{kind:>8} {row['bytes'] / 1e9:6.2f} GB  pyarrow {row['pyarrow_s']:6.2f} s  rawgpu {row['rawgpu_s']:6.2f} s"
              f"  {row['ratio']:.2f}x  progress reports {row['progress_calls']}"
              f"  {'PASS' if row['ratio'] <= 1.5 else 'FAIL'} (target <= 1.5x)", flush=True)
    return rows
