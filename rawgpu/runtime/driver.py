"""The CUDA driver, checked: one `check()`, the primary context, streams, events, memory, modules, launches, graphs.

Everything goes through `cuda.bindings.driver`, whose calls return `(CUresult, *values)`; `check()` turns a
non-success result into a `CudaError` that names the call and the error. This is the only module that touches the
bindings (tests/test_layering.py holds the rest of rawgpu to that), so a change of binding version or error policy
has one place to go. No model code lives here.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

from .errors import CudaError, GpuHangError, NoDeviceError, OutOfMemoryError

STATIC_SHARED_LIMIT = 48 * 1024  # a block's shared memory, static and dynamic together, without an opt-in


@lru_cache(maxsize=1)
def _cu():
    """Import the bindings lazily so that CPU-only code (planning, packing, CLI checks) never needs a driver."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - the package is a hard dependency
        raise NoDeviceError(f"cuda-bindings is not installed ({exc}); install rawgpu with its CUDA stack: "
                            'pip install ".[cu13]" (or ".[cu12]" for a driver that supports only CUDA 12)') from None
    return driver


def check(result: Any, call: str = "CUDA call") -> Any:
    """Unwrap a `(CUresult, *values)` tuple: raise CudaError on failure, else return None, the value, or the values."""
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if int(err) != 0:
        raise CudaError(call, *error_text(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def error_text(err: Any) -> tuple[str, str]:
    """The driver's name and description of an error code (falls back to the enum's name)."""
    cu = _cu()
    name = getattr(err, "name", str(err))
    try:
        res, desc = cu.cuGetErrorString(err)
        text = desc.decode() if int(res) == 0 and desc else ""
    except Exception:  # no libcuda to ask: the name alone still says what happened
        text = ""
    return name, text


def call(fn: Any, *args: Any) -> Any:
    """`check(fn(*args))`, naming the call after the driver function."""
    return check(fn(*args), fn.__name__)


_initialized = False
_init_lock = threading.Lock()


def init_in_background() -> None:
    """Start cuInit in a thread, so that its time overlaps the caller's own work (reading the data): the
    bindings let the GIL go while the driver works. init() then waits for it; its failure is init()'s to report."""
    def quietly() -> None:
        try:
            init()
        except Exception:  # noqa: BLE001 - init() in the caller raises it again, in its own words
            pass

    threading.Thread(target=quietly, daemon=True, name="rawgpu-cuinit").start()


def init() -> None:
    """cuInit once; a missing driver or GPU becomes NoDeviceError, a driver too old for the bindings says so."""
    with _init_lock:
        _init()


def _init() -> None:
    global _initialized
    if _initialized:
        return
    cu = _cu()
    try:
        result = cu.cuInit(0)
    except Exception as exc:  # the bindings raise if libcuda.so cannot be loaded at all
        raise NoDeviceError(f"no NVIDIA driver found ({exc.__class__.__name__}: {exc}); rawgpu needs an NVIDIA GPU") from None
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        name, _ = error_text(err)
        if name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NOT_FOUND"):
            raise NoDeviceError("no CUDA GPU found (cuInit: CUDA_ERROR_NO_DEVICE); rawgpu needs an NVIDIA GPU")
        if name in ("CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"):
            raise NoDeviceError(_driver_too_old_message())
        check(result, "cuInit")
    version = driver_version()
    if version[0] < bindings_major():
        raise NoDeviceError(_driver_too_old_message())
    _initialized = True


def bindings_major() -> int:
    from cuda.bindings import __version__ as v

    return int(v.split(".")[0])


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports, e.g. (13, 0)."""
    v = call(_cu().cuDriverGetVersion)
    return v // 1000, (v % 1000) // 10


def device_count() -> int:
    """How many CUDA GPUs the driver sees; initialises the driver first, since it cannot count before cuInit."""
    init()
    return call(_cu().cuDeviceGetCount)


def _driver_too_old_message() -> str:
    try:
        major, minor = driver_version()
        have = f"supports CUDA {major}.{minor}"
    except Exception:
        have = "is too old"
    need = bindings_major()
    fix = ('pip install ".[cu12]" in a fresh virtual environment' if need > 12 else "update the NVIDIA driver")
    return (f"the NVIDIA driver {have}, but the installed cuda-bindings need CUDA {need}: "
            f"update the driver, or install the CUDA 12 build with: {fix}")


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory: int
    shared_per_block: int
    shared_per_block_optin: int
    shared_per_sm: int
    l2_bytes: int
    pci_bus_id: str = ""  # e.g. "0000:19:00.0": how NVML finds the same GPU whatever its numbering

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


class Device:
    """One GPU and its primary context, made current on this thread."""

    def __init__(self, index: int = 0):
        init()
        cu = _cu()
        count = device_count()
        if count == 0:
            raise NoDeviceError("no CUDA GPU found; rawgpu needs an NVIDIA GPU")
        if not 0 <= index < count:
            raise NoDeviceError(f"no GPU with index {index}: this machine has {count} (0..{count - 1})")
        self.handle = call(cu.cuDeviceGet, index)
        self.context = call(cu.cuDevicePrimaryCtxRetain, self.handle)
        call(cu.cuCtxSetCurrent, self.context)
        attr = cu.CUdevice_attribute

        def get(a: Any) -> int:
            return check(cu.cuDeviceGetAttribute(a, self.handle), "cuDeviceGetAttribute")

        raw_name = call(cu.cuDeviceGetName, 256, self.handle)
        self.info = DeviceInfo(
            index=index,
            name=raw_name.split(b"\0")[0].decode(),
            compute_capability=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            total_memory=call(cu.cuDeviceTotalMem, self.handle),
            shared_per_block=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            shared_per_block_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            shared_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            pci_bus_id=call(cu.cuDeviceGetPCIBusId, 32, self.handle).split(b"\0")[0].decode(),
        )
        self._released = False

    def __getattr__(self, name: str) -> Any:  # device.name, device.sm_count, ... straight from DeviceInfo
        if name == "info":
            raise AttributeError(name)
        return getattr(self.info, name)

    def make_current(self) -> None:
        """This device's context current on this thread again, after foreign code (a peer framework probing every
        GPU) left another current: streams, events and modules belong to the context current when made."""
        call(_cu().cuCtxSetCurrent, self.context)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device right now."""
        return mem_info()

    def synchronize(self) -> None:
        context_synchronize()

    def close(self) -> None:
        if not self._released:
            self._released = True
            call(_cu().cuDevicePrimaryCtxRelease, self.handle)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stream:
    """A non-blocking stream: never implicitly ordered with the legacy default stream."""

    def __init__(self):
        cu = _cu()
        self.handle = call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        _streams.add(self)

    def synchronize(self, what: str = "the work queued on a stream") -> None:
        """Wait until the queued work has finished, under the watchdog (`wait_until`)."""
        wait_until(self.query, what)

    def query(self) -> bool:
        """Whether everything queued on the stream has finished; never blocks."""
        return _finished(_cu().cuStreamQuery(self.handle), "cuStreamQuery")

    def wait(self, event: "Event") -> None:
        """Work queued here from now on starts after the work before the event's last record (in a capture: a
        dependency of the graph, which joins this stream to the capture)."""
        call(_cu().cuStreamWaitEvent, self.handle, event.handle, 0)

    def close(self) -> None:
        if self.handle is not None:
            call(_cu().cuStreamDestroy, self.handle)
            self.handle = None


class Event:
    """A timing event; `elapsed_ms(start, end)` reads the time between two recorded events. timing=False: an event
    only for ordering streams (Stream.wait), which the driver records more cheaply."""

    def __init__(self, timing: bool = True):
        flags = 0 if timing else int(_cu().CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.handle = call(_cu().cuEventCreate, flags)

    def record(self, stream: Stream) -> "Event":
        call(_cu().cuEventRecord, self.handle, stream.handle)
        return self

    def synchronize(self, what: str = "the work before an event") -> None:
        """Wait until the work before the event's last record has finished, under the watchdog (`wait_until`)."""
        wait_until(self.query, what)

    def query(self) -> bool:
        """Whether the work before the event's last record has finished; never blocks."""
        return _finished(_cu().cuEventQuery(self.handle), "cuEventQuery")

    def elapsed_ms(self, end: "Event") -> float:
        end.synchronize()
        return call(_cu().cuEventElapsedTime, self.handle, end.handle)

    def close(self) -> None:
        if self.handle is not None:
            call(_cu().cuEventDestroy, self.handle)
            self.handle = None


# --- waiting for the GPU ------------------------------------------------------------------------------------
# The host never blocks inside the driver: a blocking synchronize cannot be interrupted, so a GPU that never
# finishes would leave a process that neither Ctrl-C nor SIGTERM ends. Every wait polls a query and sleeps between
# polls (a signal's handler runs during the sleep), and a wait that outlasts the watchdog gives the GPU up: from
# then on every wait fails at once, and closing frees nothing (the process's exit hands the context back).

WATCHDOG_SECONDS = 30.0  # no GPU work rawgpu queues takes this long unless the GPU has stopped
_watchdog = WATCHDOG_SECONDS
_given_up: str | None = None
_streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()


def set_watchdog(seconds: float) -> None:
    """How long a wait for the GPU may last before the GPU is given up (GpuHangError)."""
    global _watchdog
    if not seconds > 0:
        raise ValueError(f"the watchdog needs a positive number of seconds, got {seconds}")
    _watchdog = float(seconds)


def give_up_gpu(reason: str) -> None:
    """Stop waiting for this process's GPU work: every later wait raises GpuHangError(reason) at once."""
    global _given_up
    _given_up = _given_up or reason


def gpu_given_up() -> str | None:
    """Why this process stopped waiting for its GPU work, or None."""
    return _given_up


def wait_until(done: Callable[[], bool], what: str, timeout: float | None = None) -> bool:
    """Poll `done()` until it is true. timeout None: the watchdog's limit, past which the GPU is given up and
    GpuHangError names `what`; a number: return False after that many seconds instead (the caller decides)."""
    if _given_up:
        raise GpuHangError(_given_up)
    if done():
        return True
    limit = _watchdog if timeout is None else timeout
    start, pause = time.monotonic(), 20e-6
    while not done():
        if time.monotonic() - start > limit:
            if timeout is not None:
                return False
            give_up_gpu(f"the GPU has not finished {what} in {limit:g} s: it has stopped (a fault in the driver or "
                        "the GPU) or is far slower than expected; rawgpu stopped waiting for it")
            raise GpuHangError(_given_up)
        time.sleep(pause)  # signals act here: Ctrl-C or SIGTERM ends even a wait for a GPU that never finishes
        pause = min(2 * pause, 1e-3)
    return True


def _finished(result: Any, call_name: str) -> bool:
    """A query's answer: CUDA_SUCCESS is done, CUDA_ERROR_NOT_READY is not yet, anything else is an error."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) == int(_cu().CUresult.CUDA_ERROR_NOT_READY):
        return False
    check((err,), call_name)
    return True


# --- memory and copies ----------------------------------------------------------------------------------------
# Plain driver calls on the current context. None of them waits for kernels on our non-blocking streams: callers
# that need that ordering (memory.Tensor does) call context_synchronize() around them.

def context_synchronize(timeout: float | None = None) -> bool:
    """Wait until every stream of the current context has finished its queued work: each of our streams is polled
    (`wait_until`, same timeout rule), then the context's own synchronize covers the copies and memsets of the
    default stream, which are short."""
    for stream in list(_streams):
        if stream.handle is not None and not wait_until(stream.query, "the work queued on a stream", timeout):
            return False
    call(_cu().cuCtxSynchronize)
    return True


def mem_info() -> tuple[int, int]:
    """(free, total) bytes on the current device."""
    return call(_cu().cuMemGetInfo)


def mem_alloc(nbytes: int) -> int:
    """A new device allocation's address. The driver running out of memory is OutOfMemoryError, the same type a
    plan that does not fit gets, so callers catch one error for "too big" wherever it was found."""
    result = _cu().cuMemAlloc(nbytes)
    if int(result[0]) != 0:
        name, _ = error_text(result[0])
        if name == "CUDA_ERROR_OUT_OF_MEMORY":
            raise OutOfMemoryError(f"not enough GPU memory: cuMemAlloc({nbytes} B) failed: {name}")
    return int(check(result, "cuMemAlloc"))


def mem_free(ptr: int) -> None:
    call(_cu().cuMemFree, int(ptr))


def _host_buffer(array: Any, writable: bool) -> tuple[int, int]:
    """(address, bytes) of a numpy array's memory; a strided view would copy the wrong bytes, so it is refused."""
    if not array.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous (use numpy.ascontiguousarray)")
    if writable and not array.flags.writeable:
        raise ValueError("host array to copy into is read-only")
    return array.ctypes.data, array.nbytes


def copy_host_to_device(ptr: int, host: Any) -> None:
    """Copy all of a contiguous numpy array to device address `ptr` (an empty array copies nothing).
    From pageable memory the call may return before the data has landed: synchronise before reading it back."""
    address, nbytes = _host_buffer(host, writable=False)
    if nbytes:
        call(_cu().cuMemcpyHtoD, int(ptr), address, nbytes)


def copy_device_to_host(host: Any, ptr: int) -> None:
    """Fill a contiguous numpy array from device address `ptr`; returns once the bytes are in `host`."""
    address, nbytes = _host_buffer(host, writable=True)
    if nbytes:
        call(_cu().cuMemcpyDtoH, address, int(ptr), nbytes)


def copy_device_to_device(dst: int, src: int, nbytes: int) -> None:
    """Copy nbytes between device addresses of this context; returns once they are copied."""
    if nbytes:
        call(_cu().cuMemcpyDtoD, int(dst), int(src), nbytes)
        context_synchronize()


def copy_device_to_device_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Queue a device-to-device copy on `stream`, ordered with the kernels there (e.g. to time a copy)."""
    call(_cu().cuMemcpyDtoDAsync, int(dst), int(src), nbytes, stream.handle)


def memset_d8(ptr: int, byte: int, nbytes: int) -> None:
    """Set `nbytes` bytes at `ptr` to `byte`. Asynchronous, and not ordered with non-blocking streams."""
    call(_cu().cuMemsetD8, int(ptr), byte, nbytes)


# --- kernel arguments -----------------------------------------------------------------------------------------
# A signature is a string, one letter per parameter, as compiler.entry_signatures reads it from the compiled kernel:
#   p = 8 bytes (a device address: a Tensor or an int, or an int64), i = int32, f = float32, t = tensor map (128 bytes,
#   `tensor_map_2d`); q = int64 alone (signatures written by hand, in dev/ experiments).
_ARG_CTYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float,
               "t": ctypes.c_uint64 * 16}
_ARG_STRUCT = {"p": "Q", "i": "i", "q": "q", "f": "f", "t": "128s"}
TENSOR_MAP_BYTES = 128


def _as_int_pointer(value: Any) -> int:
    ptr = getattr(value, "ptr", value)  # a Tensor passes its device address
    return int(ptr)


def _convert(kind: str, value: Any, position: int) -> Any:
    if kind == "p":  # an address (unsigned) or an int64 (signed): the same 8 bytes
        if isinstance(value, float) or not hasattr(getattr(value, "ptr", value), "__index__"):
            raise TypeError(f"argument {position} must be a device address or an integer for 'p', got {value!r}")
        v = _as_int_pointer(value)
        if not -(1 << 63) <= v < (1 << 64):
            raise OverflowError(f"argument {position} = {v} does not fit 8 bytes")
        return v & ((1 << 64) - 1)
    if kind in "iq":
        if isinstance(value, float) or not hasattr(value, "__index__"):
            raise TypeError(f"argument {position} must be an integer for '{kind}', got {value!r}")
        bits = 32 if kind == "i" else 64
        v = int(value)
        if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
            raise OverflowError(f"argument {position} = {v} does not fit int{bits}")
        return v
    if kind == "f":
        return float(value)
    if kind == "t":
        if not isinstance(value, (bytes, bytearray)) or len(value) != TENSOR_MAP_BYTES:
            raise TypeError(f"argument {position} must be a {TENSOR_MAP_BYTES}-byte tensor map for 't'")
        return bytes(value)
    raise ValueError(f"unknown argument kind {kind!r} (use p, i, q, f, t)")


def _check_signature(signature: str, args: Sequence[Any]) -> None:
    if bad := set(signature) - set(_ARG_CTYPES):
        raise ValueError(f"unknown argument kind(s) {sorted(bad)} in signature {signature!r} (use p, i, q, f, t)")
    if len(signature) != len(args):
        raise TypeError(f"kernel takes {len(signature)} arguments ({signature}), got {len(args)}")


def pack_args(signature: str, args: Sequence[Any]) -> bytes:
    """The argument values as the kernel receives them, concatenated little-endian: for tests and checks."""
    _check_signature(signature, args)
    fmt = "<" + "".join(_ARG_STRUCT[k] for k in signature)
    return struct.pack(fmt, *(_convert(k, a, i) for i, (k, a) in enumerate(zip(signature, args))))


def _c_value(kind: str, value: Any) -> Any:
    ctype = _ARG_CTYPES[kind]
    return ctype.from_buffer_copy(value) if kind == "t" else ctype(value)


def tensor_map_2d(address: int, inner: int, outer: int, row_bytes: int, box_inner: int, box_outer: int) -> bytes:
    """A TMA descriptor (sm_90+) for a row-major fp16 matrix of `outer` rows x `inner` elements, rows `row_bytes`
    apart, copied in boxes of box_outer x box_inner with the 128-byte swizzle; reads outside the matrix give zeros.
    The 128 bytes are passed to a kernel by value ('t' in a signature)."""
    cu = _cu()
    tmap = check(cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, int(address),
        [cu.cuuint64_t(inner), cu.cuuint64_t(outer)], [cu.cuuint64_t(row_bytes)],
        [cu.cuuint32_t(box_inner), cu.cuuint32_t(box_outer)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled({outer}x{inner} fp16, box {box_outer}x{box_inner})")
    return ctypes.string_at(tmap.getPtr(), TENSOR_MAP_BYTES)


class PackedArgs:
    """Kernel arguments converted once into C values plus the `void*[]` array cuLaunchKernel reads."""

    def __init__(self, signature: str, args: Sequence[Any]):
        _check_signature(signature, args)
        self.values = [_c_value(k, _convert(k, a, i)) for i, (k, a) in enumerate(zip(signature, args))]
        self.array = (ctypes.c_void_p * max(1, len(self.values)))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.array)


class LazyArgs:
    """A launch's arguments, packed (PackedArgs) when first needed: by then its kernel is built and its signature
    known."""

    def __init__(self, kernel: "Kernel", args: Sequence[Any]):
        self.kernel, self.args, self._packed = kernel, tuple(args), None

    def _pack(self) -> PackedArgs:
        if self._packed is None:
            self.kernel.func  # noqa: B018 - builds and loads it, which gives its signature
            try:
                self._packed = PackedArgs(self.kernel.signature, self.args)
            except (TypeError, OverflowError, ValueError) as exc:
                raise type(exc)(f"kernel {self.kernel.name}: {exc}") from None
        return self._packed

    @property
    def address(self) -> int:
        return self._pack().address

    @property
    def values(self) -> list:
        return self._pack().values


class Module:
    """A loaded cubin; `kernel(name)` looks a kernel up. signatures: each kernel's parameters as its build read them
    (compiler.CompiledModule.signatures); a module without them takes one per kernel from the caller."""

    def __init__(self, cubin: bytes, resources: dict | None = None, signatures: dict[str, str] | None = None):
        self.handle = call(_cu().cuModuleLoadData, cubin)
        self.resources = resources or {}
        self.signatures = signatures or {}
        self._kernels: dict[str, Kernel] = {}

    @classmethod
    def of(cls, compiled: Any) -> "Module":
        """A compiler.CompiledModule, loaded."""
        return cls(compiled.cubin, compiled.resources, compiled.signatures)

    def kernel(self, name: str, signature: str | None = None) -> "Kernel":
        known = self.signatures.get(name)
        if signature is None and known is None:
            raise TypeError(f"kernel {name}: the module does not know its parameters; pass its signature")
        if signature is not None and known is not None and signature != known:
            raise TypeError(f"kernel {name} takes {known}, not {signature}")
        k = self._kernels.get(name)
        if k is None:
            func = check(_cu().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            k = self._kernels[name] = Kernel(func, name, signature or known, self.resources.get(name))
        elif signature is not None and k.signature != signature:
            raise TypeError(f"kernel {name} was declared with signature {k.signature}, not {signature}")
        return k

    def global_address(self, name: str) -> tuple[int, int]:
        """A __device__ variable's address and size (the profiling builds' stamp buffers, dev/)."""
        ptr, nbytes = check(_cu().cuModuleGetGlobal(self.handle, name.encode()), f"cuModuleGetGlobal({name})")
        return int(ptr), int(nbytes)

    def close(self) -> None:
        if self.handle is not None:
            call(_cu().cuModuleUnload, self.handle)
            self.handle = None


class Kernel:
    """A kernel function with its argument signature; `bind(...)` packs arguments once for repeated launches."""

    def __init__(self, func: Any, name: str, signature: str | None, resources: Any = None,
                 resolve: Callable[[], tuple[Any, Any, str]] | None = None):
        """func: the CUfunction, or None with `resolve`, which returns (func, resources, signature) when the kernel is
        first needed (its module may still be compiling while launches are planned and bound: their arguments are
        packed then, by the signature the build read)."""
        self._func, self.name, self.signature, self.resources = func, name, signature, resources
        self._resolve = resolve
        self._dynamic_shared_limit = 0  # opted in to (0: the driver's default, 48 KB less the static memory)
        self._non_portable_clusters = False

    @property
    def func(self) -> Any:
        if self._func is None:
            self._func, self.resources, self.signature = self._resolve()
            if self._dynamic_shared_limit:
                self._set_shared_limit()
        return self._func

    def ensure_shared(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit to what a launch asks for, whenever that grows (set once the
        kernel is loaded). The driver's default is 48 KB less the kernel's static shared memory, which a kernel with
        both would overrun well below 48 KB of dynamic memory."""
        if nbytes > self._dynamic_shared_limit:
            self._dynamic_shared_limit = nbytes
            if self._func is not None:
                self._set_shared_limit()

    def _set_shared_limit(self) -> None:
        cu, nbytes = _cu(), self._dynamic_shared_limit
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(self._func, attr, nbytes), f"cuFuncSetAttribute({self.name}, {nbytes} B)")

    def bind(self, grid: Sequence[int] | int, block: Sequence[int] | int, shared_bytes: int, *args: Any,
             cooperative: bool = False, cluster: Sequence[int] | int = 1) -> "Launch":
        packed = PackedArgs(self.signature, args) if self.signature is not None else LazyArgs(self, args)
        return Launch(self, grid, block, shared_bytes, packed, cooperative, cluster)

    def allow_cluster(self, ctas: int) -> None:
        """Clusters above 8 CTAs are 'non-portable': the kernel must opt in before such a launch (sm_90: up to 16)."""
        if ctas > 8 and not self._non_portable_clusters:
            attr = _cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            check(_cu().cuFuncSetAttribute(self.func, attr, 1), f"cuFuncSetAttribute({self.name}, non-portable cluster)")
            self._non_portable_clusters = True

    def max_active_clusters(self, ctas: int, threads: int, shared_bytes: int) -> int:
        """How many clusters of `ctas` blocks of this shape the GPU can hold at once (0: it cannot run one)."""
        self.ensure_shared(shared_bytes)
        self.allow_cluster(ctas)
        config = _launch_config((ctas, 1, 1), (threads, 1, 1), shared_bytes, [_cluster_attribute(ctas)])
        return int(check(_cu().cuOccupancyMaxActiveClusters(self.func, config),
                         f"cuOccupancyMaxActiveClusters({self.name}, {ctas} CTAs)"))

    def max_blocks_per_sm(self, threads: int, shared_bytes: int) -> int:
        """How many blocks of this shape one SM holds at once (registers, shared memory, threads)."""
        self.ensure_shared(shared_bytes)
        return int(check(_cu().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, threads, shared_bytes),
                         f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})"))


def _dim3(d: Sequence[int] | int) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(t) <= 3 or any(int(x) < 1 for x in t):
        raise ValueError(f"bad launch dimension {d!r}: 1 to 3 positive integers")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))  # type: ignore[return-value]


def _cluster_attribute(dims: Sequence[int] | int) -> Any:
    cu = _cu()
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = _dim3(dims)
    return attr


def _launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int, attrs: list) -> Any:
    config = _cu().CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_bytes
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config


class Launch:
    """One ready-to-go launch: kernel, geometry and packed arguments. `run(stream)` costs one driver call.

    cooperative: every block is guaranteed resident at once (cuLaunchKernelEx with the cooperative attribute),
    which grid-wide barriers inside the kernel need; the driver refuses a grid that cannot be resident.
    cluster: blocks come in thread-block clusters of this many (sm_90+; co-scheduled, sharing shared memory); an int
    is a cluster along x, a tuple its extent along each axis (each must divide the grid's).
    programmatic: the launch may start while the previous kernel in the stream still runs (programmatic dependent
    launch, sm_90+); only for kernels that keep the contract of ptx/pdl.cuh. See `overlapping()`.
    side, joins: where it runs beside a chain of launches (`beside()`, `after()`: SideStream).
    """

    def __init__(self, kernel: Kernel, grid: Any, block: Any, shared_bytes: int, args: PackedArgs,
                 cooperative: bool = False, cluster: Sequence[int] | int = 1, programmatic: bool = False,
                 side: "SideStream | None" = None, joins: tuple["SideStream", ...] = ()):
        self.kernel, self.grid, self.block, self.shared_bytes, self.args = kernel, _dim3(grid), _dim3(block), int(shared_bytes), args
        self.cluster_dims = _dim3(cluster)
        self.cooperative, self.cluster, self.programmatic = cooperative, math.prod(self.cluster_dims), bool(programmatic)
        self.side, self.joins = side, tuple(joins)
        if any(g % c for g, c in zip(self.grid, self.cluster_dims)):
            raise ValueError(f"cluster of {cluster} CTAs must divide the grid {self.grid}")
        kernel.ensure_shared(self.shared_bytes)
        extended = cooperative or self.cluster > 1 or self.programmatic
        self._config = self._extended_config() if extended else None

    def overlapping(self) -> "Launch":
        """The same launch, allowed to start while the kernel before it in the stream still runs: its blocks wait
        inside the kernel (griddepcontrol.wait, ptx/pdl.cuh) instead of in the launch queue."""
        if self.cooperative:
            raise ValueError(f"{self.kernel.name}: a cooperative launch cannot overlap the kernel before it")
        return self._with(programmatic=True)

    def beside(self, side: "SideStream") -> "Launch":
        """The same launch on `side`'s stream: it starts after everything issued on the caller's stream before it
        (and the side's launch before it), and what the caller issues next does not wait for it."""
        return self._with(side=side)

    def after(self, *sides: "SideStream") -> "Launch":
        """The same launch, starting only after everything issued on `sides` before it (their join)."""
        return self._with(joins=self.joins + sides)

    def alone(self) -> "Launch":
        """The same launch on the caller's stream, neither beside a chain nor joining one (to time it by itself)."""
        return self._with(side=None, joins=())

    def _with(self, **changes: Any) -> "Launch":
        now = dict(cooperative=self.cooperative, cluster=self.cluster_dims, programmatic=self.programmatic,
                   side=self.side, joins=self.joins)
        return Launch(self.kernel, self.grid, self.block, self.shared_bytes, self.args, **{**now, **changes})

    def _extended_config(self) -> Any:
        cu, attrs = _cu(), []
        if self.cooperative:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            attrs.append(attr)
        if self.cluster > 1:
            self.kernel.allow_cluster(self.cluster)
            attrs.append(_cluster_attribute(self.cluster_dims))
        if self.programmatic:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        return _launch_config(self.grid, self.block, self.shared_bytes, attrs)

    def run(self, stream: Stream) -> None:
        for side in self.joins:
            side.join(stream)
        if self.side is not None:
            stream = self.side.fork(stream)
        if self._config is not None:
            self._config.hStream = stream.handle
            kind = ("cooperative" if self.cooperative else f"cluster of {self.cluster}" if self.cluster > 1
                    else "programmatic")
            check(_cu().cuLaunchKernelEx(self._config, self.kernel.func, self.args.address, 0),
                  f"cuLaunchKernelEx({self.kernel.name}, {kind})")
            return
        g, b = self.grid, self.block
        check(_cu().cuLaunchKernel(self.kernel.func, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_bytes,
                                   stream.handle, self.args.address, 0), f"cuLaunchKernel({self.kernel.name})")

    def __repr__(self) -> str:
        extra = (", programmatic" if self.programmatic else "") + (f", beside {self.side.name}" if self.side else "")
        return f"Launch({self.kernel.name}, grid={self.grid}, block={self.block}, smem={self.shared_bytes}{extra})"


class SideStream:
    """A stream beside the one a chain of launches is issued on, for launches off the chain's critical path
    (Launch.beside, Launch.after). Captured into a graph, its forks and joins are the graph's branches. Its stream
    and events are made at first use: a step is planned before there is a context."""

    def __init__(self, name: str):
        self.name = name
        self._stream: Stream | None = None
        self._fork = self._done = None
        self._open = False  # forked since the last join: a join without one has nothing to wait for

    def fork(self, main: Stream) -> Stream:
        """The side's stream, ordered after everything issued on `main` so far."""
        if self._stream is None:
            self._stream, self._fork, self._done = Stream(), Event(timing=False), Event(timing=False)
        self._fork.record(main)
        self._stream.wait(self._fork)
        self._open = True
        return self._stream

    def join(self, main: Stream) -> None:
        """Order what `main` issues next after everything issued on the side so far (what it issued before its last
        join is ordered already; waiting on it again would tie a graph capture to work outside it)."""
        if self._open:
            self._done.record(self._stream)
            main.wait(self._done)
            self._open = False

    def close(self) -> None:
        for handle in (self._fork, self._done, self._stream):
            if handle is not None:
                handle.close()
        self._stream = self._fork = self._done = None
        self._open = False

    def __repr__(self) -> str:
        return f"SideStream({self.name})"


def launch(kernel: Kernel, grid: Any, block: Any, shared_bytes: int, stream: Stream, *args: Any) -> None:
    """Pack and launch in one go (for one-off launches; hot paths keep a `Launch` from `kernel.bind`)."""
    kernel.bind(grid, block, shared_bytes, *args).run(stream)


# --- CUDA graphs ----------------------------------------------------------------------------------------------
# Handles in, handles or plain Python values out: graph.py builds capture, replay and inspection on these.

def begin_capture(stream: Stream) -> None:
    """Start recording `stream` into a graph. Thread-local mode: only this thread's unsafe calls (a synchronize,
    a blocking copy) break the capture, so other threads' driver work cannot spoil it."""
    mode = _cu().CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    call(_cu().cuStreamBeginCapture, stream.handle, mode)


def end_capture(stream: Stream, discard: bool = False) -> Any:
    """Stop recording `stream` and return the captured graph. A failed capture raises CudaError and `discard`
    returns None; either way the partial graph is destroyed here, so none leaks."""
    cu = _cu()
    err, graph = cu.cuStreamEndCapture(stream.handle)[:2]
    if (int(err) != 0 or discard) and graph is not None and int(graph) != 0:
        cu.cuGraphDestroy(graph)  # unchecked: the capture's own outcome is what the caller reports
        graph = None
    check((err,), "cuStreamEndCapture")
    return graph


def graph_instantiate(graph: Any) -> Any:
    return check(_cu().cuGraphInstantiate(graph, 0), "cuGraphInstantiate")


def graph_launch(graph_exec: Any, stream: Stream) -> None:
    call(_cu().cuGraphLaunch, graph_exec, stream.handle)


def graph_upload(graph_exec: Any, stream: Stream) -> None:
    """Move an executable graph's launch resources to the device now rather than during its first launch."""
    call(_cu().cuGraphUpload, graph_exec, stream.handle)


def graph_nodes(graph: Any) -> list[Any]:
    """Every node handle, in the driver's order (asked twice: first for the count, then for the handles)."""
    cu = _cu()
    _, count = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    handles, _ = check(cu.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    return list(handles[:count])


def graph_edges(graph: Any) -> list[tuple[Any, Any, str]]:
    """(from, to, kind) node handles; kind "programmatic" where `to` may start while `from` still runs
    (programmatic dependent launch), else "default"."""
    cu = _cu()
    # CUDA 12 bindings return the edge types only from the _v2 call; CUDA 13's cuGraphGetEdges returns them itself
    get = getattr(cu, "cuGraphGetEdges_v2", cu.cuGraphGetEdges)
    count = call(get, graph, 0)[-1]
    if count == 0:
        return []
    res = call(get, graph, count)
    data = res[2] if len(res) > 3 else [None] * count  # bindings without edge data: every edge is a default one
    programmatic = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    kinds = ["programmatic" if d is not None and int(d.type) == programmatic else "default" for d in data[:count]]
    return list(zip(res[0][:count], res[1][:count], kinds))


def graph_node_type(node: Any) -> str:
    """The node's type as a short name: "kernel", "memset", "empty", ..."""
    kind = call(_cu().cuGraphNodeGetType, node)
    return kind.name.replace("CU_GRAPH_NODE_TYPE_", "").lower()


def graph_kernel_node(node: Any) -> tuple[str, tuple[int, int, int], tuple[int, int, int], int]:
    """A kernel node's (kernel name, grid, block, dynamic shared bytes)."""
    p = call(_cu().cuGraphKernelNodeGetParams, node)
    return (function_name(p.func), (p.gridDimX, p.gridDimY, p.gridDimZ), (p.blockDimX, p.blockDimY, p.blockDimZ),
            p.sharedMemBytes)


def function_name(func: Any) -> str:
    """The name a kernel function was compiled under (graphs hold functions, not our Kernel objects)."""
    name = call(_cu().cuFuncGetName, func)
    return name.decode() if isinstance(name, bytes) else str(name)


def graph_debug_dot(graph: Any, path: str, verbose: bool = True) -> None:
    """Write the driver's own DOT description of `graph` to `path`; verbose lists every parameter of every node."""
    cu = _cu()
    flags = cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE if verbose else 0
    call(cu.cuGraphDebugDotPrint, graph, str(path).encode(), int(flags))


def graph_exec_destroy(graph_exec: Any) -> None:
    call(_cu().cuGraphExecDestroy, graph_exec)


def graph_destroy(graph: Any) -> None:
    call(_cu().cuGraphDestroy, graph)
