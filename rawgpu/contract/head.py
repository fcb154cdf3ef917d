"""head.cu (kernels/head.py): the classifier head's step in one cluster."""

from __future__ import annotations

from .abi import header
from .optim import UPDATE_FAMILIES
from .shapes import MAX_CLASSES

HEAD_THREADS = 256
HEAD_CLASSES = MAX_CLASSES  # classes, padded: the head's one MMA tile
HEAD_BATCHES = (32, 64, 128, 256)  # batch tiles (ROWS): a batch of B rows runs the smallest tile >= B
HEAD_FAMILIES = UPDATE_FAMILIES
HEAD_MAX_CTAS = 16  # the largest cluster (sm_90's non-portable limit): the partial logits a CTA adds up


def head_kernel_name(rows: int, family: str) -> str:
    return f"head_step_b{rows}_{family}"


def head_smem_per_row(rows: int) -> int:
    """Shared memory per row of W a CTA holds (head.cu's carve()): that row of W16 and of lo (CLASSES + 8 halves
    each) and that column of h (rows halves)."""
    return 2 * (HEAD_CLASSES + 8) * 2 + rows * 2


def head_smem_fixed(rows: int) -> int:
    """The rest of carve(): two mbarriers, h's padding (8 columns), the warps' partial logits (32 rows a warp, rows
    of CLASSES + 4 floats), the received partial logits (at most 2 x rows), dlogits (rows of CLASSES + 8 halves),
    labels, loss and hits."""
    return (16 + rows * 8 * 2 + HEAD_THREADS * (HEAD_CLASSES + 4) * 4 + 2 * rows * HEAD_CLASSES * 4
            + rows * (HEAD_CLASSES + 8) * 2 + 3 * rows * 4)


def head_smem_bytes(rows: int, kc: int) -> int:
    """The dynamic shared memory of a CTA of the `rows` tile holding kc rows of W (head.cu asserts its layout is
    this)."""
    return head_smem_per_row(rows) * kc + head_smem_fixed(rows)


def head_kernels() -> list[str]:
    return [head_kernel_name(rows, f) for rows in HEAD_BATCHES for f in HEAD_FAMILIES]


def head_facts(arch: str, kernel: str | None = None):
    made = [f"X({head_kernel_name(rows, f)}, {rows}, {'true' if f == 'adam' else 'false'}, {head_smem_per_row(rows)}, "
            f"{head_smem_fixed(rows)})" for rows in HEAD_BATCHES for f in HEAD_FAMILIES
            if kernel in (None, head_kernel_name(rows, f))]
    instances = ("// The kernels of this build: X(name, ROWS, ADAM, SMEM_PER_ROW, SMEM_FIXED) each.\n"
                 f"#define HEAD_FOR_EACH_KERNEL(X) {' '.join(made)}\n")
    return ({"HEAD_THREADS": HEAD_THREADS, "HEAD_CLASSES": HEAD_CLASSES, "HEAD_MAX_CTAS": HEAD_MAX_CTAS},
            {"head_instances.cuh": header(__name__, "head.cu", instances)})
