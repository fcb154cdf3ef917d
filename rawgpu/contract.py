"""The contract between the Python launchers and the CUDA sources: every fact both sides use, written once.

A launcher packs a parameter table, sizes a block and its shared memory, and picks a compiled instance by name; the
kernel reads the same table, was compiled for the same block and tile shapes, and exists under that name. Copied by
hand, such facts drift apart silently. So they live here, and the compiler hands them to NVRTC with every build
(`build`): constants as `-DNAME=value` options, C struct declarations and instance lists as generated headers held
in memory. Each generated struct is followed by static_asserts of its size and every field offset, so a C compiler
that lays it out differently from ctypes fails the build instead of reading the wrong bytes.

A leaf module (the standard library and recipe.py, itself a leaf, only), so the launchers, the compiler and tools
all import it freely.
`python -m rawgpu.contract [SOURCE] [--arch sm_90]` prints what NVRTC gets.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import re
import sys
from dataclasses import dataclass, field, replace

from .recipe import INPUTS, OPTIMIZERS, SCHEDULES

# ---- C structs declared once ----------------------------------------------------------------------------------

# C spellings of the scalar types our kernels share with Python (ptx/common.cuh's typedefs); any pointer is a
# device address, 8 bytes.
_SCALARS = {
    "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "int": ctypes.c_int32, "u32": ctypes.c_uint32,
    "float": ctypes.c_float, "double": ctypes.c_double, "short": ctypes.c_int16, "u16": ctypes.c_uint16,
    "half_t": ctypes.c_uint16, "u8": ctypes.c_uint8,
}


@dataclass(frozen=True)
class CField:
    """One member of a shared struct: its C spelling (or a CStruct), array length (1: a scalar) and comment."""

    name: str
    ctype: object  # a C spelling such as "const u8*", or a CStruct subclass
    count: int = 1
    comment: str = ""

    @property
    def ctypes_type(self):
        if isinstance(self.ctype, str):
            base = ctypes.c_uint64 if self.ctype.rstrip().endswith("*") else _SCALARS[self.ctype.replace("const ", "")]
        else:
            base = self.ctype
        return base * self.count if self.count != 1 else base

    @property
    def c_type(self) -> str:
        return self.ctype if isinstance(self.ctype, str) else self.ctype.__name__


class _CStructType(type(ctypes.Structure)):
    """Makes ctypes' `_fields_` from `c_fields` as the class is created (ctypes fixes a layout then)."""

    def __new__(mcls, name, bases, namespace):
        if "c_fields" in namespace:
            fields = []
            for spec in namespace["c_fields"]:
                fname, ctype, *rest = spec
                count = next((r for r in rest if isinstance(r, int)), 1)
                comment = next((r for r in rest if isinstance(r, str)), "")
                fields.append(CField(fname, ctype, count, comment))
            namespace["c_layout"] = tuple(fields)
            namespace["_fields_"] = [(f.name, f.ctypes_type) for f in fields]
        return super().__new__(mcls, name, bases, namespace)


class CStruct(ctypes.Structure, metaclass=_CStructType):
    """A struct Python and CUDA share. A subclass lists `c_fields` as (name, C type[, count][, comment]) tuples in C
    order; ctypes' `_fields_` are made from them, and `declare` writes the C declaration. The class docstring is
    the struct's comment."""

    c_layout: tuple[CField, ...] = ()


def declare(struct: type[CStruct]) -> str:
    """The C declaration of `struct`, then static_asserts of its size and of every member's offset as ctypes lays
    them out: a C compiler that disagrees fails the build. NVRTC has no <cstddef>, so the offsets use
    __builtin_offsetof, which NVRTC 13.0 lacks: there only the size is checked (the CPU tests' NVRTC checks all)."""
    name = struct.__name__
    lines = [f"// {line}".rstrip() for line in inspect.cleandoc(struct.__doc__ or "").splitlines()]
    lines.append(f"struct {name} {{")
    decls = [f"    {f.c_type} {f.name}{f'[{f.count}]' if f.count != 1 else ''};" for f in struct.c_layout]
    width = max(len(d) for d in decls)
    for decl, f in zip(decls, struct.c_layout):
        lines.append(f"{decl:<{width}}  // {f.comment}" if f.comment else decl)
    lines.append("};")
    where = "rawgpu/contract.py"
    lines.append(f'static_assert(sizeof({name}) == {ctypes.sizeof(struct)}, "{name}: its size in {where}");')
    lines.append("#if __has_builtin(__builtin_offsetof)")
    for f in struct.c_layout:
        offset = getattr(struct, f.name).offset
        lines.append(f'static_assert(__builtin_offsetof({name}, {f.name}) == {offset}, '
                     f'"{name}.{f.name}: its offset in {where}");')
    lines.append("#endif")
    return "\n".join(lines) + "\n"


def table_bytes(table: CStruct, count: int) -> bytes:
    """A parameter table's bytes up to and including element count - 1 of its last member, an array of layers: what
    a launcher uploads, since the kernel reads no layer past the model's."""
    last = type(table).c_layout[-1]
    if not 0 <= count <= last.count:
        raise ValueError(f"{type(table).__name__}.{last.name} holds 0..{last.count} entries, not {count}")
    return bytes(table)[:getattr(type(table), last.name).offset + count * ctypes.sizeof(last.ctype)]


def _sm(arch: str) -> int:
    """'sm_90a' -> 90: the number the kernels' `__CUDA_ARCH__ / 10` would give."""
    return int(arch.removeprefix("sm_").rstrip("a"))


# ---- the training-step schedule (step_math.cuh: lr_at_step) --------------------------------------------------



def _schedule_facts(arch: str):
    return {f"SCHEDULE_{name.upper()}": code for name, code in SCHEDULES.items()}, {}


# ---- the optimiser every weight update reads (optim.cuh) ------------------------------------------------------

class Optim(CStruct):
    """The optimiser, one copy in the arena that every update kernel reads: the hyperparameters, set once from the
    recipe, and the step's values, which the gather writes every step (the fused kernel computes its own). lr comes
    first: kernels that run plain SGD read it as a float*."""

    c_fields = (
        ("lr", "float", "this step's learning rate / the loss scale: what SGD multiplies scaled gradients by"),
        ("step_size", "float", "Adam: this step's lr / (1 - beta1^t), t = steps done + 1"),
        ("bias2", "float", "Adam: 1 / sqrt(1 - beta2^t)"),
        ("decay", "float", "AdamW: 1 - lr x weight decay, the decoupled decay's factor (1 otherwise)"),
        ("kind", "int", "OPT_SGD, OPT_ADAM, OPT_ADAMW"),
        ("nesterov", "int", "SGD: w -= lr (g + mu v) instead of lr v"),
        ("beta1", "float", "SGD: the momentum mu (0: none); Adam: beta1"),
        ("beta2", "float"),
        ("m_rate", "float", "Adam: 1 - beta1, rounded once from double"),
        ("v_rate", "float", "Adam: 1 - beta2"),
        ("eps", "float", "Adam's eps x the loss scale (the moments hold scaled gradients)"),
        ("l2", "float", "SGD and Adam: weight decay x the loss scale, added to the scaled gradient"),
        ("wd", "float", "AdamW: the decoupled weight decay"),
        ("scale", "float", "the loss scale"),
        ("beta1_d", "double", "beta1 and beta2 in double, for the bias corrections"),
        ("beta2_d", "double"),
    )


OPTIM_WORDS = ctypes.sizeof(Optim) // 4  # the arena holds it as that many float32


def _optim_facts(arch: str):
    return ({f"OPT_{name.upper()}": code for name, code in OPTIMIZERS.items()},
            {"optim_abi.cuh": _header("optim.cuh", declare(Optim))})


# ---- fused_step.cu: the whole step in one persistent kernel (kernels/fused.py) -------------------------------
FS_WARPS = 8
FS_THREADS = 32 * FS_WARPS
FS_T = 32  # tile edge: 32x32 output blocks, K in chunks of 32
FS_LD = FS_T + 8  # shared row stride in halves: 80 bytes, conflict-free ldmatrix
FS_INPUTS = INPUTS  # pixels per image
FS_PANEL_LD = 808  # gathered input rows: 25 whole chunks (800) + 8 halves of padding
FS_MAX_LAYERS = 65  # linear layers: --layers 64 plus the head


def fs_stages(arch: str) -> int:
    """FS_STAGES, each warp's pipeline depth: sm_86/87/89 give a block 99 KB of shared memory, so 2 there."""
    return 2 if _sm(arch) in (86, 87, 89) else 4


def fs_smem_bytes(arch: str) -> int:
    """FS_SMEM_BYTES, the dynamic shared memory of a block: the larger of the 8 warps' pipelines (A + B tiles) and
    layer 0's gathered panel with B-only pipelines. The kernel asserts that what it carves fits."""
    tile_bytes = FS_T * FS_LD * 2
    staging = FS_WARPS * fs_stages(arch) * 2 * tile_bytes
    layer0 = FS_T * FS_PANEL_LD * 2 + FS_WARPS * fs_stages(arch) * tile_bytes
    return max(staging, layer0)


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
        ("profile", "u64*", "with -DFS_PROFILE: block 0 stamps %globaltimer here after every phase (else unused)"),
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


def _fused_facts(arch: str, kernel: str | None = None):
    defines = {"FS_WARPS": FS_WARPS, "FS_T": FS_T, "FS_LD": FS_LD, "FS_INPUTS": FS_INPUTS, "FS_PANEL_LD": FS_PANEL_LD,
               "FS_MAX_LAYERS": FS_MAX_LAYERS, "FS_STAGES": fs_stages(arch), "FS_SMEM_BYTES": fs_smem_bytes(arch)}
    kernels = " ".join(f"X({name}, {'true' if adam else 'false'})" for name, adam in FS_KERNELS.items()
                       if kernel in (None, name))
    instances = ("// The kernels of this build: X(name, ADAM) each, for FS_KERNEL.\n"
                 f"#define FS_FOR_EACH_KERNEL(X) {kernels}\n")
    return defines, {"fused_step_abi.cuh": _header("fused_step.cu", declare(FsLayer), declare(FsParams), instances)}


# ---- cluster_step.cu: the model resident in one cluster's shared memory (kernels/cluster.py) ------------------
CS_WARPS = 8
CS_THREADS = 32 * CS_WARPS
CS_ROWS = 32  # batch rows held (batch <= 32; rows past the batch are zero)
CS_INPUTS = INPUTS
CS_X_LD = 792  # halves per row of the batch in fp16: 784 + 8, conflict-free ldmatrix
CS_HEAD_LD = 20  # floats per row of the head replica (16 classes + 4: conflict-free)
CS_DLOGIT_LD = 24  # halves per row of d(logits)
CS_MAX_LINEAR = 9  # 8 hidden layers and the head
CS_TILE_COUNTS = (1, 2, 4)  # kernel instances cluster_steps_<NT>: NT 8-column tiles per CTA at most
CS_MAX_COLUMNS = 8 * max(CS_TILE_COUNTS)  # columns of a hidden layer per CTA


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
        ("profile", "u64*", "with -DCS_PROFILE: CTA 0 stamps %globaltimer at every mark (dev/cluster_phases.py)"),
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


def _cluster_facts(arch: str, kernel: str | None = None):
    defines = {"CS_WARPS": CS_WARPS, "CS_ROWS": CS_ROWS, "CS_INPUTS": CS_INPUTS, "CS_X_LD": CS_X_LD,
               "CS_HEAD_LD": CS_HEAD_LD, "CS_DLOGIT_LD": CS_DLOGIT_LD, "CS_MAX_LINEAR": CS_MAX_LINEAR}
    tiles = [t for t in CS_TILE_COUNTS if kernel in (None, cluster_kernel_name(t))]
    instances = ("// The kernel instances, cluster_steps_<NT> for every NT of CS_TILE_COUNTS: X(NT) per instance.\n"
                 f"#define CS_FOR_EACH_TILE_COUNT(X) {' '.join(f'X({t})' for t in tiles)}\n")
    return defines, {"cluster_step_abi.cuh": _header("cluster_step.cu", declare(CsLayer), declare(CsParams),
                                                     instances)}


# ---- gemm.cu and gemm_tma.cu: tile configurations and the compiled instances (kernels/gemm.py) ---------------

GEMM_SOURCE = "gemm.cu"
GEMM_TMA_SOURCE = "gemm_tma.cu"
GEMM_WGMMA_SOURCE = "gemm_wgmma.cu"
# On sm_90 the splits of a tile can meet in one thread-block cluster (gemm_epilogue.cuh: finish_cluster_splits): up
# to the portable cluster size.
MAX_CLUSTER_SPLITS = 8
# The persistent tile's resident grid: this many blocks per SM (its __launch_bounds__ promises the registers; its
# shared memory, 44 KB, fits twice even in sm_86's 99 KB).
PERSIST_BLOCKS_PER_SM = 2
STREAM_CONFIG = "stream"  # the config whose pipeline depth is stream_stages(arch)


@dataclass(frozen=True)
class GemmConfig:
    """One CTA tile shape: a `Config<BM, BN, BK, WM, WN, STAGES[, STAGED]>` of gemm.cu, or with `tma`, a
    `TmaConfig<BM, BN, STAGES>` of gemm_tma.cu (BK 64 and 4 consumer warps: the template's own; they split K at
    BM 32, the rows above)."""

    name: str
    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    staged: bool = False  # the epilogue goes through shared memory (Config<..., STAGED_> in gemm.cu)
    tma: bool = False  # fed by the sm_90 tensor copy engine (TmaConfig in gemm_tma.cu): one more warp, the producer
    persistent: bool = False  # a resident grid walks the tiles (gemm_persistent_store in gemm.cu)
    wgmma: bool = False  # Hopper's warpgroup MMA (WgConfig in gemm_wgmma.cu, sm_90a): three warpgroups, one producing
    note: str = field(default="", compare=False, repr=False)  # why the tile exists (a comment in the header)

    @property
    def threads(self) -> int:
        if self.wgmma:
            return 128 * (self.warps_m * self.warps_n + 1)  # its warps_m x warps_n are consumer warpgroups
        return 32 * (self.warps_m * self.warps_n + self.tma)

    @property
    def source(self) -> str:
        return GEMM_WGMMA_SOURCE if self.wgmma else GEMM_TMA_SOURCE if self.tma else GEMM_SOURCE

    @property
    def c_name(self) -> str:
        """The typedef in the generated header."""
        return f"Cfg_{self.name}"

    def smem_bytes(self, layout: str, epilogue: str = "store", states: int = 0) -> int:
        """Dynamic shared memory: STAGES x (A tile + B tile), each row padded by 8 halves; a staged update epilogue
        adds the weight tile (W16 and lo: as much as an fp32 tile) and one fp32 tile per optimiser state (`states`:
        momentum, or Adam's two moments), rows padded by 8 floats; the persistent tile adds its fp16 output tile,
        rows padded by 8 halves. TMA tiles are swizzled, not padded, and need 1 KB of slack to align them. (The
        kernels trap on less.)"""
        if self.tma:
            return self.stages * (self.bm + self.bn) * self.bk * 2 + 1024
        a = self.bm * (self.bk + 8) if layout[0] == "r" else self.bk * (self.bm + 8)
        b = self.bk * (self.bn + 8) if layout[1] == "r" else self.bn * (self.bk + 8)
        staged = (1 + states) * self.bm * (self.bn + 8) * 4 if self.staged and epilogue in UPDATE_EPILOGUES else 0
        out = self.bm * (self.bn + 8) * 2 if self.persistent else 0
        return self.stages * (a + b) * 2 + staged + out


def stream_stages(arch: str) -> int:
    """STREAM_STAGES, the streaming tile's pipeline depth: what fits a block's shared memory (227 KB on sm_90,
    163 KB on sm_80, 99 KB on sm_86/87/89) at 13.5 KB per stage."""
    return {90: 15, 80: 11}.get(_sm(arch), 7)


CONFIGS = {c.name: c for c in (
    GemmConfig("32x128", 32, 128, 32, 1, 4, 6, note="batch-sized M (<= 32): streams a wide B"),
    GemmConfig("32x128k64", 32, 128, 64, 2, 4, 4, note="M <= 32, longer K runs: 128-byte rows of a column-major B"),
    GemmConfig("64x128", 64, 128, 64, 2, 4, 3, note="M <= 64"),
    GemmConfig("128x128", 128, 128, 32, 2, 4, 4, note="large M"),
    GemmConfig("outer", 128, 128, 32, 2, 4, 2, note="K = batch: little to pipeline, much to write"),
    GemmConfig("outer64", 64, 128, 32, 2, 4, 2, note="the same with half the accumulators: more CTAs per SM"),
    GemmConfig(STREAM_CONFIG, 32, 64, 64, 2, 4, 7,  # stages: stream_stages(arch)
               note="M <= 32: a block per SM streams 64 columns (or a K range), as deep as shared memory allows"),
    GemmConfig("staged", 64, 128, 32, 2, 4, 2, staged=True,
               note="K = batch: weight update staged in shared memory"),
    GemmConfig("staged32", 32, 128, 32, 1, 4, 2, staged=True,
               note="the same, 32 rows, for Adam: its two moment tiles fit sm_86's shared memory"),
    GemmConfig("persist", 64, 128, 32, 2, 4, 2, persistent=True,
               note="K = batch, plain store: a resident grid walks the tiles"),
    GemmConfig("tma", 32, 64, 64, 1, 4, 16, tma=True,  # warps: 4 consumers (+ the producer)
               note="64 columns per block: 128 blocks stream an 8192-wide weight without split-K"),
    GemmConfig("tma128", 32, 128, 64, 1, 4, 10, tma=True, note="128 columns: half the re-reads of A, split-K to fill "
                                                               "the SMs"),
    GemmConfig("tma128x64", 128, 64, 64, 4, 1, 8, tma=True, note="a batch of up to 128 rows reads each weight tile "
                                                                 "once"),
    GemmConfig("wg128", 128, 128, 64, 2, 1, 6, tma=True, wgmma=True,  # warps_m: 2 consumer warpgroups of 64 rows
               note="batches above 256 on sm_90a: warpgroup MMA, 128 columns"),
    GemmConfig("wg256", 128, 256, 64, 2, 1, 4, tma=True, wgmma=True,
               note="the same, 256 columns: half the re-reads of A where the tiles still fill the GPU"),
)}
LAYOUTS = ("rr", "rc", "cr", "cc")  # A then B: r = row-major, c = column-major
EPILOGUES = ("store", "bias", "bias_relu", "drelu", "sgd", "adam", "store32")
UPDATE_EPILOGUES = ("sgd", "adam")  # the weight update fused into x^T @ dy, one per optimiser family (EPI_SGD, EPI_ADAM)
ACCUMULATORS = ("f32", "f16")
TMA_ROLES = [("rr", "store"), ("rr", "bias_relu"), ("rc", "store"), ("rc", "drelu")]
# (layout, epilogue) pairs every general tile compiles
_ROLE_INSTANCES = [("rr", "store"), ("rc", "store"), ("cr", "store"), ("cc", "store"),
                   ("rr", "bias"), ("rr", "bias_relu"), ("rc", "drelu"), ("cr", "sgd"), ("cr", "adam")]
# (config, layout, epilogue) triples compiled, each for f32 and f16 accumulation (and store32's, below)
_BASE_INSTANCES = frozenset([(c, lay, epi) for c in ("32x128", "64x128", "128x128") for lay, epi in _ROLE_INSTANCES]
                             + [(c, "cr", e) for c in ("outer", "outer64") for e in ("sgd", "store")]
                             + [("32x128k64", lay, epi) for lay, epi in [("rr", "store"), ("rc", "store"),
                                                                         ("rr", "bias_relu"), ("rc", "drelu")]]
                             + [(STREAM_CONFIG, lay, epi) for lay, epi in [("rr", "store"), ("rr", "bias"),
                                                                           ("rr", "bias_relu"), ("rc", "store"),
                                                                           ("rc", "drelu")]]
                             + [("staged", "cr", e) for e in ("sgd", "store")] + [("staged32", "cr", "adam")]
                             + [("persist", "cr", "store")]
                             + [(c, lay, epi) for c in ("tma", "tma128") for lay, epi in TMA_ROLES]
                             + [("tma128x64", "rr", epi) for epi in ("store", "bias_relu")]
                             + [(c, lay, epi) for c in ("wg128", "wg256") for lay, epi in TMA_ROLES])
# store32, an fp32 sum other GPUs add to (rawgpu/parallel.py): a tensor-parallel layer's partial sum on every tile
# that stores x @ W or dy @ W^T, which the planner gives it as it gives "store"; a data-parallel weight gradient on
# every tile the planner gives a weight update, which it runs as one GPU's update would (kernels/gemm.py)
INSTANCES = (_BASE_INSTANCES
             | {(c, lay, "store32") for c, lay, epi in _BASE_INSTANCES if epi == "store" and lay in ("rr", "rc")}
             | {(c, "cr", "store32") for c in ("32x128", "64x128", "128x128", "staged", "staged32")})


def config_for(name: str, arch: str) -> GemmConfig:
    """CONFIGS[name] with its pipeline depth for this GPU."""
    cfg = CONFIGS[name]
    return replace(cfg, stages=stream_stages(arch)) if name == STREAM_CONFIG else cfg


def instance_name(config: str, layout: str, epilogue: str) -> str:
    """gemm_<config>_<layout A><layout B>_<epilogue>: an instance's kernels are this + _f32 and _f16."""
    return f"gemm_{config}_{layout}_{epilogue}"


def kernel_name(config: str, layout: str, epilogue: str, accum: str) -> str:
    """The extern "C" name of one kernel."""
    return f"{instance_name(config, layout, epilogue)}_{accum}"


def all_kernel_names(source: str = GEMM_SOURCE) -> list[str]:
    """The instances one source file compiles."""
    return sorted(kernel_name(c, lay, e, acc) for c, lay, e in INSTANCES for acc in ACCUMULATORS
                  if CONFIGS[c].source == source)


def _instances_of(source: str) -> list[tuple[GemmConfig, str, str]]:
    order = list(CONFIGS)
    found = sorted(((c, lay, e) for c, lay, e in INSTANCES if CONFIGS[c].source == source),
                   key=lambda t: (order.index(t[0]), LAYOUTS.index(t[1]), EPILOGUES.index(t[2])))
    return [(CONFIGS[c], lay, e) for c, lay, e in found]


_C_LAYOUT = {"r": "ROW", "c": "COL"}


def _one_kernel(name: str, accs_line: str, kernel: str | None) -> str | None:
    """An instance's line of a generated header: the macro making its _f32 and _f16 kernels (kernel None), the
    single-kernel macro when `kernel` is one of the two, else None (left out)."""
    if kernel is None:
        return accs_line
    for acc in ACCUMULATORS:
        if kernel == f"{name}_{acc}":
            macro, args = accs_line.split("(", 1)
            args = args.rsplit(")", 1)[0].split(", ", 1)[1]
            return f"{macro.replace('_ACCS', '_INSTANCE')}({kernel}, {args}, {'true' if acc == 'f16' else 'false'})"
    return None


def _gemm_header(kernel: str | None = None) -> str:
    """gemm.cu's Config typedefs and instances: GEMM_ACCS / PERSIST_ACCS (gemm.cu's macros) per (config, layout,
    epilogue), each making the _f32 and _f16 kernels; with `kernel`, that one kernel alone."""
    configs = [c for c in CONFIGS.values() if c.source == GEMM_SOURCE]
    lines = []
    for c in configs:
        stages = "STREAM_STAGES" if c.name == STREAM_CONFIG else str(c.stages)
        args = f"{c.bm}, {c.bn}, {c.bk}, {c.warps_m}, {c.warps_n}, {stages}" + (", true" if c.staged else "")
        lines.append(f"typedef Config<{args}> {c.c_name};  // {c.note}")
        lines.append(f'static_assert({c.c_name}::THREADS == {c.threads}, "{c.name}: its threads in '
                     f'rawgpu/contract.py");')
    lines.append("")
    for c, lay, epi in _instances_of(GEMM_SOURCE):
        name = instance_name(c.name, lay, epi)
        operands = f"{_C_LAYOUT[lay[0]]}, {_C_LAYOUT[lay[1]]}"
        if c.persistent:
            if epi != "store":
                raise ValueError(f"the persistent tile only stores, not {epi}")
            line = f"PERSIST_ACCS({name}, {c.c_name}, {operands})"
        else:
            line = f"GEMM_ACCS({name}, {c.c_name}, {operands}, EPI_{epi.upper()})"
        if (line := _one_kernel(name, line, kernel)) is not None:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _row_a_instances(source: str, accs: str, kernel: str | None) -> list[str]:
    """The instance lines of a source fed by the tensor copy engine, whose A is always row-major: the macro `accs`
    (name, config, B's layout, epilogue) per (config, layout, epilogue); with `kernel`, that one kernel alone."""
    lines = []
    for c, lay, epi in _instances_of(source):
        if lay[0] != "r":
            raise ValueError(f"{source}'s tiles read a row-major A, not layout {lay}")
        name = instance_name(c.name, lay, epi)
        line = _one_kernel(name, f"{accs}({name}, {c.c_name}, {_C_LAYOUT[lay[1]]}, EPI_{epi.upper()})", kernel)
        if line is not None:
            lines.append(line)
    return lines


def _gemm_tma_header(kernel: str | None = None) -> str:
    """gemm_tma.cu's TmaConfig typedefs (with asserts that the template's fixed shape is the table's) and
    instances: TMA_ACCS (gemm_tma.cu's macro) per (config, layout, epilogue), A always row-major; with `kernel`,
    that one kernel alone."""
    lines = []
    for c in (c for c in CONFIGS.values() if c.source == GEMM_TMA_SOURCE):
        lines.append(f"typedef TmaConfig<{c.bm}, {c.bn}, {c.stages}> {c.c_name};  // {c.note}")
        lines.append(f"static_assert({c.c_name}::BM == {c.bm} && {c.c_name}::BK == {c.bk} && {c.c_name}::CONSUMERS == "
                     f'{c.warps_m * c.warps_n} && {c.c_name}::THREADS == {c.threads}, "{c.name}: its shape in '
                     'rawgpu/contract.py");')
    return "\n".join(lines + [""] + _row_a_instances(GEMM_TMA_SOURCE, "TMA_ACCS", kernel)) + "\n"


def _gemm_wgmma_header(kernel: str | None = None) -> str:
    """gemm_wgmma.cu's WgConfig typedefs (with asserts that the template's fixed shape is the table's) and instances:
    WG_ACCS (gemm_wgmma.cu's macro) per (config, layout, epilogue), A always row-major; with `kernel`, that one
    kernel alone."""
    lines = []
    for c in (c for c in CONFIGS.values() if c.source == GEMM_WGMMA_SOURCE):
        lines.append(f"typedef WgConfig<{c.bn}, {c.stages}> {c.c_name};  // {c.note}")
        lines.append(f"static_assert({c.c_name}::BM == {c.bm} && {c.c_name}::BK == {c.bk} && {c.c_name}::THREADS == "
                     f'{c.threads}, "{c.name}: its shape in rawgpu/contract.py");')
    return "\n".join(lines + [""] + _row_a_instances(GEMM_WGMMA_SOURCE, "WG_ACCS", kernel)) + "\n"


def nvrtc_arch(source: str, arch: str) -> str:
    """The architecture NVRTC builds `source` for on a GPU of `arch`: gemm_wgmma.cu's warpgroup MMA needs sm_90's
    arch-specific features (sm_90a; the cubin loads on sm_90 parts only, the only ones with wgmma)."""
    return "sm_90a" if source == GEMM_WGMMA_SOURCE and arch == "sm_90" else arch


def _epilogue_facts(arch: str):  # gemm_epilogue.cuh
    return {"GEMM_MAX_CLUSTER_SPLITS": MAX_CLUSTER_SPLITS}, {}


def _gemm_facts(arch: str, kernel: str | None = None):
    defines = {"STREAM_STAGES": stream_stages(arch), "PERSIST_BLOCKS_PER_SM": PERSIST_BLOCKS_PER_SM}
    return defines, {"gemm_instances.cuh": _header(GEMM_SOURCE, _gemm_header(kernel))}


def _gemm_tma_facts(arch: str, kernel: str | None = None):
    return {}, {"gemm_tma_instances.cuh": _header(GEMM_TMA_SOURCE, _gemm_tma_header(kernel))}


def _gemm_wgmma_facts(arch: str, kernel: str | None = None):
    return {}, {"gemm_wgmma_instances.cuh": _header(GEMM_WGMMA_SOURCE, _gemm_wgmma_header(kernel))}


# ---- dx_sgd.cu: a layer's backward in one pass (kernels/dx_sgd.py) --------------------------------------------

DX_SGD_BM = 64  # rows of W (input features) per block
DX_SGD_BN = 128  # columns of W per pipeline stage
DX_SGD_MAX_BATCH = 32  # batch rows (BB in dx_sgd.cu)
DX_SGD_THREADS = 256


def dx_sgd_stages(arch: str) -> int:
    """DX_SGD_STAGES: the pipeline depth that fits the part's shared memory at 42.5 KB a stage."""
    return {90: 4, 80: 3}.get(_sm(arch), 2)


def dx_sgd_smem_bytes(arch: str) -> int:
    """Per stage a W16, a lo (BM rows) and a dy chunk (the batch rows), each row padded by 8 halves; then the x tile
    (rows of BM + 8 halves)."""
    stage = DX_SGD_BM * (DX_SGD_BN + 8) * 2 * 2 + DX_SGD_MAX_BATCH * (DX_SGD_BN + 8) * 2
    return dx_sgd_stages(arch) * stage + DX_SGD_MAX_BATCH * (DX_SGD_BM + 8) * 2


def _dx_sgd_facts(arch: str):
    return {"DX_SGD_BM": DX_SGD_BM, "DX_SGD_BN": DX_SGD_BN, "DX_SGD_BB": DX_SGD_MAX_BATCH,
            "DX_SGD_THREADS": DX_SGD_THREADS, "DX_SGD_STAGES": dx_sgd_stages(arch),
            "DX_SGD_SMEM_BYTES": dx_sgd_smem_bytes(arch)}, {}


# ---- dx_update.cu: a layer's backward in one pass with any optimiser (kernels/dx_update.py) ----------------------

DXU_BM = 64  # rows of W (input features) per block
DXU_BN = 64  # columns of W per pipeline stage
DXU_BATCHES = (32, 64, 128, 256)  # the batch tiles (BB): a batch of B rows runs the smallest tile >= B
# Warps per block by batch tile: 16 where the warp grids allow it (dx: 8 features per warp and 32-row group, so BB >= 64)
# and the registers fit (at 256 rows 16 warps spill); more warps hide more of each chunk's latency (docs/history.md).
DXU_WARPS = {32: 8, 64: 16, 128: 16, 256: 8}
DXU_FAMILIES = ("sgd", "adam")  # the update compiled in: SGD's rule (with momentum or without) or Adam's (AdamW)
DXU_MAX_STAGES = 4


def block_smem_limit(arch: str) -> int:
    """The most dynamic shared memory one block can have: 227 KB on sm_90 and later, 163 KB on sm_80, 99 KB on
    sm_86/87/89."""
    return 227 * 1024 if _sm(arch) >= 90 else 163 * 1024 if _sm(arch) == 80 else 99 * 1024


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


def _dx_update_facts(arch: str, kernel: str | None = None):
    defines = {"DXU_BM": DXU_BM, "DXU_BN": DXU_BN}
    made = [f"X({dxu_kernel_name(bb, f)}, {bb}, {'true' if f == 'adam' else 'false'}, {dxu_stages(bb, f, arch)}, "
            f"{dxu_smem_bytes(bb, f, arch)}, {DXU_WARPS[bb]})" for bb in DXU_BATCHES for f in DXU_FAMILIES
            if dxu_stages(bb, f, arch) >= 2 and kernel in (None, dxu_kernel_name(bb, f))]
    instances = ("// The kernels of this build: X(name, BB, ADAM, STAGES, SMEM_BYTES, WARPS) each.\n"
                 f"#define DXU_FOR_EACH_KERNEL(X) {' '.join(made)}\n")
    return defines, {"dx_update_instances.cuh": _header("dx_update.cu", instances)}


# ---- head.cu: the classifier head's step in one cluster (kernels/head.py) ------------------------------------

HEAD_THREADS = 256
HEAD_CLASSES = 16  # classes, padded
HEAD_BATCHES = (32, 64, 128, 256)  # batch tiles (ROWS): a batch of B rows runs the smallest tile >= B
HEAD_FAMILIES = DXU_FAMILIES
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


def _head_facts(arch: str, kernel: str | None = None):
    made = [f"X({head_kernel_name(rows, f)}, {rows}, {'true' if f == 'adam' else 'false'}, {head_smem_per_row(rows)}, "
            f"{head_smem_fixed(rows)})" for rows in HEAD_BATCHES for f in HEAD_FAMILIES
            if kernel in (None, head_kernel_name(rows, f))]
    instances = ("// The kernels of this build: X(name, ROWS, ADAM, SMEM_PER_ROW, SMEM_FIXED) each.\n"
                 f"#define HEAD_FOR_EACH_KERNEL(X) {' '.join(made)}\n")
    return ({"HEAD_THREADS": HEAD_THREADS, "HEAD_CLASSES": HEAD_CLASSES, "HEAD_MAX_CTAS": HEAD_MAX_CTAS},
            {"head_instances.cuh": _header("head.cu", instances)})


# ---- loss.cu and elementwise.cu (kernels/loss.py, kernels/elementwise.py) -----------------------------------------

XENT_MAX_THREADS = 256  # softmax_xent's block: its per-warp sums are sized for it


def _loss_facts(arch: str):
    return {"XENT_MAX_WARPS": XENT_MAX_THREADS // 32}, {}


EW_THREADS = 256  # the block of every elementwise launch; bias_update's shared partials are sized for it


def _elementwise_facts(arch: str):
    return {"EW_THREADS": EW_THREADS}, {}


# ---- what each source is compiled with ----------------------------------------------------------------------

# Per source, the facts of every shared header it includes (step_math.cuh: the schedule; optim.cuh: the optimiser;
# gemm_epilogue.cuh: the cluster splits, and it includes optim.cuh) and its own. A source missing a define it needs stops at an #error naming this module.
SOURCES = {
    "cluster_step.cu": (_schedule_facts, _cluster_facts),
    "data.cu": (_schedule_facts, _optim_facts),
    "dx_sgd.cu": (_schedule_facts, _optim_facts, _epilogue_facts, _dx_sgd_facts),
    "dx_update.cu": (_schedule_facts, _optim_facts, _epilogue_facts, _dx_update_facts),
    "elementwise.cu": (_schedule_facts, _optim_facts, _epilogue_facts, _elementwise_facts),
    "fused_step.cu": (_schedule_facts, _optim_facts, _fused_facts),
    GEMM_SOURCE: (_optim_facts, _epilogue_facts, _gemm_facts),
    GEMM_TMA_SOURCE: (_optim_facts, _epilogue_facts, _gemm_tma_facts),
    GEMM_WGMMA_SOURCE: (_optim_facts, _epilogue_facts, _gemm_wgmma_facts),
    "head.cu": (_schedule_facts, _optim_facts, _epilogue_facts, _head_facts),
    "loss.cu": (_loss_facts,),
}


def _header(source: str, *parts: str) -> str:
    return (f"// Generated by rawgpu/contract.py for {source}, in memory: edit the contract, not this text.\n"
            f"// `python -m rawgpu.contract {source}` prints it.\n#pragma once\n#include \"common.cuh\"\n\n"
            + "\n".join(parts))


# They list instances: built one at a time too.
_INSTANCE_FACTS = (_cluster_facts, _fused_facts, _gemm_facts, _gemm_tma_facts, _gemm_wgmma_facts, _dx_update_facts,
                   _head_facts)


def split_kernels(source: str, arch: str | None = None) -> list[str]:
    """The kernels of a source of many template instances, each of which builds alone (a unit of compilation and
    of the cache), so that a step compiles only what it launches; [] for a source that builds whole. arch: only
    those built for that GPU (dx_update.cu builds no instance whose pipeline does not fit it)."""
    if source in (GEMM_SOURCE, GEMM_TMA_SOURCE, GEMM_WGMMA_SOURCE):
        return all_kernel_names(source)
    if source == "cluster_step.cu":
        return [cluster_kernel_name(t) for t in CS_TILE_COUNTS]
    if source == "fused_step.cu":
        return list(FS_KERNELS)
    if source == "dx_update.cu":
        return dxu_kernels(arch) if arch else [dxu_kernel_name(bb, f) for bb in DXU_BATCHES for f in DXU_FAMILIES]
    if source == "head.cu":
        return head_kernels()
    return []


def build(source: str, arch: str, kernel: str | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """What `source` is compiled with for `arch` (an 'sm_XY' name): the `-DNAME=value` options and the generated
    headers (include name -> text). A source that shares nothing gets ((), {}). kernel: one of split_kernels(source),
    built alone (the generated instance list names it only)."""
    if kernel is not None and kernel not in split_kernels(source, arch):
        raise ValueError(f"{source} has no kernel {kernel} that builds alone for {arch}")
    defines: dict[str, int] = {}
    headers: dict[str, str] = {}
    for facts in SOURCES.get(source, ()):
        d, h = facts(arch, kernel) if facts in _INSTANCE_FACTS else facts(arch)
        defines.update(d)
        headers.update(h)
    return tuple(f"-D{name}={value}" for name, value in defines.items()), dict(sorted(headers.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rawgpu.contract",
                                 description="Print the defines and generated headers NVRTC gets for a source.")
    ap.add_argument("source", nargs="*", metavar="SOURCE",
                    help=f"sources (default: all of {', '.join(sorted(SOURCES))})")
    ap.add_argument("--arch", default="sm_90", help="the GPU architecture, e.g. sm_86 (default sm_90)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d{2,3}a?", args.arch):
        ap.error(f"argument --arch: expected a name like sm_86, got {args.arch!r}")
    if unknown := [name for name in args.source if name not in SOURCES]:
        ap.error(f"argument SOURCE: no kernel source {', '.join(unknown)}; the sources: {', '.join(sorted(SOURCES))}")
    for source in args.source or sorted(SOURCES):
        defines, headers = build(source, args.arch)
        print(f"==== {source} for {args.arch}: {' '.join(defines) or 'no defines'}")
        for name, text in headers.items():
            print(f"---- {name}\n{text}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader (head, less) stopped early: not an error
        sys.stderr.close()
        sys.exit(0)
