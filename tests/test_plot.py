"""Tests for rawgpu.training.plot: the training-curve PNG, its path checks, and a missing matplotlib."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from rawgpu.runtime.errors import RawgpuError
from rawgpu.training.plot import PlotUnavailable, check_plot_path, plot_available, write_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

needs_matplotlib = pytest.mark.skipif(not plot_available(), reason="matplotlib is not installed")


def assert_png(path):
    blob = path.read_bytes()
    assert blob.startswith(PNG_SIGNATURE) and len(blob) > 10_000
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left beside it


@needs_matplotlib
def test_writes_a_png(tmp_path):
    path = tmp_path / "run.png"
    write_plot(path, [1, 2, 3], [0.5, 0.2, 0.1], [0.95, 0.97, 0.981], title="hidden 256, batch 128")
    assert_png(path)


@needs_matplotlib
@pytest.mark.parametrize("loss", [[0.5, math.nan, 0.1], [math.inf, 0.3, math.nan], [0.0, -1.0, 2.0]],
                         ids=["nan", "inf", "non-positive"])
def test_odd_losses_do_not_crash(tmp_path, loss):
    path = tmp_path / "odd.png"
    write_plot(str(path), [1, 2, 3], loss, [0.1, math.nan, 0.3])
    assert_png(path)


@needs_matplotlib
def test_no_epochs(tmp_path):
    path = tmp_path / "empty.png"
    write_plot(path, [], [], [])
    assert path.read_bytes().startswith(PNG_SIGNATURE)


@needs_matplotlib
def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "run.png"
    path.write_bytes(b"old")
    write_plot(path, [1], [0.3], [0.9])
    assert_png(path)


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.png"):
        write_plot(tmp_path / "run.jpg", [1], [0.3], [0.9])
    with pytest.raises(ValueError, match="one of each per epoch"):
        write_plot(tmp_path / "run.png", [1, 2], [0.3], [0.9])
    assert list(tmp_path.iterdir()) == []


@needs_matplotlib
def test_unwritable_directory_is_one_line(tmp_path):
    path = tmp_path / "gone" / "run.png"
    with pytest.raises(RawgpuError) as info:
        write_plot(path, [1], [0.3], [0.9])
    assert str(info.value).startswith(f"{path}: cannot write the plot") and "\n" not in str(info.value)


def test_check_plot_path(tmp_path):
    assert check_plot_path(tmp_path / "run.png") is None
    assert check_plot_path(tmp_path / "RUN.PNG") is None
    assert "must end in .png" in check_plot_path(tmp_path / "run.svg")
    assert "must end in .png" in check_plot_path(tmp_path / "run")
    assert "does not exist" in check_plot_path(tmp_path / "missing" / "run.png")
    (tmp_path / "dir.png").mkdir()
    assert "is a directory" in check_plot_path(tmp_path / "dir.png")
    (tmp_path / "file").write_text("")
    assert "does not exist" in check_plot_path(tmp_path / "file" / "run.png")
    for problem in [check_plot_path(tmp_path / "run.svg"), check_plot_path(tmp_path / "missing" / "run.png")]:
        assert "\n" not in problem


def test_check_plot_path_read_only_directory():
    """A directory no file can be created in, even by root (whom os.access and chmod do not stop): /proc."""
    assert "cannot write in /proc" in check_plot_path(Path("/proc/run.png"))


def test_missing_matplotlib(tmp_path, monkeypatch):
    plot_available()  # submodules may already be imported; the check must still notice
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_available() is False
    with pytest.raises(PlotUnavailable) as info:
        write_plot(tmp_path / "run.png", [1], [0.3], [0.9])
    from rawgpu.runtime.install import hint

    assert str(info.value) == f"--plot needs matplotlib: {hint('plot')}"
    assert isinstance(info.value, RawgpuError)
    assert list(tmp_path.iterdir()) == []


@needs_matplotlib
def test_leaves_pyplot_and_the_backend_alone(tmp_path):
    """A fresh interpreter, so no other test has imported pyplot: drawing must not import it either."""
    code = ("import sys; from rawgpu.training.plot import write_plot; "
            f"write_plot({str(tmp_path / 'run.png')!r}, [1], [0.3], [0.9]); "
            "print('matplotlib.pyplot' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
