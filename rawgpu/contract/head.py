"""head.cu (kernels/head.py): the classifier head's step in one cluster."""

from __future__ import annotations

from .abi import header
from .optim import UPDATE_FAMILIES
from .shapes import HEAD_TILE_CLASSES

HEAD_THREADS = 256
HEAD_CLASSES = HEAD_TILE_CLASSES  # classes, padded: the head's one MMA tile
HEAD_BATCHES = (32, 64, 128, 256)  # batch tiles (ROWS): a batch of B rows runs the smallest tile >= B
HEAD_FAMILIES = UPDATE_FAMILIES
HEAD_MAX_CTAS = 16  # the largest cluster (sm_90's non-portable limit): the partial logits a CTA adds up
HEAD_TASKS = ("xent", "regression")  # softmax cross-entropy; a regression's loss (mse, l1 or huber: a launch argument)


def head_kernel_name(rows: int, family: str, task: str = "xent") -> str:
    return f"head_step_b{rows}_{family}" + ("" if task == "xent" else f"_{task}")


HEAD_LDW = HEAD_CLASSES + 8  # halves per row of W (and lo) in shared memory: conflict-free fragment loads
HEAD_LDD = HEAD_CLASSES + 8  # halves per row of dlogits
HEAD_RED_LD = HEAD_CLASSES + 4  # floats per row of the warps' partial logits
HEAD_H_PAD = 8  # halves of padding per row of h (its rows are kc + 8 halves)
HEAD_GROUP = 32  # batch rows per warp in the products (two m16 tiles)
# carve()'s regions, in order; HeadRegion in the generated header names them for the kernel
HEAD_REGIONS = ("bars", "w", "lo", "h", "red", "recv", "d", "labels", "loss", "hit")


def head_layout(rows: int, task: str = "xent") -> list[tuple[str, int, int, int]]:
    """The shared memory of a CTA of the `rows` batch tile holding kc rows of W, region by region in carve()'s order:
    (region, bytes per row, padding rows, fixed bytes), the region taking per_row x (kc + pad) + fixed bytes. Two
    mbarriers; that CTA's rows of W16 and of lo; h's columns for them (rows of kc + H_PAD halves); the warps' partial
    logits (GROUP rows a warp; z, this CTA's rows of the logits, reuses them once summed); every CTA's partial logits
    of this CTA's rows (at most 2 x rows); dlogits; labels, loss, hits. A regression's labels region holds its
    targets (rows x the padded classes, fp32) and its hits region two error sums per row."""
    warps = HEAD_THREADS // 32
    reg = task == "regression"
    sizes = {"bars": (0, 0, 16), "w": (HEAD_LDW * 2, 0, 0), "lo": (HEAD_LDW * 2, 0, 0), "h": (rows * 2, HEAD_H_PAD, 0),
             "red": (0, 0, warps * HEAD_GROUP * HEAD_RED_LD * 4), "recv": (0, 0, 2 * rows * HEAD_CLASSES * 4),
             "d": (0, 0, rows * HEAD_LDD * 2), "labels": (0, 0, rows * 4 * (HEAD_CLASSES if reg else 1)),
             "loss": (0, 0, rows * 4), "hit": (0, 0, rows * 4 * (2 if reg else 1))}
    return [(region, *sizes[region]) for region in HEAD_REGIONS]


def head_smem_per_row(rows: int, task: str = "xent") -> int:
    """Shared memory per row of W a CTA holds."""
    return sum(per_row for _, per_row, _, _ in head_layout(rows, task))


def head_smem_fixed(rows: int, task: str = "xent") -> int:
    """Shared memory a CTA of the `rows` tile takes whatever its rows of W."""
    return sum(per_row * pad + fixed for _, per_row, pad, fixed in head_layout(rows, task))


def head_smem_bytes(rows: int, kc: int, task: str = "xent") -> int:
    """The dynamic shared memory of a CTA of the `rows` tile holding kc rows of W."""
    return head_smem_per_row(rows, task) * kc + head_smem_fixed(rows, task)


def _layout_header(rows_list) -> str:
    """HeadLayout<ROWS, REG>: each region's size, per_row[r] x (kc + pad[r]) + fixed[r] bytes, in order (carve())."""
    lines = ["enum HeadRegion { " + ", ".join(f"HEAD_{r.upper()}" for r in HEAD_REGIONS) + " };",
             "template <int ROWS, bool REG> struct HeadLayout;"]
    for rows in rows_list:
        for task in HEAD_TASKS:
            cols = list(zip(*[entry[1:] for entry in head_layout(rows, task)]))
            arrays = ", ".join(f"{name}[] = {{{', '.join(map(str, col))}}}"
                               for name, col in zip(("per_row", "pad", "fixed"), cols))
            reg = "true" if task == "regression" else "false"
            lines.append(f"template <> struct HeadLayout<{rows}, {reg}> {{ static constexpr int {arrays}; }};")
    return "\n".join(lines) + "\n"


def head_kernels(tasks: tuple[str, ...] = HEAD_TASKS) -> list[str]:
    """Every instance of the tasks' (the models step's build, head_models.cu, makes cross-entropy's alone)."""
    return [head_kernel_name(rows, f, t) for rows in HEAD_BATCHES for f in HEAD_FAMILIES for t in tasks]


def head_models_facts(arch: str, kernel: str | None = None):
    """head_models.cu's: head.cu's with a model axis, cross-entropy's instances only (a sweep of regressions runs
    the layered kernels)."""
    return head_facts(arch, kernel, tasks=("xent",))


def head_facts(arch: str, kernel: str | None = None, tasks: tuple[str, ...] = HEAD_TASKS):
    made = [f"X({head_kernel_name(rows, f, t)}, {rows}, {'true' if f == 'adam' else 'false'}, "
            f"{'true' if t == 'regression' else 'false'}, {head_smem_per_row(rows, t)}, {head_smem_fixed(rows, t)})"
            for rows in HEAD_BATCHES for f in HEAD_FAMILIES for t in tasks
            if kernel in (None, head_kernel_name(rows, f, t))]
    instances = ("// The kernels of this build: X(name, ROWS, ADAM, REG, SMEM_PER_ROW, SMEM_FIXED) each.\n"
                 f"#define HEAD_FOR_EACH_KERNEL(X) {' '.join(made)}\n" + _layout_header(HEAD_BATCHES))
    return ({"HEAD_THREADS": HEAD_THREADS, "HEAD_CLASSES": HEAD_CLASSES, "HEAD_MAX_CTAS": HEAD_MAX_CTAS,
             "HEAD_LDW": HEAD_LDW, "HEAD_LDD": HEAD_LDD, "HEAD_RED_LD": HEAD_RED_LD, "HEAD_GROUP": HEAD_GROUP},
            {"head_instances.cuh": header(__name__, "head.cu", instances)})
