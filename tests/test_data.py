"""Tests for rawgpu.data: MNIST lookup, verification and download.

Most tests use tiny synthetic IDX files with the module's FILES table swapped for matching specs, so
they need no real data and run in milliseconds. Downloads go to a local HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import faulthandler
import gzip
import hashlib
import math
import os
import shutil
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from rawgpu import data
from rawgpu.data import FileSpec, load_mnist
from rawgpu.errors import DataError

REPO = Path(__file__).resolve().parents[1]
REAL_SPECS = dict(data.FILES)
NAMES = [spec.name for spec in REAL_SPECS.values()]
SMALL_DIMS = {"train_images": (6, 2, 3), "train_labels": (6,), "test_images": (4, 2, 3), "test_labels": (4,)}


# ---------------------------------------------------------------- helpers and fixtures

def idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    """A well-formed IDX header followed by payload (which may deliberately be the wrong size)."""
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def write(directory: Path, contents: dict[str, bytes], gz: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, blob in contents.items():
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(blob, compresslevel=1))
        else:
            (directory / name).write_bytes(blob)


def one_line_error(excinfo, *needles: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No test may touch the real cache, the environment's data dir, or the network."""
    monkeypatch.delenv("RAWGPU_DATA", raising=False)
    monkeypatch.setenv("RAWGPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "MIRRORS", [])
    monkeypatch.setattr(data, "TIMEOUT_S", 5.0)


@pytest.fixture
def small(monkeypatch) -> dict[str, bytes]:
    """Swap FILES for tiny specs whose hashes match synthetic content; return {file name: raw content}."""
    contents, specs = {}, {}
    for field, spec in REAL_SPECS.items():
        dims = SMALL_DIMS[field]
        n = math.prod(dims)
        values = [(i * 7) % 10 for i in range(n)] if len(dims) == 1 else [(i * 37) % 256 for i in range(n)]
        blob = idx_bytes(spec.magic, dims, bytes(values))
        specs[field] = FileSpec(spec.name, spec.magic, dims, hashlib.sha256(blob).hexdigest())
        contents[spec.name] = blob
    monkeypatch.setattr(data, "FILES", specs)
    return contents


@pytest.fixture(scope="session")
def real_mnist_dir() -> Path:
    """The real MNIST files: $RAWGPU_TEST_MNIST, then CI's ../shared/data/mnist, then .data/mnist."""
    env = os.environ.get("RAWGPU_TEST_MNIST")
    candidates = ([Path(env)] if env else []) + [REPO.parent / "shared" / "data" / "mnist", REPO / ".data" / "mnist"]
    for d in candidates:
        if all((d / n).is_file() or (d / f"{n}.gz").is_file() for n in NAMES):
            return d
    pytest.skip(f"real MNIST files not found in {', '.join(map(str, candidates))}; set $RAWGPU_TEST_MNIST")


@pytest.fixture(scope="session")
def real_gz_dir(real_mnist_dir, tmp_path_factory) -> Path:
    """The four real files as .gz in a tmp dir, to serve over HTTP."""
    out = tmp_path_factory.mktemp("real_gz")
    for n in NAMES:
        if (real_mnist_dir / f"{n}.gz").is_file():
            shutil.copyfile(real_mnist_dir / f"{n}.gz", out / f"{n}.gz")
        else:
            (out / f"{n}.gz").write_bytes(gzip.compress((real_mnist_dir / n).read_bytes(), compresslevel=1))
    return out


@pytest.fixture(scope="session")
def real_mnist(real_mnist_dir):
    return load_mnist(real_mnist_dir, download=False, cache_dir=real_mnist_dir / "no-such-cache")


@pytest.fixture
def http_server():
    """Factory: start(mode, root) -> (mirror URL, list of requested paths). Modes: good, garbage, drop, stall, 404.

    Servers listen on 127.0.0.1 only, run in daemon threads, and are shut down at teardown; a
    watchdog dumps tracebacks and exits if a test hangs.
    """
    faulthandler.dump_traceback_later(60, exit=True)
    running = []

    def start(mode: str, root: Path | None = None):
        stop = threading.Event()
        requests: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                requests.append(self.path)
                file = root / self.path.lstrip("/") if root else None
                if mode == "404" or (mode in ("good", "drop") and not file.is_file()):
                    self.send_error(404)
                    return
                body = file.read_bytes() if mode in ("good", "drop") else b"<html>not gzip</html>" * 200
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "drop":  # promise the whole body, send a little, close
                    self.wfile.write(body[:min(1000, len(body) // 2)])
                    self.close_connection = True
                elif mode == "stall":  # send a little, then go silent
                    self.wfile.write(body[:10])
                    self.wfile.flush()
                    stop.wait(10)
                else:
                    self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        running.append((server, thread, stop))
        return f"http://127.0.0.1:{server.server_address[1]}/", requests

    yield start
    for server, thread, stop in running:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    faulthandler.cancel_dump_traceback_later()


def assert_small_loaded(mnist, contents):
    assert mnist.train_images.shape == (6, 6) and mnist.test_images.shape == (4, 6)
    assert mnist.train_labels.shape == (6,) and mnist.test_labels.shape == (4,)
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        assert getattr(mnist, field).dtype == np.uint8
    name = data.FILES["train_labels"].name
    assert mnist.train_labels.tobytes() == contents[name][8:]


def cache_listing(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---------------------------------------------------------------- real files

def check_real(m):
    assert m.train_images.shape == (60000, 784) and m.train_labels.shape == (60000,)
    assert m.test_images.shape == (10000, 784) and m.test_labels.shape == (10000,)
    for a in (m.train_images, m.train_labels, m.test_images, m.test_labels):
        assert a.dtype == np.uint8
    assert set(np.unique(m.train_labels)) == set(range(10)) == set(np.unique(m.test_labels))
    assert m.train_images.max() == 255 and m.train_images.min() == 0


def test_real_files_gz(real_mnist, real_mnist_dir):
    check_real(real_mnist)
    assert real_mnist.source == real_mnist_dir


def test_real_files_raw(real_mnist, real_gz_dir, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for n in NAMES:
        (raw / n).write_bytes(gzip.decompress((real_gz_dir / f"{n}.gz").read_bytes()))
    m = load_mnist(raw, download=False)
    check_real(m)
    assert m.source == raw
    assert np.array_equal(m.train_images, real_mnist.train_images)
    assert np.array_equal(m.test_labels, real_mnist.test_labels)


def test_real_hashes_match_table(real_gz_dir):
    for spec in REAL_SPECS.values():
        content = gzip.decompress((real_gz_dir / f"{spec.name}.gz").read_bytes())
        assert hashlib.sha256(content).hexdigest() == spec.sha256


# ---------------------------------------------------------------- synthetic files, lookup

@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_small_files_load(small, tmp_path, gz):
    write(tmp_path / "d", small, gz=gz)
    m = load_mnist(tmp_path / "d", download=False)
    assert_small_loaded(m, small)
    assert m.source == tmp_path / "d"


def test_raw_preferred_over_gz(small, tmp_path):
    d = tmp_path / "d"
    write(d, small, gz=False)
    for n in small:
        (d / f"{n}.gz").write_bytes(b"not gzip")  # would fail if it were read
    assert_small_loaded(load_mnist(d, download=False), small)


def test_missing_without_download(small, tmp_path):
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "nowhere", download=False)
    one_line_error(e, "--data-dir", "train-images-idx3-ubyte", str(tmp_path / "nowhere"),
                   str(tmp_path / "cache" / "mnist"))


def test_env_data_dir_respected(small, tmp_path, monkeypatch):
    write(tmp_path / "envdata", small)
    monkeypatch.setenv("RAWGPU_DATA", str(tmp_path / "envdata"))
    assert load_mnist(download=False).source == tmp_path / "envdata"


def test_argument_beats_env(small, tmp_path, monkeypatch):
    write(tmp_path / "arg", small)
    monkeypatch.setenv("RAWGPU_DATA", str(tmp_path / "envdata-missing"))
    assert load_mnist(tmp_path / "arg", download=False).source == tmp_path / "arg"


def test_env_cache_respected(small, tmp_path, monkeypatch):
    monkeypatch.setenv("RAWGPU_CACHE", str(tmp_path / "mycache"))
    assert data.default_cache_dir() == tmp_path / "mycache"
    write(tmp_path / "mycache" / "mnist", small)
    assert load_mnist(download=False).source == tmp_path / "mycache" / "mnist"


def test_default_cache_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("RAWGPU_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.default_cache_dir() == tmp_path / "home" / ".cache" / "rawgpu"


def test_cache_dir_argument(small, tmp_path):
    write(tmp_path / "c", small)
    assert load_mnist(download=False, cache_dir=tmp_path / "c").source == tmp_path / "c"


def test_partial_data_dir_falls_through_to_cache(small, tmp_path):
    names = list(small)
    write(tmp_path / "d", {n: small[n] for n in names[:2]})
    write(tmp_path / "cache" / "mnist", {n: small[n] for n in names[2:]}, gz=False)
    m = load_mnist(tmp_path / "d", download=False)
    assert_small_loaded(m, small)
    assert m.source == tmp_path / "d"


# ---------------------------------------------------------------- bad files

def corrupt(small: dict[str, bytes], case: str) -> tuple[str, bytes, bool, str]:
    """(file name, bad content, gzip it?, expected message fragment) for one failure case."""
    img, lab = data.FILES["train_images"], data.FILES["train_labels"]
    good_img, good_lab = small[img.name], small[lab.name]
    return {
        "bad_magic": (img.name, struct.pack(">I", 0x1234) + good_img[4:], True, "bad magic number 0x00001234"),
        "wrong_dims": (img.name, idx_bytes(img.magic, (6, 3, 2), good_img[16:]), True, "wrong dimensions (6, 3, 2)"),
        "truncated": (img.name, good_img[:-5], True, f"truncated: expected {len(good_img)} bytes, got {len(good_img) - 5}"),
        "short_header": (img.name, good_img[:6], True, "truncated"),
        "trailing": (img.name, good_img + b"xyz", True, "3 trailing bytes"),
        "bad_gzip": (img.name, b"definitely not gzip", "as-is", "not a gzip file / corrupt gzip stream"),
        "truncated_gzip": (img.name, gzip.compress(good_img)[:-12], "as-is", "corrupt gzip stream"),
        "hash": (img.name, good_img[:-1] + bytes([good_img[-1] ^ 1]), True, "SHA-256 mismatch"),
        "label_range": (lab.name, good_lab[:-1] + bytes([10]), True, "label out of range: 10 at index 5"),
    }[case]


BAD_CASES = ["bad_magic", "wrong_dims", "truncated", "short_header", "trailing", "bad_gzip",
             "truncated_gzip", "hash", "label_range"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_file_in_data_dir(small, tmp_path, case):
    name, blob, gz, fragment = corrupt(small, case)
    d = tmp_path / "d"
    write(d, small)
    path = d / f"{name}.gz"
    path.write_bytes(gzip.compress(blob) if gz is True else blob)
    with pytest.raises(DataError) as e:
        load_mnist(d, download=True)  # even with download allowed, a user's file is not replaced
    one_line_error(e, str(path), fragment)
    assert path.read_bytes() == (gzip.compress(blob) if gz is True else blob)


@pytest.mark.parametrize("case", ["bad_magic", "trailing", "label_range"])
def test_bad_raw_file(small, tmp_path, case):
    name, blob, _, fragment = corrupt(small, case)
    write(tmp_path / "d", small, gz=False)
    (tmp_path / "d" / name).write_bytes(blob)
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "d", download=False)
    one_line_error(e, str(tmp_path / "d" / name), fragment)


def test_corrupt_cache_without_download_is_kept(small, tmp_path):
    cache = tmp_path / "cache" / "mnist"
    write(cache, small)
    bad = cache / f"{data.FILES['test_labels'].name}.gz"
    bad.write_bytes(b"junk")
    with pytest.raises(DataError) as e:
        load_mnist(download=False)
    one_line_error(e, str(bad), "corrupt gzip stream")
    assert bad.read_bytes() == b"junk"


def test_hash_checked_after_structure(small, tmp_path, monkeypatch):
    """A structurally bad file reports the structural problem, not just a hash mismatch."""
    name, blob, _, _ = corrupt(small, "truncated")
    write(tmp_path / "d", {**small, name: blob})
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "d", download=False)
    assert "truncated" in str(e.value) and "SHA-256" not in str(e.value)


# ---------------------------------------------------------------- downloads (local server only)

def test_download_real(real_gz_dir, http_server, tmp_path):
    url, requests = http_server("good", real_gz_dir)
    calls = []
    m = load_mnist(tmp_path / "empty", mirrors=[url], progress=lambda *a: calls.append(a))
    check_real(m)
    cache = tmp_path / "cache" / "mnist"
    assert m.source == cache
    assert cache_listing(cache) == sorted(f"{n}.gz" for n in NAMES)  # no temp files left
    assert sorted(requests) == sorted(f"/{n}.gz" for n in NAMES)
    for n in NAMES:
        mine = [(done, total) for name, done, total in calls if name == n]
        size = (real_gz_dir / f"{n}.gz").stat().st_size
        assert mine[-1] == (size, size)
        assert [d for d, _ in mine] == sorted(d for d, _ in mine)
    # second call uses the cache, no new requests
    load_mnist(mirrors=[url])
    assert len(requests) == 4


def test_download_small(small, http_server, tmp_path):
    served = tmp_path / "served"
    write(served, small)
    url, _ = http_server("good", served)
    calls = []
    m = load_mnist(mirrors=[url], progress=lambda *a: calls.append(a))
    assert_small_loaded(m, small)
    assert cache_listing(tmp_path / "cache" / "mnist") == sorted(f"{n}.gz" for n in small)
    assert {c[0] for c in calls} == set(small)


def test_only_missing_files_downloaded(small, http_server, tmp_path):
    served = tmp_path / "served"
    write(served, small)
    names = list(small)
    write(tmp_path / "cache" / "mnist", {n: small[n] for n in names[1:]})
    url, requests = http_server("good", served)
    assert_small_loaded(load_mnist(mirrors=[url]), small)
    assert requests == [f"/{names[0]}.gz"]


@pytest.mark.parametrize("mode, fragment", [
    ("garbage", "corrupt gzip stream"),
    ("drop", "connection closed after"),
    ("404", "HTTP Error 404"),
])
def test_bad_mirror_fails_cleanly(small, http_server, tmp_path, mode, fragment):
    served = tmp_path / "served"
    write(served, small)
    url, _ = http_server(mode, served)
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "d", mirrors=[url])
    one_line_error(e, "download failed", fragment, "--data-dir", "$RAWGPU_DATA", str(tmp_path / "d"),
                   str(tmp_path / "cache" / "mnist"))
    assert cache_listing(tmp_path / "cache" / "mnist") == []  # no partial or temp files


def test_drop_real_size_file(real_gz_dir, http_server, tmp_path):
    url, _ = http_server("drop", real_gz_dir)
    with pytest.raises(DataError) as e:
        load_mnist(mirrors=[url])
    one_line_error(e, "connection closed after 1000 of")
    assert cache_listing(tmp_path / "cache" / "mnist") == []


def test_stalled_mirror_times_out(small, http_server, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "TIMEOUT_S", 0.3)
    url, _ = http_server("stall")
    with pytest.raises(DataError) as e:
        load_mnist(mirrors=[url])
    one_line_error(e, "download failed", "timed out")
    assert cache_listing(tmp_path / "cache" / "mnist") == []


def test_unusable_mirror_url(small, tmp_path):
    with pytest.raises(DataError) as e:
        load_mnist(mirrors=["nonsense-scheme://127.0.0.1/"])
    one_line_error(e, "download failed", "nonsense-scheme://127.0.0.1/train-images-idx3-ubyte.gz")
    assert cache_listing(tmp_path / "cache" / "mnist") == []


@pytest.mark.parametrize("bad_mode", ["garbage", "drop", "404"])
def test_falls_back_to_next_mirror(small, http_server, tmp_path, bad_mode):
    served = tmp_path / "served"
    write(served, small)
    bad_url, bad_requests = http_server(bad_mode, served)
    good_url, good_requests = http_server("good", served)
    assert_small_loaded(load_mnist(mirrors=[bad_url, good_url]), small)
    assert len(bad_requests) == 4 and len(good_requests) == 4
    assert cache_listing(tmp_path / "cache" / "mnist") == sorted(f"{n}.gz" for n in small)


def test_fallback_real_files(real_gz_dir, http_server, tmp_path):
    bad_url, _ = http_server("garbage")
    good_url, _ = http_server("good", real_gz_dir)
    check_real(load_mnist(mirrors=[bad_url, good_url]))


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_corrupt_cached_file_redownloaded(small, http_server, tmp_path, gz):
    served = tmp_path / "served"
    write(served, small)
    cache = tmp_path / "cache" / "mnist"
    write(cache, small)
    name = data.FILES["train_images"].name
    if not gz:
        (cache / f"{name}.gz").unlink()
    bad = cache / (f"{name}.gz" if gz else name)
    bad.write_bytes(b"corrupt")
    url, requests = http_server("good", served)
    assert_small_loaded(load_mnist(mirrors=[url]), small)
    assert requests == [f"/{name}.gz"]
    assert cache_listing(cache) == sorted(f"{n}.gz" for n in small)
    assert gzip.decompress((cache / f"{name}.gz").read_bytes()) == small[name]
