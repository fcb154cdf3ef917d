"""loss.cu (kernels/loss.py)."""

from __future__ import annotations

XENT_MAX_THREADS = 1024  # softmax_xent's block, a warp per row: its per-warp sums are sized for it


def loss_facts(arch: str):
    return {"XENT_MAX_WARPS": XENT_MAX_THREADS // 32}, {}
