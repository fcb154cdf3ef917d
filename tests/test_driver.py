"""Driver layer: error checking, argument packing and NoDeviceError on CPU; device, launches and events on GPU."""

from __future__ import annotations

import os
import signal
import struct
import time
import weakref

import numpy as np
import pytest

from rawgpu.runtime import driver
from rawgpu.runtime.compiler import compile_source
from rawgpu.runtime.errors import CudaError, GpuHangError, NoDeviceError, OutOfMemoryError
from rawgpu.runtime.memory import Arena


def test_check_passes_values_and_raises_named_errors():
    from cuda.bindings.driver import CUresult

    ok = CUresult.CUDA_SUCCESS
    assert driver.check((ok,), "cuX") is None
    assert driver.check((ok, 7), "cuX") == 7
    assert driver.check((ok, 1, 2), "cuX") == (1, 2)
    with pytest.raises(CudaError) as info:
        driver.check((CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuMemAlloc")
    assert info.value.call == "cuMemAlloc"
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert "cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE" in str(info.value)


def test_pack_args_layout_matches_c():
    class FakeTensor:
        ptr = 0xDEADBEEF00

    packed = driver.pack_args("pifq", [FakeTensor(), -3, 1.5, 1 << 40])
    assert packed == struct.pack("<Qifq", 0xDEADBEEF00, -3, 1.5, 1 << 40)
    args = driver.PackedArgs("pifq", [FakeTensor(), -3, 1.5, 1 << 40])
    assert [v.value for v in args.values] == [0xDEADBEEF00, -3, 1.5, 1 << 40]
    import ctypes

    addresses = [args.array[i] for i in range(4)]
    assert addresses == [ctypes.addressof(v) for v in args.values]


def test_tensor_map_arguments_are_passed_by_value():
    blob = bytes(range(128))
    args = driver.PackedArgs("tp", [blob, 5])
    assert bytes(args.values[0]) == blob and args.values[1].value == 5
    assert driver.pack_args("t", [blob]) == blob


class _GeometryOnlyKernel:
    """Enough of driver.Kernel for Launch to check geometry and build its launch config without a GPU."""

    name, signature = "k", ""

    def ensure_shared(self, nbytes):
        pass

    def allow_cluster(self, ctas):
        pass


def test_cluster_launches_take_a_size_per_axis():
    args = driver.PackedArgs("", ())
    split = driver.Launch(_GeometryOnlyKernel(), (2, 3, 4), 64, 0, args, cluster=(1, 1, 4))  # split-K: along z
    assert split.cluster == 4 and split.cluster_dims == (1, 1, 4) and split._config is not None
    assert split.overlapping().cluster_dims == (1, 1, 4) and split.overlapping().programmatic
    row = driver.Launch(_GeometryOnlyKernel(), 16, 64, 0, args, cluster=16)  # an int: along x
    assert row.cluster_dims == (16, 1, 1)
    assert driver.Launch(_GeometryOnlyKernel(), 8, 64, 0, args)._config is None  # plain launches stay plain
    with pytest.raises(ValueError, match="must divide the grid"):
        driver.Launch(_GeometryOnlyKernel(), (2, 3, 4), 64, 0, args, cluster=(1, 1, 3))


@pytest.mark.parametrize("sig,args,exc", [
    ("pi", [1], TypeError),          # wrong count
    ("i", [1.5], TypeError),         # float for an int
    ("i", [1 << 31], OverflowError),  # does not fit int32
    ("z", [1], ValueError),          # unknown kind
    ("t", [b"x" * 64], TypeError),   # a tensor map is 128 bytes
    ("t", [7], TypeError),
])
def test_pack_args_rejects_bad_arguments(sig, args, exc):
    with pytest.raises(exc):
        driver.pack_args(sig, args)


class _FakeDriver:
    """Stands in for cuda.bindings.driver where libcuda is missing or reports no device."""

    def __init__(self, init_result=None, raises=None, version=13000):
        from cuda.bindings import driver as real

        self.real, self.init_result, self.raises, self.version = real, init_result, raises, version
        self.CUresult = real.CUresult

    def cuInit(self, flags):
        if self.raises:
            raise self.raises
        return (self.init_result,)

    def cuDriverGetVersion(self):
        return (self.CUresult.CUDA_SUCCESS, self.version)

    def cuGetErrorString(self, err):
        raise RuntimeError("no libcuda")


@pytest.fixture
def fake_driver(monkeypatch):
    def install(**kw):
        fake = _FakeDriver(**kw)
        monkeypatch.setattr(driver, "_cu", lambda: fake)
        monkeypatch.setattr(driver, "_initialized", False)
        return fake

    return install


def test_missing_driver_library_is_no_device_error(fake_driver):
    fake_driver(raises=RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search'))
    with pytest.raises(NoDeviceError, match="no NVIDIA driver found"):
        driver.init()


def test_no_device_is_no_device_error(fake_driver):
    from cuda.bindings.driver import CUresult

    fake_driver(init_result=CUresult.CUDA_ERROR_NO_DEVICE)
    with pytest.raises(NoDeviceError, match="no CUDA GPU found"):
        driver.init()


def test_old_driver_names_its_cuda_version_and_the_fix(fake_driver, monkeypatch):
    from cuda.bindings.driver import CUresult

    fake_driver(init_result=CUresult.CUDA_SUCCESS, version=12040)
    monkeypatch.setattr(driver, "bindings_major", lambda: 13)
    with pytest.raises(NoDeviceError) as info:
        driver.init()
    assert "supports CUDA 12.4" in str(info.value) and "cu12" in str(info.value)
    assert "\n" not in str(info.value)


class _FakeBinding:
    """Records calls and answers them from `results` (name -> tuple), like cuda.bindings.driver without a GPU."""

    def __init__(self, **results):
        from cuda.bindings import driver as real

        self.real, self.results, self.calls = real, results, []

    def __getattr__(self, name):
        if name.startswith("cu") and name[2:3].isupper():
            if name not in self.results:
                raise AttributeError(name)

            def fn(*args):
                self.calls.append((name, args))
                return self.results[name]

            fn.__name__ = name
            return fn
        return getattr(self.real, name)  # enums and types


@pytest.fixture
def fake_binding(monkeypatch):
    def install(**results):
        fake = _FakeBinding(**results)
        monkeypatch.setattr(driver, "_cu", lambda: fake)
        return fake

    return install


def _ok(*values):
    from cuda.bindings.driver import CUresult

    return (CUresult.CUDA_SUCCESS, *values)


def _err(name, *values):
    from cuda.bindings.driver import CUresult

    return (getattr(CUresult, name), *values)


def test_mem_alloc_maps_out_of_memory_and_names_other_errors(fake_binding):
    fake_binding(cuMemAlloc=_ok(0xABC00))
    assert driver.mem_alloc(256) == 0xABC00
    fake_binding(cuMemAlloc=_err("CUDA_ERROR_OUT_OF_MEMORY", None))
    with pytest.raises(OutOfMemoryError, match=r"cuMemAlloc\(1024 B\) failed: CUDA_ERROR_OUT_OF_MEMORY"):
        driver.mem_alloc(1024)
    fake_binding(cuMemAlloc=_err("CUDA_ERROR_INVALID_VALUE", None))
    with pytest.raises(CudaError, match="cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE") as info:
        driver.mem_alloc(0)
    assert not isinstance(info.value, OutOfMemoryError)


def test_checked_wrappers_name_the_driver_call(fake_binding, watchdog):
    fake_binding(cuCtxSynchronize=_err("CUDA_ERROR_LAUNCH_FAILED"), cuMemsetD8=_err("CUDA_ERROR_INVALID_VALUE"),
                 cuMemGetInfo=_ok(3, 4))
    assert driver.mem_info() == (3, 4)
    with pytest.raises(CudaError, match="cuCtxSynchronize failed: CUDA_ERROR_LAUNCH_FAILED"):
        driver.context_synchronize()
    with pytest.raises(CudaError, match="cuMemsetD8 failed: CUDA_ERROR_INVALID_VALUE"):
        driver.memset_d8(0x100, 0xFF, 16)


def test_host_copies_take_contiguous_arrays_and_skip_empty_ones(fake_binding):
    fake = fake_binding(cuMemcpyHtoD=_ok(), cuMemcpyDtoH=_ok())
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    driver.copy_host_to_device(0x200, host)
    assert fake.calls == [("cuMemcpyHtoD", (0x200, host.ctypes.data, 48))]
    with pytest.raises(ValueError, match="contiguous"):
        driver.copy_host_to_device(0x200, host[:, ::2])
    host.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        driver.copy_device_to_host(host, 0x200)
    driver.copy_host_to_device(0x200, np.empty(0, np.float32))
    driver.copy_device_to_host(np.empty((0, 3), np.float32), 0x200)
    assert len(fake.calls) == 1


def test_device_count_initialises_the_driver_first(fake_binding, monkeypatch):
    order = []
    monkeypatch.setattr(driver, "init", lambda: order.append("init"))
    fake_binding(cuDeviceGetCount=_ok(2))
    assert driver.device_count() == 2 and order == ["init"]


def test_end_capture_destroys_a_broken_or_discarded_graph(fake_binding):
    stream = type("S", (), {"handle": 7})()
    fake = fake_binding(cuStreamEndCapture=_err("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", 99), cuGraphDestroy=_ok())
    with pytest.raises(CudaError, match="cuStreamEndCapture failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        driver.end_capture(stream)
    assert fake.calls[-1] == ("cuGraphDestroy", (99,))
    fake = fake_binding(cuStreamEndCapture=_ok(42), cuGraphDestroy=_ok())
    assert driver.end_capture(stream, discard=True) is None
    assert fake.calls[-1] == ("cuGraphDestroy", (42,))
    fake = fake_binding(cuStreamEndCapture=_ok(42))
    assert driver.end_capture(stream) == 42


def test_graph_edges_read_the_dependency_type_where_the_bindings_give_it(fake_binding):
    from types import SimpleNamespace

    from cuda.bindings.driver import CUgraphDependencyType as T

    data = [SimpleNamespace(type=T.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT),
            SimpleNamespace(type=T.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)]
    # CUDA 13: cuGraphGetEdges returns (from, to, edge data, count)
    fake_binding(cuGraphGetEdges=_ok([1, 2], [2, 3], data, 2))
    assert driver.graph_edges("g") == [(1, 2, "default"), (2, 3, "programmatic")]
    # CUDA 12: the edge data only comes from the _v2 call, which is preferred when present
    fake_binding(cuGraphGetEdges=_ok([1], [2], 1), cuGraphGetEdges_v2=_ok([1], [2], data[1:], 1))
    assert driver.graph_edges("g") == [(1, 2, "programmatic")]
    fake_binding(cuGraphGetEdges=_ok([1], [2], 1))  # bindings without edge data
    assert driver.graph_edges("g") == [(1, 2, "default")]
    fake_binding(cuGraphGetEdges=_ok([], [], 0))
    assert driver.graph_edges("g") == []


def test_device_without_gpu_raises_no_device_error():
    try:
        dev = driver.Device(0)
    except NoDeviceError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        dev.close()
        pytest.skip("a GPU is present: this test is for machines without one (the fakes above cover the logic)")


# --- GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_reports_sane_properties(device):
    info = device.info
    assert info.name and info.sm_count > 0 and info.total_memory > 1 << 30
    assert info.compute_capability >= (8, 0)
    assert info.shared_per_block_optin >= info.shared_per_block >= 48 * 1024
    free, total = device.memory_info()
    assert 0 < free <= total


@pytest.mark.gpu
def test_bad_device_index_is_clear(device):
    with pytest.raises(NoDeviceError, match="no GPU with index 99"):
        driver.Device(99)


@pytest.mark.gpu
def test_kernel_launch_through_the_stack(device, stream, rng):
    mod = compile_source("elementwise.cu", device.arch)
    module = driver.Module(mod.cubin, mod.resources)
    k = module.kernel("axpby_f32", "ppffq")
    n = 100_003
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    with Arena() as arena:
        tx, ty = arena.tensor("x", n, np.float32), arena.tensor("y", n, np.float32)
        arena.allocate()
        tx.upload(x)
        ty.upload(y)
        driver.launch(k, (n + 255) // 256, 256, 0, stream, ty, tx, 2.5, -0.5, n)
        got = ty.download()
    ref = 2.5 * x.astype(np.float64) - 0.5 * y.astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.gpu
def test_bound_launch_replays_with_packed_args_and_events_time_it(device, stream):
    mod = compile_source("elementwise.cu", device.arch)
    k = driver.Module(mod.cubin).kernel("increment_i64", "pi")
    with Arena() as arena:
        counter = arena.tensor("counter", 1, np.int64)
        arena.allocate()
        counter.upload(np.array([5], np.int64))
        bound = k.bind(1, 32, 0, counter, 3)
        start, end = driver.Event(), driver.Event()
        start.record(stream)
        for _ in range(100):
            bound.run(stream)
        end.record(stream)
        assert start.elapsed_ms(end) > 0
        assert counter.download()[0] == 5 + 300


@pytest.mark.gpu
def test_launch_errors_name_the_call(device, stream):
    mod = compile_source("elementwise.cu", device.arch)
    k = driver.Module(mod.cubin).kernel("increment_i64", "pi")
    with pytest.raises(CudaError, match="cuLaunchKernel\\(increment_i64\\) failed: CUDA_ERROR_INVALID_VALUE"):
        driver.launch(k, 1, 4096, 0, stream, 0, 1)  # 4096 threads per block is over every GPU's limit


@pytest.mark.gpu
def test_large_dynamic_shared_memory_is_opted_in(device):
    mod = compile_source("elementwise.cu", device.arch)
    k = driver.Module(mod.cubin).kernel("copy_f16_if_odd", "ppqp")
    want = device.info.shared_per_block_optin
    k.ensure_shared(want)
    from cuda.bindings import driver as cu

    got = driver.check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.func))
    assert got == want



@pytest.mark.gpu
def test_dynamic_shared_memory_beside_static_is_opted_in(device):
    """A kernel with static shared memory (logits_xent: 9 KB) may take 44 KB more: below 48 KB of dynamic memory, but
    above the driver's default, which counts the static memory too."""
    import kernel_params  # beside this file

    mod = compile_source("loss.cu", device.arch)
    k = driver.Module(mod.cubin).kernel("logits_xent", kernel_params.signature("loss.cu", "logits_xent"))
    assert k.max_blocks_per_sm(256, 44 * 1024) >= 1

def test_a_modules_global_comes_back_with_its_size_or_a_named_error(fake_binding):
    fake = fake_binding(cuModuleLoadData=_ok("module"), cuModuleGetGlobal=_ok(0xDEF00, 144))
    module = driver.Module(b"cubin")
    assert module.global_address("head_profile") == (0xDEF00, 144)
    assert fake.calls[-1] == ("cuModuleGetGlobal", ("module", b"head_profile"))
    fake.results["cuModuleGetGlobal"] = _err("CUDA_ERROR_NOT_FOUND", None, None)
    with pytest.raises(CudaError, match=r"cuModuleGetGlobal\(missing\) failed: CUDA_ERROR_NOT_FOUND"):
        module.global_address("missing")


@pytest.fixture
def watchdog(monkeypatch):
    """A fresh waiting state (nothing given up, no stream to wait for) that the test may change."""
    monkeypatch.setattr(driver, "_given_up", None)
    monkeypatch.setattr(driver, "_watchdog", driver.WATCHDOG_SECONDS)
    monkeypatch.setattr(driver, "_streams", weakref.WeakSet())  # a real stream of a GPU test is not the fake's
    return driver


def test_waits_poll_until_done_or_the_caller_s_timeout(watchdog):
    answers = iter([False, False, True])
    assert watchdog.wait_until(lambda: next(answers), "step 3") is True
    watchdog.set_watchdog(60.0)  # the caller's timeout ends the wait, not the watchdog (which would give the GPU up)
    start = time.monotonic()
    assert watchdog.wait_until(lambda: False, "step 3", timeout=0.05) is False  # the caller decides: not given up
    assert time.monotonic() - start >= 0.05  # a lower bound only: a loaded machine may take longer, never shorter
    assert watchdog.gpu_given_up() is None


def test_the_watchdog_gives_the_gpu_up_and_every_later_wait_fails_at_once(watchdog):
    watchdog.set_watchdog(0.05)
    with pytest.raises(GpuHangError, match=r"^the GPU has not finished step 7 in 0.05 s: it has stopped"):
        watchdog.wait_until(lambda: False, "step 7")
    with pytest.raises(GpuHangError, match="step 7"):  # the first reason stays; at once: the GPU is not even asked
        watchdog.wait_until(lambda: pytest.fail("a given-up GPU was polled"), "step 8")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            watchdog.set_watchdog(bad)


def test_a_signal_ends_a_wait_for_a_gpu_that_never_finishes(watchdog):
    """The wait sleeps between polls, so a signal's handler runs inside it (a blocking synchronize would hold it)."""
    def alarm(signum, frame):
        raise KeyboardInterrupt

    watchdog.set_watchdog(20.0)  # a wait the signal did not end would end by the watchdog: GpuHangError, not this
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(KeyboardInterrupt):
            watchdog.wait_until(lambda: False, "step 1")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert watchdog.gpu_given_up() is None


def test_queries_read_not_ready_as_unfinished_and_name_other_errors(fake_binding, watchdog):
    fake_binding(cuStreamQuery=_err("CUDA_ERROR_NOT_READY"), cuEventQuery=_ok(), cuCtxSynchronize=_ok(),
                 cuStreamCreate=_ok(0x5))
    stream = driver.Stream()
    assert stream.query() is False
    assert driver.context_synchronize(timeout=0.02) is False  # our stream is still busy
    event = driver.Event.__new__(driver.Event)
    event.handle = 0x6
    assert event.query() is True
    fake_binding(cuStreamQuery=_err("CUDA_ERROR_LAUNCH_FAILED"))
    with pytest.raises(CudaError, match="cuStreamQuery failed: CUDA_ERROR_LAUNCH_FAILED"):
        stream.query()
    stream.handle = None  # a closed stream is not waited for
    fake_binding(cuCtxSynchronize=_ok())
    assert driver.context_synchronize() is True


def test_sigterm_stops_like_ctrl_c_and_exits_143():
    from rawgpu.runtime.errors import Terminated, interrupt_status, run_cli

    assert interrupt_status(KeyboardInterrupt()) == 130 and interrupt_status(Terminated()) == 143
    previous = signal.getsignal(signal.SIGTERM)
    try:
        def work():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises inside the sleep
            return 0

        assert run_cli(work) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
