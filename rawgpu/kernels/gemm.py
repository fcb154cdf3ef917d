"""GEMM launcher: pick a tile configuration and a split-K factor for a shape, check the operands, bind.

`plan_gemm` is plain Python (tested on CPU): which compiled instance runs, on what grid, and how much
split-K workspace it needs. `gemm` binds a plan to tensors and returns a `Launch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from .. import contract
from ..contract import (CONFIGS, EPILOGUES, INSTANCES, LAYOUTS, MAX_CLUSTER_SPLITS, OPTIM_WORDS,  # noqa: F401
                        PERSIST_BLOCKS_PER_SM, TMA_ROLES, UPDATE_EPILOGUES, GemmConfig, all_kernel_names, config_for,
                        kernel_name, stream_stages)
from ..runtime.compiler import unit_of
from ..contract.arch import has_wgmma, sm90_or_later  # noqa: F401 - the planners ask kg for both
from ..contract.shapes import cdiv
from . import PLANNING_SM_COUNT, Kernels, require, require_split_scratch

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from ..runtime.memory import Tensor

# The tile configs, the compiled instances and their names live in rawgpu/contract/gemm.py, which generates gemm.cu's
# and gemm_tma.cu's instance lists from them; they are re-exported here for the planner and its callers.
SOURCE = contract.GEMM_SOURCE
TMA_SOURCE = contract.GEMM_TMA_SOURCE
MAX_SPLITS = 16
# How many clusters of s one-block-per-SM CTAs fit the GPU at once is set by its GPCs, not its SM count (fewer than
# SMs / s where a GPC's SMs are not a multiple of s): `cluster_capacity` asks the driver. Without a GPU, plans assume this share of
# the SMs.
PLANNING_CLUSTER_SHARE = 0.7
# Beyond this many k-tiles, a tile whose workspace rule splits wider than a cluster can takes the workspace: 8 long
# splits in a cluster stream too long, where twice as many through L2 finish sooner (`python dev/gemm_variants.py
# --sweep`).
LONG_K_TILES = 4 * MAX_CLUSTER_SPLITS
MIN_K_TILES_PER_SPLIT = 4  # a split must stream enough tiles to fill its pipeline
# Streaming at K <= 2048 (dev/gemm_variants.py --sweep): from 8 k-tiles on, splits of 2-3 k-tiles win; below that the
# fix-up costs more than the splits save.
STREAM_MIN_K_TILES_PER_SPLIT = 2
STREAM_SPLIT_MIN_K_TILES = 8
# Split-K pays only when one CTA would stream many bytes: below this, latency rules and the fix-up
# (partials through L2, a ticket, a second read) costs more than the parallelism saves.
SPLIT_MIN_BYTES = 192 * 1024
# The tensor-copy tile (config "tma") pays once the weight is this large; below it the cp.async streaming tile is
# as fast or faster (`python dev/gemm_variants.py --variants stream tma --sizes 2048 4096 8192`).
TMA_MIN_BYTES = 4 << 20
# The forward (x @ W) of a batch of 33..BATCH_STREAM_ROWS rows streams too (`python dev/forward_tiles.py --batch 128`):
# up to ROW_TILE_MIN_BYTES of weight the 32-row tiles, which read the weight once per 32 rows (from L2 after the first),
# beat every tile of more rows; the copy engine's from TMA_MIN_BYTES_BATCH, its 128-column form (which reads x half as
# often) on TMA128_MIN_COLUMNS or more. From ROW_TILE_MIN_BYTES the copy engine's 128-row tile, which reads each weight
# tile once, wins: the four reads of a weight through L2 cost more than the DRAM stream; but only from
# ROW_TILE_MIN_COLUMNS on: narrower (a rank's slice of a wide layer), its few column tiles must split K.
BATCH_STREAM_ROWS = 256
TMA_MIN_BYTES_BATCH = 1 << 20
TMA128_MIN_COLUMNS = 4096
ROW_TILE_MIN_BYTES = 12 << 20
ROW_TILE_MIN_COLUMNS = 4096
ROW_TILE = "tma128x64"
# On sm_90 x @ W of 33..BATCH_STREAM_ROWS rows takes the 64-column warpgroup-MMA tile with K split over a cluster
# (wgmma_splits) from FORWARD_WGMMA_MIN_BYTES of weight up to FORWARD_WGMMA_MAX_BYTES (the largest measured): it reads
# each weight tile once (128 rows a tile) at the tensor cores' rate, where the 32-row streaming tiles read it once per
# 32 rows; below, the streaming tiles' shorter start wins (`python dev/forward_tiles.py --configs tma stream tma128x64
# wg64k --shapes 128x1024x3072 128x512x512 128x256x784 128x4096x4096 64x1024x1024 256x1024x1024`).
FORWARD_WGMMA = "wg64k"
FORWARD_WGMMA_MIN_BYTES = 512 << 10
FORWARD_WGMMA_MAX_BYTES = 32 << 20
# Above BATCH_STREAM_ROWS rows x @ W and dy @ W^T are arithmetic: on sm_90 the warpgroup-MMA tiles run them faster
# than every mma.sync tile (`python dev/wgmma/run.py`; `python dev/gemm_variants.py --variants 128x128 wg128 wg256
# --batch 4096`), once N fills their 128 columns; the 256-column form reads A half as often and wins while its tiles
# still number half the SMs or more.
WGMMA_MIN_N = 128
WGMMA_WIDE_SHARE = 0.5
# Narrower than that, x @ W of more rows (the head's 16 columns) streams too on sm_90 while its row tiles are one
# wave: a 128-column mma.sync tile would be mostly padding, and its split-K partials cost more than the streaming
# tile's one pass over the rows; in many waves of one-block-per-SM tiles the streaming tile loses (`python
# dev/forward_tiles.py --configs 128x128 stream --shapes 1024x16x256 4096x16x1024 60000x16x1024`)
NARROW_STREAM_COLUMNS = CONFIGS[contract.STREAM_CONFIG].bn
# x^T @ dy of a batch above BATCH_STREAM_ROWS on those tiles too, with its update; where its tiles are few, K splits
# over a cluster of up to MAX_CLUSTER_SPLITS CTAs (one per SM, every split WGMMA_MIN_K_TILES_PER_SPLIT k-tiles at
# least), the splits meeting in distributed shared memory (`python dev/gemm_variants.py --variants wg128 wg256
# --sizes 256 1024 --batch 4096`)
WGMMA_MIN_K_TILES_PER_SPLIT = 2
# x^T @ dy of a weight of WGMMA_PAIR_MIN_ROWS rows or more over a batch of at most WGMMA_PAIR_MAX_K: its update costs as
# much as its multiply, and the 128-column tile two CTAs an SM ("wg128x2": one's update beside the other's multiply)
# beats the one-CTA tiles, whole or split (`python dev/gemm_variants.py --variants wg128 wg128x2
# wg256 --sizes 4096 8192 --batch 1024`); so does dy @ W^T of K under one k-tile (the head's dx, K = 16) into
# PAIR_DX_MIN_COLUMNS columns or more where the 64-column tile would take more than a wave: its work is the epilogue,
# which the other CTA overlaps, where the mma.sync tile it fell to before has none beside it (`python
# dev/gemm_variants.py --variants wg128x2 128x128 --sizes 1024 4096 --batch 4096`). Into 1024 columns it is faster
# alone too, but its step is slower (the layer's update beside it: docs/history.md)
WGMMA_PAIR_CONFIG = "wg128x2"
WGMMA_PAIR_MIN_ROWS = 4096
WGMMA_PAIR_MAX_K = 1024
PAIR_DX_MIN_COLUMNS = 2048
# The update (SGD's or Adam's) of such a weight over a batch of at most PINGPONG_MAX_K rows, where its 128 x 128 tiles
# number at least PINGPONG_MIN_WAVES x SMs: the persistent ping-pong tile ("wgpp": one warpgroup's update under the
# other's multiply, fed and stored by TMA) beats wg128x2 and, over up to 2048 rows, wg256mc; over 4096 rows the
# multicast pair wins, and with fewer tiles (the head's 4096 x 16) its warpgroups have little to overlap
# (`PYTHONPATH=.:scripts python dev/pingpong/run.py --configs wgpp`; docs/history.md).
PINGPONG_CONFIG = "wgpp"
PINGPONG_MAX_K = 2048
PINGPONG_MIN_WAVES = 2
PINGPONG_EPILOGUES = ("sgd", "adam")
# The 256-column tile in pairs of CTAs along M that load B's k-tiles once for both (TMA multicast) from
# MULTICAST_MIN_K_TILES k-tiles on: a third fewer bytes from L2 per product, which bound the single tile's main loop;
# over fewer k-tiles the pair's lockstep and cluster barriers cost more than that saves (`python dev/forward_tiles.py
# --configs wg256 wg256mc --epilogue store --shapes 4096x1024x64 4096x1024x1024 4096x1024x4096 4096x4096x4096`)
MULTICAST_CONFIG = "wg256mc"
MULTICAST_MIN_K_TILES = 12
# The 64-column tile where its tiles are one wave: twice the 128-column tile's CTAs on a GEMM whose 128-column tiles
# would leave half the SMs idle (the head's dy @ W^T of K = 16 too); x^T @ dy on it, unsplit, where those tiles fill
# half the SMs or more over at most WG64_MAX_K_TILES k-tiles: it beats the 128-column tile's cluster splits, which win
# over more k-tiles by their fewer bytes per product (`python dev/gemm_variants.py --variants wg64 wg128
# --sizes 256 1024 --batch 1024`, and `--batch 4096`)
WG64_CONFIG = "wg64"
WG64_MAX_K_TILES = 16



@dataclass(frozen=True)
class GemmPlan:
    """Everything about one GEMM launch that depends on shape alone."""

    M: int
    N: int
    K: int
    layout: str
    epilogue: str
    accum: str
    config: GemmConfig
    splits: int
    k_chunk: int
    states: int = 0  # fp32 optimiser values per weight an update epilogue keeps (0 or 1: SGD's momentum; 2: Adam's)
    cluster: bool = False  # the splits meet in a cluster's shared memory (sm_90), not in a workspace
    blocks: int = 0  # the persistent and ping-pong tiles' resident grids (0 for the others: a block per tile and split)

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        if self.config.multicast > 1:
            return (self.config.multicast, 1, 1)
        return (1, 1, self.splits) if self.cluster else (1, 1, 1)

    @property
    def tiles(self) -> tuple[int, int]:
        mc = self.config.multicast  # a whole number of clusters along M (the extra tile's CTA writes nothing)
        return cdiv(cdiv(self.M, self.config.bm), mc) * mc, cdiv(self.N, self.config.bn)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.blocks, 1, 1) if self.config.persistent or self.config.pingpong else (*self.tiles, self.splits)

    @property
    def kernel(self) -> str:
        return kernel_name(self.config.name, self.layout, self.epilogue, self.accum)

    @property
    def source(self) -> str:
        return self.config.source

    @property
    def smem_bytes(self) -> int:
        """The config's, or in gemm.cu the partial tile a cluster split leaves there if that is more (BN + 8 floats
        a row; gemm_tma.cu's pipeline always holds it)."""
        pipeline = self.config.smem_bytes(self.layout, self.epilogue, self.states)
        if self.cluster and not self.config.tma:
            return max(pipeline, self.config.bm * (self.config.bn + 8) * 4)
        return pipeline

    @property
    def workspace_floats(self) -> int:
        """fp32 partial tiles the split-K fix-up needs (0 without split-K)."""
        tm, tn = self.tiles
        return self.splits * tm * tn * self.config.bm * self.config.bn if self.splits > 1 and not self.cluster else 0

    @property
    def tickets(self) -> int:
        tm, tn = self.tiles
        return tm * tn if self.splits > 1 and not self.cluster else 0

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


def choose_config(M: int, K: int, epilogue: str, layout: str = "rr", N: int = 0, arch: str = "sm_86",
                  sm_count: int = PLANNING_SM_COUNT, accum: str = "f32") -> str:
    """Which tile runs a shape (the command that measures each rule: beside its constant above).

    - weight gradient (x^T @ dy, K = batch): the staged tile, whose epilogue writes whole row pieces (its 32-row
      form for Adam: its weight and two moment tiles of 64 rows do not fit sm_86), except a plain
      store at N <= 64 and M <= 2048, where most of its 128 columns would be padding: the 32x128 tile (faster on a
      head-sized output; at larger M it loses); and a plain store of more tiles than the persistent tile's resident
      grid, which that grid walks (with fewer tiles than blocks it loses);
    - M <= 32 (x @ W and dy @ W^T at batch size): a streaming tile, one block per SM with its whole share of K in
      flight: on sm_90 with a weight of TMA_MIN_BYTES or more the tensor-copy tile, else the cp.async one (which
      also beats the 32x128 tile on small shapes, by reaching the last k-tile sooner);
    - x @ W at 33..BATCH_STREAM_ROWS rows on sm_90 with fp32 accumulation and FORWARD_WGMMA_MIN_BYTES to
      FORWARD_WGMMA_MAX_BYTES of weight: the 64-column warpgroup-MMA tile, K split over a cluster;
    - x @ W at 33..BATCH_STREAM_ROWS rows otherwise: streaming tiles too (on sm_90 the tensor-copy tile from
      TMA_MIN_BYTES_BATCH, its 128-column form from TMA128_MIN_COLUMNS, its 128-row form from ROW_TILE_MIN_BYTES
      and ROW_TILE_MIN_COLUMNS); on sm_90 at more rows too while N <= NARROW_STREAM_COLUMNS (the head) and its row
      tiles fit one wave;
    - x @ W and dy @ W^T above BATCH_STREAM_ROWS rows on sm_90 with fp32 accumulation and N >= WGMMA_MIN_N: the
      warpgroup-MMA tile, its 64-column form where that makes one wave of tiles, else dy @ W^T of K under one k-tile
      into PAIR_DX_MIN_COLUMNS or more on two CTAs an SM (the head's dx: WGMMA_PAIR_CONFIG), else (K >= 64) its
      256-column form where that still makes WGMMA_WIDE_SHARE x SMs tiles (in multicast pairs from MULTICAST_MIN_K_TILES
      k-tiles and two row tiles on), its 128-column one where not; x^T @ dy of a batch above BATCH_STREAM_ROWS too, at
      any N (with its update; the 64-column tile where that makes one wave filling half the SMs or more over at most
      WG64_MAX_K_TILES k-tiles; else K split over a cluster where its tiles are few: the head's 16 columns in a
      128-column tile still beat the mma.sync tiles' splits through the workspace; two CTAs an SM from
      WGMMA_PAIR_MIN_ROWS rows over a batch of at most WGMMA_PAIR_MAX_K; the update (SGD's, Adam's) from
      WGMMA_PAIR_MIN_ROWS rows over a batch of at most PINGPONG_MAX_K in PINGPONG_MIN_WAVES waves of 128 x 128 tiles or
      more: the persistent ping-pong tile);
    - otherwise the smallest M tile that covers the batch.
    store32 (an fp32 sum the GPUs add up) runs the tile "store" would (the same shape streams the same bytes), but
    a weight gradient (cr) the tile of one GPU's update, whose sums it then gives bit for bit (for the ping-pong
    tile's, which stores no fp32 sum, wg128x2 or wg128: the same sums)."""
    if epilogue == "store32":  # the ping-pong tile's sums are wg128's and wg128x2's (the same steps in the same order)
        if layout == "cr":
            update = choose_config(M, K, "sgd", layout, N, arch, sm_count, accum)
            if update != PINGPONG_CONFIG:
                return update
            return WGMMA_PAIR_CONFIG if K <= WGMMA_PAIR_MAX_K else "wg128"
        epilogue = "store"
    if layout == "cr" and epilogue in UPDATE_EPILOGUES + ("store",) and M > 64 and K <= 128:
        if epilogue == "store" and 0 < N <= 64 and M <= 2048:
            return "32x128"
        persist = CONFIGS["persist"]
        if epilogue == "store" and cdiv(M, persist.bm) * cdiv(N, persist.bn) > PERSIST_BLOCKS_PER_SM * sm_count:
            return "persist"
        return "staged32" if epilogue == "adam" else "staged"
    stream_rows = CONFIGS[contract.STREAM_CONFIG].bm
    narrow = 0 < N <= NARROW_STREAM_COLUMNS and cdiv(M, stream_rows) <= sm_count and has_wgmma(arch)
    batch_forward = layout == "rr" and (32 < M <= BATCH_STREAM_ROWS or M > BATCH_STREAM_ROWS and narrow)
    if (M <= 32 or batch_forward) and ("stream", layout, epilogue) in INSTANCES:
        weight = 2 * K * N
        if (batch_forward and M <= BATCH_STREAM_ROWS and has_wgmma(arch) and accum == "f32"
                and FORWARD_WGMMA_MIN_BYTES <= weight <= FORWARD_WGMMA_MAX_BYTES
                and (FORWARD_WGMMA, layout, epilogue) in INSTANCES):
            return FORWARD_WGMMA
        if sm90_or_later(arch) and ("tma", layout, epilogue) in INSTANCES:
            if (batch_forward and weight >= ROW_TILE_MIN_BYTES and N >= ROW_TILE_MIN_COLUMNS
                    and (ROW_TILE, layout, epilogue) in INSTANCES):
                return ROW_TILE
            if (batch_forward and weight >= TMA_MIN_BYTES_BATCH and N >= TMA128_MIN_COLUMNS
                    and ("tma128", layout, epilogue) in INSTANCES):
                return "tma128"
            if weight >= (TMA_MIN_BYTES_BATCH if batch_forward else TMA_MIN_BYTES):
                return "tma"
        return "stream"
    batch = K if layout == "cr" else M
    if (batch > BATCH_STREAM_ROWS and has_wgmma(arch) and accum == "f32"
            and (N >= WGMMA_MIN_N or layout == "cr")
            and ("wg128", layout, epilogue) in INSTANCES):
        if (layout == "cr" and epilogue in PINGPONG_EPILOGUES and M >= WGMMA_PAIR_MIN_ROWS and K <= PINGPONG_MAX_K
                and cdiv(M, 128) * cdiv(N, 128) >= PINGPONG_MIN_WAVES * sm_count):
            return PINGPONG_CONFIG
        if layout == "cr" and M >= WGMMA_PAIR_MIN_ROWS and K <= WGMMA_PAIR_MAX_K:
            return WGMMA_PAIR_CONFIG
        narrow_tiles = cdiv(M, 128) * cdiv(N, 64)  # the 64-column tile's
        if narrow_tiles <= sm_count and (layout != "cr" or 2 * narrow_tiles >= sm_count
                                         and cdiv(K, 64) <= WG64_MAX_K_TILES):
            return WG64_CONFIG
        if (K < 64 and layout == "rc" and N >= PAIR_DX_MIN_COLUMNS
                and (WGMMA_PAIR_CONFIG, layout, epilogue) in INSTANCES):
            return WGMMA_PAIR_CONFIG
        if K >= 64:
            if cdiv(M, 128) * cdiv(N, 256) < WGMMA_WIDE_SHARE * sm_count:
                return "wg128"
            if cdiv(K, 64) >= MULTICAST_MIN_K_TILES and M > 128 and (MULTICAST_CONFIG, layout, epilogue) in INSTANCES:
                return MULTICAST_CONFIG
            return "wg256"
    if M <= 32:
        return "32x128"
    if M <= 64:
        return "64x128"
    return "128x128"


def choose_splits(tiles: int, k_tiles: int, sm_count: int, bytes_per_k_tile: int = 0) -> int:
    """Split K until the grid has about two CTAs per SM, when each CTA would otherwise stream more than
    SPLIT_MIN_BYTES; every split keeps MIN_K_TILES_PER_SPLIT tiles and half of SPLIT_MIN_BYTES at least."""
    if k_tiles * bytes_per_k_tile < SPLIT_MIN_BYTES:
        return 1
    want = cdiv(2 * sm_count, tiles)
    most = max(1, min(k_tiles // MIN_K_TILES_PER_SPLIT, 2 * k_tiles * bytes_per_k_tile // SPLIT_MIN_BYTES))
    return max(1, min(MAX_SPLITS, want, most))


def wgmma_splits(tiles: int, k_tiles: int, sm_count: int, capacity: Sequence[int]) -> int:
    """The warpgroup-MMA tile (one CTA per SM) on few tiles: split K over a cluster while every split's CTA still
    has an SM of its own, every split WGMMA_MIN_K_TILES_PER_SPLIT k-tiles at least, and every tile's cluster is
    resident at once (capacity: cluster_capacity's, as for the streaming tiles, also one CTA per SM)."""
    return resident_splits(tiles, min(k_tiles // WGMMA_MIN_K_TILES_PER_SPLIT, sm_count // max(tiles, 1)), capacity)


def stream_splits(tiles: int, k_tiles: int, sm_count: int) -> int:
    """Streaming blocks: split K until the grid is one block per SM (never more: each block's deep pipeline
    already keeps its SM's share of DRAM bandwidth in flight), STREAM_MIN_K_TILES_PER_SPLIT tiles per split at
    least, and no split below STREAM_SPLIT_MIN_K_TILES."""
    if k_tiles < STREAM_SPLIT_MIN_K_TILES:
        return 1
    return max(1, min(MAX_SPLITS, sm_count // tiles, k_tiles // STREAM_MIN_K_TILES_PER_SPLIT))


def cluster_splits(tiles: int, k_tiles: int, capacity: Sequence[int]) -> int:
    """Streaming blocks on sm_90, splits meeting in a cluster (dev/gemm_variants.py --sweep): the fix-up is cheap
    enough that the most splits win, down to one k-tile each, as long as every tile's cluster is resident at once (a
    second wave of clusters costs more than fewer splits save); below STREAM_SPLIT_MIN_K_TILES a split still costs
    more than it saves."""
    return 1 if k_tiles < STREAM_SPLIT_MIN_K_TILES else resident_splits(tiles, k_tiles, capacity)


def resident_splits(tiles: int, most: int, capacity: Sequence[int]) -> int:
    """The most splits, up to `most` and MAX_CLUSTER_SPLITS, at which every tile's cluster is resident at once
    (capacity[s]: how many clusters of s one-block-per-SM CTAs the GPU runs at once, cluster_capacity's)."""
    for s in range(min(MAX_CLUSTER_SPLITS, most), 1, -1):
        if tiles <= capacity[s]:
            return s
    return 1


def planning_capacity(sm_count: int) -> tuple[int, ...]:
    """cluster_capacity's estimate for planning without a GPU."""
    return tuple(int(sm_count * PLANNING_CLUSTER_SHARE) // max(s, 1) for s in range(MAX_CLUSTER_SPLITS + 1))


CAPACITY_PROBE = kernel_name("stream", "rr", "store", "f32")  # the kernel cluster_capacity asks the driver about


def plan_units(plans: list["GemmPlan | None"], arch: str) -> set:
    """The units of compilation that launches of these plans need (compiler.unit_of), with the capacity probe on
    GPUs that plan cluster splits."""
    units = {unit_of(p.source, p.kernel) for p in plans if p is not None}
    return units | ({unit_of(SOURCE, CAPACITY_PROBE)} if sm90_or_later(arch) else set())


def cluster_capacity(k: Kernels) -> tuple[int, ...]:
    """capacity[s]: how many clusters of s streaming blocks (one per SM) this GPU runs at once, s <= MAX_CLUSTER_SPLITS
    (cuOccupancyMaxActiveClusters; asked once per Kernels). Empty below sm_90."""
    if not sm90_or_later(k.arch):
        return ()
    if "cluster_capacity" not in k.facts:
        cfg = config_for("stream", k.arch)
        kernel = k.get(SOURCE, CAPACITY_PROBE)
        k.facts["cluster_capacity"] = (0, 0) + tuple(kernel.max_active_clusters(s, cfg.threads, cfg.smem_bytes("rr"))
                                                     for s in range(2, MAX_CLUSTER_SPLITS + 1))
    return k.facts["cluster_capacity"]


def plan_gemm(M: int, N: int, K: int, layout: str = "rr", epilogue: str = "store", accum: str = "f32",
              sm_count: int = PLANNING_SM_COUNT, splits: Optional[int] = None, config: Optional[str] = None,
              arch: str = "sm_86", states: int = 0, cluster: Optional[bool] = None,
              capacity: Optional[Sequence[int]] = None) -> GemmPlan:
    """Choose the instance, grid and split-K for C[M,N] = A[M,K] @ B[K,N]. Deterministic in its inputs.
    arch sets the streaming pipeline's depth; states, the fp32 optimiser values per weight the update epilogue keeps
    (sgd: 0, or 1 with momentum; adam: 2), which a staged update holds tiles of;
    cluster, how splits meet (default on sm_90: in a cluster's shared memory when every cluster is resident at once,
    by `capacity`, cluster_capacity's answer; planning_capacity's estimate if None)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if accum not in ("f32", "f16"):
        raise ValueError(f"accum must be 'f32' or 'f16', got {accum!r}")
    if min(M, N, K) < 1:
        raise ValueError(f"GEMM sizes must be positive, got M={M} N={N} K={K}")
    contiguous = {"A": K if layout[0] == "r" else M, "B": N if layout[1] == "r" else K, "C": N}
    for operand, extent in contiguous.items():
        if extent % 8:
            raise ValueError(f"GEMM {operand}'s contiguous dimension is {extent}: it must be a multiple of 8 "
                             "(pad it; see docs/design.md)")
    allowed = {"sgd": (0, 1), "adam": (2,)}.get(epilogue, (0,))
    if states not in allowed:
        raise ValueError(f"the {epilogue} epilogue keeps {' or '.join(map(str, allowed))} optimiser states, not {states}")
    name = config or choose_config(M, K, epilogue, layout, N, arch, sm_count, accum)
    if name not in CONFIGS:
        raise ValueError(f"unknown GEMM config {name!r}; known: {sorted(CONFIGS)}")
    if (name, layout, epilogue) not in INSTANCES:
        raise ValueError(f"no compiled GEMM instance for config {name}, layout {layout}, epilogue {epilogue}")
    cfg = config_for(name, arch)
    if cfg.tma and not sm90_or_later(arch):
        raise ValueError(f"GEMM config {name} needs the tensor copy engine of sm_90 or later, not {arch}")
    k_tiles = cdiv(K, cfg.bk)
    tiles = cdiv(M, cfg.bm) * cdiv(N, cfg.bn)
    bytes_per_k_tile = (cfg.bm + cfg.bn) * cfg.bk * 2
    room = tuple(capacity) if capacity else planning_capacity(sm_count)
    clusters = sm90_or_later(arch) and cluster is not False and not cfg.staged
    if cfg.wgmma and not has_wgmma(arch):
        raise ValueError(f"GEMM config {name} needs the warpgroup MMA of sm_90, not {arch}")
    if splits is not None:
        s = int(splits)
    elif cfg.split_k == layout and cluster is not False:  # its splits meet only in a cluster
        s = wgmma_splits(tiles, k_tiles, sm_count, room)
    elif cfg.persistent or cfg.wgmma:
        s = 1
    elif cfg.tma and cfg.bm > 32:
        s = stream_splits(tiles, k_tiles, sm_count)  # the row tiles: one block per SM (dev/forward_tiles.py)
    elif (name == "stream" or cfg.tma) and clusters:
        # the tensor-copy tile streams best unsplit from an eighth of the SMs on (`python dev/gemm_variants.py
        # --sweep`), but in two splits while its tiles are a quarter of the SMs or fewer and K is long (`python
        # dev/forward_tiles.py --batch 32 --configs tma --splits 1 2 4 --shapes 32x2048x8192 32x4096x4096`)
        if name == "stream" or 8 * tiles <= sm_count:
            s = cluster_splits(tiles, k_tiles, room)
        else:
            s = 2 if 4 * tiles <= sm_count and k_tiles > LONG_K_TILES else 1
        wide = stream_splits(tiles, k_tiles, sm_count)
        if s > 1 and wide > MAX_CLUSTER_SPLITS and k_tiles > LONG_K_TILES:
            s = wide  # a few tiles of long K: more splits through the workspace beat 8 in a cluster
    elif name == "stream" or cfg.tma:
        s = stream_splits(tiles, k_tiles, sm_count)
    else:
        s = choose_splits(tiles, k_tiles, sm_count, bytes_per_k_tile)
    if not 1 <= s <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {s}")
    if (cfg.persistent or cfg.pingpong) and s != 1:
        raise ValueError(f"GEMM config {name} runs whole tiles: it takes no split-K (asked for {s} splits)")
    if cfg.wgmma and s > 1 and (layout != cfg.split_k or s > MAX_CLUSTER_SPLITS or cluster is False):
        product = {"cr": "x^T @ dy", "rr": "x @ W"}
        split_k = ", ".join(f"{c.name}'s {product[c.split_k]} ({c.split_k})" for c in CONFIGS.values() if c.split_k)
        raise ValueError(f"the warpgroup-MMA tiles split K only as {split_k}, in a cluster of at most "
                         f"{MAX_CLUSTER_SPLITS} (asked: {s} splits, config {name}, layout {layout}"
                         + (", no cluster)" if cluster is False else ")"))
    k_chunk = cdiv(k_tiles, s) * cfg.bk
    s = cdiv(K, k_chunk)  # no empty splits
    clusters_ok = sm90_or_later(arch) and s <= MAX_CLUSTER_SPLITS and not cfg.staged
    if cluster and s > 1 and not clusters_ok:
        raise ValueError(f"split-K within a cluster needs sm_90 or later, at most {MAX_CLUSTER_SPLITS} splits and a "
                         f"tile without the staged epilogue (here {arch}, {s} splits, config {name})")
    if cluster is not None:
        in_cluster = bool(cluster) and s > 1
    else:  # the warpgroup-MMA tile's splits meet only in a cluster
        in_cluster = s > 1 and clusters_ok and (cfg.wgmma or tiles <= room[s])
    blocks = (min(tiles, PERSIST_BLOCKS_PER_SM * sm_count) if cfg.persistent
              else min(tiles, sm_count) if cfg.pingpong else 0)
    return GemmPlan(M, N, K, layout, epilogue, accum, cfg, s, k_chunk, states, in_cluster, blocks)


def _check_matrix(t: "Tensor", rows: int, cols: int, what: str) -> int:
    """A 2-D fp16 buffer holding a rows x cols matrix (row stride = its second dimension); returns the stride."""
    require(t, np.float16, what=what)
    if len(t.shape) != 2 or t.shape[0] < rows or t.shape[1] < cols:
        raise ValueError(f"{what}: buffer {t.name} of shape {t.shape} cannot hold a {rows} x {cols} matrix")
    if t.shape[1] % 8:
        raise ValueError(f"{what}: row stride {t.shape[1]} of {t.name} must be a multiple of 8")
    return t.shape[1]


def gemm(k: Kernels, plan: GemmPlan, A: "Tensor", B: "Tensor", out: "Tensor", *, bias: "Tensor | None" = None,
         act: "Tensor | None" = None, mom: "Tensor | None" = None, var: "Tensor | None" = None,
         w16: "Tensor | None" = None, optim: "Tensor | None" = None, workspace: "Tensor | None" = None,
         tickets: "Tensor | None" = None, keep_b: float = 0.0) -> "Launch":
    """Bind `plan` to its operands. Row-major A is [M, lda], column-major A is stored as [K, lda] (A^T rows).
    The update epilogues (sgd, adam): `out` is the master's low half, w16 its high half, optim the optimiser table
    (contract.Optim), mom and var its state (as many as the plan's `states`: momentum, or Adam's two moments).
    store32: `out` is fp32, the others' fp16. act: what dact scales by (the value the forward saved for the
    activation's derivative), or where bias_act keeps act'(z) (training, where the backward reads it).
    keep_b: the L2 policy of B's reads (kernels/l2.py), taken by the tensor-copy tile; the others read normally."""
    p = plan
    lda = _check_matrix(A, p.M, p.K, "A") if p.layout[0] == "r" else _check_matrix(A, p.K, p.M, "A (column-major)")
    ldb = _check_matrix(B, p.K, p.N, "B") if p.layout[1] == "r" else _check_matrix(B, p.N, p.K, "B (column-major)")
    if p.epilogue in UPDATE_EPILOGUES:
        require(out, np.int16, what="the master's low half (update output)")
        if w16 is None or optim is None:
            raise ValueError("the update epilogue needs w16 (the master's high half) and optim (the optimiser table)")
        require(w16, np.float16, out.shape, "w16")
        require(optim, np.float32, (OPTIM_WORDS,), "optim")
        given = [t for t in (mom, var) if t is not None]
        if len(given) != p.states or (var is not None and mom is None):
            raise ValueError(f"this plan was made for {p.states} optimiser states: pass mom{' and var' * (p.states > 1)}"
                             " exactly" if p.states else "this plan was made for plain SGD: pass no mom or var")
        for t in given:
            require(t, np.float32, out.shape, "optimiser state")
    elif p.epilogue == "store32":
        require(out, np.float32, what="C (store32: an fp32 partial sum)")
    else:
        require(out, np.float16, what="C")
    if len(out.shape) != 2 or out.shape[0] < p.M or out.shape[1] < p.N or out.shape[1] % 8:
        raise ValueError(f"output {out.name} of shape {out.shape} cannot hold {p.M} x {p.N} (stride multiple of 8)")
    # the warpgroup-MMA epilogues write (and dact reads) whole 16-byte pieces of a row; the ping-pong tile's copy
    # engine reads and writes the update's arrays from 16-byte aligned starts
    for t in (out, act) + ((w16, mom, var) if p.config.pingpong else ()):
        if t is not None and t.offset % 16:
            raise ValueError(f"{t.name} starts {t.offset} bytes into the arena: it must be 16-byte aligned")
    if p.epilogue in ("bias", "bias_act"):
        if bias is None or bias.dtype != np.float32 or bias.size < p.N:
            raise ValueError(f"epilogue {p.epilogue} needs an fp32 bias of at least {p.N} values")
    ld_act = 0
    if p.epilogue == "dact":
        if act is None:
            raise ValueError("the dact epilogue needs the saved activation")
        ld_act = _check_matrix(act, p.M, p.N, "act")
    elif act is not None:  # where bias_act keeps act'(z) for the backward
        if p.epilogue != "bias_act":
            raise ValueError(f"the {p.epilogue} epilogue takes no act")
        ld_act = _check_matrix(act, p.M, p.N, "act (the slope act'(z))")
    require_split_scratch(1 if p.cluster else p.splits, workspace, tickets, p.workspace_floats, p.tickets,
                          f"split-K x{p.splits}")
    ptr = lambda t: 0 if t is None else t  # noqa: E731 - a null pointer for unused operands
    if p.config.tma:
        maps = _update_maps(p, out, w16, mom, var) if p.config.pingpong else ()
        return _bind_tma(k, p, A, B, out, lda, ldb, (ptr(bias), ptr(act), ld_act, ptr(mom), ptr(var), ptr(w16),
                                                     ptr(optim), ptr(workspace), ptr(tickets)), keep_b, maps)
    kernel = k.get(SOURCE, p.kernel)
    return kernel.bind(p.grid, p.config.threads, p.smem_bytes,
                       A, B, out, p.M, p.N, p.K, lda, ldb, out.shape[1], p.k_chunk,
                       ptr(bias), ptr(act), ld_act, ptr(mom), ptr(var), ptr(w16), ptr(optim),
                       ptr(workspace), ptr(tickets), cluster=p.cluster_dims)


def _update_maps(p: GemmPlan, out: "Tensor", w16: "Tensor", mom: "Tensor | None", var: "Tensor | None") -> tuple:
    """The ping-pong tile's maps of the update's arrays (w16, lo, the states; a state it does not keep: w16's map,
    unread): 64 x 64 boxes of 128-byte swizzled rows, an fp32 state's as pairs of 16-bit elements (32 floats a box:
    the copy engine moves bytes)."""
    from ..runtime.driver import tensor_map_2d

    ld = out.shape[1]
    half = tensor_map_2d(w16.ptr, p.N, p.M, 2 * ld, 64, 64)
    states = [half if t is None else tensor_map_2d(t.ptr, 2 * p.N, p.M, 4 * ld, 64, 64) for t in (mom, var)]
    return (half, tensor_map_2d(out.ptr, p.N, p.M, 2 * ld, 64, 64), *states)


def _bind_tma(k: Kernels, p: GemmPlan, A: "Tensor", B: "Tensor", out: "Tensor", lda: int, ldb: int, rest: tuple,
              keep_b: float, maps: tuple = ()) -> "Launch":
    """The tensor-copy instances take tensor maps of A and B (boxes of 64 along the contiguous dimension, one
    128-byte swizzled row each) in place of pointers and strides; the maps hold the matrices' true extents, so the
    copy engine zero-fills the edges. rest: the pointers and ld_act every GEMM takes, in GEMM_TMA_PARAMS' order;
    maps: the ping-pong tile's maps of the update's arrays (_update_maps), after them."""
    from ..runtime.driver import tensor_map_2d

    cfg = p.config
    if p.layout[0] == "r":  # [M, K]: BM rows of 64 k
        map_a = tensor_map_2d(A.ptr, p.K, p.M, 2 * lda, cfg.bk, cfg.bm)
    else:                   # [K, M] (the warpgroup-MMA tiles alone): 64-column panels of 64 k-rows
        map_a = tensor_map_2d(A.ptr, p.M, p.K, 2 * lda, 64, cfg.bk)
    if p.layout[1] == "r":  # [K, N]: 64-column panels of 64 k-rows
        map_b = tensor_map_2d(B.ptr, p.N, p.K, 2 * ldb, 64, cfg.bk)
    else:                   # [N, K]: BN rows of 64 k (a multicast pair's CTAs copy BN / 2 each)
        map_b = tensor_map_2d(B.ptr, p.K, p.N, 2 * ldb, cfg.bk, cfg.bn // cfg.multicast)
    kernel = k.get(p.source, p.kernel)  # gemm_tma.cu's or gemm_wgmma.cu's: the same parameters (+ the update's maps)
    return kernel.bind(p.grid, cfg.threads, p.smem_bytes, map_a, map_b, out, p.M, p.N, p.K, out.shape[1],
                       p.k_chunk, *rest, float(keep_b), *maps, cluster=p.cluster_dims)
