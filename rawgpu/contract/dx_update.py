"""dx_update.cu (kernels/dx_update.py): a layer's backward in one pass with any optimiser."""

from __future__ import annotations

from .abi import header
from .arch import STATIC_RESERVE, block_smem_limit, deepest_pipeline
from .optim import UPDATE_FAMILIES

DXU_BM = 64  # rows of W (input features) per block
DXU_BN = 64  # columns of W per pipeline stage
DXU_BATCHES = (32, 64, 128, 256)  # the batch tiles (BB): a batch of B rows runs the smallest tile >= B
# Warps per block by batch tile: 16 where the warp grids allow it (dx: 8 features per warp and 32-row group, so BB >= 64)
# and the registers fit (at 256 rows 16 warps spill); more warps hide more of each chunk's latency (with 8 here,
# `python dev/backward_splits.py --sizes 512 2048 4096` shows it).
DXU_WARPS = {32: 8, 64: 16, 128: 16, 256: 8}
DXU_FAMILIES = UPDATE_FAMILIES  # one instance per update rule compiled in
DXU_MAX_STAGES = 4


def dxu_kernel_name(batch_tile: int, family: str) -> str:
    return f"dx_update_b{batch_tile}_{family}"


# the smallest batch tile whose x^T @ dy runs on warpgroup MMA (with 32 here, `python dev/backward_splits.py
# --sizes 4096 --batch 32` shows why not)
DXU_WGMMA_MIN_BATCH = 64


def dxu_wgmma(batch_tile: int, arch: str) -> bool:
    """Whether an instance's weight gradient x^T @ dy runs on warpgroup MMA (sm_90, whose builds are sm_90a:
    sources.nvrtc_arch), asynchronously beside dx's mma.sync, reading x and dy from 128-byte-swizzled tiles. At 32
    rows its two k-steps do not pay for the wait."""
    return arch == "sm_90" and batch_tile >= DXU_WGMMA_MIN_BATCH


def _tile_row_halves(batch_tile: int, arch: str) -> int:
    """Halves per row of dx_update.cu's x and dy tiles: 64 (128 swizzled bytes) for warpgroup MMA, else padded by 8."""
    return DXU_BN if dxu_wgmma(batch_tile, arch) else DXU_BN + 8


def dxu_stage_bytes(batch_tile: int, family: str, arch: str) -> int:
    """One pipeline stage of dx_update.cu: W16 and lo (BM rows of BN + 8 halves), one fp32 state tile per state the
    family may keep (rows of BN + 8 floats), the dy chunk (batch rows: _tile_row_halves)."""
    states = 2 if family == "adam" else 1
    return (2 * DXU_BM * (DXU_BN + 8) * 2 + states * DXU_BM * (DXU_BN + 8) * 4
            + batch_tile * _tile_row_halves(batch_tile, arch) * 2)


def _dxu_fixed_bytes(batch_tile: int, arch: str) -> int:
    """dx_update.cu's shared memory beside the pipeline: the x tile (batch rows: _tile_row_halves), the bias partials
    (one 64-bit sum per thread) and, for swizzled tiles, 1 KB to align them to the swizzle's 1024-byte period."""
    slack = 1024 if dxu_wgmma(batch_tile, arch) else 0
    return batch_tile * _tile_row_halves(batch_tile, arch) * 2 + 32 * DXU_WARPS[batch_tile] * 8 + slack


def dxu_stages(batch_tile: int, family: str, arch: str) -> int:
    """The pipeline depth that fits the part's shared memory beside the x tile and the bias partials (< 2: the
    instance is not built for this part)."""
    stage, fixed = dxu_stage_bytes(batch_tile, family, arch), _dxu_fixed_bytes(batch_tile, arch)
    return deepest_pipeline(arch, lambda s: s * stage + fixed, DXU_MAX_STAGES)


def dxu_smem_bytes(batch_tile: int, family: str, arch: str) -> int:
    """dx_update.cu's Tile<BB, ADAM, THREADS, SW>::smem(STAGES) (the kernel asserts they agree)."""
    return (dxu_stages(batch_tile, family, arch) * dxu_stage_bytes(batch_tile, family, arch)
            + _dxu_fixed_bytes(batch_tile, arch))


def dxu_kernels(arch: str) -> list[str]:
    """The instances built for `arch`: every batch tile and family whose pipeline is at least two stages deep."""
    return [dxu_kernel_name(bb, f) for bb in DXU_BATCHES for f in DXU_FAMILIES if dxu_stages(bb, f, arch) >= 2]


def dxu_stream_kernel_name(batch_tile: int, family: str) -> str:
    return f"update_stream_b{batch_tile}_{family}"


def dxu_stream_smem_bytes(batch_tile: int, family: str, arch: str) -> int:
    """dx_update.cu's update_stream_body (the models step's first layer, streamed): the band instance's stages, each
    with an x slot beside it, then the bias partials and the swizzle's slack (the kernel asserts they agree)."""
    x_bytes = batch_tile * _tile_row_halves(batch_tile, arch) * 2
    stages = dxu_stages(batch_tile, family, arch)
    return (stages * (dxu_stage_bytes(batch_tile, family, arch) + x_bytes)
            + _dxu_fixed_bytes(batch_tile, arch) - x_bytes)


def dxu_stream_kernels(arch: str) -> list[str]:
    """The streamed instances built for `arch`: those of dxu_kernels whose x slots fit too."""
    room = block_smem_limit(arch) - STATIC_RESERVE
    return [dxu_stream_kernel_name(bb, f) for bb in DXU_BATCHES for f in DXU_FAMILIES
            if dxu_stages(bb, f, arch) >= 2 and dxu_stream_smem_bytes(bb, f, arch) <= room]


def dx_update_facts(arch: str, kernel: str | None = None):
    defines = {"DXU_BM": DXU_BM, "DXU_BN": DXU_BN}
    cpp = lambda flag: "true" if flag else "false"  # noqa: E731
    made = [f"X({dxu_kernel_name(bb, f)}, {bb}, {cpp(f == 'adam')}, {dxu_stages(bb, f, arch)}, "
            f"{dxu_smem_bytes(bb, f, arch)}, {DXU_WARPS[bb]}, {cpp(dxu_wgmma(bb, arch))})"
            for bb in DXU_BATCHES for f in DXU_FAMILIES
            if dxu_stages(bb, f, arch) >= 2 and kernel in (None, dxu_kernel_name(bb, f))]
    built = dxu_stream_kernels(arch)
    streamed = [f"X({name}, {bb}, {cpp(f == 'adam')}, {dxu_stages(bb, f, arch)}, "
                f"{dxu_stream_smem_bytes(bb, f, arch)}, {DXU_WARPS[bb]}, {cpp(dxu_wgmma(bb, arch))})"
                for bb in DXU_BATCHES for f in DXU_FAMILIES
                if (name := dxu_stream_kernel_name(bb, f)) in built and kernel in (None, name)]
    instances = ("// The kernels of this build: X(name, BB, ADAM, STAGES, SMEM_BYTES, WARPS, WG) each; the streamed\n"
                 "// update's (built with the model axis alone: dx_update_models.cu) likewise.\n"
                 f"#define DXU_FOR_EACH_KERNEL(X) {' '.join(made)}\n"
                 f"#define DXU_FOR_EACH_STREAM(X) {' '.join(streamed)}\n")
    return defines, {"dx_update_instances.cuh": header(__name__, "dx_update.cu", instances)}
