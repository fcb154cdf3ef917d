"""Which weight reads and writes of the layered step should stay in L2 (cache policies, ptx/l2.cuh).

Why: at large H the step streams every weight from DRAM, yet some of those streams read bytes that were in L2 a
moment before. The forward reads W16 of layers 1, 2, ..., the backward of the top layers (one pass over each
weight: dx_sgd, or dx_update with an optimiser's state) comes right after it and reads W16 again, top down. And the
backward writes W16 of the lower layers last, just before the next step's forward reads them. So two kinds of gaps:
  A: layer l's forward -> its backward: short for the top layers (only the layers above run in between);
  B: layer l's backward writes W16 -> the next forward reads it: short for the low layers.
Set A holds the top layers (head down) and set B the low ones (bottom up), each as many as `budget` of the L2
holds, the last one in part (a fraction of its lines). Kept lines are marked evict-last by the access that opens
the gap; every other weight access of those layers is marked evict-first, so the bytes streamed past in between
push out each other, not the kept ones. At any moment the kept lines are at most one set's bytes: A's layers are
all above B's whenever both are partial, and a forward releases B's lines as it reads them.

A plan gives, per layer, one `keep` value for its forward's weight reads and three for its one-pass backward
(reading both halves, writing W16, writing lo and the optimiser's state); ptx/l2.cuh says what a value means (> 0:
that fraction kept, 0: normal, < 0: evict first). The backward reads normally: marked evict-first they were slower.
Layers whose backward is not one pass read and write normally, and so does every layer when less than MIN_KEEP of
the top one fits. The hints pay at large widths and change nothing where the weights stay in L2 anyway
(`python dev/step_variants.py --l2-budgets 0 0.3 0.9 --sizes 4096 8192`). Plain Python, tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

NORMAL, FIRST = 0.0, -1.0
DEFAULT_BUDGET = 0.6  # of the L2's bytes, for one kept set at a time (dev/step_variants.py --l2-budgets compares)
MIN_KEEP = 0.5  # below this share of the top layer kept, the hints cost more than they save


@dataclass(frozen=True)
class LayerPolicy:
    forward: float = NORMAL  # the forward GEMM's weight (W16) reads
    read: float = NORMAL     # the one-pass backward: both halves read
    hi: float = NORMAL       # the one-pass backward: W16 written
    lo: float = NORMAL       # the one-pass backward: lo (and the optimiser's state) written


def _greedy(order: Sequence[int], sizes: Sequence[int], room: float) -> dict[int, float]:
    """Layer -> the fraction of its W16 kept, taking layers in `order` while `room` bytes last."""
    kept = {}
    for i in order:
        if room <= 0:
            break
        kept[i] = min(1.0, room / sizes[i])
        room -= sizes[i]
    return kept


def plan_l2(w16_bytes: Sequence[int], one_pass: Sequence[bool], l2_bytes: int,
            budget: float = DEFAULT_BUDGET) -> list[LayerPolicy]:
    """Policies for layers with these W16 sizes, where one_pass[i] says layer i's backward is one pass. budget: the
    share of L2 each set may fill; 0 plans no hints at all."""
    if len(w16_bytes) != len(one_pass):
        raise ValueError("one size and one backward kind per layer")
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"the L2 budget is a fraction of the cache, 0..1, got {budget}")
    fused = [i for i, f in enumerate(one_pass) if f]
    if budget == 0.0 or not fused or l2_bytes <= 0:
        return [LayerPolicy() for _ in w16_bytes]
    room = budget * l2_bytes
    a = _greedy(fused[::-1], w16_bytes, room)  # forward -> backward, from the top
    b = _greedy(fused, w16_bytes, room)        # backward -> next forward, from the bottom
    if a[fused[-1]] < MIN_KEEP:
        return [LayerPolicy() for _ in w16_bytes]
    return [LayerPolicy(forward=a.get(i, FIRST), read=NORMAL, hi=b.get(i, FIRST), lo=FIRST) if i in fused
            else LayerPolicy() for i in range(len(w16_bytes))]
