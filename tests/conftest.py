"""Shared fixtures: the `gpu` marker skips with the driver's own reason when no GPU is usable."""

from __future__ import annotations

import functools

import numpy as np
import pytest


@functools.lru_cache(maxsize=1)
def _gpu_status() -> tuple[object | None, str]:
    try:
        from rawgpu.driver import Device

        return Device(0), ""
    except Exception as exc:  # NoDeviceError, or anything the bindings raise without a driver
        return None, f"no usable GPU: {exc}"


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    device, reason = _gpu_status()
    if device is None:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    device, reason = _gpu_status()
    if device is None:
        pytest.skip(reason)
    return device


@pytest.fixture(scope="session")
def stream(device):
    from rawgpu.driver import Stream

    return Stream()


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed on failure so a bad case can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)
