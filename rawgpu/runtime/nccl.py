"""NCCL, checked: one rank's communicator and the collectives a step on several GPUs captures into its graph.

NCCL comes through NVIDIA's own Python packaging, nccl4py's low-level bindings (`nccl.bindings.nccl`) over the
library of `nvidia-nccl-cu13`: the optional extra `pip install ".[multi]"`. As driver.py is for CUDA, this is the one
module that touches those bindings, and every call goes through `check()`, which names the call and NCCL's error.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 before the first communicator, whatever the environment says (a
program using it can put a shared host's GPUs out of service).
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .errors import RawgpuError

if TYPE_CHECKING:
    from .driver import Stream
    from .memory import Tensor

UNIQUE_ID_BYTES = 128  # ncclUniqueId: what rank 0 hands the other ranks


class NcclError(RawgpuError):
    """An NCCL call failed, or NCCL is not installed; names the call, NCCL's result and its description."""


@lru_cache(maxsize=1)
def _nccl() -> Any:
    """Import the bindings lazily: planning and the CLI's checks never need them, and one GPU never does."""
    from .install import nccl_stack_problem

    if (why := nccl_stack_problem()) is not None:
        raise NcclError(why)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        from nccl.bindings import nccl
    except ImportError as exc:
        from .install import hint

        raise NcclError(f"several GPUs need NCCL, which is not installed ({exc}): {hint('multi')}") from None
    return nccl


def available() -> str | None:
    """Why NCCL cannot be used here (not installed, or its library missing); None when it can."""
    try:
        version()
    except NcclError as exc:
        return str(exc)
    return None


def check(fn: Callable[..., Any], call: str, *args: Any) -> Any:
    """fn(*args), with a failure raised as NcclError naming `call` and NCCL's result."""
    nccl = _nccl()
    try:
        return fn(*args)
    except nccl.NCCLError as exc:
        status = getattr(exc, "status", None)
        try:
            name = f"nccl{nccl.Result(status).name}"
        except (TypeError, ValueError):
            name = f"NCCL result {status}"
        raise NcclError(f"{call} failed: {name} ({exc})") from None


def version() -> str:
    """The NCCL library's version, e.g. 2.32.3."""
    code = check(_nccl().get_version, "ncclGetVersion")
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def new_unique_id() -> bytes:
    """A fresh communicator id (rank 0 makes it; every rank of the communicator is given the same bytes)."""
    nccl = _nccl()
    uid = check(nccl.get_unique_id, "ncclGetUniqueId")
    return ctypes.string_at(uid.ptr, UNIQUE_ID_BYTES)


_DTYPES = {np.dtype(np.float32): "Float32", np.dtype(np.float16): "Float16", np.dtype(np.float64): "Float64",
           np.dtype(np.int32): "Int32", np.dtype(np.int64): "Int64", np.dtype(np.uint8): "Uint8",
           np.dtype(np.int8): "Int8"}
OPS = ("sum", "max", "min")


def nccl_dtype(dtype: Any) -> str:
    """NCCL's name (ncclDataType_t without the prefix) for a numpy dtype."""
    try:
        return _DTYPES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"NCCL has no collective for {np.dtype(dtype)}: use one of "
                         f"{', '.join(str(d) for d in _DTYPES)}") from None


class Collective:
    """One collective bound to its buffers, run on a stream like a kernel's Launch (so a step's list of launches,
    and the CUDA graph captured from it, can hold it). A collective cannot start early: `overlapping()` is itself."""

    def __init__(self, call: str, fn: Callable[..., Any], args: tuple, describe: str):
        self.call, self._fn, self._args, self.describe = call, fn, args, describe

    def run(self, stream: "Stream") -> None:
        check(self._fn, self.call, *self._args, int(stream.handle))

    def overlapping(self) -> "Collective":
        return self


class Communicator:
    """This process's rank of `ranks`, on the GPU whose context is current (driver.Device), over NCCL."""

    def __init__(self, ranks: int, rank: int, unique_id: bytes):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in 0..{ranks - 1}, got {rank}")
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"a communicator id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        nccl = _nccl()
        self.ranks, self.rank = ranks, rank
        self._lock = threading.Lock()  # async_error may come from another thread: never on a communicator freed
        uid = nccl.UniqueId.from_buffer(bytearray(unique_id))
        self._comm = check(nccl.comm_init_rank, f"ncclCommInitRank(rank {rank} of {ranks})", ranks, uid, rank)

    def _bind(self, call: str, fn: Callable[..., Any], send: "Tensor", recv: "Tensor", count: int,
              recv_count: int, op: str | None) -> Collective:
        if self._comm is None:
            raise NcclError(f"{call}: the communicator is closed")
        if send.dtype != recv.dtype:
            raise ValueError(f"{call}: send is {send.dtype}, recv {recv.dtype}")
        if count < 1 or count > send.size or recv_count > recv.size:
            raise ValueError(f"{call}: {count} values sent from {send.size} and {recv_count} received into "
                             f"{recv.size}")
        nccl = _nccl()
        dtype = int(getattr(nccl.DataType, nccl_dtype(send.dtype)))
        ops = () if op is None else (self._op(op),)
        args = (send.ptr, recv.ptr, count, dtype) + ops + (self._comm,)
        return Collective(call, fn, args, f"{call}({count} x {send.dtype}{'' if op is None else ', ' + op})")

    @staticmethod
    def _op(op: str) -> int:
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        return int(getattr(_nccl().RedOp, op.capitalize()))

    def all_reduce(self, send: "Tensor", recv: "Tensor", count: int, op: str = "sum") -> Collective:
        """recv[:count] = the op over the ranks of send[:count] (send may be recv: in place)."""
        return self._bind("ncclAllReduce", _nccl().all_reduce, send, recv, count, count, op)

    def all_gather(self, send: "Tensor", recv: "Tensor", count: int) -> Collective:
        """recv[r count:(r + 1) count] = rank r's send[:count], for every rank r."""
        return self._bind("ncclAllGather", _nccl().all_gather, send, recv, count, count * self.ranks, None)

    def reduce_scatter(self, send: "Tensor", recv: "Tensor", count: int, op: str = "sum") -> Collective:
        """recv[:count] = the op over the ranks of send[rank count:(rank + 1) count]."""
        if count * self.ranks > send.size:
            raise ValueError(f"ncclReduceScatter: {count} x {self.ranks} ranks from {send.size} values")
        return self._bind("ncclReduceScatter", _nccl().reduce_scatter, send, recv, count, count, op)

    @property
    def alive(self) -> bool:
        return self._comm is not None

    def async_error(self) -> str | None:
        """NCCL's name for the error an asynchronous operation of this communicator met (a peer lost, a network
        error), or None while there is none. Safe from another thread while collectives run (NCCL's fault tolerance
        pattern: poll this, then abort)."""
        nccl = _nccl()
        with self._lock:
            if self._comm is None:
                return None
            result = check(nccl.comm_get_async_error, "ncclCommGetAsyncError", self._comm)
        if result in (nccl.Result.Success, nccl.Result.InProgress):
            return None
        try:
            return f"nccl{nccl.Result(result).name}"
        except ValueError:
            return f"NCCL result {result}"

    def abort(self) -> None:
        """End the communicator at once: collectives waiting for a rank that is gone return (ncclCommAbort)."""
        with self._lock:
            if self._comm is not None:
                comm, self._comm = self._comm, None
                check(_nccl().comm_abort, "ncclCommAbort", comm)

    def close(self) -> None:
        with self._lock:
            if self._comm is not None:
                comm, self._comm = self._comm, None
                check(_nccl().comm_destroy, "ncclCommDestroy", comm)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
