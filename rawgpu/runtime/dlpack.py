"""Arrays other libraries hand over on the GPU by DLPack (a PyTorch tensor, a JAX array on the GPU rawgpu trains on):
features used where they are. The model copies them device to device into its arena (MLP.upload_data) and checks them there
(every value finite, kernels/gather.py: first_nonfinite); they never pass through the host.

The DLPack capsule is read with ctypes (the DLTensor struct, DLPack 0.8 and later). rawgpu and the array's owner share
the device's primary context (PyTorch, JAX and rawgpu all use it), so the array's address is valid in rawgpu's; the
capsule is held until the array is dropped, which keeps the owner's memory alive (its destructor calls the owner's
deleter). Before the copy rawgpu waits for all work in the context, the owner's queued writes included.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import driver as drv
from .errors import DataError

KDL_CUDA, KDL_CUDA_MANAGED = 2, 13  # DLPack device types whose memory a CUDA context addresses
# (DLPack type code, bits) -> NumPy's dtype: what a host copy can hold (targets); features take FEATURE_DTYPES
_DTYPES = {**{(0, b): np.dtype(f"int{b}") for b in (8, 16, 32, 64)}, **{(1, b): np.dtype(f"uint{b}") for b in (8, 16, 32, 64)},
           **{(2, b): np.dtype(f"float{b}") for b in (16, 32, 64)}, (6, 8): np.dtype(np.bool_)}
_NAMES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}
FEATURE_DTYPES = (np.dtype(np.uint8), np.dtype(np.float16), np.dtype(np.float32))  # kept on the GPU as they are


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def on_gpu(a: Any) -> bool:
    """Whether `a` is an array DLPack places in GPU memory (not a host or pinned host array)."""
    if isinstance(a, DeviceArray):
        return True
    if isinstance(a, np.ndarray) or not hasattr(a, "__dlpack_device__"):
        return False
    try:
        return int(a.__dlpack_device__()[0]) in (KDL_CUDA, KDL_CUDA_MANAGED)
    except Exception:  # noqa: BLE001 - a producer that cannot say is not one we read from the GPU
        return False


class DeviceArray:
    """A C-contiguous array on a CUDA device, as its DLPack capsule describes it: address, shape, dtype, device.
    Holds the capsule (and the array it came from) so the memory stays alive. np.asarray(it) copies it to the host:
    what an evaluation's confusion matrix or a prediction of it needs, never the training."""

    def __init__(self, a: Any, what: str):
        try:
            try:
                capsule = a.__dlpack__(stream=1)  # CUDA's legacy default stream: ordered after the owner's work
            except Exception:  # noqa: BLE001 - a producer without that stream argument (copy_to_device waits anyway)
                capsule = a.__dlpack__()
            address = _get_pointer(capsule, b"dltensor")
        except Exception as exc:  # noqa: BLE001 - any producer's refusal, or a capsule of another kind, is one line
            raise DataError(f"{what}: its DLPack export failed ({type(a).__name__}: {' '.join(str(exc).split())})") \
                from None
        t = _DLManagedTensor.from_address(address).dl_tensor
        shape = tuple(int(t.shape[i]) for i in range(t.ndim))
        dtype = _DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
        if dtype is None:
            name = f"{_NAMES.get(t.dtype.code, 'code ' + str(t.dtype.code))}{t.dtype.bits}"
            raise DataError(f"{what}: a GPU array of {name}, which rawgpu cannot read (convert it there first, e.g. "
                            "x.float())")
        if t.strides:
            want, stride = [], 1
            for n in reversed(shape):
                want.append(stride)
                stride *= n
            got = [int(t.strides[i]) for i in range(t.ndim)]
            if any(g != w for g, w, n in zip(got, reversed(want), shape) if n > 1):
                raise DataError(f"{what}: a GPU array that is not C-contiguous (strides {tuple(got)}); pass "
                                "x.contiguous()")
        self.ptr = int(t.data or 0) + int(t.byte_offset)
        self.shape, self.dtype, self.device_id = shape, dtype, int(t.device.device_id)
        self._keep = (capsule, a)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape: int) -> "DeviceArray":
        """The same memory seen with another shape (C order), as numpy's reshape of a contiguous array."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape)
        if -1 in shape:
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            shape = tuple(int(np.prod(self.shape, dtype=np.int64)) // max(known, 1) if n == -1 else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != int(np.prod(self.shape, dtype=np.int64)):
            raise ValueError(f"cannot reshape a GPU array of shape {self.shape} into {shape}")
        out = object.__new__(DeviceArray)
        out.ptr, out.shape, out.dtype, out.device_id, out._keep = self.ptr, shape, self.dtype, self.device_id, self._keep
        return out

    def copy_to_device(self, ptr: int) -> None:
        """Its bytes into device address `ptr` (this context's), after every queued write in the context."""
        drv.context_synchronize()
        drv.copy_device_to_device(ptr, self.ptr, self.nbytes)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        with drv.Device(self.device_id):  # the primary context, current on this thread
            drv.context_synchronize()
            drv.copy_device_to_host(out, self.ptr)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device_id})"
