"""The split master weights (rawgpu/model/master.py, cu/master.cuh): exact for every float32 the design promises, close
below that, and the form the kernels rely on (|lo| <= 2^14, hi = fp16(w)). CPU only; the GPU tests compare the
kernels' split and join with these functions bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.model import master


def _random_floats(rng, n: int) -> np.ndarray:
    """Random bit patterns: every exponent equally likely, so tiny, huge and subnormal values all show up."""
    w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return w[np.isfinite(w) & (np.abs(w) < 65504)]


def test_join_of_split_is_exact_from_2_to_the_minus_16():
    w = _random_floats(np.random.default_rng(0), 2_000_000)
    hi, lo = master.split(w)
    back = master.join(hi, lo)
    exact = np.abs(w) >= master.EXACT_FROM
    assert exact.sum() > 200_000
    assert np.array_equal(back[exact].view(np.uint32), w[exact].view(np.uint32))
    assert np.abs(back[~exact].astype(np.float64) - w[~exact]).max() <= 2.0 ** -40  # half of u = 2^-39
    assert np.array_equal(hi.view(np.uint16), w.astype(np.float16).view(np.uint16)), "hi must be fp16(w)"
    assert np.abs(lo.astype(np.int32)).max() <= 2**14


@pytest.mark.parametrize("w", [1.0, -1.0, 1 + 2.0**-23, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-14 * (1 + 2.0**-11),
                               2.0**-16, -(2.0**-16), 65504.0, -65504.0, 65519.0, 0.0, 3e-3, -0.0123456789])
def test_edges_round_trip(w):
    """Ties halfway between two fp16 values (hi rounded to even, |lo| = 2^14), the top of the fp16 range, binade
    edges."""
    w = np.float32(w)
    hi, lo = master.split(np.array([w]))
    assert master.join(hi, lo)[0] == w


def test_every_fp32_value_near_typical_weights_is_exact():
    """All 2^23 values of the binade [2^-7, 2^-6) (Kaiming bounds here are 0.01-0.04): exact, no sampling."""
    bits = np.arange(2**23, dtype=np.uint32) + np.uint32((127 - 7) << 23)
    w = bits.view(np.float32)
    for sign in (1, -1):
        assert np.array_equal(master.join(*master.split(sign * w)).view(np.uint32), (sign * w).view(np.uint32))


def test_rounding_as_the_master_is_one_multiple_of_2_to_the_minus_39():
    """cu/master.cuh's master_round (the cluster step rounds each fp32 update with it) is join(split(w)) without the
    split: w from 2^-16 up, w rounded to a multiple of 2^-39 (ties to even) below."""
    w = _random_floats(np.random.default_rng(1), 2_000_000)
    w = np.concatenate([w, (np.arange(-5000, 5000, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0**-39)])
    rounded = np.where(np.abs(w) < np.float32(2.0**-16), np.rint(w * np.float32(2.0**39)) * np.float32(2.0**-39), w)
    joined = master.join(*master.split(w))
    assert np.array_equal(rounded.astype(np.float32) + np.float32(0), joined + np.float32(0))  # -0 == +0 here


def test_non_finite_values_stay_non_finite():
    w = np.array([np.inf, -np.inf, np.nan, 70000.0], np.float32)
    hi, lo = master.split(w)
    back = master.join(hi, lo)
    assert np.isposinf(back[0]) and np.isneginf(back[1]) and np.isnan(back[2]) and np.isposinf(back[3])
    assert not lo.any()


def test_join_refuses_mismatched_halves():
    with pytest.raises(TypeError, match="float16 and int16"):
        master.join(np.zeros(3, np.float32), np.zeros(3, np.int16))
    with pytest.raises(TypeError, match="one shape"):
        master.join(np.zeros(3, np.float16), np.zeros(4, np.int16))
