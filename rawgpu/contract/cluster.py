"""The cluster step (cluster_step.cu, kernels/cluster.py): the model resident in one cluster's shared memory."""

from __future__ import annotations

import ctypes

from .shapes import HEAD_TILE_CLASSES, INPUTS
from .abi import CStruct, declare, header

CS_WARPS = 8
CS_THREADS = 32 * CS_WARPS
CS_ROWS = 32  # batch rows held (batch <= 32; rows past the batch are zero)
CS_INPUTS = INPUTS
CS_MAX_LINEAR = 9  # 8 hidden layers and the head
CS_TILE_COUNTS = (1, 2, 4)  # kernel instances cluster_steps_<NT>: NT 8-column tiles per CTA at most
CS_MAX_COLUMNS = 8 * max(CS_TILE_COUNTS)  # columns of a hidden layer per CTA

# One CTA's shared memory: kernels/cluster.py sizes its regions with these and cluster_step.cu indexes them with the
# same numbers, so the two cannot disagree. Rows are padded past the columns they hold so that a fragment's rows
# fall into different banks.
CS_CLASSES = HEAD_TILE_CLASSES  # the head's width: two 8-class MMA tiles (every CTA holds a replica of the head)
CS_X_LD = CS_INPUTS + 8  # halves per row of the batch in fp16
CS_HEAD_LD = CS_CLASSES + 4  # floats per row of the head replica
CS_DLOGIT_LD = CS_CLASSES + 8  # halves per row of d(logits)
CS_W_PAD = 4  # floats past the n columns of a row of a hidden layer's weight slice
CS_ACT_PAD = 8  # halves past the hs columns of a row of h
CS_DY_PAD = 8  # halves past the n columns of a row of dy: zeros, read by the last k-step of 16 when n is 8 mod 16
CS_HEAD_GROUPS = CS_WARPS // (CS_CLASSES // 8)  # the head's K-groups: a warp takes 8 classes of one group's k-steps
CS_MISC = ("labels", "row_loss", "row_hit")  # the misc region: CS_ROWS 4-byte entries of each, at CS_MISC_<NAME>
CS_ALIGN = 128  # the alignment of every region


class CsLayer(CStruct):
    """One linear layer in the cluster step's table."""

    c_fields = (
        ("wlo", "short*", "global master weights [in_p, out_p]: the low half (master.cuh) ..."),
        ("w16", "half_t*", "... and the high half, the fp16 working copy (both written at the end of a launch)"),
        ("b", "float*", "global bias [out_p]"),
        ("in_p", "i64"), ("out_p", "i64"),
        ("rows", "i64", "rows held in shared memory: 784 for layer 0, hs above (the head: hs)"),
        ("w_off", "i64"), ("b_off", "i64"),
    )


class CsParams(CStruct):
    """The cluster step's table, which the launcher writes into the arena (table_bytes: CS_HEADER_FIELDS + layers x
    CS_LAYER_FIELDS 8-byte words), with the shared-memory layout kernels/cluster.py plans (the byte offsets)."""

    c_fields = (
        ("images", "const u8*", "[rows, 784]"),
        ("labels", "const u8*"),
        ("perm", "const int*"),
        ("step", "i64*"),
        ("loss_sum", "double*"),
        ("correct", "int*"),
        ("batch", "i64"), ("steps_per_epoch", "i64"), ("layers", "i64"), ("schedule", "i64"),
        ("total_steps", "i64"), ("warmup_steps", "i64"), ("classes", "i64"),
        ("hs", "i64", "hidden width padded to ctas x n"),
        ("n", "i64", "columns per CTA (a multiple of 8, at most 8 NT)"),
        ("act_off", "i64"), ("raw_off", "i64"), ("x_off", "i64"), ("dy_off", "i64"), ("dlogit_off", "i64"),
        ("rs_off", "i64"), ("scratch_off", "i64"), ("misc_off", "i64"), ("smem_bytes", "i64"),
        ("lr0", "double", "lr0 and lr_min already divided by the loss scale"),
        ("lr_min", "double"), ("dlogit_scale", "double"),
        ("layer", CsLayer, CS_MAX_LINEAR),
    )


CS_HEADER_FIELDS = CsParams.layer.offset // 8
CS_LAYER_FIELDS = ctypes.sizeof(CsLayer) // 8


def cluster_kernel_name(tiles: int) -> str:
    return f"cluster_steps_{tiles}"


def cluster_facts(arch: str, kernel: str | None = None):
    defines = {"CS_WARPS": CS_WARPS, "CS_ROWS": CS_ROWS, "CS_INPUTS": CS_INPUTS, "CS_MAX_LINEAR": CS_MAX_LINEAR,
               "CS_CLASSES": CS_CLASSES, "CS_X_LD": CS_X_LD, "CS_HEAD_LD": CS_HEAD_LD, "CS_DLOGIT_LD": CS_DLOGIT_LD,
               "CS_W_PAD": CS_W_PAD, "CS_ACT_PAD": CS_ACT_PAD, "CS_DY_PAD": CS_DY_PAD,
               "CS_HEAD_GROUPS": CS_HEAD_GROUPS, "CS_ALIGN": CS_ALIGN,
               **{f"CS_MISC_{name.upper()}": i * CS_ROWS for i, name in enumerate(CS_MISC)}}
    tiles = [t for t in CS_TILE_COUNTS if kernel in (None, cluster_kernel_name(t))]
    instances = ("// The kernel instances, cluster_steps_<NT> for every NT of CS_TILE_COUNTS: X(NT) per instance.\n"
                 f"#define CS_FOR_EACH_TILE_COUNT(X) {' '.join(f'X({t})' for t in tiles)}\n")
    return defines, {"cluster_step_abi.cuh": header(__name__, "cluster_step.cu", declare(CsLayer), declare(CsParams),
                                                     instances)}
