"""A table's columns into the model's rows on the GPU (runtime/columns.py): each chunk of rows goes up as the reader
holds it, a column at a time into a staging buffer, and columns_to_rows writes the rows from there (docs/perf.md:
Reading tables). The staging buffer is a few MB of the arena, planned where a model could take columns."""

from __future__ import annotations

import numpy as np

from ..contract import COLUMNS_MAX, COLUMNS_TILE_ROWS
from ..kernels import Kernels
from ..kernels import gather as kd
from ..runtime import driver as drv
from ..runtime.columns import Columns
from ..runtime.driver import Stream
from ..runtime.errors import DataError
from ..runtime.memory import Tensor

STAGING_BYTES = 16 << 20  # at most: every column's chunk of rows; larger chunks copy no faster (docs/perf.md)
WIDEST = 8  # bytes per value staged: float64 columns


def staging_bytes(rows: int, inputs: int) -> int:
    """The staging buffer a model of `inputs` features and up to `rows` rows a set plans: 0 where no table it takes
    stays columns (wider than COLUMNS_MAX); else room for a whole number of tiles of rows, at most STAGING_BYTES."""
    if not 1 <= inputs <= COLUMNS_MAX or rows < 1:
        return 0
    tiles = -(-rows // COLUMNS_TILE_ROWS)
    per_tile = COLUMNS_TILE_ROWS * inputs * WIDEST
    return max(1, min(tiles, STAGING_BYTES // per_tile)) * per_tile


def beyond_fp16(what: str, row: int, col: int, value: float) -> DataError:
    """The one line for a finite feature fp16 cannot hold, wherever the features become fp16 (mlp.kept_features on
    the host, upload_columns on the GPU)."""
    return DataError(f"{what}: row {row}, column {col}: {value:g} is beyond fp16's range (65504); keep the features "
                     "as fp32 (input_dtype fp32, --input-dtype fp32)")


def upload_columns(k: Kernels, x: Columns, tensor: Tensor, staging: Tensor, first: Tensor, what: str) -> None:
    """tensor [N, F] (fp16 or fp32) = the rows of x; DataError naming the first value the tensor's dtype cannot
    hold (a finite float beyond fp16's range: beyond_fp16)."""
    rows, features = x.shape
    if (rows, features) != tensor.shape:
        raise DataError(f"{what}: {rows} rows of {features} features, the model keeps {tensor.shape}")
    size = x.column_dtype.itemsize
    chunk = staging.nbytes // (features * size) // COLUMNS_TILE_ROWS * COLUMNS_TILE_ROWS
    if chunk < 1:
        raise ValueError(f"{what}: a staging buffer of {staging.nbytes} B holds no tile of {features} columns")
    cols = staging.view((features, chunk), x.column_dtype)
    first.upload(np.array([rows * features], np.uint64))
    stream = Stream()
    try:
        for row0 in range(0, rows, chunk):
            n = min(chunk, rows - row0)
            for j in range(features):
                at = cols.ptr + j * chunk * size
                for piece in x.pieces(j, row0, row0 + n):
                    drv.copy_host_to_device(at, np.ascontiguousarray(piece))
                    at += piece.nbytes
            drv.context_synchronize()  # the pageable copies have landed (they are not ordered with `stream`)
            kd.columns_to_rows(k, cols, n, tensor, row0, first).run(stream)
            stream.synchronize("the rows made from a table's columns")  # before the next chunk overwrites staging
    finally:
        stream.close()
    bad = int(first.download()[0])
    if bad < rows * features:
        row, col = divmod(bad, features)
        value = float(x.part(col, row, row + 1)[0])
        if tensor.dtype == np.float16:
            raise beyond_fp16(what, row, col, value)
        raise DataError(f"{what}: row {row}, column {col}: {value:g} does not fit {tensor.dtype}")
