"""Arena planning (CPU) and device round trips (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.runtime.errors import OutOfMemoryError, RawgpuError
from rawgpu.runtime.memory import ALIGNMENT, Arena


def test_plan_aligns_and_never_overlaps(rng):
    arena = Arena()
    dtypes = [np.float16, np.float32, np.uint8, np.int64]
    tensors = [arena.tensor(f"t{i}", tuple(rng.integers(0, 50, size=rng.integers(1, 4))), dtypes[i % 4])
               for i in range(40)]
    spans = sorted((t.offset, t.offset + t.nbytes) for t in tensors)
    for t in tensors:
        assert t.offset % ALIGNMENT == 0
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "buffers overlap"
    assert arena.peak_bytes >= spans[-1][1]
    assert arena.peak_bytes % ALIGNMENT == 0


def test_larger_alignment_is_honoured():
    arena = Arena()
    arena.tensor("a", 3, np.uint8)
    b = arena.tensor("b", 10, np.float32, alignment=4096)
    assert b.offset % 4096 == 0


def test_tensor_metadata():
    arena = Arena()
    t = arena.tensor("w", (784, 256), np.float16)
    assert t.shape == (784, 256) and t.nbytes == 784 * 256 * 2 and t.size == 784 * 256
    v = t.view((256,), offset_bytes=512)
    assert v.offset == t.offset + 512
    with pytest.raises(ValueError):
        t.view((784 * 256,), offset_bytes=2)


@pytest.mark.parametrize("bad", [dict(alignment=100), dict(alignment=128)])
def test_bad_alignment_is_refused(bad):
    with pytest.raises(ValueError):
        Arena(**bad)


def test_duplicate_and_negative_and_late_buffers_are_refused():
    arena = Arena()
    arena.tensor("a", 4, np.float32)
    with pytest.raises(ValueError, match="already planned"):
        arena.tensor("a", 4, np.float32)
    with pytest.raises(ValueError, match="negative"):
        arena.tensor("b", (-1, 4), np.float32)
    with pytest.raises(RawgpuError, match="not allocated"):
        _ = arena["a"].ptr


def test_oversize_plan_is_refused_before_allocating(monkeypatch):
    """The needed-vs-free check runs against the driver's free-memory figure, faked here so it runs on CPU too."""
    from rawgpu.runtime import driver

    def mem_alloc(n):  # pragma: no cover - must not be reached
        raise AssertionError("allocated despite the plan not fitting")

    monkeypatch.setattr(driver, "init", lambda: None)
    monkeypatch.setattr(driver, "mem_info", lambda: (1 << 30, 2 << 30))
    monkeypatch.setattr(driver, "mem_alloc", mem_alloc)
    arena = Arena()
    arena.tensor("huge", (1 << 31,), np.uint8)
    with pytest.raises(OutOfMemoryError) as info:
        arena.allocate()
    assert "need 2.00 GiB" in str(info.value) and "1.00 GiB free" in str(info.value)


def test_driver_refusing_a_plan_that_fitted_says_both_sizes(monkeypatch):
    """Free memory can shrink between the check and the allocation (another process): still OutOfMemoryError."""
    from rawgpu.runtime import driver

    def mem_alloc(n):
        raise OutOfMemoryError(f"not enough GPU memory: cuMemAlloc({n} B) failed: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(driver, "init", lambda: None)
    monkeypatch.setattr(driver, "mem_info", lambda: (4 << 30, 8 << 30))
    monkeypatch.setattr(driver, "mem_alloc", mem_alloc)
    arena = Arena()
    arena.tensor("big", (3 << 30,), np.uint8)
    with pytest.raises(OutOfMemoryError, match="cuMemAlloc of 3.00 GiB failed with 4.00 GiB reported free"):
        arena.allocate()
    assert not arena.allocated


def test_copies_are_fenced_by_context_synchronize(monkeypatch):
    """Uploads, fills and zeroing wait for queued kernels before and for the copy after (non-blocking streams are
    not ordered with these calls); downloads only before, since the copy back returns with the data."""
    from rawgpu.runtime import driver

    calls = []
    monkeypatch.setattr(driver, "init", lambda: None)
    monkeypatch.setattr(driver, "mem_info", lambda: (1 << 30, 1 << 30))
    monkeypatch.setattr(driver, "mem_alloc", lambda n: 0x10000)
    monkeypatch.setattr(driver, "mem_free", lambda ptr: calls.append(("free", ptr)))
    monkeypatch.setattr(driver, "context_synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(driver, "copy_host_to_device", lambda ptr, host: calls.append(("htod", ptr, host.nbytes)))
    monkeypatch.setattr(driver, "copy_device_to_host", lambda host, ptr: calls.append(("dtoh", ptr, host.nbytes)))
    monkeypatch.setattr(driver, "memset_d8", lambda ptr, byte, n: calls.append(("memset", ptr, byte, n)))
    with Arena() as arena:
        a = arena.tensor("a", 4, np.float32)
        b = arena.tensor("b", 2, np.int64)
        arena.allocate()
        b.upload(np.arange(2))
        a.download()
        a.fill_bytes(0x1FF)
        arena.zero()
    assert calls == ["sync", ("htod", 0x10000 + b.offset, 16), "sync",
                     "sync", ("dtoh", 0x10000, 16),
                     "sync", ("memset", 0x10000, 0xFF, 16), "sync",
                     "sync", ("memset", 0x10000, 0, arena.peak_bytes), "sync",
                     ("free", 0x10000)]


# --- GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.uint8, np.int32, np.int64])
def test_upload_download_round_trip(device, rng, dtype):
    with Arena() as arena:
        a = arena.tensor("a", (123, 77), dtype)
        b = arena.tensor("b", (5,), dtype)
        arena.allocate()
        data = (rng.standard_normal((123, 77)) * 100).astype(dtype)
        a.fill_bytes(0xFF)
        a.upload(data)
        b.upload(np.arange(5).astype(dtype))
        assert np.array_equal(a.download(), data)
        assert np.array_equal(b.download(), np.arange(5).astype(dtype))


@pytest.mark.gpu
def test_upload_checks_shape_and_dtype(device):
    with Arena() as arena:
        a = arena.tensor("a", (4, 4), np.float32)
        arena.allocate()
        with pytest.raises(ValueError, match="shape"):
            a.upload(np.zeros((4, 5), np.float32))
        with pytest.raises(TypeError, match="dtype"):
            a.upload(np.zeros((4, 4), np.float64))


@pytest.mark.gpu
def test_more_than_the_device_has_is_out_of_memory(device):
    arena = Arena()
    arena.tensor("too_big", (device.info.total_memory + (1 << 30),), np.uint8)
    with pytest.raises(OutOfMemoryError, match="need .* free of"):
        arena.allocate()


@pytest.mark.gpu
@pytest.mark.gpu_exclusive  # asserts on the device-wide free figure, which other processes move
def test_close_frees_the_allocation(device):
    free_before, _ = device.memory_info()
    with Arena() as arena:
        arena.tensor("big", (1 << 30,), np.uint8)
        arena.allocate()
        assert device.memory_info()[0] <= free_before - (1 << 30)
    assert device.memory_info()[0] >= free_before - (64 << 20)
