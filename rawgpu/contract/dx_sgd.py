"""dx_sgd.cu (kernels/dx_sgd.py): a layer's backward in one pass with plain SGD."""

from __future__ import annotations

from .arch import sm

DX_SGD_BM = 64  # rows of W (input features) per block
DX_SGD_BN = 128  # columns of W per pipeline stage
DX_SGD_MAX_BATCH = 32  # batch rows (BB in dx_sgd.cu)
DX_SGD_THREADS = 256


def dx_sgd_stages(arch: str) -> int:
    """DX_SGD_STAGES: the pipeline depth that fits the part's shared memory at 42.5 KB a stage."""
    return {90: 4, 80: 3}.get(sm(arch), 2)


def dx_sgd_smem_bytes(arch: str) -> int:
    """Per stage a W16, a lo (BM rows) and a dy chunk (the batch rows), each row padded by 8 halves; then the x tile
    (rows of BM + 8 halves)."""
    stage = DX_SGD_BM * (DX_SGD_BN + 8) * 2 * 2 + DX_SGD_MAX_BATCH * (DX_SGD_BN + 8) * 2
    return dx_sgd_stages(arch) * stage + DX_SGD_MAX_BATCH * (DX_SGD_BM + 8) * 2


def dx_sgd_facts(arch: str):
    return {"DX_SGD_BM": DX_SGD_BM, "DX_SGD_BN": DX_SGD_BN, "DX_SGD_BB": DX_SGD_MAX_BATCH,
            "DX_SGD_THREADS": DX_SGD_THREADS, "DX_SGD_STAGES": dx_sgd_stages(arch),
            "DX_SGD_SMEM_BYTES": dx_sgd_smem_bytes(arch)}, {}
