"""Your own data, checked: arrays in memory (`from_arrays`) or table files (`from_tables`, data/tables.py reads
them), each into the fields of a datasets.Dataset (`Dataset.from_arrays`, `Dataset.from_tables` build it), every
problem one line before any GPU work.

Features may be uint8 (read as pixels, / 255), float16 or float32 (other numbers become float32, checked to fit), of
any width from 1 to MAX_INPUTS; features already on the GPU (DLPack: a PyTorch tensor, a JAX array) stay there
(runtime/dlpack.py); targets are class labels (whole numbers in 0..classes-1, classes 2..MAX_CLASSES) or, for
a regression, 1..MAX_OUTPUTS values per row. Without a test set, a seeded `test_fraction` of the rows is held out, the
same rows on every host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import tables
from ..runtime.columns import Columns
from ..runtime.dlpack import FEATURE_DTYPES, DeviceArray, on_gpu
from ..contract.shapes import MAX_CLASSES, MAX_INPUTS, MAX_OUTPUTS
from ..runtime.errors import DataError

TEST_FRACTION = 0.1  # held out when no test set is given


def host_array(a: Any, what: str) -> np.ndarray:
    """A NumPy view of `a`: an ndarray, anything with __array__, or a host array handed over by DLPack; a GPU array
    (DLPack on a CUDA device) copied to the host (targets, rows to predict: small next to the features, which
    `_features` leaves on the GPU)."""
    if isinstance(a, np.ndarray):
        return a
    if on_gpu(a):
        return np.asarray(a if isinstance(a, DeviceArray) else DeviceArray(a, what))
    if hasattr(a, "__dlpack_device__"):
        kind = int(a.__dlpack_device__()[0])
        if kind not in (1, 3):  # kDLCPU, kDLCUDAHost: host memory NumPy can view
            raise DataError(f"{what}: an array on DLPack device type {kind}, which rawgpu cannot read; pass it as a "
                            "host array or on the GPU")
        try:
            return np.from_dlpack(a)
        except (TypeError, BufferError, RuntimeError):
            pass  # a host array of a dtype DLPack cannot hand NumPy: __array__ below
    try:
        return np.asarray(a)
    except Exception as exc:  # noqa: BLE001 - any library's conversion error means "not an array"
        raise DataError(f"{what}: not an array ({type(a).__name__}: {' '.join(str(exc).split())})") from None


def _features(x: Any, what: str) -> np.ndarray | DeviceArray:
    """Rows x features, checked: a host array as `numbers` takes it, or a GPU array as it is (its values are checked
    on the GPU, where the model copies it: MLP.upload_data)."""
    a = (x if isinstance(x, DeviceArray) else DeviceArray(x, what)) if on_gpu(x) else host_array(x, what)
    if isinstance(a, DeviceArray) and a.dtype not in FEATURE_DTYPES:
        raise DataError(f"{what}: a GPU array of {a.dtype}; rawgpu takes uint8, float16 or float32 features on the "
                        "GPU (convert it there first, e.g. x.float() or x.half())")
    if a.ndim == 1:
        a = a.reshape(-1, 1)
    if a.ndim != 2:
        if a.ndim > 2 and a.dtype == np.uint8:  # images [N, rows, cols]: flattened as IDX images are
            a = a.reshape(len(a), -1)
        else:
            raise DataError(f"{what}: expected rows x features, got shape {a.shape}")
    if len(a) == 0:
        raise DataError(f"{what}: no rows")
    if not 1 <= a.shape[1] <= MAX_INPUTS:
        raise DataError(f"{what}: {a.shape[1]} features per row; rawgpu takes 1 to {MAX_INPUTS}")
    return a if isinstance(a, DeviceArray) else numbers(a, what)


def numbers(a: np.ndarray, what: str) -> np.ndarray:
    """Rows of features [N, F] as the GPU takes them: uint8, float16 and float32 as they are, other real numbers as
    float32 (checked to fit); DataError naming the row and column of a value that is no number or not finite."""
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_) or np.iscomplexobj(a):
        raise DataError(f"{what}: holds {a.dtype}, not real numbers")
    if a.dtype not in (np.uint8, np.float16, np.float32):
        wide = a.astype(np.float64)
        if (at := tables.too_large(wide, np.float32)) is not None:
            raise DataError(f"{what}: row {at[0]}, column {at[1]}: {wide[at]:g} does not fit float32")
        a = wide.astype(np.float32)
    if a.dtype != np.uint8:
        bad = ~np.isfinite(a)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise DataError(f"{what}: row {r}, column {c}: {a[r, c]} (every value must be finite)")
    return a


def _targets(y: Any, rows: int, what: str, regression: bool, classes: int | None) -> tuple[np.ndarray, int]:
    """Labels int32 [N] and the classes (given, else the largest label + 1), or values float32 [N, K] and K."""
    a = host_array(y, what)
    if a.ndim not in (1, 2) or len(a) != rows:
        raise DataError(f"{what}: expected {rows} targets (one value or row per row of features), got shape {a.shape}")
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_) or np.iscomplexobj(a):
        raise DataError(f"{what}: holds {a.dtype}, not real numbers")
    wide = a.reshape(rows, -1).astype(np.float64)
    bad = ~np.isfinite(wide)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise DataError(f"{what}: row {r}: {wide[r, c]} (every target must be finite)")
    if regression:
        if not 1 <= wide.shape[1] <= MAX_OUTPUTS:
            raise DataError(f"{what}: a regression has 1 to {MAX_OUTPUTS} values per row, got {wide.shape[1]}")
        return wide.astype(np.float32), wide.shape[1]
    if wide.shape[1] != 1:
        raise DataError(f"{what}: class labels are one per row, got {wide.shape[1]} per row "
                        "(for several values per row use a regression loss)")
    labels = wide[:, 0]
    whole = np.floor(labels) == labels
    if not whole.all():
        r = int(np.argmin(whole))
        raise DataError(f"{what}: row {r}: label {labels[r]:g} is not a whole number (for values use a regression "
                        "loss: regression=True, --loss mse)")
    limit = classes if classes is not None else MAX_CLASSES
    out = (labels < 0) | (labels >= limit)
    if out.any():
        r = int(np.argmax(out))
        raise DataError(f"{what}: row {r}: label {int(labels[r])} is out of range 0..{limit - 1}"
                        + ("" if classes is not None else f" (at most {MAX_CLASSES} classes)"))
    return labels.astype(np.int32), classes if classes is not None else max(2, int(labels.max()) + 1)


def from_arrays(x_train: Any, y_train: Any, x_test: Any = None, y_test: Any = None, *, regression: bool | None = None,
                classes: int | None = None, test_fraction: float = TEST_FRACTION, seed: int = 0,
                name: str = "arrays", features: Sequence[str] | None = None,
                targets: Sequence[str] | None = None) -> dict[str, Any]:
    """The Dataset fields of your arrays. x: rows x features (uint8 as pixels, float16, float32; other numbers become float32);
    y: class labels (whole numbers) or, with regression, values [N] or [N, K]. regression None: values when y is
    of a floating dtype, labels otherwise. classes: the number of classes (default the largest label + 1). Without
    x_test and y_test, a seeded test_fraction of the rows is held out. DataError (one line) on anything wrong."""
    if (x_test is None) != (y_test is None):
        raise DataError("from_arrays: give x_test and y_test together, or neither")
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, (int, np.integer))
                                or not 2 <= classes <= MAX_CLASSES):
        raise DataError(f"from_arrays: classes must be an integer in 2..{MAX_CLASSES}, got {classes!r}")
    x = _features(x_train, "x_train")
    y_host = host_array(y_train, "y_train")  # once: a GPU array's targets are copied to the host here
    if regression is None:
        regression = np.issubdtype(y_host.dtype, np.floating)
    y, outputs = _targets(y_host, len(x), "y_train", bool(regression), classes)
    if x_test is None:
        if isinstance(x, DeviceArray):
            raise DataError("x_train is on the GPU: pass x_test and y_test too (rawgpu draws a held-out split from "
                            "host arrays only)")
        if not 0.0 < test_fraction < 1.0:
            raise DataError(f"from_arrays: test_fraction must be between 0 and 1, got {test_fraction}")
        take = int(round(len(x) * test_fraction))
        if take < 1 or take >= len(x):
            raise DataError(f"from_arrays: a test_fraction of {test_fraction} of {len(x)} rows leaves no test rows or "
                            "no training rows; pass x_test and y_test")
        order = np.random.default_rng(seed).permutation(len(x))
        train, test = np.sort(order[take:]), np.sort(order[:take])
        xt, yt = x[test], y[test]
        x, y = x[train], y[train]
    else:
        xt = _features(x_test, "x_test")
        if xt.shape[1] != x.shape[1]:
            raise DataError(f"x_test: {xt.shape[1]} features per row, x_train has {x.shape[1]}")
        if xt.dtype != x.dtype and (isinstance(x, DeviceArray) or isinstance(xt, DeviceArray)):
            raise DataError(f"x_test: {xt.dtype} features, x_train's are {x.dtype} (features on the GPU are used as "
                            "they are: give both the same dtype)")
        if xt.dtype != x.dtype:
            if x.dtype == np.uint8:
                raise DataError(f"x_test: {xt.dtype} features, x_train's are uint8 pixels")
            if (at := tables.too_large(xt, x.dtype)) is not None:  # x_train's dtype holds x_test's values
                raise DataError(f"x_test: row {at[0]}, column {at[1]}: {float(xt[at]):g} does not fit {x.dtype}, "
                                "x_train's dtype")
            xt = xt.astype(x.dtype)
        yt, _ = _targets(y_test, len(xt), "y_test", bool(regression), None if regression else outputs)
        if regression and yt.shape[1] != outputs:
            raise DataError(f"y_test: {yt.shape[1]} values per row, y_train has {outputs}")
    feature_names = tuple(features) if features is not None else ()
    if feature_names and len(feature_names) != x.shape[1]:
        raise DataError(f"from_arrays: {len(feature_names)} feature names for {x.shape[1]} features")
    return _fields(name, x, y, xt, yt, outputs, Path(name), bool(regression), feature_names,
                   tuple(targets) if targets is not None else ())


def _fields(name: str, x, y, xt, yt, outputs: int, source: Path, regression: bool, features: tuple,
            targets: tuple) -> dict[str, Any]:
    # GPU arrays stay where they are, and a table's columns as they are (the GPU makes their rows: runtime/columns.py)
    kept = lambda a: a if isinstance(a, (DeviceArray, Columns)) else np.ascontiguousarray(a)  # noqa: E731
    return dict(name=name, train_images=kept(x), train_labels=np.ascontiguousarray(y),
                test_images=kept(xt), test_labels=np.ascontiguousarray(yt),
                image_shape=(1, x.shape[1]), classes=outputs, source=source, regression=regression, features=features,
                targets=targets)


def from_tables(path: str | Path, *, target: str | Sequence[str] | None = None, features: Sequence[str] | None = None,
                test: str | Path | None = None, test_fraction: float = TEST_FRACTION, regression: bool = False,
                seed: int = 0, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The Dataset fields of table files (.npy, .npz, CSV, Parquet: data/tables.py): the training table at `path`, the test set
    from `test` (or the .npz's x_test/y_test, else a seeded test_fraction of the rows). The test table must have
    the training table's columns. progress(file, bytes done, total) while a CSV is read."""
    def read(p: Path, split: str) -> tables.Table:
        report = (lambda done, total: progress(str(p), done, total)) if progress is not None else None
        return tables.read(p, target=target, features=features, split=split, progress=report)

    path = Path(path)
    train = read(path, "train")
    if test is not None:
        held = read(Path(test), "test" if Path(test).suffix.lower() == ".npz" else "train")
        tables.same_columns(train, held, "test")
    elif path.suffix.lower() == ".npz" and _npz_has(path, "x_test"):
        held = read(path, "test")
    else:
        train, held = tables.split(train, test_fraction, seed, "test")
    if held.x.dtype != train.x.dtype:  # one dtype on the GPU: the wider of the two (bytes only where both are)
        wide = np.float32 if np.float32 in (held.x.dtype, train.x.dtype) else np.float16
        train, held = (t if t.x.dtype == wide else tables.Table(t.x.astype(wide), t.y, t.features, t.targets, t.source)
                       for t in (train, held))
    if regression:
        y, yt, outputs = tables.values(train), tables.values(held), train.y.shape[1]
    else:
        y, outputs = tables.labels(train)
        yt, _ = tables.labels(held, outputs)
    return _fields(path.stem, train.x, y, held.x, yt, outputs, path, regression, train.features, train.targets)


def _npz_has(path: Path, key: str) -> bool:
    return path.is_file() and key in tables.npz_keys(path)


def scored_table(path: str | Path, columns: dict[str, Any] | None, regression: bool, classes: int,
                 progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The Dataset fields of a table a trained model is scored on (evaluate): every row of `path` (an .npz's x_test
    and y_test where it has them) is a test row (and stands in as the training set the Dataset needs), read with the
    model's columns (a checkpoint's record: {"features": [...], "targets": [...]}; None: the file's own, the target
    last)."""
    report = (lambda done, total: progress(str(path), done, total)) if progress is not None else None
    columns, path = columns or {}, Path(path)
    split = "test" if path.suffix.lower() == ".npz" and _npz_has(path, "x_test") else "train"  # an .npz's test set
    table = tables.read(path, target=None if split == "test" else columns.get("targets") or None,
                        features=None if split == "test" else columns.get("features") or None, split=split,
                        progress=report)
    if regression:
        y = tables.values(table)
        if y.shape[1] != classes:
            raise DataError(f"{path}: {y.shape[1]} target columns; the model predicts {classes}")
    else:
        y, _ = tables.labels(table, classes)
    x = table.x if isinstance(table.x, Columns) else np.ascontiguousarray(table.x)
    return _fields(Path(path).stem, x, y, x, y, classes, Path(path), regression, table.features, table.targets)
