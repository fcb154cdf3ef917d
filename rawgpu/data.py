"""MNIST from the four standard IDX files: find, download, verify, parse.

Why so strict: a half-downloaded or silently different dataset trains "fine" to the wrong numbers.
So every file is checked for structure (magic number, dimensions, exact size, label range) and then
for the SHA-256 of its decompressed content, and every failure is a one-line DataError naming the
file and what is wrong.

Where files come from, per file, first place wins: an explicit ``data_dir`` (else ``$RAWGPU_DATA``),
then the cache (``cache_dir``, else ``$RAWGPU_CACHE/mnist``, else ``~/.cache/rawgpu/mnist``).
Each file may be stored raw or gzipped (``.gz``); raw is checked first. Files missing everywhere are
downloaded into the cache from ``MIRRORS``, verified, and only then moved into place.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rawgpu.errors import DataError

MIRRORS = [
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
]
TIMEOUT_S = 30.0  # per socket operation, so a stalled mirror fails instead of hanging
CHUNK = 1 << 16
NUM_CLASSES = 10
IMAGES_MAGIC = 0x00000803  # uint8, 3 dims
LABELS_MAGIC = 0x00000801  # uint8, 1 dim
HINT = "pass --data-dir DIR or set $RAWGPU_DATA to a directory holding the four MNIST files"


@dataclass(frozen=True)
class FileSpec:
    """What one IDX file must look like; a table of these (FILES) drives loading, so tests can swap it."""

    name: str
    magic: int
    dims: tuple[int, ...]
    sha256: str  # of the decompressed content, so re-compressed .gz files still match


FILES: dict[str, FileSpec] = {
    "train_images": FileSpec("train-images-idx3-ubyte", IMAGES_MAGIC, (60000, 28, 28),
                             "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"),
    "train_labels": FileSpec("train-labels-idx1-ubyte", LABELS_MAGIC, (60000,),
                             "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"),
    "test_images": FileSpec("t10k-images-idx3-ubyte", IMAGES_MAGIC, (10000, 28, 28),
                            "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"),
    "test_labels": FileSpec("t10k-labels-idx1-ubyte", LABELS_MAGIC, (10000,),
                            "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"),
}


# eq=False: comparing or hashing numpy arrays field by field is ambiguous; identity is what we want.
@dataclass(frozen=True, eq=False)
class MNIST:
    """The four arrays, images flattened to (N, 784) uint8, labels (N,) uint8 in 0..9.

    The arrays are read-only views of the verified file bytes; copy before modifying in place.
    ``source`` is the directory the training images came from.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: Path


def default_cache_dir() -> Path:
    """``$RAWGPU_CACHE`` or ``~/.cache/rawgpu``; MNIST lives in its ``mnist`` subdirectory."""
    env = os.environ.get("RAWGPU_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rawgpu"


def load_mnist(data_dir: str | Path | None = None, *, download: bool = True,
               cache_dir: Path | None = None, mirrors: list[str] | None = None,
               progress: Callable[[str, int, int | None], None] | None = None) -> MNIST:
    """Find, verify and parse the four MNIST files, downloading missing ones into the cache.

    ``progress(name, bytes_done, total_or_None)`` is called while downloading, so a CLI can draw a bar.
    Raises DataError (one line, naming the file) on anything missing, corrupt or undownloadable.
    """
    user = data_dir if data_dir not in (None, "") else os.environ.get("RAWGPU_DATA") or None
    user_dir = Path(user).expanduser() if user else None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / "mnist"
    mirrors = MIRRORS if mirrors is None else mirrors
    arrays: dict[str, np.ndarray] = {}
    source: Path | None = None
    for field, spec in FILES.items():
        arrays[field], path = _load_one(spec, user_dir, cache, download, mirrors, progress)
        source = source or path.parent
    return MNIST(**arrays, source=source)


def _load_one(spec: FileSpec, user_dir: Path | None, cache: Path, download: bool,
              mirrors: list[str], progress) -> tuple[np.ndarray, Path]:
    """One file from the first place that has it; a corrupt user file is an error, a corrupt cached one is re-fetched."""
    if user_dir is not None and (path := _find(spec.name, user_dir)) is not None:
        return _read(spec, path), path  # never delete what the user pointed us at
    while (path := _find(spec.name, cache)) is not None:
        try:
            return _read(spec, path), path
        except DataError as e:
            if not download:
                raise DataError(f"{e} (delete it, or allow download to fetch a fresh copy)") from None
            _remove(path)  # ours to replace; then look again (a .gz may sit beside a bad raw file)
    where = ", ".join(str(d) for d in (user_dir, cache) if d is not None)
    if not download:
        raise DataError(f"MNIST file {spec.name} (or {spec.name}.gz) not found in {where}; "
                        f"downloading is off; {HINT}")
    return _download(spec, cache, mirrors, progress, where)


def missing_files(directory: str | Path) -> list[str]:
    """The MNIST files (raw or .gz) that `directory` lacks: every one when it is not a directory."""
    d = Path(directory).expanduser()
    return [spec.name for spec in FILES.values() if not d.is_dir() or _find(spec.name, d) is None]


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


def _read(spec: FileSpec, path: Path) -> np.ndarray:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    return _decode(blob, path.suffix == ".gz", spec, str(path))


def _decode(blob: bytes, gzipped: bool, spec: FileSpec, where: str) -> np.ndarray:
    """Decompress, check structure (specific messages), then check the hash (catches everything else)."""
    if gzipped:
        try:
            blob = gzip.decompress(blob)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{where}: not a gzip file / corrupt gzip stream ({_one_line(e)})") from None
    array = _parse_idx(blob, spec, where)
    digest = hashlib.sha256(blob).hexdigest()
    if digest != spec.sha256:
        raise DataError(f"{where}: SHA-256 mismatch: expected {spec.sha256}, got {digest}; "
                        "the file is corrupt or not the standard MNIST")
    return array


def _parse_idx(blob: bytes, spec: FileSpec, where: str) -> np.ndarray:
    ndim = len(spec.dims)
    header = 4 + 4 * ndim
    expected = header + math.prod(spec.dims)
    if len(blob) >= 4 and (magic := int.from_bytes(blob[:4], "big")) != spec.magic:
        raise DataError(f"{where}: bad magic number 0x{magic:08x} (expected 0x{spec.magic:08x})")
    if len(blob) < header:
        raise DataError(f"{where}: truncated: expected {expected} bytes, got {len(blob)}")
    dims = struct.unpack(f">{ndim}I", blob[4:header])
    if dims != spec.dims:
        raise DataError(f"{where}: wrong dimensions {dims} (expected {spec.dims})")
    if len(blob) < expected:
        raise DataError(f"{where}: truncated: expected {expected} bytes, got {len(blob)}")
    if len(blob) > expected:
        raise DataError(f"{where}: {len(blob) - expected} trailing bytes: expected {expected} bytes, "
                        f"got {len(blob)}")
    array = np.frombuffer(blob, dtype=np.uint8, offset=header)
    if ndim == 1:
        bad = np.flatnonzero(array >= NUM_CLASSES)
        if bad.size:
            raise DataError(f"{where}: label out of range: {array[bad[0]]} at index {bad[0]} "
                            f"(expected 0..{NUM_CLASSES - 1})")
        return array
    return array.reshape(dims[0], -1)


def _download(spec: FileSpec, cache: Path, mirrors: list[str], progress, where: str) -> tuple[np.ndarray, Path]:
    """Try each mirror in turn; the first verified copy wins, failures leave nothing behind."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{cache}: cannot create the cache directory ({e.strerror or e}); {HINT}") from None
    reason = "no download mirrors configured"
    for mirror in mirrors:
        url = mirror.rstrip("/") + f"/{spec.name}.gz"
        try:
            return _fetch_verified(url, spec, cache, progress)
        except DataError as e:
            reason = _one_line(e)  # already names the URL
        except (OSError, http.client.HTTPException, ValueError) as e:
            reason = f"{url}: {_one_line(e) or type(e).__name__}"
    raise DataError(f"MNIST file {spec.name} not found in {where} and download failed ({reason}); {HINT}")


def _fetch_verified(url: str, spec: FileSpec, cache: Path, progress) -> tuple[np.ndarray, Path]:
    """Stream to a temp file beside the target, verify it, then os.replace so the cache never holds a partial file."""
    final = cache / f"{spec.name}.gz"
    tmp = tempfile.NamedTemporaryFile(dir=cache, prefix=f".{spec.name}.", suffix=".part", delete=False)
    tmp_path = Path(tmp.name)
    try:
        with tmp:
            _stream(url, tmp, spec.name, progress)
        array = _decode(tmp_path.read_bytes(), True, spec, url)
        os.replace(tmp_path, final)
        return array, final
    finally:
        tmp_path.unlink(missing_ok=True)  # no-op after a successful replace


def _stream(url: str, out, name: str, progress) -> None:
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


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
