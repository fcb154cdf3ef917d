"""CUDA graph capture, replay, inspection and failure handling: the logic on CPU over faked driver functions,
the real thing on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.runtime import driver
from rawgpu.runtime.compiler import compile_source
from rawgpu.runtime.errors import CudaError, GraphCaptureError
from rawgpu.runtime.graph import Node, capture
from rawgpu.runtime.memory import Arena

N = 4099


class _Stream:
    handle = 7


@pytest.fixture
def fake_graphs(monkeypatch):
    """rawgpu.runtime.driver's graph functions over a made-up graph: nodes 10..13, edges 12 -> 10 and 11 -> 12 (programmatic);
    `log` records what was called."""
    log = []
    kernels = {10: ("axpby_f32", (17, 1, 1), (256, 1, 1), 0), 12: ("increment_i64", (1, 1, 1), (32, 1, 1), 1024)}
    fakes = dict(
        begin_capture=lambda stream: log.append("begin"),
        end_capture=lambda stream, discard=False: log.append(("end", discard)) or (None if discard else "graph"),
        graph_instantiate=lambda graph: "exec",
        graph_nodes=lambda graph: [10, 11, 12, 13],
        graph_edges=lambda graph: [(12, 10, "default"), (11, 12, "programmatic")],
        graph_node_type=lambda node: "kernel" if node in kernels else "memset",
        graph_kernel_node=lambda node: kernels[node],
        graph_exec_destroy=lambda e: log.append(("exec_destroy", e)),
        graph_destroy=lambda g: log.append(("destroy", g)),
    )
    for name, fn in fakes.items():
        monkeypatch.setattr(driver, name, fn)
    return log


def test_nodes_come_in_dependency_order_with_their_edges(fake_graphs):
    graph = capture(_Stream(), lambda: None)
    assert fake_graphs == ["begin", ("end", False)]
    assert graph.nodes() == [Node(0, "memset"), Node(1, "memset"),
                             Node(2, "kernel", "increment_i64", (1, 1, 1), (32, 1, 1), 1024),
                             Node(3, "kernel", "axpby_f32", (17, 1, 1), (256, 1, 1), 0)]
    assert graph.edges() == [(2, 3), (0, 2)]
    assert graph.typed_edges() == [(2, 3, "default"), (0, 2, "programmatic")]
    graph.close()
    graph.close()
    assert fake_graphs[2:] == [("exec_destroy", "exec"), ("destroy", "graph")]


def test_function_failure_discards_the_capture_and_is_reported(fake_graphs):
    def boom():
        raise ValueError("planned failure")

    with pytest.raises(GraphCaptureError, match="graph capture failed: ValueError: planned failure"):
        capture(_Stream(), boom)
    assert fake_graphs == ["begin", ("end", True)]


def test_a_call_capture_forbids_is_named_as_such(fake_graphs):
    def sync():
        raise CudaError("cuStreamSynchronize", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")

    with pytest.raises(GraphCaptureError, match="cuStreamSynchronize failed: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED "
                                                "-- that call is not allowed while a stream is being captured"):
        capture(_Stream(), sync)


def test_broken_capture_without_an_exception_names_end_capture(fake_graphs, monkeypatch):
    def end_capture(stream, discard=False):
        raise CudaError("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")

    def fails():
        raise ValueError("first")

    monkeypatch.setattr(driver, "end_capture", end_capture)
    with pytest.raises(GraphCaptureError, match="cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED "
                                                r"\(an operation inside the captured function is not allowed"):
        capture(_Stream(), lambda: None)
    with pytest.raises(GraphCaptureError, match="ValueError: first"):  # the function's own error says more
        capture(_Stream(), fails)


def test_ctrl_c_during_capture_stays_a_keyboard_interrupt(fake_graphs):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(_Stream(), interrupted)
    assert fake_graphs == ["begin", ("end", True)]


# --- GPU ------------------------------------------------------------------------------------------------------


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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_exception_inside_capture_is_reported(setup):
    stream = setup["stream"]

    def boom():
        raise ValueError("planned failure")

    with pytest.raises(GraphCaptureError, match="ValueError: planned failure"):
        capture(stream, boom)
    stream.synchronize()


@pytest.mark.gpu
def test_a_side_stream_forks_and_joins_as_the_chain_orders_it(setup):
    """A launch beside the chain starts after the chain's launches before it, a launch after the side waits for it:
    eagerly and as a graph (a fork and a join edge), 200 rounds give the bits of the same launches in one stream."""
    s, stream = setup, setup["stream"]
    axpby, inc = s["launches"][0].kernel, s["launches"][1].kernel
    side = driver.SideStream("test side")
    x, y, c = s["x"], s["y"], s["c"]
    chain = [axpby.bind(17, 256, 0, y, x, 0.75, 0.5, N),   # y from x
             axpby.bind(9, 128, 0, x, y, -0.25, 1.0, N),   # x from y: beside, after the launch above
             inc.bind(1, 1, 0, c, 1),                      # the chain goes on meanwhile
             axpby.bind(5, 1024, 0, y, x, 0.5, 0.5, N)]    # reads x: after the side
    placed = [chain[0], chain[1].beside(side), chain[2], chain[3].after(side)]
    try:
        results = []
        for launches, graphed in ((chain, False), (placed, False), (placed, True)):
            _reset(s)
            if graphed:
                graph = capture(stream, lambda: [launch.run(stream) for launch in launches])
                nodes, edges = graph.nodes(), sorted(graph.edges())
                assert len(nodes) == 4
                by_grid = {n.grid[0]: n.index for n in nodes}
                a, b, cnt, d = by_grid[17], by_grid[9], by_grid[1], by_grid[5]
                assert edges == sorted([(a, b), (a, cnt), (b, d), (cnt, d)]), edges
                for _ in range(200):
                    graph.launch(stream)
                graph.close()
            else:
                for _ in range(200):
                    for launch in launches:
                        launch.run(stream)
            stream.synchronize()
            results.append((x.download(), y.download(), c.download()))
        for got in results[1:]:
            for a, b in zip(results[0], got):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert results[0][2][0] == 200 and np.isfinite(results[0][0]).all()
        # a join with no fork since the side's last join waits for nothing (what the side ran is ordered already):
        # a capture of it holds no tie to work outside the capture
        graph = capture(stream, lambda: [launch.run(stream) for launch in (chain[0], chain[3].after(side))])
        assert len(graph.nodes()) == 2 and len(graph.edges()) == 1
        graph.close()
    finally:
        side.close()
