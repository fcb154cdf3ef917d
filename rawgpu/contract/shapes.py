"""The shapes the kernels are built around: every width padded to 8 halves, the head's one MMA tile of classes, the
default input width (MNIST's) that the cluster and fused steps are compiled for, and the gather's widest row."""

from __future__ import annotations

INPUTS = 784  # MNIST's shape, the default: 28 x 28 pixels, 10 classes, 60000 + 10000 images
MAX_CLASSES = 16  # the head computes one mma tile of 16 columns
MAX_INPUTS = 16384  # pixels per image: gather_batch runs a thread per 16 columns, at most 1024 threads


def cdiv(a: int, b: int) -> int:
    """Ceiling division: tiles, blocks and chunks that cover `a` items in pieces of `b`."""
    return -(-a // b)


def pad8(n: int) -> int:
    """Every width is padded to a multiple of 8 (16-byte rows of fp16: the GEMMs' contiguous dimension)."""
    return cdiv(n, 8) * 8
