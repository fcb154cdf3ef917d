"""Launcher for cu/cluster_step.cu: training steps by one thread-block cluster whose shared memory holds the model.

`plan` lays out one CTA's shared memory (plain Python, tested on CPU) and says whether the model fits;
`unsupported_reason` says when the cluster step cannot run a recipe; `param_table` packs the CsParams table the
kernel reads (every field 8 bytes, in the order of the C struct); `cluster_steps` binds the launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import Kernels

if TYPE_CHECKING:
    from ..driver import Launch
    from ..memory import Tensor

SOURCE = "cluster_step.cu"
TILE_COUNTS = (1, 2, 4)  # kernel instances cluster_steps_<NT>: NT 8-column tiles per CTA at most
SIGNATURE = "pi"
THREADS = 256  # CS_THREADS
ROWS = 32  # CS_ROWS: the largest batch
INPUTS = 784
X_LD = 792  # CS_X_LD (halves)
HEAD_LD = 20  # CS_HEAD_LD
DLOGIT_LD = 24  # CS_DLOGIT_LD
MAX_LINEAR = 9  # CS_MAX_LINEAR: 8 hidden layers and the head
MAX_COLUMNS = 32  # 8 x CS_NT_MAX columns per CTA
CTAS = 16  # the cluster: sm_90 runs up to 16 CTAs in one (a non-portable size, opted into at launch)
SHARED_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block
HEADER_FIELDS = 28  # CsParams before layer[]: 7 pointers, 18 int64, 3 doubles
LAYER_FIELDS = 8  # CsLayer: wlo, w16, b, in_p, out_p, rows, w_off, b_off
PARAM_BYTES = 1024  # room for the table's static copy in shared memory (808 B; ptxas reports 896)
SCHEDULE_KINDS = {"constant": 0, "cosine": 1, "linear": 2}
ALIGN = 128


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


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
        return f"cluster_steps_{next(t for t in TILE_COUNTS if 8 * t >= self.n)}"

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
    n = _pad8(-(-_pad8(hidden) // ctas))
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
    w_off = tuple(take(f"w{i}", r * (n + 4) * 4) for i, r in enumerate(rows[:-1])) + (take("head", hs * HEAD_LD * 4),)
    b_off = tuple(take(f"b{i}", n * 4) for i in range(layers)) + (take("head_bias", 16 * 4),)
    take("act", (layers + 1) * ROWS * (hs + 8) * 2)  # h_0 alternates by step parity
    take("raw", ROWS * INPUTS)
    take("x", ROWS * X_LD * 2)
    take("dy", 2 * ROWS * (n + 8) * 2)  # alternates by layer parity
    take("dlogits", ROWS * DLOGIT_LD * 2)
    take("rs", min(2, layers - 1) * ctas * ROWS * n * 4 if layers > 1 else 0)
    take("scratch", max(8 * ROWS * n, 4 * ROWS * 16) * 4)  # warps' partial sums: a forward's, the head's
    take("misc", 3 * ROWS * 4)  # labels, per-row loss and hit
    return ClusterPlan(ctas, n, hs, w_off, b_off, rows, regions, end)


def unsupported_reason(recipe, arch: str) -> str | None:
    """Why the cluster step cannot run this recipe on this arch; None when it can."""
    if int(arch.removeprefix("sm_")) < 90:
        return f"the cluster step needs thread-block clusters (sm_90 or newer), this GPU is {arch}"
    if recipe.batch > ROWS:
        return f"the cluster step takes batches of at most {ROWS}, got {recipe.batch}"
    if recipe.momentum > 0:
        return "the cluster step runs plain SGD (momentum 0)"
    if recipe.accum != "fp32":
        return "the cluster step accumulates in fp32 only"
    try:
        p = plan(recipe.hidden, recipe.layers)
    except ValueError as exc:
        return str(exc)
    if p.smem_bytes + PARAM_BYTES > SHARED_LIMIT:
        return (f"the model does not fit in the shared memory of {CTAS} SMs: {p.smem_bytes // 1024} KB per SM, "
                f"{(SHARED_LIMIT - PARAM_BYTES) // 1024} KB available")
    return None


def param_table(model, p: ClusterPlan, profile: int = 0) -> np.ndarray:
    """The CsParams bytes for an allocated MLP (pointers are device addresses), as uint64 words. profile: a device
    buffer for timestamps (a kernel built with -DCS_PROFILE writes 1 + steps x len(marks(layers)) of them), or 0."""
    r = model.recipe
    from ..mlp import CLASSES, loss_scale

    scale = loss_scale(r.batch)
    f32 = np.float32
    doubles = [float(f32(r.lr / scale)), float(f32(r.lr_min / scale)), float(f32(scale / r.batch))]
    o = p.offsets
    words = [model.images.ptr, model.labels.ptr, model.perm.ptr, model.step.ptr, model.loss_sum.ptr,
             model.correct.ptr, profile, r.batch, r.steps_per_epoch, len(model.layers), SCHEDULE_KINDS[r.schedule],
             r.total_steps, r.warmup_steps, CLASSES, p.hs, p.n, o["act"], o["raw"], o["x"], o["dy"], o["dlogits"],
             o["rs"], o["scratch"], o["misc"], p.smem_bytes]
    words += [int(np.float64(d).view(np.uint64)) for d in doubles]
    assert len(words) == HEADER_FIELDS
    for i, lay in enumerate(model.layers):
        words += [lay.wlo.ptr, lay.w16.ptr, lay.b.ptr, lay.wlo.shape[0], lay.wlo.shape[1], p.rows[i], p.w_off[i],
                  p.b_off[i]]
    return np.array([w & (2**64 - 1) for w in words], dtype=np.uint64)


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


def marks(layers: int) -> list[str]:
    """What each CS_PROFILE timestamp of a step closes (the time since the previous one), in kernel order."""
    out = []
    for i in range(layers):
        out += [f"forward {i}" + (" (+ convert, gather)" if i == 0 else "") + " + stores", f"receive h{i}"]
    out += ["head loss", "head dy"]
    for i in range(layers - 1, 0, -1):
        out += [f"partial dx {i}", f"update {i}" + (" + head" if i == layers - 1 else ""), "receive partials",
                f"collect dy {i - 1}"]
    out.append("update 0" + (" + head" if layers == 1 else ""))
    return out


def table_words(layers: int) -> int:
    return HEADER_FIELDS + LAYER_FIELDS * layers


def check_schedulable(k: Kernels, p: ClusterPlan) -> None:
    """A clear error when this GPU cannot co-schedule the cluster (the launch itself would fail less clearly)."""
    from ..errors import RawgpuError

    kernel = k.get(SOURCE, p.kernel, SIGNATURE)
    if kernel.max_active_clusters(p.ctas, THREADS, p.smem_bytes) < 1:
        raise RawgpuError(f"this GPU cannot run a cluster of {p.ctas} CTAs with {p.smem_bytes // 1024} KB of shared "
                          "memory each; use --kernels fused")


def cluster_steps(k: Kernels, table: "Tensor", p: ClusterPlan, n_steps: int) -> "Launch":
    """n_steps training steps in one launch of one cluster."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    kernel = k.get(SOURCE, p.kernel, SIGNATURE)
    return kernel.bind(p.ctas, THREADS, p.smem_bytes, table, n_steps, cluster=p.ctas)
