"""Tests for rawgpu.data.datasets: dataset lookup, verification and download, and IDX sets of any size.

Most tests use tiny synthetic IDX files with a dataset's spec in DATASETS swapped for one with matching
checksums, so they need no real data and run in milliseconds. Downloads go to a local HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import faulthandler
import gzip
import hashlib
import math
import os
import re
import shutil
import struct
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from rawgpu.data import datasets as data
from rawgpu.data.datasets import FileSpec, load_dataset, load_mnist
from rawgpu.runtime.errors import DataError
from rawgpu.contract.shapes import IDX_MAX_CLASSES
from rawgpu.model.recipe import MAX_INPUTS

REPO = Path(__file__).resolve().parents[1]
REAL_DATASETS = dict(data.DATASETS)
REAL_SPECS = dict(REAL_DATASETS["mnist"].files)
NAMES = [spec.name for spec in REAL_SPECS.values()]
FIELDS = list(REAL_SPECS)
SMALL_DIMS = {"train_images": (6, 2, 3), "train_labels": (6,), "test_images": (4, 2, 3), "test_labels": (4,)}


# ---------------------------------------------------------------- helpers and fixtures

def idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    """A well-formed IDX header followed by payload (which may deliberately be the wrong size)."""
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def compress(blob: bytes, level: int = 1) -> bytes:
    """Deterministic gzip (mtime 0), so a test can know the MD5 of the .gz it writes."""
    return gzip.compress(blob, compresslevel=level, mtime=0)


def write(directory: Path, contents: dict[str, bytes], gz: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, blob in contents.items():
        if gz:
            (directory / f"{name}.gz").write_bytes(compress(blob))
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
    for name, spec in REAL_DATASETS.items():
        monkeypatch.setitem(data.DATASETS, name, replace(spec, mirrors=()))
    monkeypatch.setattr(data, "TIMEOUT_S", 5.0)


@pytest.fixture
def make_small(monkeypatch):
    """Factory: swap dataset `name`'s files for tiny specs with the chosen checksums of synthetic content.

    md5: of the .gz that `write` makes; sha: of the content. Returns {file name: raw content}.
    """
    def make(name: str = "mnist", md5: bool = True, sha: bool = True) -> dict[str, bytes]:
        contents, specs = {}, {}
        for field, spec in REAL_SPECS.items():
            dims = SMALL_DIMS[field]
            n = math.prod(dims)
            values = [(i * 7) % 10 for i in range(n)] if len(dims) == 1 else [(i * 37) % 256 for i in range(n)]
            blob = idx_bytes(spec.magic, dims, bytes(values))
            specs[field] = FileSpec(spec.name, spec.magic, dims, hashlib.sha256(blob).hexdigest() if sha else "",
                                    hashlib.md5(compress(blob)).hexdigest() if md5 else "")
            contents[spec.name] = blob
        monkeypatch.setitem(data.DATASETS, name, replace(data.DATASETS[name], files=specs))
        return contents

    return make


@pytest.fixture
def small(make_small) -> dict[str, bytes]:
    """MNIST swapped for tiny files with both checksums known; {file name: raw content}."""
    return make_small()


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
            (out / f"{n}.gz").write_bytes(compress((real_mnist_dir / n).read_bytes()))
    return out


@pytest.fixture(scope="session")
def real_mnist(real_mnist_dir):
    return load_mnist(real_mnist_dir, download=False, cache_dir=real_mnist_dir / "no-such-cache")


@pytest.fixture
def http_server():
    """Factory: start(mode, root) -> (mirror URL, list of requested paths).

    Modes: good, nolength (good without Content-Length), garbage, drop, stall, 404.

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
                if mode == "404" or (mode in ("good", "nolength", "drop") and not file.is_file()):
                    self.send_error(404)
                    return
                body = file.read_bytes() if mode in ("good", "nolength", "drop") else b"<html>not gzip</html>" * 200
                self.send_response(200)
                if mode != "nolength":
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


def assert_small_loaded(mnist, contents, name="mnist", verified=True):
    assert mnist.train_images.shape == (6, 6) and mnist.test_images.shape == (4, 6)
    assert mnist.train_labels.shape == (6,) and mnist.test_labels.shape == (4,)
    for field in FIELDS:
        assert getattr(mnist, field).dtype == np.uint8
        assert not getattr(mnist, field).flags.writeable
    assert mnist.train_labels.tobytes() == contents[REAL_SPECS["train_labels"].name][8:]
    assert (mnist.name, mnist.image_shape, mnist.inputs, mnist.classes) == (name, (2, 3), 6, 10)
    if verified:
        assert mnist.verified and mnist.unverified == ()


def cache_listing(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---------------------------------------------------------------- the catalogue

TITLES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST", "kmnist": "KMNIST", "idx": "IDX set"}


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "kmnist"])
def test_catalogue_entry(name):
    spec = REAL_DATASETS[name]
    files = list(spec.files.values())
    assert (spec.name, spec.title, spec.classes, spec.cached) == (name, TITLES[name], 10, True)
    assert list(spec.files) == FIELDS and [f.name for f in files] == NAMES
    assert [f.dims for f in files] == [(60000, 28, 28), (60000,), (10000, 28, 28), (10000,)]
    assert all(re.fullmatch("[0-9a-f]{32}", f.gz_md5) for f in files)
    assert all(re.fullmatch("[0-9a-f]{64}", f.sha256) for f in files) if name == "mnist" else \
        all(f.sha256 == "" for f in files)
    assert len(spec.mirrors) == 2 and all(re.fullmatch("https?://.+/", m) for m in spec.mirrors)
    assert spec.title in spec.hint and "--data-dir" in spec.hint
    assert ("$RAWGPU_DATA" in spec.hint) == (name == "mnist")


def test_catalogue_checksums_distinct():
    """A value pasted into the wrong row shows up as a duplicate."""
    md5s = [f.gz_md5 for spec in REAL_DATASETS.values() for f in spec.files.values()]
    assert len(md5s) == len(set(md5s)) == 12


def test_names_titles_and_unknown_name(tmp_path):
    assert data.DATASET_NAMES == ("mnist", "fashion-mnist", "kmnist", "idx")
    assert {n: data.dataset_spec(n).title for n in data.DATASET_NAMES} == TITLES
    assert data.IDX.hint == "--dataset idx needs --data-dir DIR holding the four IDX files"
    assert data.MNIST is data.Dataset
    for call in (lambda: load_dataset("cifar10"), lambda: data.missing_files(tmp_path, "cifar10")):
        with pytest.raises(ValueError) as e:
            call()
        assert all(n in str(e.value) for n in ("cifar10", *data.DATASET_NAMES))


def test_known_shape():
    for name in ("mnist", "fashion-mnist", "kmnist"):
        assert data.known_shape(name) == dict(inputs=784, classes=10, train_rows=60000, test_rows=10000)
    assert data.known_shape("idx") is None
    with pytest.raises(ValueError):
        data.known_shape("cifar10")


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "kmnist", "idx"])
def test_missing_files_per_dataset(tmp_path, name):
    assert data.missing_files(tmp_path / "nowhere", name) == NAMES
    write(tmp_path / "d", {NAMES[0]: b"x"}, gz=False)
    write(tmp_path / "d", {NAMES[2]: b"x"})
    assert data.missing_files(tmp_path / "d", name) == [NAMES[1], NAMES[3]]


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


def test_real_files_pass_by_md5_or_content_sha(real_mnist, real_mnist_dir, monkeypatch):
    """The files in .data/mnist: three are the published .gz (MD5), train-images is re-compressed (content SHA)."""
    assert real_mnist.verified and real_mnist.classes == 10 and real_mnist.image_shape == (28, 28)
    paths = {f: real_mnist_dir / f"{spec.name}.gz" for f, spec in REAL_SPECS.items()}
    if not all(p.is_file() for p in paths.values()):
        pytest.skip(f"the real MNIST files in {real_mnist_dir} are not all gzipped")
    by_md5 = [f for f, p in paths.items() if hashlib.md5(p.read_bytes()).hexdigest() == REAL_SPECS[f].gz_md5]
    if real_mnist_dir == REPO / ".data" / "mnist":
        assert by_md5 == ["train_labels", "test_images", "test_labels"]

    def load_without_sha(fields):
        files = {f: replace(spec, sha256="") if f in fields else spec for f, spec in REAL_SPECS.items()}
        monkeypatch.setitem(data.DATASETS, "mnist", replace(data.DATASETS["mnist"], files=files))
        return load_mnist(real_mnist_dir, download=False, cache_dir=real_mnist_dir / "no-such-cache")

    assert load_without_sha(by_md5).verified  # MD5 alone carries these
    if by_content := [f for f in FIELDS if f not in by_md5]:
        with pytest.raises(DataError) as e:
            load_without_sha(FIELDS)  # and the content hash carries the rest
        one_line_error(e, str(paths[by_content[0]]), "checksum mismatch", REAL_SPECS[by_content[0]].gz_md5,
                       "not the standard MNIST")


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
    img, lab = data.DATASETS["mnist"].files["train_images"], data.DATASETS["mnist"].files["train_labels"]
    good_img, good_lab = small[img.name], small[lab.name]
    return {
        "bad_magic": (img.name, struct.pack(">I", 0x1234) + good_img[4:], True, "bad magic number 0x00001234"),
        "wrong_dims": (img.name, idx_bytes(img.magic, (6, 3, 2), good_img[16:]), True, "wrong dimensions (6, 3, 2)"),
        "truncated": (img.name, good_img[:-5], True, f"truncated: expected {len(good_img)} bytes, got {len(good_img) - 5}"),
        "short_header": (img.name, good_img[:6], True, "truncated"),
        "trailing": (img.name, good_img + b"xyz", True, "3 trailing bytes"),
        "bad_gzip": (img.name, b"definitely not gzip", "as-is", "not a gzip file / corrupt gzip stream"),
        "truncated_gzip": (img.name, gzip.compress(good_img)[:-12], "as-is", "corrupt gzip stream"),
        "hash": (img.name, good_img[:-1] + bytes([good_img[-1] ^ 1]), True, "checksum mismatch"),
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
    bad = cache / f"{REAL_SPECS['test_labels'].name}.gz"
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
    assert "truncated" in str(e.value) and "checksum" not in str(e.value)


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
        assert mine[0] == (0, size) and mine[-1] == (size, size)
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


def test_progress_without_content_length(small, http_server, tmp_path):
    """Without a length the bar cannot know the end, so the last call gives the total."""
    write(tmp_path / "served", small)
    url, _ = http_server("nolength", tmp_path / "served")
    calls = []
    assert_small_loaded(load_mnist(mirrors=[url], progress=lambda *a: calls.append(a)), small)
    for n in NAMES:
        mine = [(done, total) for name, done, total in calls if name == n]
        size = (tmp_path / "served" / f"{n}.gz").stat().st_size
        assert mine[0] == (0, None) and mine[-1] == (size, size)
        assert all(total is None for _, total in mine[:-1]) and len(mine) >= 3


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


def test_a_failed_download_leaves_no_folder_it_created(small, tmp_path):
    """The cache folders the download made are removed when it fails (they would stay empty); one that was there
    before stays."""
    with pytest.raises(DataError):
        load_mnist(mirrors=["nonsense-scheme://127.0.0.1/"])
    assert not (tmp_path / "cache").exists()
    (tmp_path / "cache").mkdir()
    with pytest.raises(DataError):
        load_mnist(mirrors=["nonsense-scheme://127.0.0.1/"])
    assert (tmp_path / "cache").is_dir() and not (tmp_path / "cache" / "mnist").exists()


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
    name = REAL_SPECS["train_images"].name
    if not gz:
        (cache / f"{name}.gz").unlink()
    bad = cache / (f"{name}.gz" if gz else name)
    bad.write_bytes(b"corrupt")
    url, requests = http_server("good", served)
    assert_small_loaded(load_mnist(mirrors=[url]), small)
    assert requests == [f"/{name}.gz"]
    assert cache_listing(cache) == sorted(f"{n}.gz" for n in small)
    assert gzip.decompress((cache / f"{name}.gz").read_bytes()) == small[name]


# ---------------------------------------------------------------- checksums

def test_gz_passes_on_md5_alone(make_small, tmp_path):
    contents = make_small(sha=False)
    write(tmp_path / "d", contents)
    assert_small_loaded(load_mnist(tmp_path / "d", download=False), contents)


def test_gz_md5_mismatch(make_small, tmp_path):
    contents = make_small(sha=False)
    write(tmp_path / "d", contents)
    name = NAMES[1]
    path = tmp_path / "d" / f"{name}.gz"
    path.write_bytes(compress(contents[name], level=9))  # same content, other bytes
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "d", download=False)
    expected = data.DATASETS["mnist"].files["train_labels"].gz_md5
    got = hashlib.md5(path.read_bytes()).hexdigest()
    one_line_error(e, str(path), "checksum mismatch", f"expected MD5 {expected}", f"got MD5 {got}",
                   "not the standard MNIST")
    assert "SHA-256" not in str(e.value)


def test_recompressed_gz_passes_on_content_sha(make_small, tmp_path):
    contents = make_small()
    d = tmp_path / "d"
    d.mkdir()
    for spec in data.DATASETS["mnist"].files.values():
        (d / f"{spec.name}.gz").write_bytes(compress(contents[spec.name], level=9))
        assert hashlib.md5((d / f"{spec.name}.gz").read_bytes()).hexdigest() != spec.gz_md5
    assert_small_loaded(load_mnist(d, download=False), contents)


def test_raw_file_sha_mismatch(small, tmp_path):
    write(tmp_path / "d", small, gz=False)
    path = tmp_path / "d" / NAMES[3]
    path.write_bytes(small[NAMES[3]][:-1] + bytes([(small[NAMES[3]][-1] + 1) % 10]))
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path / "d", download=False)
    message = one_line_error(e, str(path), "checksum mismatch: expected SHA-256", "not the standard MNIST")
    assert "MD5" not in message


@pytest.mark.parametrize("name", ["fashion-mnist", "kmnist"])
def test_raw_file_without_known_hash_is_unverified(make_small, tmp_path, name):
    contents = make_small(name, sha=False)
    d = tmp_path / "d"
    write(d, {n: contents[n] for n in NAMES[:2]}, gz=False)
    write(d, {n: contents[n] for n in NAMES[2:]})
    m = load_dataset(name, d, download=False)
    assert_small_loaded(m, contents, name, verified=False)
    assert m.unverified == (str(d / NAMES[0]), str(d / NAMES[1])) and not m.verified


# ---------------------------------------------------------------- other named datasets

def test_download_other_dataset_into_its_cache(make_small, http_server, tmp_path):
    contents = make_small("fashion-mnist", sha=False)
    write(tmp_path / "served", contents)
    url, requests = http_server("good", tmp_path / "served")
    m = load_dataset("fashion-mnist", mirrors=[url])
    assert_small_loaded(m, contents, "fashion-mnist")
    cache = tmp_path / "cache" / "fashion-mnist"
    assert m.source == cache and cache_listing(cache) == sorted(f"{n}.gz" for n in NAMES)
    assert cache_listing(tmp_path / "cache") == ["fashion-mnist"]
    assert load_dataset("fashion-mnist", mirrors=[url], download=False).source == cache
    assert len(requests) == 4


def test_download_uses_the_datasets_mirrors(make_small, http_server, tmp_path, monkeypatch):
    contents = make_small("kmnist", sha=False)
    write(tmp_path / "served", contents)
    url, requests = http_server("good", tmp_path / "served")
    monkeypatch.setitem(data.DATASETS, "kmnist", replace(data.DATASETS["kmnist"], mirrors=("nonsense://x/", url)))
    assert_small_loaded(load_dataset("kmnist"), contents, "kmnist")
    assert sorted(requests) == sorted(f"/{n}.gz" for n in NAMES)


def test_download_must_pass_md5(make_small, http_server, tmp_path):
    contents = make_small("kmnist", sha=False)
    served = tmp_path / "served"
    served.mkdir()
    for name, blob in contents.items():
        (served / f"{name}.gz").write_bytes(compress(blob, level=9))  # right content, not the published bytes
    url, _ = http_server("good", served)
    with pytest.raises(DataError) as e:
        load_dataset("kmnist", mirrors=[url])
    one_line_error(e, "KMNIST file train-images-idx3-ubyte", "download failed", "checksum mismatch",
                   "not the standard KMNIST", "pass --data-dir DIR holding the four KMNIST files")
    assert cache_listing(tmp_path / "cache" / "kmnist") == []


def test_env_data_dir_only_for_mnist(make_small, tmp_path, monkeypatch):
    contents = make_small("fashion-mnist")
    write(tmp_path / "envdata", contents)
    monkeypatch.setenv("RAWGPU_DATA", str(tmp_path / "envdata"))
    with pytest.raises(DataError) as e:
        load_dataset("fashion-mnist", download=False)
    message = one_line_error(e, "Fashion-MNIST file train-images-idx3-ubyte", str(tmp_path / "cache" / "fashion-mnist"),
                             "downloading is off", "pass --data-dir DIR holding the four Fashion-MNIST files")
    assert "RAWGPU_DATA" not in message and str(tmp_path / "envdata") not in message
    assert load_dataset("fashion-mnist", tmp_path / "envdata", download=False).source == tmp_path / "envdata"


# ---------------------------------------------------------------- idx sets of any size

def write_idx_set(directory: Path, n_train: int = 123, n_test: int = 45, shape: tuple[int, int] = (5, 7),
                  classes: int = 3, gz: bool = False, **override: bytes) -> dict[str, bytes]:
    """Four IDX files of the given size, labels cycling through 0..classes-1; `override` replaces one by field."""
    rng = np.random.default_rng(0)
    blobs = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        blobs[f"{split}_images"] = idx_bytes(data.IMAGES_MAGIC, (n, *shape), images.tobytes())
        blobs[f"{split}_labels"] = idx_bytes(data.LABELS_MAGIC, (n,), bytes(i % classes for i in range(n)))
    blobs.update(override)
    write(directory, {REAL_SPECS[field].name: blob for field, blob in blobs.items()}, gz=gz)
    return blobs


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_idx_set_any_size(tmp_path, gz):
    d = tmp_path / "set"
    blobs = write_idx_set(d, gz=gz)
    m = load_dataset("idx", d)
    assert (m.name, m.image_shape, m.inputs, m.classes, m.source) == ("idx", (5, 7), 35, 3, d)
    assert m.train_images.shape == (123, 35) and m.test_images.shape == (45, 35)
    assert m.train_labels.shape == (123,) and m.test_labels.shape == (45,)
    for field in FIELDS:
        array = getattr(m, field)
        assert array.dtype == np.uint8 and not array.flags.writeable
        assert array.tobytes() == blobs[field][16 if "images" in field else 8:]
    assert not m.verified
    assert m.unverified == tuple(str(d / (f"{n}.gz" if gz else n)) for n in NAMES)
    assert not (tmp_path / "cache").exists()


def test_idx_classes_from_both_label_files(tmp_path):
    test_labels = idx_bytes(data.LABELS_MAGIC, (45,), bytes([4] + [0] * 44))
    write_idx_set(tmp_path / "set", classes=2, test_labels=test_labels)
    assert load_dataset("idx", tmp_path / "set").classes == 5


def test_idx_set_at_the_limits(tmp_path):
    """Every byte is a label: 256 classes, and the widest image."""
    write_idx_set(tmp_path / "set", n_train=IDX_MAX_CLASSES, n_test=2, shape=(MAX_INPUTS // 128, 128),
                  classes=IDX_MAX_CLASSES)
    m = load_dataset("idx", tmp_path / "set")
    assert (m.classes, m.inputs) == (IDX_MAX_CLASSES, MAX_INPUTS)


IDX_ERRORS = {  # case -> (write_idx_set arguments, the field whose file is named, message fragments)
    "image sizes differ": (dict(test_images=idx_bytes(data.IMAGES_MAGIC, (45, 7, 5), bytes(45 * 35))),
                           "test_images", ["images of 7x5", "are 5x7", NAMES[0]]),
    "label count": (dict(train_labels=idx_bytes(data.LABELS_MAGIC, (122,), bytes(i % 3 for i in range(122)))),
                    "train_labels", ["122 labels for the 123 images", NAMES[0]]),
    "single class": (dict(classes=1), "train_labels", ["every label is 0, a single class", NAMES[3]]),
    "2-dim images": (dict(train_images=idx_bytes(0x802, (123, 35), bytes(123 * 35))), "train_images",
                     ["2-dim IDX file (magic 0x00000802)", "expected magic 0x00000803: uint8, 3 dims"]),
    "too many pixels": (dict(n_train=2, n_test=2, shape=(129, 128), classes=2), "train_images",
                        [f"{129 * 128} pixels; at most {MAX_INPUTS} fit"]),
    "no images": (dict(n_train=0), "train_images", ["empty: dimensions (0, 5, 7)"]),
    "wrong size": (dict(test_images=idx_bytes(data.IMAGES_MAGIC, (45, 5, 7), bytes(45 * 35 - 1))), "test_images",
                   [f"truncated: expected {16 + 45 * 35} bytes, got {16 + 45 * 35 - 1}"]),
}


@pytest.mark.parametrize("case", list(IDX_ERRORS))
def test_idx_set_errors(tmp_path, case):
    kwargs, field, fragments = IDX_ERRORS[case]
    d = tmp_path / "set"
    write_idx_set(d, **kwargs)
    with pytest.raises(DataError) as e:
        load_dataset("idx", d)
    one_line_error(e, str(d / REAL_SPECS[field].name), *fragments)


def test_idx_set_missing_file(tmp_path, http_server):
    d = tmp_path / "set"
    write_idx_set(d)
    (d / NAMES[3]).unlink()
    url, requests = http_server("good", d)
    with pytest.raises(DataError) as e:
        load_dataset("idx", d, download=True, mirrors=[url])
    one_line_error(e, f"IDX set file {NAMES[3]} (or {NAMES[3]}.gz) not found in {d}; "
                      "--dataset idx needs --data-dir DIR holding the four IDX files")
    assert requests == [] and not (tmp_path / "cache").exists()


def test_idx_set_needs_a_directory(tmp_path, monkeypatch):
    write_idx_set(tmp_path / "set")
    monkeypatch.setenv("RAWGPU_DATA", str(tmp_path / "set"))  # MNIST's variable: not for idx
    with pytest.raises(DataError) as e:
        load_dataset("idx")
    assert str(e.value) == "--dataset idx needs --data-dir DIR holding the four IDX files"
    for missing in (tmp_path / "no-such-dir", tmp_path / "set" / NAMES[0]):
        with pytest.raises(DataError) as e:
            load_dataset("idx", missing)
        one_line_error(e, f"{missing}: not a directory", "--dataset idx needs --data-dir DIR")
