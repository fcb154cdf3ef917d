"""Images to predict on, read from PNG, .npy or IDX files, and predictions written out as CSV or JSON.

The format is told by the content (magic bytes), so a misnamed file still reads; the suffix only shapes the error
when the content is of no known kind. Every image must already be the model's size: nothing is resized, cropped,
inverted or centred, since any of those would change the digit the model sees without telling the user. MNIST
digits are white on black; colour becomes gray with the ITU-R 601 weights and transparency is laid over black.

Every problem with an input is a one-line DataError naming the file and what is wrong.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np

from ..runtime.errors import DataError
from ..runtime.files import write_atomic

IMAGES_MAGIC = 0x00000803  # IDX: uint8, 3 dims
GZIP_MAGIC = b"\x1f\x8b"
NPY_MAGIC = b"\x93NUMPY"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R BT.601
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}  # what the PNG spec allows
RESAVE = "re-save it as an 8-bit non-interlaced PNG"


def read_images(paths: list[str | Path], image_shape: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    """All images of all files, in order, as uint8 (N, rows*cols), and one name per image.

    Each image must be exactly rows x cols: none is resized. A PNG or a single-image .npy is named by its path as
    given; an image from a file that holds a stack (IDX, or a .npy of shape (N, rows, cols) or (N, rows*cols)) by
    the path and its index, as ``digits.idx[3]``. A float .npy whose largest value is <= 1 is read as 0..1, any
    other as 0..255 (one rule per file, so a dim 0..255 image with no value above 1 would read as bright).
    """
    rows, cols = shape = (int(image_shape[0]), int(image_shape[1]))
    if rows <= 0 or cols <= 0 or len(image_shape) != 2:
        raise ValueError(f"image_shape must be two positive sizes, not {image_shape}")
    if not paths:
        raise DataError("no image files given")
    arrays, names = [], []
    for path in paths:
        images, stacked = _read_file(Path(path), str(path), shape)
        arrays.append(images.reshape(len(images), rows * cols))
        names += [f"{path}[{i}]" for i in range(len(images))] if stacked else [str(path)]
    return np.ascontiguousarray(np.concatenate(arrays), dtype=np.uint8), names


def _read_file(path: Path, where: str, shape: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """(images (N, rows, cols) uint8, whether the file holds a stack), the format told by the first bytes."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{where}: is a directory, not an image file") from None
    except OSError as e:
        raise DataError(f"{where}: cannot read: {e.strerror or e}") from None
    if not blob:
        raise DataError(f"{where}: empty file")
    if blob.startswith(GZIP_MAGIC):
        try:
            blob = gzip.decompress(blob)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{where}: corrupt gzip stream ({_one_line(e)})") from None
        if not blob.startswith(b"\0\0"):
            raise DataError(f"{where}: the gzipped content is not an IDX images file")
        return _parse_idx(blob, where, shape), True
    if blob.startswith(PNG_SIGNATURE):
        return _decode_png(blob, where, shape)[None], False
    if blob.startswith(NPY_MAGIC):
        return _parse_npy(blob, where, shape)
    if blob.startswith(b"\0\0"):  # every IDX magic starts with two zero bytes
        return _parse_idx(blob, where, shape), True
    suffix = path.suffix.lower()
    if suffix == ".png":
        raise DataError(f"{where}: not a PNG file (bad signature)")
    if suffix == ".npy":
        raise DataError(f"{where}: not a .npy file (bad magic)")
    raise DataError(f"{where}: unknown image format (expected PNG, .npy, or IDX images, optionally gzipped)")


def _check_size(where: str, got: tuple[int, ...], shape: tuple[int, int]) -> None:
    if tuple(got) != shape:
        what = "x".join(map(str, got))
        raise DataError(f"{where}: image is {what}, the model takes {shape[0]}x{shape[1]}")


def _parse_idx(blob: bytes, where: str, shape: tuple[int, int]) -> np.ndarray:
    if len(blob) >= 4 and (magic := int.from_bytes(blob[:4], "big")) != IMAGES_MAGIC:
        raise DataError(f"{where}: bad magic number 0x{magic:08x} (expected 0x{IMAGES_MAGIC:08x}, IDX images)")
    if len(blob) < 16:
        raise DataError(f"{where}: truncated: the IDX header is 16 bytes, got {len(blob)}")
    n, rows, cols = struct.unpack(">3I", blob[4:16])
    _check_size(where, (rows, cols), shape)
    if n == 0:
        raise DataError(f"{where}: holds no images")
    expected = 16 + n * rows * cols
    if len(blob) < expected:
        raise DataError(f"{where}: truncated: expected {expected} bytes, got {len(blob)}")
    if len(blob) > expected:
        raise DataError(f"{where}: {len(blob) - expected} trailing bytes: expected {expected} bytes, "
                        f"got {len(blob)}")
    return np.frombuffer(blob, dtype=np.uint8, offset=16).reshape(n, rows, cols)


def _parse_npy(blob: bytes, where: str, shape: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """Integers must lie in 0..255; floats are 0..1 when the file's largest value is <= 1, else 0..255."""
    try:
        array = np.load(io.BytesIO(blob), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{where}: cannot load the .npy array ({_one_line(e)})") from None
    if array.dtype.kind not in "uif":
        raise DataError(f"{where}: dtype {array.dtype} is not supported (use uint8 0..255, integers 0..255, "
                        "or floats 0..1 or 0..255)")
    rows, cols = shape
    stacked = True
    if array.ndim == 2 and array.shape[1] == rows * cols and array.shape != shape:
        array = array.reshape(len(array), rows, cols)
    elif array.ndim == 2:
        _check_size(where, array.shape, shape)
        array, stacked = array[None], False
    elif array.ndim == 3 and array.shape[:2] == shape and array.shape[2] in (3, 4) and array.shape[1:] != shape:
        raise DataError(f"{where}: array of shape {array.shape} is one {rows}x{cols} image with {array.shape[2]} "
                        f"colour channels; the model takes grayscale ({rows}, {cols}) or (N, {rows}, {cols})")
    elif array.ndim == 3:
        _check_size(where, array.shape[1:], shape)
    else:
        raise DataError(f"{where}: array of shape {array.shape}; expected ({rows}, {cols}), (N, {rows}, {cols}) "
                        f"or (N, {rows * cols})")
    if len(array) == 0:
        raise DataError(f"{where}: holds no images")
    if array.dtype == np.uint8:
        return array, stacked
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise DataError(f"{where}: holds NaN or infinite values")
    low, high = array.min(), array.max()
    if low < 0 or high > 255:
        raise DataError(f"{where}: values from {low} to {high}, outside 0..255")
    if array.dtype.kind == "f":
        array = np.rint(array.astype(np.float64) * (255.0 if high <= 1 else 1.0))
    return array.astype(np.uint8), stacked


def _decode_png(blob: bytes, where: str, shape: tuple[int, int]) -> np.ndarray:
    """One PNG as gray uint8 (rows, cols): 8-bit of every colour type and 16-bit of the non-palette ones."""
    chunks = _png_chunks(blob, where)
    header = chunks.get(b"IHDR", [b""])[0]
    if len(header) != 13:
        raise DataError(f"{where}: corrupt PNG: the IHDR chunk is {len(header)} bytes, expected 13")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">2I5B", header)
    if colour not in PNG_DEPTHS or depth not in PNG_DEPTHS[colour] or compression or filtering or interlace > 1:
        raise DataError(f"{where}: corrupt PNG: invalid header (colour type {colour}, bit depth {depth})")
    if depth < 8:
        raise DataError(f"{where}: PNG bit depth {depth} is not supported; {RESAVE}")
    if interlace:
        raise DataError(f"{where}: interlaced PNG is not supported; {RESAVE}")
    _check_size(where, (height, width), shape)
    if b"IDAT" not in chunks:
        raise DataError(f"{where}: corrupt PNG: no IDAT chunk")
    channels, sample_bytes = PNG_CHANNELS[colour], depth // 8
    pixel_bytes = channels * sample_bytes
    raw = _inflate(b"".join(chunks[b"IDAT"]), height * (1 + width * pixel_bytes), where)
    data = _unfilter(raw, height, width * pixel_bytes, pixel_bytes, where)
    samples = data.reshape(height, width, channels, sample_bytes)
    full = samples[..., 0].astype(np.uint16) << 8 | samples[..., 1] if sample_bytes == 2 else samples[..., 0]
    high = samples[..., 0].astype(np.float64)  # 16-bit samples keep their high byte
    alpha = None
    transparency = chunks.get(b"tRNS", [None])[0]
    if colour == 3:
        luma, alpha = _palette(chunks, transparency, samples[..., 0, 0], where)
    else:
        luma = high[..., 0] if colour in (0, 4) else high[..., :3] @ LUMA
        if colour in (4, 6):
            alpha = high[..., -1]
        elif transparency is not None and len(transparency) == 2 * channels:  # one colour marked fully transparent
            key = np.frombuffer(transparency, dtype=">u2")
            alpha = np.where((full == key).all(axis=-1), 0.0, 255.0)
    if alpha is not None:
        luma = luma * alpha / 255.0
    return np.clip(np.rint(luma), 0, 255).astype(np.uint8)


def _png_chunks(blob: bytes, where: str) -> dict[bytes, list[bytes]]:
    """Chunk type -> data of each such chunk, in order; checks every CRC and stops at IEND."""
    chunks: dict[bytes, list[bytes]] = {}
    pos = len(PNG_SIGNATURE)
    while True:
        if pos + 8 > len(blob):
            raise DataError(f"{where}: truncated PNG: it ends before the IEND chunk")
        length, kind = struct.unpack(">I4s", blob[pos:pos + 8])
        if not kind.isalpha():  # chunk types are four ASCII letters: past the signature, this is no PNG
            raise DataError(f"{where}: corrupt PNG: no valid chunk after the signature (not a PNG file?)")
        end = pos + 12 + length
        if end > len(blob):
            raise DataError(f"{where}: truncated PNG: the {kind.decode('latin-1')!r} chunk runs past the end")
        data = blob[pos + 8:end - 4]
        if zlib.crc32(kind + data) != int.from_bytes(blob[end - 4:end], "big"):
            raise DataError(f"{where}: corrupt PNG: CRC mismatch in the {kind.decode('latin-1')!r} chunk")
        if pos == len(PNG_SIGNATURE) and kind != b"IHDR":
            raise DataError(f"{where}: corrupt PNG: the first chunk is not IHDR")
        if kind == b"IEND":
            return chunks
        if not kind[0] & 0x20 and kind not in (b"IHDR", b"PLTE", b"IDAT"):  # lower-case first letter: skippable
            raise DataError(f"{where}: PNG chunk {kind.decode('latin-1')!r} is not supported")
        chunks.setdefault(kind, []).append(data)
        pos = end


def _inflate(compressed: bytes, expected: int, where: str) -> bytes:
    """The zlib stream, which must hold exactly `expected` bytes (never more are decompressed)."""
    stream = zlib.decompressobj()
    try:
        raw = stream.decompress(compressed, expected + 1)
    except zlib.error as e:
        raise DataError(f"{where}: corrupt PNG image data ({_one_line(e)})") from None
    if len(raw) > expected:
        raise DataError(f"{where}: corrupt PNG: the image data holds more than the {expected} bytes expected")
    if not stream.eof:
        raise DataError(f"{where}: truncated PNG image data: {len(raw)} of {expected} bytes")
    if len(raw) < expected:
        raise DataError(f"{where}: corrupt PNG: the image data is {len(raw)} bytes, expected {expected}")
    return raw


def _unfilter(raw: bytes, height: int, row_bytes: int, pixel_bytes: int, where: str) -> np.ndarray:
    """Undo the per-row PNG filters; Average and Paeth depend on the byte just decoded, so they loop per byte."""
    lines = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + row_bytes)
    out = np.empty((height, row_bytes), dtype=np.uint8)
    prev = np.zeros(row_bytes, dtype=np.uint8)
    for y, (kind, line) in enumerate(zip(lines[:, 0], lines[:, 1:])):
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: a running sum per byte of the pixel
            row = np.cumsum(line.reshape(-1, pixel_bytes), axis=0, dtype=np.uint8).ravel()
        elif kind == 2:
            row = line + prev
        elif kind in (3, 4):
            row = np.array(_predict_row(line.tolist(), prev.tolist(), pixel_bytes, paeth=kind == 4), dtype=np.uint8)
        else:
            raise DataError(f"{where}: corrupt PNG: row {y} has filter type {kind} (expected 0..4)")
        out[y] = prev = row
    return out


def _predict_row(line: list[int], prev: list[int], pixel_bytes: int, paeth: bool) -> list[int]:
    row = line[:]
    for i, (value, up) in enumerate(zip(line, prev)):
        left, corner = (row[i - pixel_bytes], prev[i - pixel_bytes]) if i >= pixel_bytes else (0, 0)
        if paeth:
            guess = left + up - corner
            d_left, d_up, d_corner = abs(guess - left), abs(guess - up), abs(guess - corner)
            predictor = left if d_left <= d_up and d_left <= d_corner else up if d_up <= d_corner else corner
        else:
            predictor = (left + up) >> 1
        row[i] = (value + predictor) & 0xFF
    return row


def _palette(chunks: dict[bytes, list[bytes]], transparency: bytes | None, index: np.ndarray,
             where: str) -> tuple[np.ndarray, np.ndarray]:
    """(gray, alpha) of palette indices: PLTE gives the colours, tRNS (if any) the alpha of the first entries."""
    plte = chunks.get(b"PLTE", [b""])[0]
    if not plte or len(plte) % 3 or len(plte) > 768:
        raise DataError(f"{where}: corrupt PNG: palette image without a valid PLTE chunk")
    colours = np.frombuffer(plte, dtype=np.uint8).reshape(-1, 3)
    if index.max() >= len(colours):
        raise DataError(f"{where}: corrupt PNG: palette index {index.max()} with {len(colours)} palette entries")
    alpha = np.full(len(colours), 255.0)
    if transparency:
        given = np.frombuffer(transparency[:len(colours)], dtype=np.uint8)
        alpha[:len(given)] = given
    return (colours @ LUMA)[index], alpha[index]


def write_predictions(path: str | Path, names: list[str], probabilities: np.ndarray, values: bool = False) -> None:
    """Write one row per image (name, argmax class, every class probability) as .csv or .json, atomically; with
    values, a regression's: one row per input (name, its values v0..vK-1).

    The file appears whole or not at all; an existing file is replaced only once the new one is complete.
    Probabilities are written in the shortest form that reads back to the same value of their dtype.
    """
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in (".csv", ".json"):
        raise ValueError(f"{path}: the predictions file must end in .csv or .json")
    probabilities = np.asarray(probabilities)
    if probabilities.ndim != 2 or len(probabilities) != len(names) or probabilities.shape[1] == 0:
        raise ValueError(f"probabilities of shape {probabilities.shape} do not fit {len(names)} names "
                         "(expected (images, classes))")
    if probabilities.dtype.kind not in "fiu":
        raise ValueError(f"probabilities of dtype {probabilities.dtype}: expected floats")
    if probabilities.dtype.kind != "f":
        probabilities = probabilities.astype(np.float64)
    if not np.isfinite(probabilities).all():
        raise ValueError("probabilities hold NaN or infinite values")
    predicted = probabilities.argmax(axis=1)
    texts = [[str(p) for p in row] for row in probabilities]  # str of a numpy float is its shortest exact form
    if values:
        text = _values_text(kind, names, probabilities, texts)
    elif kind == ".csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["image", "predicted", *(f"p{k}" for k in range(probabilities.shape[1]))])
        writer.writerows([name, int(label), *row] for name, label, row in zip(names, predicted, texts))
        text = out.getvalue()
    else:
        records = [json.dumps({"image": name, "predicted": int(label), "probabilities": [float(p) for p in row]})
                   for name, label, row in zip(names, predicted, texts)]
        text = "[\n" + ",\n".join(records) + "\n]\n" if records else "[]\n"
    try:
        write_atomic(path, text.encode())
    except OSError as e:
        raise DataError(f"{path}: cannot write: {e.strerror or e}") from None


def _values_text(kind: str, names: list[str], values: np.ndarray, texts: list[list[str]]) -> str:
    if kind == ".csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["row", *(f"v{k}" for k in range(values.shape[1]))])
        writer.writerows([name, *row] for name, row in zip(names, texts))
        return out.getvalue()
    records = [json.dumps({"row": name, "values": [float(v) for v in row]}) for name, row in zip(names, values)]
    return "[\n" + ",\n".join(records) + "\n]\n" if records else "[]\n"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
