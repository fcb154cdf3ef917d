"""Experiment: the head's forward GEMM and softmax_xent (two launches of the layered step's long form before
logits_xent) against the one kernel doing both (cu/loss.cu's logits_xent), at up to 16 classes.

    PYTHONPATH=.:scripts python dev/logits_xent/run.py [--batch B ...] [--inputs K ...] [--classes C ...]
                                                       [--repeats N] [--trials T]

For each shape: first both ways once on the same fresh random h, W, bias and labels (outputs poisoned first), each
checked against float64 (the logits against h @ W + b; the loss, hits and dlogits against float64 softmax of each
way's own fp16 logits), and the two ways' logits compared; then each timed as bench.py times (CUDA events around
graph replays of N steps' launches in a chain, overlapping on sm_90 as the step launches them, medians of T). What
the pair costs in the chain against the one kernel is what fusing would take off the step. Not part of the product
(dev/README.md); its numbers go to docs/perf.md.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.timing import time_graph
from rawgpu.kernels import Kernels
from rawgpu.kernels import gemm as kg
from rawgpu.kernels import loss as kl
from rawgpu.model.recipe import loss_scale
from rawgpu.runtime import driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

COLS = kl.LX_CLASSES


def reference(h: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return h.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)


def softmax_reference(z16: np.ndarray, labels: np.ndarray, classes: int, inv: float):
    """Loss sum, hits and dlogits [B, COLS] in float64 from the fp16 logits a way wrote."""
    z = z16[:, :classes].astype(np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    rows = np.arange(len(z))
    loss = float(np.sum(np.log(e.sum(axis=1)) - (z[rows, labels] - z.max(axis=1))))
    hits = int(np.sum(np.argmax(z, axis=1) == labels))
    d = np.zeros((len(z), COLS))
    d[:, :classes] = p
    d[rows, labels] -= 1.0
    return loss, hits, d * inv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[300, 1024, 4096])
    ap.add_argument("--inputs", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--classes", type=int, nargs="+", default=[2, 10])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args(argv)
    if any(k % 8 for k in args.inputs) or not all(2 <= c <= COLS for c in args.classes):
        print(f"logits_xent: inputs must be multiples of 8 and classes 2..{COLS}", file=sys.stderr)
        return 1
    return run_cli(lambda: run(args), "logits_xent")


def run(args: argparse.Namespace) -> int:
    device = driver.Device(0)
    kernels, stream, rng = Kernels(device.arch), driver.Stream(), np.random.default_rng(0)
    overlap = kg.sm90_or_later(device.arch)
    print(f"{device.name} ({device.arch}): us per step's head forward and loss, a chain of {args.repeats} steps")
    failed = False
    for B in args.batch:
        for K in args.inputs:
            for classes in args.classes:
                failed |= not run_shape(device, kernels, stream, rng, overlap, B, K, classes, args)
    return 1 if failed else 0


def run_shape(device, kernels, stream, rng, overlap, B, K, classes, args) -> bool:
    plan = kg.plan_gemm(B, COLS, K, "rr", "bias", "f32", sm_count=device.sm_count, arch=device.arch,
                        capacity=kg.cluster_capacity(kernels))
    scale = loss_scale(B)
    with Arena() as arena:
        h = arena.tensor("h", (B, K), np.float16)
        w = arena.tensor("w", (K, COLS), np.float16)
        bias = arena.tensor("bias", (COLS,), np.float32)
        labels = arena.tensor("labels", (B,), np.int32)
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        ways = {}
        for name in ("pair", "fused"):
            ways[name] = dict(logits=arena.tensor(f"logits_{name}", (B, COLS), np.float16),
                              dlogits=arena.tensor(f"dlogits_{name}", (B, COLS), np.float16),
                              loss=arena.tensor(f"loss_{name}", (1,), np.float64),
                              correct=arena.tensor(f"correct_{name}", (1,), np.int32),
                              sums=arena.tensor(f"sums_{name}", (2,), np.int64),
                              ticket=arena.tensor(f"ticket_{name}", (1,), np.int32))
        arena.allocate()
        arena.zero()
        h16 = (rng.standard_normal((B, K)) * 0.5).astype(np.float16)
        w16 = np.zeros((K, COLS), np.float16)
        w16[:, :classes] = (rng.standard_normal((K, classes)) / np.sqrt(K)).astype(np.float16)
        b32 = np.zeros(COLS, np.float32)
        b32[:classes] = rng.standard_normal(classes).astype(np.float32) * 0.1
        y = rng.integers(0, classes, B).astype(np.int32)
        h.upload(h16), w.upload(w16), bias.upload(b32), labels.upload(y)

        p, f = ways["pair"], ways["fused"]
        pair = [kg.gemm(kernels, plan, h, w, p["logits"], bias=bias, workspace=ws, tickets=tickets),
                kl.softmax_xent(kernels, p["logits"], labels, p["dlogits"], p["loss"], p["correct"], B, classes,
                                grad_scale=scale, scratch=p["sums"], ticket=p["ticket"])]
        fused = [kl.logits_xent(kernels, h, w, bias, labels, f["logits"], f["dlogits"], f["loss"], f["correct"], B,
                                classes, grad_scale=scale, scratch=f["sums"], ticket=f["ticket"])]
        if overlap:
            pair, fused = [x.overlapping() for x in pair], [x.overlapping() for x in fused]
        for way in ways.values():
            way["logits"].fill_bytes(0xFF), way["dlogits"].fill_bytes(0xFF)
        for launch in pair + fused:
            launch.run(stream)
        stream.synchronize()

        want = reference(h16, w16, b32)
        ok, notes = True, []
        for name, way in ways.items():
            z = way["logits"].download()
            zerr = float(np.max(np.abs(z.astype(np.float64) - want) / (np.abs(want) + 1e-2)))
            loss, hits, d = softmax_reference(z, y, classes, scale / B)
            derr = float(np.max(np.abs(way["dlogits"].download().astype(np.float64) - d)) / np.max(np.abs(d)))
            got_loss, got_hits = float(way["loss"].download()[0]), int(way["correct"].download()[0])
            lerr = abs(got_loss - loss) / max(abs(loss), 1e-9)
            good = zerr < 2e-3 and derr < 2e-3 and lerr < 1e-5 and got_hits == hits
            ok &= good
            notes.append(f"{name}: logits {zerr:.1e}, dlogits {derr:.1e}, loss {lerr:.1e}, hits {got_hits}/{hits}"
                         + ("" if good else " WRONG"))
        same = np.array_equal(ways["pair"]["logits"].download().view(np.uint16),
                              ways["fused"]["logits"].download().view(np.uint16))
        n = args.repeats
        t_pair = time_graph(stream, lambda: [x.run(stream) for _ in range(n) for x in pair], n, args.trials)
        t_fused = time_graph(stream, lambda: [x.run(stream) for _ in range(n) for x in fused], n, args.trials)
        print(f"  batch {B:5d} K {K:5d} classes {classes:2d}: pair {t_pair:6.2f} us ({plan.config.name}, "
              f"{plan.splits} splits + softmax_xent), fused {t_fused:6.2f} us; the same logits: {same}; "
              + "; ".join(notes))
        return ok


if __name__ == "__main__":
    raise SystemExit(main())
