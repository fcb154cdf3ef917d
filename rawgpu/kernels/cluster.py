"""Launcher for cu/cluster_step.cu: training steps by one thread-block cluster whose shared memory holds the model.

`plan` lays out one CTA's shared memory (plain Python, tested on CPU) and says whether the model fits;
`cluster_steps` binds the launch. The kernel's sizes, the layout's strides and widths, and its CsParams table are
declared once in contract/cluster.py, which the kernel is built with too. When the step runs and what goes into its
table: steps/cluster.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from .. import contract
from ..contract import (CS_ACT_PAD, CS_CLASSES, CS_DLOGIT_LD, CS_DY_PAD, CS_HEAD_GROUPS, CS_HEAD_LD, CS_MISC, CS_W_PAD,
                        CS_WARPS, CS_X_LD)
from ..contract.shapes import pad8

if TYPE_CHECKING:
    from ..runtime.driver import Launch
    from . import Kernels
    from ..runtime.memory import Tensor

SOURCE = "cluster_step.cu"
TILE_COUNTS = contract.CS_TILE_COUNTS  # kernel instances cluster_steps_<NT>: NT 8-column tiles per CTA at most
THREADS = contract.CS_THREADS
ROWS = contract.CS_ROWS  # the largest batch
INPUTS = contract.CS_INPUTS
MAX_LINEAR = contract.CS_MAX_LINEAR  # 8 hidden layers and the head
MAX_COLUMNS = contract.CS_MAX_COLUMNS
CTAS = 16  # the cluster: sm_90 runs up to 16 CTAs in one (a non-portable size, opted into at launch)
SHARED_LIMIT = contract.block_smem_limit("sm_90")  # the kernel runs on sm_90 only
PARAM_BYTES = 1024  # room for the kernel's static shared memory, its copy of the table (tests check ptxas's report)
ALIGN = contract.CS_ALIGN


@dataclass(frozen=True)
class ClusterPlan:
    """One CTA's shared-memory layout (byte offsets) for a model, and its share of the columns."""

    ctas: int
    n: int  # columns of every hidden layer per CTA
    hs: int  # hidden width padded to ctas x n
    w_off: tuple[int, ...]  # per linear layer (the last: the head replica)
    b_off: tuple[int, ...]
    rows: tuple[int, ...]  # rows held per linear layer
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (offset, bytes), for tests/docs
    smem_bytes: int = 0

    @property
    def kernel(self) -> str:
        """The instance sized for this plan: the fewest 8-column tiles that hold n columns."""
        return contract.cluster_kernel_name(next(t for t in TILE_COUNTS if 8 * t >= self.n))

    @property
    def offsets(self) -> dict[str, int]:
        return {name: off for name, (off, _) in self.regions.items()}


def plan(hidden: int, layers: int, ctas: int = CTAS) -> ClusterPlan:
    """The layout for `layers` hidden layers of width `hidden` over `ctas` CTAs (ValueError if the shape has no
    layout at all; whether it fits is `plan.smem_bytes <= SHARED_LIMIT`)."""
    if not 2 <= ctas <= 16:
        raise ValueError(f"a cluster holds 2..16 CTAs, got {ctas}")
    if layers < 1 or layers + 1 > MAX_LINEAR:
        raise ValueError(f"the cluster step takes 1..{MAX_LINEAR - 1} hidden layers, got {layers}")
    n = pad8(-(-pad8(hidden) // ctas))
    if n > MAX_COLUMNS:
        raise ValueError(f"hidden {hidden} needs {n} columns per CTA over {ctas} CTAs; the kernel takes {MAX_COLUMNS}")
    hs = n * ctas
    regions: dict[str, tuple[int, int]] = {}
    end = 0

    def take(name: str, nbytes: int) -> int:
        nonlocal end
        off = end
        regions[name] = (off, nbytes)
        end = -(-(off + nbytes) // ALIGN) * ALIGN
        return off

    rows = tuple([INPUTS] + [hs] * (layers - 1) + [hs])
    w_off = (tuple(take(f"w{i}", r * (n + CS_W_PAD) * 4) for i, r in enumerate(rows[:-1]))
             + (take("head", hs * CS_HEAD_LD * 4),))
    b_off = tuple(take(f"b{i}", n * 4) for i in range(layers)) + (take("head_bias", CS_CLASSES * 4),)
    take("act", (layers + 1) * ROWS * (hs + CS_ACT_PAD) * 2)  # h_0 alternates by step parity
    take("raw", ROWS * INPUTS)
    take("x", ROWS * CS_X_LD * 2)
    take("dy", 2 * ROWS * (n + CS_DY_PAD) * 2)  # alternates by layer parity
    take("dlogits", ROWS * CS_DLOGIT_LD * 2)
    take("rs", min(2, layers - 1) * ctas * ROWS * n * 4 if layers > 1 else 0)
    # the warps' partial sums: a forward's (a K-group per warp), the head's
    take("scratch", max(CS_WARPS * ROWS * n, CS_HEAD_GROUPS * ROWS * CS_CLASSES) * 4)
    take("misc", len(CS_MISC) * ROWS * 4)
    return ClusterPlan(ctas, n, hs, w_off, b_off, rows, regions, end)


def phases(layers: int) -> list[tuple[str, str]]:
    """(phase, what ends it) for one step with `layers` hidden layers, as the kernel runs them (tests, inspect_graph).
    A receive waits on the CTA's own mbarrier for the bytes the other CTAs stored into it."""
    out = [(f"forward {i}: " + ("convert the batch, " if i == 0 else "") + f"h{i} slice into every CTA's copy",
            f"receive h{i}") for i in range(layers)]
    out.append(("head (every CTA): logits, softmax cross-entropy, dy of the top layer", "-"))
    for i in range(layers - 1, 0, -1):
        out.append((f"backward {i}: partial dx to owners; update{' + head' if i == layers - 1 else ''}",
                    f"receive partials of dx{i - 1}"))
        out.append((f"backward {i - 1}: sum partials", "-"))
    out.append((f"backward 0: update{' + head' if layers == 1 else ''}", "- (next step)"))
    return out


def table_words(layers: int) -> int:
    """8-byte words of a CsParams table for `layers` linear layers (the kernel reads no layer past those)."""
    return len(contract.table_bytes(contract.CsParams(), layers)) // 8


def check_schedulable(k: Kernels, p: ClusterPlan) -> None:
    """A clear error when this GPU cannot co-schedule the cluster (the launch itself would fail less clearly)."""
    from ..runtime.errors import RawgpuError

    kernel = k.get(SOURCE, p.kernel)
    if kernel.max_active_clusters(p.ctas, THREADS, p.smem_bytes) < 1:
        raise RawgpuError(f"this GPU cannot run a cluster of {p.ctas} CTAs with {p.smem_bytes // 1024} KB of shared "
                          "memory each; use --step fused")


def cluster_steps(k: Kernels, table: "Tensor", p: ClusterPlan, n_steps: int) -> "Launch":
    """n_steps training steps in one launch of one cluster."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    kernel = k.get(SOURCE, p.kernel)
    return kernel.bind(p.ctas, THREADS, p.smem_bytes, table, n_steps, cluster=p.ctas)
