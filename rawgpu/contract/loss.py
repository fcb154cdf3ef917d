"""loss.cu (kernels/loss.py)."""

from __future__ import annotations

XENT_MAX_THREADS = 1024  # softmax_xent's block, a warp per row: its per-warp sums are sized for it
REGRESSION_LOSSES = {"mse": 0, "l1": 1, "huber": 2}  # regression_loss's codes (REG_MSE, REG_L1, REG_HUBER)


def loss_facts(arch: str):
    codes = {f"REG_{name.upper()}": code for name, code in REGRESSION_LOSSES.items()}
    return {"XENT_MAX_WARPS": XENT_MAX_THREADS // 32, **codes}, {}
