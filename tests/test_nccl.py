"""NCCL through rawgpu/runtime/nccl.py: the checked calls and their arguments against a fake binding (CPU), and one
rank's collectives captured into a CUDA graph on the GPU, against numpy."""

from __future__ import annotations

import builtins
import enum
import os
import types

import numpy as np
import pytest

from rawgpu.runtime import nccl


# --- CPU: a fake binding that records what it is asked -----------------------------------------------------------


class FakeError(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status


def fake_binding(calls: list, fail: dict | None = None) -> types.SimpleNamespace:
    """nccl.bindings.nccl's shape, as rawgpu/runtime/nccl.py uses it; `fail` maps a function name to a status to
    raise."""
    fail = fail or {}

    def recorder(name, result=None):
        def fn(*args):
            calls.append((name, args))
            if name in fail:
                raise FakeError(fail[name], f"{name} said no")
            return result
        return fn

    class Id:
        def __init__(self, raw):
            self.raw = bytes(raw)

        @classmethod
        def from_buffer(cls, buf):
            return cls(buf)

    return types.SimpleNamespace(
        NCCLError=FakeError,
        Result=enum.IntEnum("Result", {"Success": 0, "UnhandledCudaError": 1, "SystemError": 2, "InternalError": 3,
                                       "InvalidArgument": 4, "InvalidUsage": 5}),
        DataType=enum.IntEnum("DataType", {"Int8": 0, "Uint8": 1, "Int32": 2, "Int64": 4, "Float16": 6,
                                           "Float32": 7, "Float64": 8}),
        RedOp=enum.IntEnum("RedOp", {"Sum": 0, "Prod": 1, "Max": 2, "Min": 3}),
        UniqueId=Id,
        get_version=recorder("get_version", 23203),
        comm_init_rank=recorder("comm_init_rank", "comm"),
        all_reduce=recorder("all_reduce"), all_gather=recorder("all_gather"),
        reduce_scatter=recorder("reduce_scatter"), comm_destroy=recorder("comm_destroy"))


class FakeTensor:
    def __init__(self, ptr: int, size: int, dtype=np.float32):
        self.ptr, self.size, self.dtype = ptr, size, np.dtype(dtype)


class FakeStream:
    handle = 0x5157


@pytest.fixture
def fake(monkeypatch):
    calls: list = []

    def install(fail=None):
        monkeypatch.setattr(nccl, "_nccl", lambda: fake_binding(calls, fail))
        return calls
    return install


def test_collectives_pass_their_buffers_type_op_communicator_and_stream_in_nccls_order(fake):
    calls = fake()
    uid = bytes(range(128))
    comm = nccl.Communicator(4, 2, uid)
    assert calls[-1][0] == "comm_init_rank" and calls[-1][1][0] == 4 and calls[-1][1][2] == 2
    assert calls[-1][1][1].raw == uid
    a, b = FakeTensor(0x1000, 64), FakeTensor(0x2000, 256)
    comm.all_reduce(a, a, 64, "max").run(FakeStream())
    assert calls[-1] == ("all_reduce", (0x1000, 0x1000, 64, 7, 2, "comm", 0x5157))
    comm.all_gather(a, b, 64).run(FakeStream())
    assert calls[-1] == ("all_gather", (0x1000, 0x2000, 64, 7, "comm", 0x5157))
    comm.reduce_scatter(b, a, 64).run(FakeStream())
    assert calls[-1] == ("reduce_scatter", (0x2000, 0x1000, 64, 7, 0, "comm", 0x5157))
    h = FakeTensor(0x3000, 8, np.float16)
    assert comm.all_reduce(h, h, 8).describe == "ncclAllReduce(8 x float16, sum)"
    comm.close()
    comm.close()  # once only
    assert [c[0] for c in calls].count("comm_destroy") == 1
    with pytest.raises(nccl.NcclError, match="closed"):
        comm.all_reduce(a, a, 64)


@pytest.mark.parametrize("what,msg", [
    (lambda c, a, b: c.all_reduce(a, b, 64), "float32, recv float16"),
    (lambda c, a, b: c.all_reduce(a, a, 65), "65 values sent from 64"),
    (lambda c, a, b: c.all_gather(a, a, 64), "received into 64"),
    (lambda c, a, b: c.reduce_scatter(a, a, 32), "32 x 4 ranks from 64"),
    (lambda c, a, b: c.all_reduce(a, a, 64, "avg"), "op must be one of sum, max, min"),
    (lambda c, a, b: c.all_reduce(FakeTensor(1, 8, np.uint16), FakeTensor(1, 8, np.uint16), 8), "no collective for"),
])
def test_bad_collectives_are_refused_before_nccl_sees_them(fake, what, msg):
    calls = fake()
    comm = nccl.Communicator(4, 0, bytes(128))
    with pytest.raises(ValueError, match=msg):
        what(comm, FakeTensor(1, 64), FakeTensor(2, 64, np.float16))
    assert [c[0] for c in calls] == ["comm_init_rank"]


def test_bad_communicators_are_refused(fake):
    fake()
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        nccl.Communicator(2, 2, bytes(128))
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(2, 0, bytes(16))


def test_a_failed_call_names_the_call_and_nccls_result(fake):
    fake({"comm_init_rank": 5})
    with pytest.raises(nccl.NcclError, match=r"ncclCommInitRank\(rank 1 of 2\) failed: ncclInvalidUsage \(comm_init"):
        nccl.Communicator(2, 1, bytes(128))
    fake({"all_reduce": 2})
    comm = nccl.Communicator(2, 1, bytes(128))
    t = FakeTensor(1, 4)
    with pytest.raises(nccl.NcclError, match="ncclAllReduce failed: ncclSystemError"):
        comm.all_reduce(t, t, 4).run(FakeStream())
    assert nccl.version() == "2.32.3"


def test_without_the_extra_every_use_says_how_to_install_it(monkeypatch):
    real_import = builtins.__import__

    def no_nccl(name, *args, **kw):
        if name.split(".")[0] == "nccl":
            raise ImportError("No module named 'nccl'")
        return real_import(name, *args, **kw)

    nccl._nccl.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_nccl)
    try:
        why = nccl.available()
        from rawgpu.runtime.install import hint

        assert "not installed" in why and why.endswith(hint("multi"))
        with pytest.raises(nccl.NcclError, match="pip install"):
            nccl.Communicator(2, 0, bytes(128))
    finally:
        nccl._nccl.cache_clear()


def test_nvlink_multicast_is_off_whatever_the_environment_says(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    nccl._nccl.cache_clear()
    try:
        nccl.available()
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    finally:
        nccl._nccl.cache_clear()


# --- GPU: one rank, captured into a graph ------------------------------------------------------------------------


@pytest.fixture
def one_rank(device):
    if (why := nccl.available()) is not None:
        pytest.skip(why)
    with nccl.Communicator(1, 0, nccl.new_unique_id()) as comm:
        yield comm


@pytest.mark.gpu
def test_one_ranks_collectives_in_a_cuda_graph_give_their_inputs(device, stream, one_rank, rng):
    """With one rank each collective is a copy: captured into one CUDA graph and replayed twice, every output
    (poisoned before each replay) is its input bit for bit."""
    from rawgpu.runtime.graph import capture
    from rawgpu.runtime.memory import Arena

    x = rng.standard_normal(1000).astype(np.float32)
    h = rng.standard_normal(520).astype(np.float16)
    with Arena() as arena:
        tx, ty, tg, ts = (arena.tensor(n, (1000,), np.float32) for n in ("x", "y", "g", "s"))
        th = arena.tensor("h", (520,), np.float16)
        arena.allocate()
        tx.upload(x)
        th.upload(h)
        collectives = [one_rank.all_reduce(tx, ty, 1000), one_rank.all_gather(tx, tg, 1000),
                       one_rank.reduce_scatter(tx, ts, 1000, "max"), one_rank.all_reduce(th, th, 520)]
        graph = capture(stream, lambda: [c.run(stream) for c in collectives])
        try:
            # one rank: NCCL records each out-of-place collective as a copy, and the in-place one as nothing
            assert {n.type for n in graph.nodes()} <= {"memcpy", "kernel"} and len(graph.nodes()) >= 3
            for _ in range(2):
                for t in (ty, tg, ts):
                    t.fill_bytes(0xFF)
                graph.launch(stream)
                stream.synchronize()
                for t in (ty, tg, ts):
                    assert np.array_equal(t.download().view(np.uint32), x.view(np.uint32)), t.name
                assert np.array_equal(th.download().view(np.uint16), h.view(np.uint16))
        finally:
            graph.close()
