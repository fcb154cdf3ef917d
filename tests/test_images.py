"""Tests for rawgpu.data.images: reading PNG, .npy and IDX images for prediction, writing predictions.

The PNGs come from a small encoder below that applies each filter type itself, so the decoder's unfiltering is
checked against an independent implementation, byte for byte. Images are 5x7 (not square) to catch transposes.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from rawgpu.runtime import files
from rawgpu.runtime.errors import DataError
from rawgpu.data.images import read_images, write_predictions

SHAPE = (5, 7)
LUMA = np.array([0.299, 0.587, 0.114])


# ---------------------------------------------------------------- helpers

def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def filter_row(line: bytes, prev: bytes, kind: int, bpp: int) -> bytes:
    """One row filtered as the PNG spec defines it, byte by byte from the unfiltered bytes."""
    out = bytearray()
    for i, x in enumerate(line):
        a = line[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        if kind == 0:
            pred = 0
        elif kind == 1:
            pred = a
        elif kind == 2:
            pred = b
        elif kind == 3:
            pred = (a + b) // 2
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        out.append((x - pred) % 256)
    return bytes(out)


def png_bytes(pixels: np.ndarray, colour: int, depth: int = 8, filters=(0, 1, 2, 3, 4), *, palette=None,
              trns: bytes | None = None, interlace: int = 0, idat_parts: int = 1) -> bytes:
    """A PNG of pixels (rows, cols, channels); row y uses filters[y % len(filters)]."""
    height, width = pixels.shape[:2]
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    samples = pixels.astype(">u2" if depth == 16 else np.uint8).reshape(height, width * channels)
    bpp = channels * depth // 8
    raw, prev = bytearray(), bytes(width * bpp)
    for y in range(height):
        line = samples[y].tobytes()
        kind = filters[y % len(filters)]
        raw += bytes([kind]) + filter_row(line, prev, kind, bpp)
        prev = line
    stream = zlib.compress(bytes(raw))
    step = -(-len(stream) // idat_parts)
    out = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">2I5B", width, height, depth, colour, 0, 0,
                                                                    interlace))
    if palette is not None:
        out += png_chunk(b"PLTE", np.asarray(palette, dtype=np.uint8).tobytes())
    if trns is not None:
        out += png_chunk(b"tRNS", trns)
    out += png_chunk(b"tEXt", b"Comment\0ignored")
    for i in range(0, len(stream), step):
        out += png_chunk(b"IDAT", stream[i:i + step])
    return out + png_chunk(b"IEND", b"")


def idx_bytes(images_: np.ndarray, magic: int = 0x803) -> bytes:
    return struct.pack(">4I", magic, *images_.shape) + images_.astype(np.uint8).tobytes()


def save(tmp_path: Path, name: str, blob: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def save_npy(tmp_path: Path, name: str, array: np.ndarray) -> Path:
    path = tmp_path / name
    np.save(path, array, allow_pickle=True)
    return path


def read_one(path: Path) -> np.ndarray:
    array, names = read_images([path], SHAPE)
    assert names == [str(path)]
    return array.reshape(SHAPE)


def error_of(paths, shape=SHAPE) -> str:
    with pytest.raises(DataError) as info:
        read_images(paths, shape)
    message = str(info.value)
    assert "\n" not in message
    return message


def file_error(path: Path, shape=SHAPE) -> str:
    message = error_of([path], shape)
    assert message.startswith(f"{path}: ")
    return message


@pytest.fixture
def pixels(rng):
    return lambda channels, high=256: rng.integers(0, high, size=(*SHAPE, channels))


# ---------------------------------------------------------------- PNG

@pytest.mark.parametrize("kind", [0, 1, 2, 3, 4], ids=["none", "sub", "up", "average", "paeth"])
def test_png_gray_each_filter(tmp_path, pixels, kind):
    gray = pixels(1)
    assert np.array_equal(read_one(save(tmp_path, "g.png", png_bytes(gray, 0, filters=(kind,)))), gray[..., 0])


def test_png_extreme_rows_through_every_filter(tmp_path):
    """Rows of 0 and 255 make every predictor wrap around modulo 256."""
    gray = np.zeros((*SHAPE, 1), dtype=np.uint8)
    gray[1::2] = 255
    gray[:, 3] = 128
    for kind in range(5):
        got = read_one(save(tmp_path, f"{kind}.png", png_bytes(gray, 0, filters=(kind, 4 - kind))))
        assert np.array_equal(got, gray[..., 0])


@pytest.mark.parametrize("kind", [1, 3, 4], ids=["sub", "average", "paeth"])
@pytest.mark.parametrize("channels, colour", [(1, 0), (4, 6)], ids=["gray", "rgba"])
def test_png_filters_with_many_ties(tmp_path, rng, kind, channels, colour):
    """Few distinct values near 0 and 255: Paeth's tie rules and the modulo-256 wrap are hit many times."""
    shape = (24, 20)
    values = rng.choice([0, 1, 2, 3, 253, 254, 255], size=(*shape, channels))
    if channels == 4:
        values[..., 3] = 255
    blob = png_bytes(values, colour, filters=(kind,))
    expected = values[..., 0] if channels == 1 else np.rint(values[..., :3] @ LUMA)
    assert np.array_equal(read_images([save(tmp_path, "t.png", blob)], shape)[0].reshape(shape), expected)


def test_png_paeth_tie_rules(tmp_path):
    """left=8, up=11, corner=10 ties left with corner (left wins); left=11, up=8, corner=10 ties up with corner."""
    gray = np.array([[10, 11, 10, 8], [8, 50, 11, 60]])[..., None]
    blob = png_bytes(gray, 0, filters=(4,))
    assert np.array_equal(read_images([save(tmp_path, "p.png", blob)], (2, 4))[0].reshape(2, 4), gray[..., 0])


def test_png_rgb(tmp_path, pixels):
    rgb = pixels(3)
    expected = np.rint(rgb @ LUMA)
    assert np.array_equal(read_one(save(tmp_path, "c.png", png_bytes(rgb, 2))), expected)


def test_png_rgb_known_values(tmp_path):
    rgb = np.zeros((*SHAPE, 3), dtype=np.uint8)
    rgb[0, 0], rgb[0, 1], rgb[0, 2], rgb[0, 3] = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
    got = read_one(save(tmp_path, "c.png", png_bytes(rgb, 2)))
    assert got[0, :5].tolist() == [76, 150, 29, 255, 0]


def test_png_gray_alpha_over_black(tmp_path, pixels):
    ga = pixels(2)
    expected = np.rint(ga[..., 0] * ga[..., 1] / 255)
    assert np.array_equal(read_one(save(tmp_path, "ga.png", png_bytes(ga, 4))), expected)


def test_png_rgba_over_black(tmp_path, pixels):
    rgba = pixels(4)
    expected = np.rint((rgba[..., :3] @ LUMA) * rgba[..., 3] / 255)
    assert np.array_equal(read_one(save(tmp_path, "rgba.png", png_bytes(rgba, 6, idat_parts=3))), expected)


def test_png_palette_with_transparency(tmp_path, rng, pixels):
    palette = rng.integers(0, 256, size=(20, 3))
    alpha = rng.integers(0, 256, size=5)  # tRNS may cover only the first entries
    index = pixels(1, high=20)
    full_alpha = np.concatenate([alpha, np.full(15, 255)])
    expected = np.rint((palette @ LUMA)[index[..., 0]] * full_alpha[index[..., 0]] / 255)
    blob = png_bytes(index, 3, palette=palette, trns=bytes(alpha.astype(np.uint8)))
    assert np.array_equal(read_one(save(tmp_path, "p.png", blob)), expected)


def test_png_gray_colour_key_transparency(tmp_path, pixels):
    gray = pixels(1)
    key = int(gray[2, 3, 0])
    expected = np.where(gray[..., 0] == key, 0, gray[..., 0])
    blob = png_bytes(gray, 0, trns=struct.pack(">H", key))
    assert np.array_equal(read_one(save(tmp_path, "k.png", blob)), expected)


def test_png_16_bit_takes_the_high_byte(tmp_path, pixels):
    gray, rgb = pixels(1, 65536), pixels(3, 65536)
    assert np.array_equal(read_one(save(tmp_path, "g16.png", png_bytes(gray, 0, 16))), gray[..., 0] >> 8)
    expected = np.rint((rgb >> 8) @ LUMA)
    assert np.array_equal(read_one(save(tmp_path, "c16.png", png_bytes(rgb, 2, 16))), expected)


def test_png_named_by_content_not_suffix(tmp_path, pixels):
    gray = pixels(1)
    assert np.array_equal(read_one(save(tmp_path, "digit.bin", png_bytes(gray, 0))), gray[..., 0])


def test_png_written_by_pillow(tmp_path, rng, pixels):
    """A real-world encoder (zlib, its own filter choice) as a cross-check of the hand-written one."""
    image = pytest.importorskip("PIL.Image")
    gray, rgb = pixels(1).astype(np.uint8), pixels(3).astype(np.uint8)
    rgba = pixels(4).astype(np.uint8)
    palette = rng.integers(0, 256, size=(40, 3), dtype=np.uint8)  # up to 16 colours Pillow writes 4-bit: refused
    index = pixels(1, high=40).astype(np.uint8)[..., 0]
    image.fromarray(gray[..., 0]).save(tmp_path / "g.png")
    image.fromarray(rgb).save(tmp_path / "c.png")
    image.fromarray(rgba).save(tmp_path / "rgba.png")
    indexed = image.fromarray(index, mode="P")
    indexed.putpalette(palette.tobytes())
    indexed.save(tmp_path / "p.png")
    assert np.array_equal(read_one(tmp_path / "g.png"), gray[..., 0])
    assert np.array_equal(read_one(tmp_path / "c.png"), np.rint(rgb @ LUMA))
    assert np.array_equal(read_one(tmp_path / "rgba.png"), np.rint((rgba[..., :3] @ LUMA) * rgba[..., 3] / 255))
    assert np.array_equal(read_one(tmp_path / "p.png"), np.rint((palette @ LUMA)[index]))


def test_png_wrong_size(tmp_path, pixels):
    path = save(tmp_path, "big.png", png_bytes(pixels(1), 0))
    assert file_error(path, (28, 28)) == f"{path}: image is 5x7, the model takes 28x28"


def test_png_crc_mismatch(tmp_path, pixels):
    blob = bytearray(png_bytes(pixels(1), 0))
    blob[blob.index(b"IDAT") + 6] ^= 0x01
    assert "CRC mismatch in the 'IDAT' chunk" in file_error(save(tmp_path, "crc.png", bytes(blob)))


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_png_truncated(tmp_path, pixels, keep):
    blob = png_bytes(pixels(1), 0)
    assert "truncated" in file_error(save(tmp_path, "cut.png", blob[:int(len(blob) * keep)]))


def test_png_truncated_image_data(tmp_path, pixels):
    """Chunks intact, but the zlib stream inside IDAT stops early."""
    gray = pixels(1)
    blob = png_bytes(gray, 0)
    start = blob.index(b"IDAT") - 4
    length = int.from_bytes(blob[start:start + 4], "big")
    stream = blob[start + 8:start + 8 + length]
    blob = blob[:start] + png_chunk(b"IDAT", stream[:-10]) + blob[start + 12 + length:]
    assert "truncated PNG image data" in file_error(save(tmp_path, "short.png", blob))


def test_png_interlaced(tmp_path, pixels):
    message = file_error(save(tmp_path, "i.png", png_bytes(pixels(1), 0, interlace=1)))
    assert "interlaced" in message and "8-bit non-interlaced" in message


def test_png_low_bit_depth(tmp_path):
    blob = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">2I5B", 7, 5, 4, 0, 0, 0, 0))
    blob += png_chunk(b"IDAT", zlib.compress(bytes(5 * 5))) + png_chunk(b"IEND", b"")
    message = file_error(save(tmp_path, "4bit.png", blob))
    assert "bit depth 4 is not supported" in message and "8-bit non-interlaced" in message


def test_png_bad_filter_type(tmp_path, pixels):
    blob = png_bytes(pixels(1), 0, filters=(0,))
    raw = bytearray(zlib.decompress(bytes(blob[blob.index(b"IDAT") + 4:blob.index(b"IEND") - 8])))
    raw[0] = 5
    blob = blob[:blob.index(b"IDAT") - 4] + png_chunk(b"IDAT", zlib.compress(bytes(raw))) + png_chunk(b"IEND", b"")
    assert "filter type 5" in file_error(save(tmp_path, "f.png", blob))


def test_png_palette_errors(tmp_path, pixels):
    index = pixels(1, high=4)
    assert "PLTE" in file_error(save(tmp_path, "nopal.png", png_bytes(index, 3)))
    blob = png_bytes(index + 4, 3, palette=np.zeros((4, 3)))
    assert "palette index" in file_error(save(tmp_path, "range.png", blob))


def test_png_bad_signature_with_png_suffix(tmp_path):
    assert "not a PNG file" in file_error(save(tmp_path, "x.png", b"GIF89a..."))


# ---------------------------------------------------------------- IDX

@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_idx_multi_image(tmp_path, rng, gz):
    stack = rng.integers(0, 256, size=(3, *SHAPE), dtype=np.uint8)
    blob = idx_bytes(stack)
    path = save(tmp_path, "d.idx.gz" if gz else "d.idx", gzip.compress(blob) if gz else blob)
    array, names = read_images([path], SHAPE)
    assert array.dtype == np.uint8 and array.shape == (3, 35)
    assert np.array_equal(array, stack.reshape(3, -1))
    assert names == [f"{path}[{i}]" for i in range(3)]


def test_idx_errors(tmp_path, rng):
    stack = rng.integers(0, 256, size=(2, *SHAPE), dtype=np.uint8)
    blob = idx_bytes(stack)
    assert "truncated: expected 86 bytes, got 85" in file_error(save(tmp_path, "t.idx", blob[:-1]))
    assert "truncated" in file_error(save(tmp_path, "h.idx", blob[:10]))
    assert "1 trailing bytes" in file_error(save(tmp_path, "x.idx", blob + b"\0"))
    assert "bad magic number 0x00000801" in file_error(save(tmp_path, "m.idx", idx_bytes(stack, 0x801)))
    assert "image is 5x7, the model takes 28x28" in file_error(save(tmp_path, "s.idx", blob), (28, 28))
    assert "holds no images" in file_error(save(tmp_path, "e.idx", idx_bytes(stack[:0])))
    assert "corrupt gzip" in file_error(save(tmp_path, "c.gz", gzip.compress(blob)[:-9]))
    assert "not an IDX images file" in file_error(save(tmp_path, "p.gz", gzip.compress(b"hello")))


# ---------------------------------------------------------------- .npy

def test_npy_uint8_shapes(tmp_path, rng):
    stack = rng.integers(0, 256, size=(4, *SHAPE), dtype=np.uint8)
    for name, array in [("stack.npy", stack), ("flat.npy", stack.reshape(4, 35))]:
        got, names = read_images([save_npy(tmp_path, name, array)], SHAPE)
        assert np.array_equal(got, stack.reshape(4, 35))
        assert names == [f"{tmp_path / name}[{i}]" for i in range(4)]
    assert np.array_equal(read_one(save_npy(tmp_path, "one.npy", stack[0])), stack[0])


def test_npy_values(tmp_path, rng):
    unit = rng.random(SHAPE)
    assert np.array_equal(read_one(save_npy(tmp_path, "f01.npy", unit.astype(np.float32))),
                          np.rint(unit.astype(np.float32).astype(np.float64) * 255))
    wide = unit * 255
    wide[0, 0] = 255.0
    assert np.array_equal(read_one(save_npy(tmp_path, "f255.npy", wide)), np.rint(wide))
    ints = rng.integers(0, 256, size=SHAPE).astype(np.int16)
    assert np.array_equal(read_one(save_npy(tmp_path, "i.npy", ints)), ints)
    assert read_one(save_npy(tmp_path, "ones.npy", np.ones(SHAPE))).max() == 255  # max <= 1: the 0..1 scale


@pytest.mark.parametrize("array, expect", [
    (np.full(SHAPE, 255.5), "outside 0..255"),
    (np.full(SHAPE, -0.1), "outside 0..255"),
    (np.full(SHAPE, np.nan), "NaN or infinite"),
    (np.full(SHAPE, np.inf, dtype=np.float32), "NaN or infinite"),
    (np.full(SHAPE, 256, dtype=np.int32), "outside 0..255"),
    (np.full(SHAPE, -1, dtype=np.int8), "outside 0..255"),
    (np.zeros(SHAPE, dtype=bool), "dtype bool is not supported"),
    (np.zeros(SHAPE, dtype=np.complex64), "dtype complex64 is not supported"),
    (np.zeros(SHAPE, dtype=object), "Object arrays cannot be loaded"),
    (np.zeros(35, dtype=np.uint8), "array of shape (35,)"),
    (np.zeros((1, 1, *SHAPE), dtype=np.uint8), "array of shape (1, 1, 5, 7)"),
    (np.zeros((2, 7, 5), dtype=np.uint8), "image is 7x5, the model takes 5x7"),
    (np.zeros((6, 6), dtype=np.uint8), "image is 6x6, the model takes 5x7"),
    (np.zeros((0, *SHAPE), dtype=np.uint8), "holds no images"),
], ids=["float-high", "float-negative", "nan", "inf", "int-high", "int-negative", "bool", "complex", "object",
        "1d", "4d", "3d-wrong-size", "2d-wrong-size", "empty"])
def test_npy_errors(tmp_path, array, expect):
    assert expect in file_error(save_npy(tmp_path, "bad.npy", array))


def test_npy_truncated(tmp_path):
    blob = save_npy(tmp_path, "ok.npy", np.zeros(SHAPE, dtype=np.uint8)).read_bytes()
    assert "cannot load the .npy array" in file_error(save(tmp_path, "cut.npy", blob[:-3]))
    assert "not a .npy file" in file_error(save(tmp_path, "fake.npy", b"PK\x03\x04zip"))


# ---------------------------------------------------------------- files in general

def test_several_files_in_order(tmp_path, rng, pixels):
    gray = pixels(1)
    stack = rng.integers(0, 256, size=(2, *SHAPE), dtype=np.uint8)
    paths = [save(tmp_path, "a.png", png_bytes(gray, 0)), save(tmp_path, "b.idx", idx_bytes(stack)),
             save_npy(tmp_path, "c.npy", stack[1])]
    array, names = read_images([str(p) for p in paths], list(SHAPE))
    assert names == [str(paths[0]), f"{paths[1]}[0]", f"{paths[1]}[1]", str(paths[2])]
    assert np.array_equal(array, np.stack([gray[..., 0], stack[0], stack[1], stack[1]]).reshape(4, 35))


def test_file_errors(tmp_path):
    assert error_of([]) == "no image files given"
    assert file_error(tmp_path / "missing.png").endswith("no such file")
    assert "is a directory" in file_error(tmp_path)
    assert "empty file" in file_error(save(tmp_path, "empty.png", b""))
    assert "unknown image format" in file_error(save(tmp_path, "notes.txt", b"hello"))


def test_unreadable_file(tmp_path, monkeypatch):
    path = save(tmp_path, "locked.png", b"x")

    def denied(self):  # what a file without read permission gives (chmod alone does not stop root)
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_bytes", denied)
    assert "cannot read" in file_error(path) and "Permission denied" in file_error(path)


# ---------------------------------------------------------------- write_predictions

def probabilities_for(rng, n: int, classes: int = 10) -> np.ndarray:
    p = rng.random((n, classes)).astype(np.float32)
    return p / p.sum(axis=1, keepdims=True)


def test_write_csv_round_trip(tmp_path, rng):
    names = ["a.png", "b,with comma.png", 'q"uote.idx[3]']
    p = probabilities_for(rng, 3)
    path = tmp_path / "out.csv"
    write_predictions(path, names, p)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["image", "predicted", *(f"p{k}" for k in range(10))]
    assert [r[0] for r in rows[1:]] == names
    assert [int(r[1]) for r in rows[1:]] == p.argmax(axis=1).tolist()
    assert np.array_equal(np.array([r[2:] for r in rows[1:]], dtype=np.float32), p)


def test_write_json_round_trip(tmp_path, rng):
    names = ["a.png", "b.npy[0]"]
    p = probabilities_for(rng, 2, 3).astype(np.float64)
    path = tmp_path / "out.JSON"
    write_predictions(path, names, p)
    records = json.loads(path.read_text())
    assert [r["image"] for r in records] == names
    assert [r["predicted"] for r in records] == p.argmax(axis=1).tolist()
    assert np.array_equal(np.array([r["probabilities"] for r in records]), p)


def test_write_uses_the_usual_permissions(tmp_path, rng):
    umask = os.umask(0o022)
    os.umask(umask)
    path = tmp_path / "out.csv"
    write_predictions(path, ["a"], probabilities_for(rng, 1))
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_write_rejects_bad_arguments(tmp_path, rng):
    p = probabilities_for(rng, 2)
    for bad in [lambda: write_predictions(tmp_path / "out.txt", ["a", "b"], p),
                lambda: write_predictions(tmp_path / "out.csv", ["a"], p),
                lambda: write_predictions(tmp_path / "out.csv", ["a", "b"], p[0]),
                lambda: write_predictions(tmp_path / "out.csv", ["a", "b"], np.full((2, 3), np.nan))]:
        with pytest.raises(ValueError) as info:
            bad()
        assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_write_missing_directory(tmp_path, rng):
    path = tmp_path / "nope" / "out.csv"
    with pytest.raises(DataError) as info:
        write_predictions(path, ["a"], probabilities_for(rng, 1))
    assert str(info.value).startswith(f"{path}: cannot write") and "\n" not in str(info.value)


def test_write_failure_leaves_nothing(tmp_path, rng, monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    path = tmp_path / "out.json"
    with pytest.raises(DataError, match="No space left on device"):
        write_predictions(path, ["a"], probabilities_for(rng, 1))
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old.csv"
    old.write_text("previous\n")
    with pytest.raises(DataError):
        write_predictions(old, ["a"], probabilities_for(rng, 1))
    assert old.read_text() == "previous\n"
    assert list(tmp_path.iterdir()) == [old]


def test_a_colour_array_a_fake_png_and_a_stack_of_the_wrong_size_say_what_they_are(tmp_path):
    colour = tmp_path / "rgb.npy"
    np.save(colour, np.zeros((28, 28, 3), np.uint8))
    with pytest.raises(DataError, match=r"rgb.npy: array of shape \(28, 28, 3\) is one 28x28 image with 3 colour "
                                        r"channels; the model takes grayscale"):
        read_images([colour], (28, 28))
    stack = tmp_path / "stack.npy"
    np.save(stack, np.zeros((5, 20, 20), np.uint8))
    with pytest.raises(DataError, match=r"stack.npy: image is 20x20, the model takes 28x28"):
        read_images([stack], (28, 28))
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"\x89PNG\r\n\x1a\n" + b"this is not a png at all, only text")
    with pytest.raises(DataError, match=r"fake.png: corrupt PNG: no valid chunk after the signature"):
        read_images([fake], (28, 28))
