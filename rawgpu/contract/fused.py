"""The fused step (fused_step.cu, kernels/fused.py): the whole step in one persistent kernel."""

from __future__ import annotations

import ctypes

from .shapes import INPUTS
from .abi import CStruct, declare, header
from .arch import deepest_pipeline
from .optim import Optim

FS_WARPS = 8
FS_THREADS = 32 * FS_WARPS
FS_T = 32  # tile edge: 32x32 output blocks, K in chunks of 32
FS_LD = FS_T + 8  # shared row stride in halves: 80 bytes, conflict-free ldmatrix
FS_INPUTS = INPUTS  # pixels per image
FS_PANEL_LD = 808  # gathered input rows: 25 whole chunks (800) + 8 halves of padding
FS_MAX_LAYERS = 65  # linear layers: --layers 64 plus the head


FS_MAX_STAGES = 4  # each warp's deepest pipeline (sm_90 would fit 5)


def _smem_bytes(stages: int) -> int:
    """The larger of the 8 warps' pipelines (A + B tiles) and layer 0's gathered panel with B-only pipelines."""
    tile_bytes = FS_T * FS_LD * 2
    return max(FS_WARPS * stages * 2 * tile_bytes, FS_T * FS_PANEL_LD * 2 + FS_WARPS * stages * tile_bytes)


def fs_stages(arch: str) -> int:
    """FS_STAGES, each warp's pipeline depth: what fits the part (2 in sm_86/87/89's 99 KB)."""
    return deepest_pipeline(arch, _smem_bytes, FS_MAX_STAGES)


def fs_smem_bytes(arch: str) -> int:
    """FS_SMEM_BYTES, the dynamic shared memory of a block. The kernel asserts that what it carves fits."""
    return _smem_bytes(fs_stages(arch))


class FsLayer(CStruct):
    """One linear layer in the fused step's table."""

    c_fields = (
        ("wlo", "short*", "the master's low half [in_p, out_p] (master.cuh)"),
        ("w16", "half_t*", 2, "fp16 working copies, double-buffered: the master's high half"),
        ("b", "float*", "bias [out_p]"),
        ("mw", "float*", "the optimiser's first state: momentum or Adam's first moment (nullptr without)"),
        ("mb", "float*"),
        ("vw", "float*", "Adam's second moment (nullptr without)"),
        ("vb", "float*"),
        ("x", "half_t*", "input activation [batch, in_p] (layer 0: written here, from the gather)"),
        ("y", "half_t*", "output activation [batch, out_p] (unused for the last layer)"),
        ("dy", "half_t*", "gradient at the output [batch, out_p] (the last layer: d(logits))"),
        ("dx", "half_t*", "gradient at the input [batch, in_p] (nullptr for layer 0)"),
        ("in_p", "i64", "padded widths (multiples of 8; the last out_p is 16)"),
        ("out_p", "i64"),
    )


class FsParams(CStruct):
    """The fused step's table, which the launcher writes into the arena (table_bytes: FS_HEADER_FIELDS + layers x
    FS_LAYER_FIELDS 8-byte words)."""

    c_fields = (
        ("images", "const u8*", "[rows, 784]"),
        ("labels", "const u8*"),
        ("perm", "const int*", "this epoch's sample order"),
        ("step", "i64*", "the step counter: read at start, advanced by n_steps at the end"),
        ("loss_sum", "double*"),
        ("correct", "int*"),
        ("row_loss", "float*", "[batch]: per-row loss and hit, summed by one warp in the next phase"),
        ("row_hit", "int*"),
        ("barrier", "u64*", "grid barrier counter (a multiple of the grid size between launches)"),
        ("batch", "i64"), ("steps_per_epoch", "i64"), ("layers", "i64"), ("schedule", "i64"),
        ("total_steps", "i64"), ("warmup_steps", "i64"), ("classes", "i64"),
        ("lr0", "double", "lr0 and lr_min already divided by the loss scale"),
        ("lr_min", "double"), ("dlogit_scale", "double"),
        ("optim", Optim, "the optimiser's hyperparameters (optim.cuh); the kernel computes the step's values"),
        ("layer", FsLayer, FS_MAX_LAYERS),
    )


FS_HEADER_FIELDS = FsParams.layer.offset // 8  # 8-byte words before layer[]
FS_LAYER_FIELDS = ctypes.sizeof(FsLayer) // 8


FS_KERNELS = {"fused_steps": False, "fused_steps_adam": True}  # kernel -> Adam's update (else SGD's), built apart


def fused_kernel_name(adam: bool) -> str:
    return next(name for name, a in FS_KERNELS.items() if a == adam)


def fused_facts(arch: str, kernel: str | None = None):
    defines = {"FS_WARPS": FS_WARPS, "FS_T": FS_T, "FS_LD": FS_LD, "FS_INPUTS": FS_INPUTS, "FS_PANEL_LD": FS_PANEL_LD,
               "FS_MAX_LAYERS": FS_MAX_LAYERS, "FS_STAGES": fs_stages(arch), "FS_SMEM_BYTES": fs_smem_bytes(arch)}
    kernels = " ".join(f"X({name}, {'true' if adam else 'false'})" for name, adam in FS_KERNELS.items()
                       if kernel in (None, name))
    instances = ("// The kernels of this build: X(name, ADAM) each, for FS_KERNEL.\n"
                 f"#define FS_FOR_EACH_KERNEL(X) {kernels}\n")
    return defines, {"fused_step_abi.cuh": header(__name__, "fused_step.cu", declare(FsLayer), declare(FsParams),
                                                  instances)}
