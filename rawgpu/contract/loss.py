"""loss.cu (kernels/loss.py)."""

from __future__ import annotations

XENT_MAX_THREADS = 1024  # softmax_xent's block, a warp per row: its per-warp sums are sized for it
REGRESSION_LOSSES = {"mse": 0, "l1": 1, "huber": 2}  # regression_loss's codes (REG_MSE, REG_L1, REG_HUBER)
# logits_xent's block: LX_ROWS rows (one mma row tile) by the head tile's LX_CLASSES padded classes, LX_WARPS warps
# splitting K, each loading LX_DEPTH of its 16-wide steps before it multiplies them
LX_ROWS, LX_CLASSES, LX_WARPS, LX_DEPTH = 16, 16, 8, 4


def loss_facts(arch: str):
    codes = {f"REG_{name.upper()}": code for name, code in REGRESSION_LOSSES.items()}
    return {"XENT_MAX_WARPS": XENT_MAX_THREADS // 32, "LX_ROWS": LX_ROWS, "LX_COLS": LX_CLASSES, "LX_WARPS": LX_WARPS,
            "LX_DEPTH": LX_DEPTH, **codes}, {}
