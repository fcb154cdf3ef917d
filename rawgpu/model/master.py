"""The fp32 master weights as (hi, lo): hi = fp16(w), the working copy the GEMMs read, and lo = (w - hi) / u as
int16 with u = ulp16(hi) / 2^15. The same arithmetic as cu/master.cuh, bit for bit, for uploads, downloads and
tests. Exact (join(split(w)) == w) for every float32 with 2^-16 <= |w| < 65520; smaller weights are held to 2^-39.
"""

from __future__ import annotations

import numpy as np

EXACT_FROM = 2.0 ** -16  # the smallest magnitude held exactly


def _exponent(hi: np.ndarray) -> np.ndarray:
    return np.maximum((hi.view(np.uint16).astype(np.int32) >> 10) & 31, 1)


def _power_of_two(exponent: np.ndarray) -> np.ndarray:
    return (exponent.astype(np.int32) << 23).view(np.float32)


def split(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 weights -> (hi float16, lo int16), same shape."""
    w = np.asarray(w, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        hi = w.astype(np.float16)
        rest = w - hi.astype(np.float32)
        scaled = rest * _power_of_two(167 - _exponent(hi))
    lo = np.where(np.isfinite(scaled), np.rint(scaled), 0).astype(np.int16)
    return hi, lo


def join(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """(hi float16, lo int16) -> the float32 master."""
    if hi.dtype != np.float16 or lo.dtype != np.int16 or hi.shape != lo.shape:
        raise TypeError(f"join needs float16 and int16 of one shape, got {hi.dtype}{hi.shape}, {lo.dtype}{lo.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        return hi.astype(np.float32) + lo.astype(np.float32) * _power_of_two(87 + _exponent(hi))
