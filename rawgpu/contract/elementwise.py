"""elementwise.cu (kernels/elementwise.py)."""

from __future__ import annotations

EW_THREADS = 256  # the block of every elementwise launch; bias_update's shared partials are sized for it


def elementwise_facts(arch: str):
    return {"EW_THREADS": EW_THREADS}, {}
