"""Device memory: an Arena plans every named buffer up front and makes ONE allocation; Tensors are views into it.

Planning is plain Python (offsets, alignment, sizes), so it is tested without a GPU, and a plan that does not
fit is refused with needed-vs-free bytes before anything is allocated. Nothing else in rawgpu allocates device memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from . import driver as drv
from .errors import OutOfMemoryError, RawgpuError

ALIGNMENT = 256  # bytes; >= every vector width and cp.async/ldmatrix need, and what cuMemAlloc itself gives


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class Tensor:
    """A typed view of arena memory: device pointer, shape, dtype. Copies to and from numpy check both."""

    def __init__(self, arena: "Arena", name: str, offset: int, shape: tuple[int, ...], dtype: np.dtype):
        self.arena, self.name, self.offset = arena, name, offset
        self.shape, self.dtype = shape, np.dtype(dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        """The device address; only valid once the arena is allocated."""
        if not self.arena.allocated:
            raise RawgpuError(f"{self.name}: the arena is not allocated yet, so the tensor has no address")
        return self.arena.base + self.offset

    def view(self, shape: tuple[int, ...], dtype: Any = None, offset_bytes: int = 0, name: str | None = None) -> "Tensor":
        """Another shape/dtype over part of this buffer (e.g. one layer's slice)."""
        t = Tensor(self.arena, name or self.name, self.offset + offset_bytes, tuple(shape), dtype or self.dtype)
        if offset_bytes < 0 or offset_bytes + t.nbytes > self.nbytes:
            raise ValueError(f"view of {t.nbytes} B at +{offset_bytes} does not fit in {self.name} ({self.nbytes} B)")
        return t

    def _check_host(self, array: np.ndarray) -> np.ndarray:
        if tuple(array.shape) != self.shape:
            raise ValueError(f"{self.name}: shape {tuple(array.shape)} does not match the tensor's {self.shape}")
        if array.dtype != self.dtype:
            raise TypeError(f"{self.name}: dtype {array.dtype} does not match the tensor's {self.dtype}")
        return np.ascontiguousarray(array)

    def upload(self, array: np.ndarray) -> None:
        """Copy a host array in; waits for queued device work first so the copy is ordered after it."""
        host = self._check_host(np.asarray(array))
        drv.context_synchronize()
        if host.nbytes:
            drv.copy_host_to_device(self.ptr, host)
        # A pageable copy may return before its DMA lands, and it is not ordered with non-blocking streams.
        drv.context_synchronize()

    def download(self) -> np.ndarray:
        """A new host array with the tensor's contents, after all queued device work has finished."""
        out = np.empty(self.shape, self.dtype)
        drv.context_synchronize()
        if out.nbytes:
            drv.copy_device_to_host(out, self.ptr)
        return out

    def fill_bytes(self, byte: int) -> None:
        """Set every byte (e.g. 0xFF makes fp16/fp32 NaN: the poison tests use before a kernel runs)."""
        drv.context_synchronize()
        drv.memset_d8(self.ptr, byte & 0xFF, self.nbytes)
        drv.context_synchronize()  # the memset is asynchronous and unordered with our streams

    def __repr__(self) -> str:
        return f"Tensor({self.name}, shape={self.shape}, dtype={self.dtype}, offset={self.offset})"


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    nbytes: int


class Arena:
    """Plan named buffers with `tensor()`, then `allocate()` once. Use as a context manager to free on exit."""

    def __init__(self, alignment: int = ALIGNMENT):
        if alignment < ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {ALIGNMENT}, got {alignment}")
        self.alignment = alignment
        self.slots: dict[str, Slot] = {}
        self.tensors: dict[str, Tensor] = {}
        self.planned_bytes = 0
        self.base = 0
        self._allocated = False

    def tensor(self, name: str, shape: tuple[int, ...] | int, dtype: Any, alignment: int | None = None) -> Tensor:
        """Reserve a buffer; its pointer is valid after allocate()."""
        if self._allocated:
            raise RawgpuError(f"cannot add {name!r}: the arena is already allocated (plan everything at start-up)")
        if name in self.slots:
            raise ValueError(f"buffer {name!r} is already planned")
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"buffer {name!r}: negative dimension in {shape}")
        align = max(self.alignment, alignment or 0)
        if align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        offset = _align(self.planned_bytes, align)
        t = Tensor(self, name, offset, shape, np.dtype(dtype))
        self.slots[name] = Slot(name, offset, t.nbytes)
        self.tensors[name] = t
        self.planned_bytes = offset + _align(t.nbytes, self.alignment)
        return t

    @property
    def peak_bytes(self) -> int:
        """Device bytes the arena holds (or will hold): there is no other device memory in rawgpu."""
        return max(self.planned_bytes, self.alignment)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tensors.values())

    def allocate(self, device: Any = None) -> "Arena":
        """Make the single device allocation; refuse up front (needed vs free) when it cannot fit."""
        drv.init()
        free, total = drv.mem_info()
        need = self.peak_bytes
        if need > free:
            raise OutOfMemoryError(f"not enough GPU memory: need {format_bytes(need)} ({need} B), "
                                   f"{format_bytes(free)} free of {format_bytes(total)}")
        try:
            self.base = drv.mem_alloc(need)
        except OutOfMemoryError as exc:  # fitted the free figure, yet the driver refused: say both sizes
            raise OutOfMemoryError(f"not enough GPU memory: cuMemAlloc of {format_bytes(need)} failed "
                                   f"with {format_bytes(free)} reported free") from exc
        self._allocated = True
        return self

    def zero(self) -> None:
        """Every byte of the allocation = 0, so padding and counters start defined (cuMemAlloc does not clear)."""
        drv.context_synchronize()
        drv.memset_d8(self.base, 0, self.peak_bytes)
        drv.context_synchronize()

    @property
    def allocated(self) -> bool:
        return self._allocated

    def close(self) -> None:
        if self._allocated:
            drv.mem_free(self.base)
            self._allocated = False
            self.base = 0

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
