"""dx_sgd.cu (kernels/dx_sgd.py): a layer's backward in one pass with plain SGD."""

from __future__ import annotations

from .arch import deepest_pipeline

DX_SGD_BM = 64  # rows of W (input features) per block
DX_SGD_BN = 128  # columns of W per pipeline stage
DX_SGD_MAX_BATCH = 32  # batch rows (BB in dx_sgd.cu)
DX_SGD_THREADS = 256
DX_SGD_MAX_STAGES = 4  # deeper gains nothing at 42.5 KB a stage (sm_90 would fit 5)
DX_SGD_LDW = DX_SGD_BN + 8  # halves per W16 (and lo) row in shared memory: conflict-free pair access
DX_SGD_LDY = DX_SGD_BN + 8  # halves per dy row
DX_SGD_LDX = DX_SGD_BM + 8  # halves per x row


def dx_sgd_stage() -> dict[str, int]:
    """One pipeline stage in shared memory: where its W16 chunk (BM rows), its lo chunk and its dy chunk (the batch
    rows) start, and its size in bytes."""
    w_bytes, y_bytes = DX_SGD_BM * DX_SGD_LDW * 2, DX_SGD_MAX_BATCH * DX_SGD_LDY * 2
    return {"w16": 0, "lo": w_bytes, "dy": 2 * w_bytes, "bytes": 2 * w_bytes + y_bytes}


def _smem_bytes(stages: int) -> int:
    """The pipeline's stages, then the x tile (the batch rows)."""
    return stages * dx_sgd_stage()["bytes"] + DX_SGD_MAX_BATCH * DX_SGD_LDX * 2


def dx_sgd_stages(arch: str) -> int:
    """DX_SGD_STAGES: the pipeline depth that fits the part's shared memory."""
    return deepest_pipeline(arch, _smem_bytes, DX_SGD_MAX_STAGES)


def dx_sgd_smem_bytes(arch: str) -> int:
    return _smem_bytes(dx_sgd_stages(arch))


def dx_sgd_facts(arch: str):
    stage = dx_sgd_stage()
    return {"DX_SGD_BM": DX_SGD_BM, "DX_SGD_BN": DX_SGD_BN, "DX_SGD_BB": DX_SGD_MAX_BATCH,
            "DX_SGD_THREADS": DX_SGD_THREADS, "DX_SGD_STAGES": dx_sgd_stages(arch),
            "DX_SGD_SMEM_BYTES": dx_sgd_smem_bytes(arch), "DX_SGD_LDW": DX_SGD_LDW, "DX_SGD_LDY": DX_SGD_LDY,
            "DX_SGD_LDX": DX_SGD_LDX, "DX_SGD_LO_AT": stage["lo"], "DX_SGD_DY_AT": stage["dy"],
            "DX_SGD_STAGE_BYTES": stage["bytes"], "DX_SGD_X_AT": dx_sgd_stages(arch) * stage["bytes"]}, {}
