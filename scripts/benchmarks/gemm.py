"""The GEMMs and one-pass backwards of a training step, each timed alone as `scripts/bench.py gemm` times it: a graph
of launches rotating over enough operand copies to exceed twice the L2 (so big weights come from DRAM, as in
training), the median over replays (timing.time_graph); cuBLAS's time on the same shapes for reference, through
PyTorch, imported only when asked for (bench_torch)."""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from rawgpu.runtime import driver as drv
from rawgpu.model import master, optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import Kernels
from rawgpu.kernels import dx_sgd as D
from rawgpu.kernels import dx_update as U
from rawgpu.kernels import gemm as G
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import Recipe
from .timing import copies_for, settle, time_graph


def mlp_gemms(hidden: int, batch: int):
    """(role, layer, M, N, K, layout, fused epilogue) of one training step of 784 -> h -> h -> h -> 10 (padded 16)."""
    dims = [(784, hidden), (hidden, hidden), (hidden, 16)]
    out = []
    for i, (fin, fout) in enumerate(dims):
        last = i == len(dims) - 1
        out.append(("fwd", f"{fin}x{fout}", batch, fout, fin, "rr", "bias" if last else "bias_act"))
        if i > 0:
            out.append(("dx", f"{fout}x{fin}", batch, fin, fout, "rc", "dact"))
        out.append(("dW+sgd", f"{fin}x{fout}", fin, fout, batch, "cr", "sgd"))
    return out


def min_bytes(role: str, M: int, N: int, K: int, fused: bool) -> int:
    """The fewest bytes the operation must move: each input read once, each output written once."""
    ab = 2 * (M * K + K * N)
    if role == "dW+sgd" and fused:
        return ab + M * N * (4 + 4)  # read and write the master weights, W16 and lo (rawgpu/model/master.py)
    extra = 2 * M * N if role == "dx" and fused else 0  # the saved activation
    return ab + 2 * M * N + extra + (4 * N if role == "fwd" and fused else 0)


def bench_ours(device, stream, kernels, role, M, N, K, layout, epilogue, launches, trials, rng,
               config=None, overlap=False, split=None, cluster=None, sustained=0.0) -> tuple[float, int]:
    """Microseconds per launch and the split count. overlap: each launch may start while the one before runs
    (programmatic dependent launch, as the layered training step launches them on sm_90+); cluster: how the splits
    meet (None: the plan's choice)."""
    plan = G.plan_gemm(M, N, K, layout, epilogue, "f32", sm_count=device.sm_count, config=config, arch=device.arch,
                       splits=split, cluster=cluster, capacity=G.cluster_capacity(kernels))
    per_copy = 2 * (M * K + K * N) + M * N * (8 if epilogue == "sgd" else 4)
    n = copies_for(per_copy, device.l2_bytes)
    with Arena() as arena:
        sets = []
        for c in range(n):
            A = arena.tensor(f"A{c}", (M, K) if layout[0] == "r" else (K, M), np.float16)
            B = arena.tensor(f"B{c}", (K, N) if layout[1] == "r" else (N, K), np.float16)
            kw = {}
            if epilogue == "sgd":
                out = arena.tensor(f"Wlo_{c}", (M, N), np.int16)
                kw["w16"] = arena.tensor(f"W16_{c}", (M, N), np.float16)
            else:
                out = arena.tensor(f"C{c}", (M, N), np.float16)
            if epilogue == "dact":
                kw["act"] = arena.tensor(f"act{c}", (M, N), np.float16)
            sets.append((A, B, out, kw))
        bias = arena.tensor("bias", (N,), np.float32)
        optim = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        arena.allocate()
        for A, B, out, kw in sets:  # random data: zeros can run faster than real data
            A.upload((rng.standard_normal(A.shape) * 0.1).astype(np.float16))
            B.upload((rng.standard_normal(B.shape) * 0.1).astype(np.float16))
            if epilogue == "sgd":
                hi, lo = master.split(rng.standard_normal(out.shape).astype(np.float32))
                kw["w16"].upload(hi)
                out.upload(lo)
            if "act" in kw:
                kw["act"].upload(rng.standard_normal(kw["act"].shape).astype(np.float16))
        bias.upload(rng.standard_normal(N).astype(np.float32))
        optim.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(Recipe(momentum=0.0)), 0, 1e-6)))
        tickets.upload(np.zeros(tickets.shape, np.int32))
        binds = [G.gemm(kernels, plan, A, B, out, bias=bias, optim=optim if epilogue == "sgd" else None, workspace=ws,
                        tickets=tickets, **kw) for A, B, out, kw in sets]
        binds = [b.overlapping() for b in binds] if overlap else binds
        runs = [binds[i % n] for i in range(launches)]
        us = time_graph(stream, lambda: [b.run(stream) for b in runs], launches, trials, sustained)
    return us, plan.splits


def bench_dx_sgd(device, stream, kernels, B, IN, N, launches, trials, rng, overlap=False,
                 with_dx=True, splits=None, cluster=None, roles=None, sustained=0.0) -> tuple[float, int]:
    """The fused backward (dx with the ReLU mask + the SGD update of the master weights) on rotating copies;
    with_dx False: the update alone (the first layer's). splits, cluster, roles: the column ranges, where their dx
    sums meet, dx and the update in one block or apart (None: the plan's choice)."""
    plan = D.plan_dx_sgd(B, IN, N, device.sm_count, splits, arch=device.arch, capacity=G.cluster_capacity(kernels),
                         cluster=cluster, dx=with_dx, roles=roles)
    n = copies_for(IN * N * 8, device.l2_bytes)
    with Arena() as arena:
        sets = [(arena.tensor(f"x{c}", (B, IN), np.float16), arena.tensor(f"dy{c}", (B, N), np.float16),
                 arena.tensor(f"wlo_{c}", (IN, N), np.int16), arena.tensor(f"w16_{c}", (IN, N), np.float16),
                 arena.tensor(f"dx{c}", (B, IN), np.float16)) for c in range(n)]
        lr = arena.tensor("lr", (1,), np.float32)
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        arena.allocate()
        for x, dy, wlo, w16, _ in sets:
            x.upload(np.maximum(rng.standard_normal(x.shape), 0).astype(np.float16))
            dy.upload((rng.standard_normal(dy.shape) * 0.1).astype(np.float16))
            hi, lo = master.split((rng.standard_normal(wlo.shape) * 0.1).astype(np.float32))
            w16.upload(hi)
            wlo.upload(lo)
        lr.upload(np.array([1e-6], np.float32))
        tickets.upload(np.zeros(tickets.shape, np.int32))
        binds = [D.dx_sgd(kernels, plan, *t[:4], t[4] if with_dx else None, lr, ws, tickets) for t in sets]
        binds = [b.overlapping() for b in binds] if overlap else binds
        runs = [binds[i % n] for i in range(launches)]
        us = time_graph(stream, lambda: [b.run(stream) for b in runs], launches, trials, sustained)
    return us, plan.splits


def bench_dx_update(device, stream, kernels, rng, B, IN, N, opt, with_dx, splits, launches, trials,
                    cluster=None, roles=None, sustained=0.0) -> tuple[float, int]:
    """The one-pass backward with optimiser `opt` (dx_update: dx, when with_dx, and the update of the master and its
    state) on rotating copies, each launch overlapping the one before: microseconds per launch and the column-range
    count. splits, cluster, roles as bench_dx_sgd takes them (None: the plan's choice)."""
    recipe = Recipe(optimizer=opt) if opt != "sgd" else Recipe(momentum=0.9)
    states = recipe._state_tensors
    plan = U.plan_dx_update(B, IN, N, opt, device.arch, device.sm_count, splits,
                            capacity=G.cluster_capacity(kernels), cluster=cluster, dx=with_dx,
                            roles=roles if with_dx else None)
    n = copies_for(IN * N * (8 + 8 * states), device.l2_bytes)
    with Arena() as arena:
        sets = []
        for c in range(n):
            t = dict(x=arena.tensor(f"x{c}", (B, IN), np.float16), dy=arena.tensor(f"dy{c}", (B, N), np.float16),
                     wlo=arena.tensor(f"wlo{c}", (IN, N), np.int16), w16=arena.tensor(f"w16{c}", (IN, N), np.float16),
                     dx=arena.tensor(f"dx{c}", (B, IN), np.float16), b=arena.tensor(f"b{c}", (N,), np.float32))
            for name in ("mw", "vw")[:states]:
                t[name] = arena.tensor(f"{name}{c}", (IN, N), np.float32)
            for name in ("mb", "vb")[:states]:
                t[name] = arena.tensor(f"{name}{c}", (N,), np.float32)
            sets.append(t)
        optim = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        arena.allocate()
        for t in sets:  # random data: zeros can run faster than real data
            t["x"].upload(np.maximum(rng.standard_normal((B, IN)), 0).astype(np.float16))
            t["dy"].upload((rng.standard_normal((B, N)) * 0.1).astype(np.float16))
            hi, lo = master.split((rng.standard_normal((IN, N)) * 0.1).astype(np.float32))
            t["w16"].upload(hi)
            t["wlo"].upload(lo)
            for name in ("mw", "vw", "mb", "vb"):
                if name in t:
                    t[name].upload(np.abs(rng.standard_normal(t[name].shape)).astype(np.float32))
        optim.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(recipe), 3, 1e-7)))
        tickets.upload(np.zeros(tickets.shape, np.int32))
        binds = [U.dx_update(kernels, plan, t["x"], t["dy"], t["wlo"], t["w16"], t.get("mw"), t.get("vw"),
                             t["dx"] if with_dx else None, optim, ws, tickets, bias=t["b"], mb=t.get("mb"),
                             vb=t.get("vb")).overlapping() for t in sets]
        runs = [binds[i % n] for i in range(launches)]
        return time_graph(stream, lambda: [b.run(stream) for b in runs], launches, trials, sustained), plan.splits


def bench_torch(role, M, N, K, launches, trials, l2, sustained=0.0) -> float | None:
    """cuBLAS (torch.matmul, fp16, captured in a CUDA graph) on the shape of `role`, rotating over copies sized by the
    L2 (`l2` bytes) as bench_ours does, after `sustained` seconds of replays as time_graph: microseconds per launch,
    or None when PyTorch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    per_copy = 2 * (M * K + K * N + M * N)
    n = copies_for(per_copy, l2)
    dev = "cuda"
    if role == "fwd":  # x[M,K] @ W[K,N]
        ops = [(torch.randn(M, K, dtype=torch.half, device=dev), torch.randn(K, N, dtype=torch.half, device=dev))
               for _ in range(n)]
    elif role == "dx":  # dy[M,K] @ W[N,K]^T
        ops = [(torch.randn(M, K, dtype=torch.half, device=dev), torch.randn(N, K, dtype=torch.half, device=dev).t())
               for _ in range(n)]
    else:  # x[K,M]^T @ dy[K,N]
        ops = [(torch.randn(K, M, dtype=torch.half, device=dev).t(), torch.randn(K, N, dtype=torch.half, device=dev))
               for _ in range(n)]
    outs = [torch.empty(M, N, dtype=torch.half, device=dev) for _ in range(n)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            torch.matmul(*ops[i % n], out=outs[i % n])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            torch.matmul(*ops[i % n], out=outs[i % n])
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    settle(g.replay, torch.cuda.synchronize, sustained)
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    del g, ops, outs
    torch.cuda.empty_cache()
    return statistics.median(times)


def gemm_shape(text: str) -> tuple[int, int, int]:
    """An argparse type: a GEMM's M x N x K, each positive (`4096x4096x1024`)."""
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK, got {text!r}") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return m, n, k


def variants_error(variants: list[str], arch: str) -> str | None:
    """Why some --variants cannot run on this GPU (the tensor-copy tiles need sm_90+), or None."""
    bad = [v for v in variants if G.CONFIGS[v].tma and not G.sm90_or_later(arch)]
    return f"--variants {' '.join(bad)} need the tensor copy engine of sm_90 or later; this GPU is {arch}" if bad else None


def open_gpu(device_index: int, variants: list[str], prog: str):
    """(device, stream, kernels, rng) for timing GEMMs, or None after a one-line error when a variant cannot run on
    this GPU (the dev scripts' shared set-up)."""
    device = drv.Device(device_index)
    if why := variants_error(variants, device.arch):
        print(f"{prog}: error: {why}", file=sys.stderr)
        return None
    return device, drv.Stream(), Kernels(device.arch), np.random.default_rng(0)
