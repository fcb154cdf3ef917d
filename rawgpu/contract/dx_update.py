"""dx_update.cu (kernels/dx_update.py): a layer's backward in one pass with any optimiser."""

from __future__ import annotations

from .abi import header
from .arch import block_smem_limit

DXU_BM = 64  # rows of W (input features) per block
DXU_BN = 64  # columns of W per pipeline stage
DXU_BATCHES = (32, 64, 128, 256)  # the batch tiles (BB): a batch of B rows runs the smallest tile >= B
# Warps per block by batch tile: 16 where the warp grids allow it (dx: 8 features per warp and 32-row group, so BB >= 64)
# and the registers fit (at 256 rows 16 warps spill); more warps hide more of each chunk's latency (docs/history.md).
DXU_WARPS = {32: 8, 64: 16, 128: 16, 256: 8}
DXU_FAMILIES = ("sgd", "adam")  # the update compiled in: SGD's rule (with momentum or without) or Adam's (AdamW)
DXU_MAX_STAGES = 4


def dxu_kernel_name(batch_tile: int, family: str) -> str:
    return f"dx_update_b{batch_tile}_{family}"


def dxu_stage_bytes(batch_tile: int, family: str) -> int:
    """One pipeline stage of dx_update.cu: W16 and lo (BM rows of BN + 8 halves), one fp32 state tile per state the
    family may keep (rows of BN + 8 floats), the dy chunk (rows of BN + 8 halves)."""
    states = 2 if family == "adam" else 1
    return 2 * DXU_BM * (DXU_BN + 8) * 2 + states * DXU_BM * (DXU_BN + 8) * 4 + batch_tile * (DXU_BN + 8) * 2


def _dxu_fixed_bytes(batch_tile: int) -> int:
    """dx_update.cu's shared memory beside the pipeline: the x tile (rows of BM + 8 halves), the bias partials (one
    64-bit sum per thread)."""
    return batch_tile * (DXU_BM + 8) * 2 + 32 * DXU_WARPS[batch_tile] * 8


def dxu_stages(batch_tile: int, family: str, arch: str) -> int:
    """The pipeline depth that fits the part's shared memory beside the x tile and the bias partials (< 2: the
    instance is not built for this part)."""
    room = block_smem_limit(arch) - 1024 - _dxu_fixed_bytes(batch_tile)  # 1 KB: the kernel's static shared memory
    return min(DXU_MAX_STAGES, room // dxu_stage_bytes(batch_tile, family))


def dxu_smem_bytes(batch_tile: int, family: str, arch: str) -> int:
    """dx_update.cu's Tile<BB, ADAM, THREADS>::smem(STAGES) (the kernel asserts they agree)."""
    return dxu_stages(batch_tile, family, arch) * dxu_stage_bytes(batch_tile, family) + _dxu_fixed_bytes(batch_tile)


def dxu_kernels(arch: str) -> list[str]:
    """The instances built for `arch`: every batch tile and family whose pipeline is at least two stages deep."""
    return [dxu_kernel_name(bb, f) for bb in DXU_BATCHES for f in DXU_FAMILIES if dxu_stages(bb, f, arch) >= 2]


def dx_update_facts(arch: str, kernel: str | None = None):
    defines = {"DXU_BM": DXU_BM, "DXU_BN": DXU_BN}
    made = [f"X({dxu_kernel_name(bb, f)}, {bb}, {'true' if f == 'adam' else 'false'}, {dxu_stages(bb, f, arch)}, "
            f"{dxu_smem_bytes(bb, f, arch)}, {DXU_WARPS[bb]})" for bb in DXU_BATCHES for f in DXU_FAMILIES
            if dxu_stages(bb, f, arch) >= 2 and kernel in (None, dxu_kernel_name(bb, f))]
    instances = ("// The kernels of this build: X(name, BB, ADAM, STAGES, SMEM_BYTES, WARPS) each.\n"
                 f"#define DXU_FOR_EACH_KERNEL(X) {' '.join(made)}\n")
    return defines, {"dx_update_instances.cuh": header(__name__, "dx_update.cu", instances)}
