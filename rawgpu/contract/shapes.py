"""The shapes the kernels are built around: every width padded to 8 halves, the one-tile heads' 16 classes and a run's
most classes, the default input width (MNIST's) that the cluster and fused steps are compiled for, and the gather's
widest row."""

from __future__ import annotations

INPUTS = 784  # MNIST's shape, the default: 28 x 28 pixels, 10 classes, 60000 + 10000 images
HEAD_TILE_CLASSES = 16  # the one-tile heads (head.cu, the fused and cluster steps): one mma tile of 16 columns
MAX_CLASSES = 1000  # above HEAD_TILE_CLASSES the head is a GEMM over the classes and softmax_xent reads them all
IDX_MAX_CLASSES = 256  # IDX labels are bytes
MAX_OUTPUTS = 64  # a regression's values per row (regression_loss: a row's values in one warp's registers)
MAX_INPUTS = 16384  # pixels per image (and a table's features): the widest first layer the planner and tests cover


def cdiv(a: int, b: int) -> int:
    """Ceiling division: tiles, blocks and chunks that cover `a` items in pieces of `b`."""
    return -(-a // b)


def pad8(n: int) -> int:
    """Every width is padded to a multiple of 8 (16-byte rows of fp16: the GEMMs' contiguous dimension)."""
    return cdiv(n, 8) * 8


def padded_classes(classes: int) -> int:
    """The head's width in the buffers: the one tile up to its 16 classes (what the one-tile heads compute), else
    padded to 8 as every other width."""
    return HEAD_TILE_CLASSES if classes <= HEAD_TILE_CLASSES else pad8(classes)
