"""CUDA graph capture, replay, inspection and failure handling (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import driver
from rawgpu.compiler import compile_source
from rawgpu.errors import GraphCaptureError
from rawgpu.graph import capture
from rawgpu.memory import Arena

pytestmark = pytest.mark.gpu
N = 4099


@pytest.fixture
def setup(device, stream, rng):
    mod = compile_source("elementwise.cu", device.arch)
    module = driver.Module(mod.cubin, mod.resources)
    axpby = module.kernel("axpby_f32", "ppffq")
    inc = module.kernel("increment_i64", "pi")
    arena = Arena()
    x, y, c = arena.tensor("x", N, np.float32), arena.tensor("y", N, np.float32), arena.tensor("c", 1, np.int64)
    arena.allocate()
    x0, y0 = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    launches = [axpby.bind(17, 256, 0, y, x, 0.75, 0.5, N), inc.bind(1, 1, 0, c, 1), axpby.bind(9, 128, 0, x, y, -0.25, 1.0, N)]
    yield dict(x=x, y=y, c=c, x0=x0, y0=y0, launches=launches, stream=stream)
    arena.close()


def _reset(s):
    s["x"].upload(s["x0"])
    s["y"].upload(s["y0"])
    s["c"].upload(np.zeros(1, np.int64))


def test_1000_replays_match_1000_direct_runs_bitwise(setup):
    s, stream = setup, setup["stream"]
    _reset(s)
    for _ in range(1000):
        for launch in s["launches"]:
            launch.run(stream)
    direct = s["x"].download(), s["y"].download(), s["c"].download()

    _reset(s)
    graph = capture(stream, lambda: [launch.run(stream) for launch in s["launches"]])
    for _ in range(1000):
        graph.launch(stream)
    stream.synchronize()
    replayed = s["x"].download(), s["y"].download(), s["c"].download()
    assert replayed[2][0] == 1000
    for a, b in zip(direct, replayed):
        assert np.array_equal(a, b)
    assert np.isfinite(replayed[0]).all()
    graph.close()


def test_nodes_edges_and_dot(setup, tmp_path):
    s, stream = setup, setup["stream"]
    graph = capture(stream, lambda: [launch.run(stream) for launch in s["launches"]])
    nodes = graph.nodes()
    assert [n.type for n in nodes] == ["kernel"] * 3
    assert [n.kernel for n in nodes] == ["axpby_f32", "increment_i64", "axpby_f32"]
    assert [n.grid for n in nodes] == [(17, 1, 1), (1, 1, 1), (9, 1, 1)]
    assert [n.block for n in nodes] == [(256, 1, 1), (1, 1, 1), (128, 1, 1)]
    assert all(n.shared_bytes == 0 for n in nodes)
    assert graph.edges() == [(0, 1), (1, 2)]
    dot = graph.to_dot(tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and "axpby_f32" in dot and "increment_i64" in dot
    graph.close()


def test_failed_capture_raises_and_leaves_the_stream_usable(setup):
    s, stream = setup, setup["stream"]

    def bad():
        s["launches"][0].run(stream)
        stream.synchronize()  # not allowed while capturing

    with pytest.raises(GraphCaptureError, match="graph capture failed"):
        capture(stream, bad)
    _reset(s)
    s["launches"][1].run(stream)
    stream.synchronize()
    assert s["c"].download()[0] == 1


def test_exception_inside_capture_is_reported(setup):
    stream = setup["stream"]

    def boom():
        raise ValueError("planned failure")

    with pytest.raises(GraphCaptureError, match="ValueError: planned failure"):
        capture(stream, boom)
    stream.synchronize()
