"""Datasets from the four standard IDX files: find, download, verify, parse.

Why so strict: a half-downloaded or silently different dataset trains "fine" to the wrong numbers.
So every file is checked for structure (magic number, dimensions, exact size, label range), the four together
for consistency (one label per image, one image size), and a named dataset's files for their checksums
(`_verify` owns that rule). Every failure is a one-line DataError naming the file and what is wrong.

Named datasets (``DATASETS``): per file, first place wins: an explicit ``data_dir`` (else, for MNIST only,
``$RAWGPU_DATA``: it names a directory of MNIST files, so it cannot serve the others), then the cache
(``cache_dir``, else ``default_cache_dir() / name``). Each file may be stored raw or gzipped (``.gz``); raw is checked first.
Files missing everywhere are downloaded as ``.gz`` into the cache from the dataset's mirrors, verified, and
only then moved into place.

The ``"idx"`` set (``IDX``): the four files from ``data_dir`` only, of any size within the recipe's limits,
classes given by the labels; no cache, no download, no checksums, so every file is listed as unverified.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import struct
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from . import arrays
from ..runtime.dlpack import DeviceArray
from ..runtime.errors import DataError
from ..contract.shapes import IDX_MAX_CLASSES
from ..model.recipe import MAX_INPUTS, SettingError, SettingTypeError, shown

TIMEOUT_S = 30.0  # per socket operation, so a stalled mirror fails instead of hanging
CHUNK = 1 << 16
IMAGES_MAGIC = 0x00000803  # uint8, 3 dims: (N, rows, cols)
LABELS_MAGIC = 0x00000801  # uint8, 1 dim: (N,)

Progress = Callable[[str, int, int | None], None]  # (file name, bytes done, total or None)


@dataclass(frozen=True)
class FileSpec:
    """What one IDX file must look like and the checksums it is compared against ("" where none is known)."""

    name: str
    magic: int  # its low byte is the number of dimensions
    dims: tuple[int, ...] | None  # None: any size (the idx set), the set's own checks still apply
    sha256: str = ""  # of the decompressed content, so re-compressed .gz files still match
    gz_md5: str = ""  # of the published .gz file, the one torchvision checks


Found = tuple[np.ndarray, Path, bool]  # a parsed file: its array, where it came from, whether a checksum matched


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: its files by Dataset field, where to download them, and how messages name it."""

    name: str
    title: str
    files: Mapping[str, FileSpec]
    mirrors: tuple[str, ...] = ()
    classes: int | None = 10  # None: the labels say (max label + 1)
    env: str = ""  # an environment variable that may name the data directory
    cached: bool = True  # False: read from data_dir only, never cached or downloaded

    @property
    def hint(self) -> str:
        """The advice that ends every "not found" message."""
        if not self.cached:
            return f"--dataset {self.name} needs --data-dir DIR holding the four IDX files"
        where = f"--data-dir DIR or set ${self.env} to a directory" if self.env else "--data-dir DIR"
        return f"pass {where} holding the four {self.title} files"


_STANDARD = {  # Dataset field -> (file name, magic, dims of the 28 x 28 sets)
    "train_images": ("train-images-idx3-ubyte", IMAGES_MAGIC, (60000, 28, 28)),
    "train_labels": ("train-labels-idx1-ubyte", LABELS_MAGIC, (60000,)),
    "test_images": ("t10k-images-idx3-ubyte", IMAGES_MAGIC, (10000, 28, 28)),
    "test_labels": ("t10k-labels-idx1-ubyte", LABELS_MAGIC, (10000,)),
}


def _files(gz_md5: Mapping[str, str] | None = None, sha256: Mapping[str, str] | None = None, *,
           any_size: bool = False) -> dict[str, FileSpec]:
    """The four standard files with the given checksums (by Dataset field), 28 x 28 unless `any_size`."""
    return {field: FileSpec(name, magic, None if any_size else dims, (sha256 or {}).get(field, ""),
                            (gz_md5 or {}).get(field, ""))
            for field, (name, magic, dims) in _STANDARD.items()}


DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec("mnist", "MNIST", _files(
        gz_md5=dict(train_images="f68b3c2dcbeaaa9fbdd348bbdeb94873", train_labels="d53e105ee54ea40749a09fcbcd1e9432",
                    test_images="9fb629c4189551a2d022fa330f9573f3", test_labels="ec29112dd5afa0611ce80d1b7f02629c"),
        sha256=dict(train_images="ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
                    train_labels="65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
                    test_images="0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
                    test_labels="ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2")),
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/",
                 "https://storage.googleapis.com/cvdf-datasets/mnist/"),
        env="RAWGPU_DATA"),
    "fashion-mnist": DatasetSpec("fashion-mnist", "Fashion-MNIST", _files(
        gz_md5=dict(train_images="8d4fb7e6c68d591d4c3dfef9ec88bf0d", train_labels="25c81989df183df01b3e8a0aad5dffbe",
                    test_images="bef4ecab320f06d8554ea6380940ec79", test_labels="bb300cfdad3c16e7a12a480ee83cd310")),
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
                 "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/")),
    "kmnist": DatasetSpec("kmnist", "KMNIST", _files(
        gz_md5=dict(train_images="bdb82020997e1d708af4cf47b453dcf7", train_labels="e144d726b3acfaa3e44228e80efcd344",
                    test_images="5c965bf0a639b31b8f53240b1b52f4d7", test_labels="7320c461ea6c1c855c0b718fb2a4b134")),
        mirrors=("https://codh.rois.ac.jp/kmnist/dataset/kmnist/", "http://codh.rois.ac.jp/kmnist/dataset/kmnist/")),
}
IDX = DatasetSpec("idx", "IDX set", _files(any_size=True), classes=None, cached=False)
DATASET_NAMES = (*DATASETS, IDX.name)


# eq=False: comparing or hashing numpy arrays field by field is ambiguous; identity is what we want.
@dataclass(frozen=True, eq=False)
class Dataset:
    """The four arrays: inputs (N, features) and their targets. From IDX files: images flattened to (N, rows * cols)
    uint8, labels (N,) uint8 in 0..classes-1, read-only views of the checked file bytes (copy before modifying in
    place). From your own data (`from_arrays`, `from_tables`, data/arrays.py): features uint8, float16 or float32
    (image_shape (1, features)), and class labels int32 (N,) or, for a regression, values float32 (N, classes).
    ``source`` is where the training inputs came from; ``unverified`` lists the files that passed the structural
    checks only, because no checksum is known for them. ``features`` and ``targets`` name a table's columns."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    image_shape: tuple[int, int]
    classes: int
    source: Path
    unverified: tuple[str, ...] = ()
    regression: bool = False  # the targets are values (classes of them per row), not class labels
    features: tuple[str, ...] = ()  # a table's feature columns, in order (empty for images)
    targets: tuple[str, ...] = ()  # a table's target columns

    @classmethod
    def from_arrays(cls, x_train, y_train, x_test=None, y_test=None, **options) -> "Dataset":
        """A dataset of your own arrays (NumPy, or anything with __array__ or host __dlpack__): arrays.from_arrays
        says what it takes (regression, classes, test_fraction, seed, name, features, targets)."""
        return cls(**arrays.from_arrays(x_train, y_train, x_test, y_test, **options))

    @classmethod
    def from_tables(cls, path, **options) -> "Dataset":
        """A dataset of table files (.npy, .npz, CSV, Parquet): arrays.from_tables says what it takes (target,
        features, test, test_fraction, regression, seed, progress)."""
        return cls(**arrays.from_tables(path, **options))

    @classmethod
    def scored_table(cls, path, columns, regression: bool, classes: int, progress=None) -> "Dataset":
        """Every row of a table file as a test set for a trained model: arrays.scored_table."""
        return cls(**arrays.scored_table(path, columns, regression, classes, progress))

    def validation_split(self, fraction: float, seed: int) -> tuple["Dataset", "Dataset"]:
        """(the training rows less a seeded `fraction` of them, with those as its test set: what each epoch is
        scored on; the same training rows with the real test set: what the finished model is scored on once)."""
        n = len(self.train_images)
        if self.on_gpu:
            raise DataError(f"{self.name}: the training features are on the GPU; rawgpu draws a validation split from "
                            "host arrays only")
        take = int(round(n * fraction))
        if not 0.0 < fraction < 1.0 or take < 1 or take >= n:
            raise DataError(f"{self.name}: a validation fraction of {fraction} of {n} training rows leaves no "
                            "validation rows or no training rows")
        order = np.random.default_rng([seed, 1]).permutation(n)  # apart from the test split's draw
        keep, held = np.sort(order[take:]), np.sort(order[:take])
        train = dict(train_images=self.train_images[keep], train_labels=self.train_labels[keep])
        return (replace(self, **train, test_images=self.train_images[held], test_labels=self.train_labels[held]),
                replace(self, **train))

    @property
    def inputs(self) -> int:
        return self.image_shape[0] * self.image_shape[1]

    @property
    def is_table(self) -> bool:
        """Rows of features rather than images (no image shape to show)."""
        return bool(self.features) or self.train_images.dtype != np.uint8 or self.regression

    @property
    def input_dtype(self) -> str:
        """How the GPU keeps the features unless the recipe says otherwise: bytes as pixels (u8), floats as fp16;
        features already on the GPU as they are (fp32 stays fp32: no conversion there)."""
        if self.train_images.dtype == np.uint8:
            return "u8"
        return "fp32" if self.on_gpu and self.train_images.dtype == np.float32 else "fp16"

    @property
    def on_gpu(self) -> bool:
        """The features were handed over on the GPU (runtime/dlpack.py) and stay there."""
        return isinstance(self.train_images, DeviceArray) or isinstance(self.test_images, DeviceArray)

    def describe(self) -> str:
        """One line for a run's header: 'mnist: 60000 + 10000 images of 28x28, 10 classes'."""
        n, m = len(self.train_images), len(self.test_images)
        if not self.is_table:
            rows, cols = self.image_shape
            return f"{self.name}: {n} + {m} images of {rows}x{cols}, {self.classes} classes"
        what = f"{self.classes} value{'s' if self.classes > 1 else ''}" if self.regression else f"{self.classes} classes"
        return f"{self.name}: {n} + {m} rows of {self.inputs} {self.train_images.dtype} features, {what}"

    @property
    def verified(self) -> bool:
        return not self.unverified

    def digest(self) -> str:
        """A digest of the four arrays and the shape (BLAKE2b): equal on every host that holds the same data, which
        the ranks of a job on several hosts compare before they start."""
        if self.on_gpu:
            raise DataError(f"{self.name}: features on the GPU train on this process's GPU only; for a job of "
                            "several ranks pass host arrays or a file")
        h = hashlib.blake2b(digest_size=32)
        h.update(f"{self.name} {self.image_shape} {self.classes} {self.regression}".encode())
        for a in (self.train_images, self.train_labels, self.test_images, self.test_labels):
            h.update(f"{a.shape}".encode())
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
        return h.hexdigest()


MNIST = Dataset


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of a dataset name; an unknown name is a caller's mistake, so a ValueError listing the choices."""
    spec = IDX if name == IDX.name else DATASETS.get(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    return spec


def check_data_argument(data: object, *, none_ok: bool = False, also: tuple[str, ...] = (),
                        name: str = "data", arrays_ok: bool = False) -> None:
    """The data a Trainer or a Sweep is given: a Dataset, a name of DATASET_NAMES (or of `also`), or None where
    none_ok; else a SettingError naming the parameter (SettingTypeError for another type), one line."""
    names = (*also, *DATASET_NAMES)
    if isinstance(data, Dataset) or (data is None and none_ok) or (arrays_ok and isinstance(data, tuple)):
        return
    what = (f"a Dataset, {'a tuple of arrays (x, y), ' if arrays_ok else ''}one of {', '.join(names)}"
            + (" or None" if none_ok else ""))
    if isinstance(data, str):
        if data not in names:
            raise SettingError(name, f"must be {what}, got {data!r}")
        return
    raise SettingTypeError(name, f"must be {what}, got {shown(data)}")


def known_shape(name: str) -> dict[str, int] | None:
    """A dataset's shape from its table, so a run can be checked before any file is read; None for the idx set."""
    spec = dataset_spec(name)
    train, test = spec.files["train_images"].dims, spec.files["test_images"].dims
    if train is None or test is None or spec.classes is None:
        return None
    return dict(inputs=train[1] * train[2], classes=spec.classes, train_rows=train[0], test_rows=test[0])


def default_cache_dir() -> Path:
    """``$RAWGPU_CACHE`` or ``~/.cache/rawgpu``; each named dataset lives in a subdirectory named after it."""
    env = os.environ.get("RAWGPU_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rawgpu"


def load_dataset(name: str = "mnist", data_dir: str | Path | None = None, *, download: bool = True,
                 cache_dir: str | Path | None = None, mirrors: Sequence[str] | None = None,
                 progress: Progress | None = None) -> Dataset:
    """Find, check and parse the four files of dataset `name`, downloading missing ones into the cache.

    ``cache_dir`` is the directory for this dataset's files (default ``default_cache_dir() / name``).
    ``progress(name, bytes_done, total_or_None)`` is called while downloading, so a CLI can draw a bar.
    Raises DataError (one line, naming the file) on anything missing, corrupt, inconsistent or undownloadable.
    """
    spec = dataset_spec(name)
    user_dir = _user_dir(spec, data_dir)
    cache = None
    if spec.cached:
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / spec.name
    mirrors = spec.mirrors if mirrors is None else mirrors
    found = {field: _load_one(spec, file, user_dir, cache, download, mirrors, progress)
             for field, file in spec.files.items()}
    return _assemble(spec, found)


def load_mnist(data_dir: str | Path | None = None, *, download: bool = True, cache_dir: str | Path | None = None,
               mirrors: Sequence[str] | None = None, progress: Progress | None = None) -> Dataset:
    """``load_dataset("mnist", ...)``."""
    return load_dataset("mnist", data_dir, download=download, cache_dir=cache_dir, mirrors=mirrors,
                        progress=progress)


def missing_files(directory: str | Path, name: str = "mnist") -> list[str]:
    """The dataset's files (raw or .gz) that `directory` lacks: every one when it is not a directory."""
    d = Path(directory).expanduser()
    return [f.name for f in dataset_spec(name).files.values() if not d.is_dir() or _find(f.name, d) is None]


def _user_dir(spec: DatasetSpec, data_dir: str | Path | None) -> Path | None:
    """`data_dir`, else the spec's environment variable; a set that is never cached requires an existing one."""
    user = data_dir if data_dir not in (None, "") else (os.environ.get(spec.env) if spec.env else None) or None
    user_dir = Path(user).expanduser() if user else None
    if not spec.cached and (user_dir is None or not user_dir.is_dir()):
        raise DataError(f"{user_dir}: not a directory; {spec.hint}" if user_dir else spec.hint)
    return user_dir


def _load_one(spec: DatasetSpec, file: FileSpec, user_dir: Path | None, cache: Path | None, download: bool,
              mirrors: Sequence[str], progress: Progress | None) -> Found:
    """One file from the first place that has it; a corrupt user file is an error, a corrupt cached one is re-fetched."""
    if user_dir is not None and (path := _find(file.name, user_dir)) is not None:
        return _read(spec, file, path)  # never delete what the user pointed us at
    while cache is not None and (path := _find(file.name, cache)) is not None:
        try:
            return _read(spec, file, path)
        except DataError as e:
            if not download:
                raise DataError(f"{e} (delete it, or allow download to fetch a fresh copy)") from None
            _remove(path)  # ours to replace; then look again (a .gz may sit beside a bad raw file)
    where = ", ".join(str(d) for d in (user_dir, cache) if d is not None)
    if cache is None or not download:
        off = "downloading is off; " if cache is not None else ""
        raise DataError(f"{spec.title} file {file.name} (or {file.name}.gz) not found in {where}; {off}{spec.hint}")
    return _download(spec, file, cache, mirrors, progress, where)


def _find(name: str, directory: Path) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise DataError(f"{path}: corrupt cached file and cannot delete it: {e.strerror or e}") from None


def _read(spec: DatasetSpec, file: FileSpec, path: Path) -> Found:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    array, verified = _decode(blob, path.suffix == ".gz", spec, file, str(path))
    return array, path, verified


def _decode(blob: bytes, gzipped: bool, spec: DatasetSpec, file: FileSpec, where: str) -> tuple[np.ndarray, bool]:
    """Decompress, check structure (specific messages), then the checksum (catches everything else)."""
    content = blob
    if gzipped:
        try:
            content = gzip.decompress(blob)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{where}: not a gzip file / corrupt gzip stream ({_one_line(e)})") from None
    array = _parse_idx(content, file, spec.classes or IDX_MAX_CLASSES, where)
    return array, _verify(file, blob if gzipped else None, content, spec.title, where)


def _verify(file: FileSpec, gz: bytes | None, content: bytes, title: str, where: str) -> bool:
    """The checksum rule: a .gz passes on its published MD5 or on its content's SHA-256, a raw file on the SHA-256.

    True when a known checksum matches, False when none is known (structure was all there was to check).
    The content hash lets a re-compressed .gz through: its bytes differ, its pixels do not.
    """
    known = []
    if gz is not None and file.gz_md5:
        known.append(("MD5", file.gz_md5, lambda: hashlib.md5(gz, usedforsecurity=False).hexdigest()))
    if file.sha256:
        known.append(("SHA-256", file.sha256, lambda: hashlib.sha256(content).hexdigest()))
    if not known:
        return False
    got = []
    for label, expected, digest in known:
        if (value := digest()) == expected:
            return True
        got.append(f"{label} {value}")
    wanted = " or ".join(f"{label} {expected}" for label, expected, _ in known)
    raise DataError(f"{where}: checksum mismatch: expected {wanted}, got {', '.join(got)}; "
                    f"the file is corrupt or not the standard {title}")


def _parse_idx(blob: bytes, file: FileSpec, label_limit: int, where: str) -> np.ndarray:
    """The array the header describes, images (N, rows, cols), labels (N,) checked to be below `label_limit`."""
    ndim = file.magic & 0xFF
    header = 4 + 4 * ndim
    if len(blob) >= 4 and (magic := int.from_bytes(blob[:4], "big")) != file.magic:
        got = f"{magic & 0xFF}-dim IDX file (magic 0x{magic:08x})" if magic >> 8 == file.magic >> 8 else \
            f"bad magic number 0x{magic:08x}"
        raise DataError(f"{where}: {got}; expected magic 0x{file.magic:08x}: uint8, {ndim} dims")
    if len(blob) < header:
        raise DataError(f"{where}: truncated: a {ndim}-dim header needs {header} bytes, got {len(blob)}")
    dims = struct.unpack(f">{ndim}I", blob[4:header])
    if file.dims is not None and dims != file.dims:
        raise DataError(f"{where}: wrong dimensions {dims} (expected {file.dims})")
    if 0 in dims:
        raise DataError(f"{where}: empty: dimensions {dims}, each must be at least 1")
    expected = header + math.prod(dims)
    if len(blob) < expected:
        raise DataError(f"{where}: truncated: expected {expected} bytes, got {len(blob)}")
    if len(blob) > expected:
        raise DataError(f"{where}: {len(blob) - expected} trailing bytes: expected {expected} bytes, "
                        f"got {len(blob)}")
    array = np.frombuffer(blob, dtype=np.uint8, offset=header)
    if ndim == 1:
        bad = np.flatnonzero(array >= label_limit)
        if bad.size:
            raise DataError(f"{where}: label out of range: {array[bad[0]]} at index {bad[0]} "
                            f"(expected 0..{label_limit - 1})")
    return array.reshape(dims)


def _assemble(spec: DatasetSpec, found: Mapping[str, Found]) -> Dataset:
    """Check the four files against each other, then the classes: the spec's, else the labels' (max + 1)."""
    for images, labels in (("train_images", "train_labels"), ("test_images", "test_labels")):
        (x, x_path, _), (y, y_path, _) = found[images], found[labels]
        if len(y) != len(x):
            raise DataError(f"{y_path}: {len(y)} labels for the {len(x)} images of {x_path}")
    (train, train_path, _), (test, test_path, _) = found["train_images"], found["test_images"]
    rows, cols = train.shape[1:]
    if test.shape[1:] != train.shape[1:]:
        raise DataError(f"{test_path}: images of {test.shape[1]}x{test.shape[2]}, but those of {train_path} are "
                        f"{rows}x{cols}")
    if rows * cols > MAX_INPUTS:
        raise DataError(f"{train_path}: images of {rows}x{cols} = {rows * cols} pixels; at most {MAX_INPUTS} fit")
    classes = spec.classes
    if classes is None:
        label_files = (found["train_labels"], found["test_labels"])
        classes = max(int(y.max()) for y, _, _ in label_files) + 1
        if classes < 2:
            raise DataError(f"{', '.join(str(p) for _, p, _ in label_files)}: every label is 0, a single class; "
                            "at least 2 are needed")
    return Dataset(spec.name, train.reshape(len(train), -1), found["train_labels"][0],
                   test.reshape(len(test), -1), found["test_labels"][0], (rows, cols), classes,
                   train_path.parent, tuple(str(path) for _, path, verified in found.values() if not verified))


def _download(spec: DatasetSpec, file: FileSpec, cache: Path, mirrors: Sequence[str], progress: Progress | None,
              where: str) -> Found:
    """Try each mirror in turn; the first verified copy wins, failures leave nothing behind (not even the cache
    folders this call created, when they stay empty)."""
    created = [d for d in (cache, *cache.parents) if not d.exists()]  # innermost first
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{cache}: cannot create the cache directory ({e.strerror or e}); {spec.hint}") from None
    found = None
    try:
        reason = "no download mirrors configured"
        for mirror in mirrors:
            url = mirror.rstrip("/") + f"/{file.name}.gz"
            try:
                found = _fetch_verified(url, spec, file, cache, progress)
                return found
            except DataError as e:
                reason = _one_line(e)  # already names the URL
            except (OSError, http.client.HTTPException, ValueError) as e:
                reason = f"{url}: {_one_line(e) or type(e).__name__}"
        raise DataError(f"{spec.title} file {file.name} not found in {where} and download failed ({reason}); "
                        f"{spec.hint}")
    finally:
        if found is None:  # failed or interrupted
            _remove_empty(created)


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove these folders, innermost first, while they are empty (best effort: another process may fill one)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _fetch_verified(url: str, spec: DatasetSpec, file: FileSpec, cache: Path, progress: Progress | None) -> Found:
    """Stream to a temp file beside the target, verify it, then os.replace so the cache never holds a partial file."""
    final = cache / f"{file.name}.gz"
    tmp = tempfile.NamedTemporaryFile(dir=cache, prefix=f".{file.name}.", suffix=".part", delete=False)
    tmp_path = Path(tmp.name)
    try:
        with tmp:
            _stream(url, tmp, file.name, progress)
        array, verified = _decode(tmp_path.read_bytes(), True, spec, file, url)
        os.replace(tmp_path, final)
        return array, final, verified
    finally:
        tmp_path.unlink(missing_ok=True)  # no-op after a successful replace


def _stream(url: str, out, name: str, progress: Progress | None) -> None:
    """Copy the body to `out`; progress at the start, per chunk, and once more at the end with the total known."""
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        length = response.headers.get("Content-Length", "")
        total = int(length) if length.isdigit() else None
        done = 0
        if progress:
            progress(name, done, total)
        while chunk := response.read(CHUNK):
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(name, done, total)
    if total is not None and done != total:  # http.client does not raise on a short body
        raise ConnectionError(f"connection closed after {done} of {total} bytes")
    if progress:
        progress(name, done, done)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
