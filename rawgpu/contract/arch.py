"""What a GPU architecture gives one block, for the sizes that depend on it."""

from __future__ import annotations


def sm(arch: str) -> int:
    """'sm_90a' -> 90: the number the kernels' `__CUDA_ARCH__ / 10` would give."""
    return int(arch.removeprefix("sm_").rstrip("a"))


def block_smem_limit(arch: str) -> int:
    """The most dynamic shared memory one block can have: 227 KB on sm_90 and later, 163 KB on sm_80, 99 KB on
    sm_86/87/89."""
    return 227 * 1024 if sm(arch) >= 90 else 163 * 1024 if sm(arch) == 80 else 99 * 1024
