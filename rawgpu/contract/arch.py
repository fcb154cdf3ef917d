"""What a GPU architecture gives one block, for the sizes that depend on it."""

from __future__ import annotations

# What a plan made without its GPU assumes (tests, the prebuild, the CLIs' checks before the GPU): sm_90, where rawgpu
# is measured, and the SM count of each arch's largest chip (the plan's split-K choices, and so a few GEMM instances,
# follow it; an instance the GPU's own plan needs beyond these builds then).
PLANNING_ARCH = "sm_90"
TYPICAL_SMS = {"sm_80": 108, "sm_86": 84, "sm_87": 16, "sm_89": 128, "sm_90": 132, "sm_90a": 132}
PLANNING_SM_COUNT = TYPICAL_SMS[PLANNING_ARCH]


def sm(arch: str) -> int:
    """'sm_90a' -> 90: the number the kernels' `__CUDA_ARCH__ / 10` would give."""
    return int(arch.removeprefix("sm_").rstrip("a"))


def block_smem_limit(arch: str) -> int:
    """The most dynamic shared memory one block can have: 227 KB on sm_90 and later, 163 KB on sm_80, 99 KB on
    sm_86/87/89."""
    return 227 * 1024 if sm(arch) >= 90 else 163 * 1024 if sm(arch) == 80 else 99 * 1024


STATIC_RESERVE = 1024  # bytes of a block's shared memory kept for a kernel's static __shared__ variables


def deepest_pipeline(arch: str, smem_bytes, most: int) -> int:
    """The most pipeline stages, up to `most`, whose dynamic shared memory smem_bytes(stages) fits one block of
    `arch` (block_smem_limit, less STATIC_RESERVE); 0 where not even one does. Every kernel's depth comes from here."""
    room = block_smem_limit(arch) - STATIC_RESERVE
    return max((s for s in range(1, most + 1) if smem_bytes(s) <= room), default=0)


def sm90_or_later(arch: str) -> bool:
    """Hopper or later: the tensor copy engine, thread-block clusters beyond 8 CTAs, programmatic dependent launch."""
    return sm(arch) >= 90


def has_wgmma(arch: str) -> bool:
    """Whether the part has Hopper's warpgroup MMA (sm_90 alone: an arch-specific feature, sources.nvrtc_arch)."""
    return arch.rstrip("a") == "sm_90"
