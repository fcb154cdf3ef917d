"""Shared fixtures: the `gpu` marker skips with the driver's own reason when no GPU is usable; under pytest-xdist a
`gpu_exclusive` test has the GPU to itself."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import pytest


@functools.lru_cache(maxsize=1)
def _gpu_status() -> tuple[object | None, str]:
    try:
        from rawgpu.runtime.driver import Device

        return Device(0), ""
    except Exception as exc:  # NoDeviceError, or anything the bindings raise without a driver
        return None, f"no usable GPU: {exc}"


def skip_without_gpu() -> object:
    """The device, or a skip with the driver's reason. Every GPU test skips from this one line, so the summary
    folds them into one entry with their count instead of a line each."""
    device, reason = _gpu_status()
    if device is None:
        pytest.skip(reason)
    return device


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """The tests that read the whole builds run last: their builds (whole_builds_early) then overlap every other
    test instead of holding the session up where the first of them comes."""
    items.sort(key=lambda item: "whole_builds" in getattr(item, "fixturenames", ()))


def pytest_runtest_setup(item):
    """A `gpu` test without a GPU skips before any of its fixtures is set up."""
    if item.get_closest_marker("gpu"):
        skip_without_gpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist the workers share one GPU: a `gpu_exclusive` test runs with no other GPU test beside it,
    from its first fixture's set-up to its last one's teardown (the fixtures allocate too)."""
    with _gpu_turn(item):
        yield


@contextlib.contextmanager
def _gpu_turn(item):
    """A file lock in the run's temporary folder, which its local workers share: exclusive for a `gpu_exclusive`
    test, shared for every other GPU test. Without xdist there is one process, and nothing to take."""
    basetemp = item.config.option.basetemp
    if not hasattr(item.config, "workerinput") or not basetemp or not item.get_closest_marker("gpu"):
        yield
        return
    import fcntl  # POSIX only: imported where xdist's workers need it, and nowhere else

    folder = Path(basetemp).parent
    exclusive = item.get_closest_marker("gpu_exclusive") is not None
    # Every test passes the gate on its way in, and an exclusive one holds it while it waits: no new GPU test starts
    # behind it, so it waits for the running ones only, not for a moment when none happens to run.
    with open(folder / "gpu-gate.lock", "a") as gate, open(folder / "gpu.lock", "a") as turn:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(turn, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files lets go of the lock


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """One kernel cache for the whole session: every unit is built once. Builds are the CPU suite's slowest part, so
    the cache outlives the session ($RAWGPU_TEST_CACHE, default ~/.cache/rawgpu-tests): an entry is found only by
    its content (compiler.cache_key: every source and header, the generated contract, the options, NVRTC's
    version), so a changed kernel is built again and an unchanged one is not. RAWGPU_TEST_CACHE=fresh builds into a
    new temporary folder; a cache the caller named ($RAWGPU_CACHE) is used as it is. The tests of the cache itself
    use folders of their own."""
    if os.environ.get("RAWGPU_CACHE"):
        yield os.environ["RAWGPU_CACHE"]
        return
    kept = os.environ.get("RAWGPU_TEST_CACHE") or str(Path.home() / ".cache" / "rawgpu-tests")
    path = str(tmp_path_factory.mktemp("rawgpu-cache")) if kept == "fresh" else kept
    os.environ["RAWGPU_CACHE"] = path
    try:
        yield path
    finally:
        os.environ.pop("RAWGPU_CACHE", None)


_early_builds: list = []  # the process building every source whole, when this session runs a test that needs it


@pytest.fixture(scope="session", autouse=True)
def whole_builds_early(request, kernel_cache):
    """When a collected test uses `whole_builds`, start those builds now, in a process of their own (whole_builds.py),
    so that they use the CPUs while the other tests run (those that read them run last)."""
    if any("whole_builds" in getattr(item, "fixturenames", ()) for item in request.session.items):
        import subprocess
        import sys

        here = Path(__file__).resolve().parent
        env = {**os.environ, "RAWGPU_CACHE": kernel_cache,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))}
        _early_builds.append(subprocess.Popen([sys.executable, str(here / "whole_builds.py")], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    yield
    for proc in _early_builds:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def whole_builds(kernel_cache):
    """(source, arch) -> every source built whole for sm_80, sm_86 and sm_90 (whole_builds.py): the early process's
    builds, read from the cache once it has finished; what it could not build is built (and fails) here."""
    from whole_builds import build

    for proc in _early_builds:
        proc.wait()
    return build()


@pytest.fixture(scope="session")
def device():
    return skip_without_gpu()


@pytest.fixture(scope="session")
def stream(device):
    from rawgpu.runtime.driver import Stream

    return Stream()


@pytest.fixture(scope="session")
def kernels_for(device):
    """The device's kernels built for an activation (rawgpu.model.recipe.ACTIVATIONS), one Kernels per activation."""
    from rawgpu.kernels import Kernels

    built: dict = {}
    return lambda activation="relu": built.setdefault(activation, Kernels(device.arch, activation=activation))


@pytest.fixture(scope="session")
def mnist():
    """MNIST from $RAWGPU_DATA or the cache, never downloaded: a test that needs it skips, saying why, without it."""
    from rawgpu.data.datasets import load_mnist
    from rawgpu.runtime.errors import DataError

    try:
        return load_mnist(download=False)
    except DataError as exc:
        pytest.skip(f"MNIST not available offline (set RAWGPU_DATA): {exc}")


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; a failing test's report names the seed, and RAWGPU_TEST_SEED=N replays it."""
    seed = int(os.environ.get("RAWGPU_TEST_SEED") or np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that drew fresh inputs says from which seed, so the case can be run again."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("rng", f"inputs drawn from seed {value}: RAWGPU_TEST_SEED={value} "
                                               f"python -m pytest '{item.nodeid}'"))
