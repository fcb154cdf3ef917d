"""runtime/host_rows.py: work over blocks of rows on every core, and what uses it before an upload (a split's gather,
the features kept as fp16 or fp32): the same values as NumPy's one-thread forms, whatever the blocks."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.model.mlp import kept_features
from rawgpu.runtime import host_rows
from rawgpu.runtime.errors import DataError


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 7 rows, and huge pages from 0 bytes: every path of the threads and the mapping, on small arrays."""
    monkeypatch.setattr(host_rows, "ROW_BLOCK_LEAST", 7)
    monkeypatch.setattr(host_rows, "ROW_BLOCK_MOST", 7)
    monkeypatch.setattr(host_rows, "HUGE_PAGES_FROM", 0)


def test_blocks_cover_the_rows_once_in_order(small_blocks):
    for n in (0, 1, 7, 8, 50):
        spans = host_rows.in_blocks(n, lambda a, b: (a, b))
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])) and all(a < b for a, b in spans if n)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.float64])
def test_take_rows_is_numpys_gather(rng, small_blocks, dtype):
    a = (rng.standard_normal((53, 5)) * 100).astype(dtype)
    a_poison = a.copy()
    for index in (np.sort(rng.permutation(53)[:40]), rng.permutation(53)[:13], np.array([], np.int64)):
        got = host_rows.take_rows(a, index)
        assert got.dtype == a.dtype and got.flags.writeable and np.array_equal(got, a[index])
    assert np.array_equal(a, a_poison)  # the source is only read
    y = rng.standard_normal(53)
    assert np.array_equal(host_rows.take_rows(y, np.arange(0, 53, 3)), y[::3])


@pytest.mark.parametrize("source", [np.float32, np.float16, np.uint8])
@pytest.mark.parametrize("kept", ["fp16", "fp32"])
def test_kept_features_are_numpys_conversion_in_any_blocks(rng, small_blocks, source, kept):
    x = (rng.integers(0, 256, (61, 9)) if source == np.uint8 else rng.standard_normal((61, 9)) * 50).astype(source)
    want = np.float16 if kept == "fp16" else np.float32
    expected = (x * np.float32(1.0 / 255.0)).astype(want) if source == np.uint8 else x.astype(want)
    got = kept_features(x, kept, "t")
    assert got.dtype == want and np.array_equal(got, expected)


def test_a_feature_beyond_fp16_in_a_late_block_is_named(rng, small_blocks):
    x = rng.standard_normal((60, 4)).astype(np.float32)
    x[57, 2] = -7e4
    with pytest.raises(DataError, match=r"^t: row 57, column 2: -70000 is beyond fp16's range"):
        kept_features(x, "fp16", "t")
    x[57, 2] = np.inf  # an inf given is no overflow: kept (the table readers refuse it before)
    assert np.isinf(kept_features(x, "fp16", "t")[57, 2])


def test_take_rows_refuses_an_index_outside_the_rows(rng):
    a = rng.standard_normal((5, 2))
    for bad in ([0, 5], [-1, 2]):
        with pytest.raises(IndexError, match="outside 0..4"):
            host_rows.take_rows(a, np.array(bad))


def test_work_on_every_core_keeps_the_units_order():
    import threading

    seen = []
    out = host_rows.on_every_core(lambda u: (seen.append(threading.get_ident()), u * u)[1], list(range(50)))
    assert out == [u * u for u in range(50)] and len(seen) == 50
    main = threading.get_ident()
    assert host_rows.on_every_core(lambda u: (u, threading.get_ident() == main), ["one"]) == [("one", True)]
    assert host_rows.on_every_core(lambda u: u, []) == []
