"""Issue 41's first question: can one launch per GEMM role, over every model of a sweep, stream all N models'
weights near the copy rate? The GEMMs of one training step of N models 784-H-H-H-10 (the layered step's long form:
each layer's forward with bias and ReLU, input gradient with ReLU's mask, weight gradient with the fused SGD-momentum
update of the split master), each role one launch of gemm.cu built with -DGEMM_MODELS=1 (grid x: every model's m
tiles; each operand a model stride), timed as one CUDA graph of those 11 launches, overlapping where the GPU can.

    PYTHONPATH=. python3 dev/sweep/gemm_models.py [--models 8 32 128] [--hidden 128 256 1024] [--batch 128]

First, for 3 models, every output of the N-model launches (activations, gradients, the updated master halves and
momentum) must equal, bit for bit, model i's run alone through the product's own kernels (each checked against
float64 in tests/): the model axis changes where a model's operands are, not its arithmetic. Then the table: us per
step's GEMMs for all N, and % of all N models' weight traffic (20 B per weight: the forward's and the input
gradient's fp16 reads, the update's read and write of both master halves and the momentum) at the copy rate.
The rest of a sweep step (the gather, the loss, the bias updates, the counter) is not here.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rawgpu.runtime import compiler
from rawgpu.model import optimizer
from benchmarks.timing import copy_bandwidth, time_graph
from rawgpu.cli.common import count
from rawgpu.contract import OPTIM_WORDS
from rawgpu.runtime.errors import RawgpuError
from rawgpu.kernels import gemm as kg
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import Recipe, pad8



def widths(hidden: int) -> list[int]:
    return [pad8(784), pad8(hidden), pad8(hidden), pad8(hidden), 16]


def plans(hidden: int, batch: int, sm_count: int, arch: str) -> list[tuple[str, int, kg.GemmPlan]]:
    """(role, layer, plan) of every GEMM of a step, in launch order, each the product planner's tile without split-K
    (N models fill the GPU instead)."""
    w, out = widths(hidden), []

    def plan(M, N, K, layout, epi, states=0):
        p = kg.plan_gemm(M, N, K, layout, epi, "f32", sm_count, arch=arch, states=states)
        name = "64x128" if p.config.tma or p.config.persistent else p.config.name
        return kg.plan_gemm(M, N, K, layout, epi, "f32", sm_count, arch=arch, states=states, config=name, splits=1,
                            cluster=False)

    for i in range(4):
        out.append(("forward", i, plan(batch, w[i + 1], w[i], "rr", "bias_act" if i < 3 else "bias")))
    for i in range(3, -1, -1):
        if i:
            out.append(("dx", i, plan(batch, w[i], w[i + 1], "rc", "dact")))
        out.append(("dW+sgd", i, plan(w[i], w[i + 1], batch, "cr", "sgd", states=1)))
    return out


def role_bytes(role: str, p: kg.GemmPlan) -> int:
    """One model's DRAM bytes of a launch: its weight traffic (forward, dx: the fp16 copy read; the update: both
    master halves and the momentum read and written) and its activations read and written, fp16."""
    if role == "dW+sgd":
        return p.M * p.N * 16 + 2 * p.K * (p.M + p.N)
    return p.N * p.K * 2 + 2 * p.M * (p.N + p.K) if role == "forward" else p.N * p.K * 2 + 2 * p.M * (2 * p.N + p.K)


class Buffers:
    """N models' operands, model-major: acts[i] [N x B, w_i], grads[i] the same (grads[4]: the head's dlogits), per
    layer the master halves lo/w16 and momentum [N x in, out], the bias [N x out], the optimiser table [N, words]."""

    def __init__(self, arena: Arena, n: int, hidden: int, batch: int):
        w, a = widths(hidden), arena
        self.n, self.batch, self.w = n, batch, w
        self.acts = [a.tensor(f"act{i}", (n * batch, w[i]), np.float16) for i in range(5)]
        self.grads = [None] + [a.tensor(f"grad{i}", (n * batch, w[i]), np.float16) for i in range(1, 5)]
        self.lo = [a.tensor(f"lo{i}", (n * w[i], w[i + 1]), np.int16) for i in range(4)]
        self.w16 = [a.tensor(f"w16_{i}", (n * w[i], w[i + 1]), np.float16) for i in range(4)]
        self.mom = [a.tensor(f"mom{i}", (n * w[i], w[i + 1]), np.float32) for i in range(4)]
        self.bias = [a.tensor(f"b{i}", n * w[i + 1], np.float32) for i in range(4)]
        self.optim = a.tensor("optim", (n, OPTIM_WORDS), np.float32)

    def inputs(self) -> list:
        return [self.acts[0], self.grads[4]] + self.w16 + self.lo + self.mom + self.bias + self.acts[1:4]

    def outputs(self) -> list:
        return self.acts[1:] + self.grads[1:4] + self.lo + self.w16 + self.mom

    def fill(self, rng: np.random.Generator, words: np.ndarray) -> dict:
        """Fresh random operands (padding included: the GEMMs do not care), returned by name for copying."""
        host = {}
        for t in Buffers.inputs(self):
            if t.dtype == np.int16:
                v = rng.integers(-32768, 32767, t.shape, dtype=np.int16)
            else:
                v = (rng.standard_normal(t.shape) * (0.05 if t in self.w16 else 1.0)).astype(t.dtype)
            t.upload(v)
            host[t.name] = v
        self.optim.upload(np.tile(words, (self.n, 1)))
        return host


def check_bits(name: str, device, batch: int, make_buffers, launches_of, stream, rng, words) -> bool:
    """The model axis changes where a model's operands are, not its arithmetic: 3 models at H = 64 run through the
    model-axis launches (launches_of(buffers, True)), then each alone through the product's (launches_of(one,
    False)) from its own operands; every output must match bit for bit. Says so, or names the first that differs."""
    n, h = 3, 64
    with Arena() as sweep_arena, Arena() as one_arena:
        many, one = make_buffers(sweep_arena, n, h), make_buffers(one_arena, 1, h)
        sweep_arena.allocate()
        one_arena.allocate()
        host = many.fill(rng, words)
        for launch in launches_of(many, True):
            launch.run(stream)
        stream.synchronize()
        alone = launches_of(one, False)
        for i in range(n):
            one.fill(rng, words)  # the scratch zeroed and the optimiser table set; the operands then overwritten
            for t in one.inputs():
                whole = host[t.name]
                rows = whole.shape[0] // n
                t.upload(whole[i * rows:(i + 1) * rows])
            for launch in alone:
                launch.run(stream)
            stream.synchronize()
            for t_many, t_one in zip(many.outputs(), one.outputs()):
                rows = t_one.shape[0]
                if t_many.download()[i * rows:(i + 1) * rows].tobytes() != t_one.download().tobytes():
                    print(f"{name}: model {i} of {n}: {t_many.name} differs from the model run alone",
                          file=sys.stderr)
                    return False
    print(f"# {device.name} ({device.arch}): {n} models x 784-{h}-{h}-{h}-10, batch {batch}: every output of the "
          f"model-axis launches equals each model run alone, bit for bit")
    return True


def launches(plan_list, buf: Buffers, kernel_of, models: bool) -> list:
    """The step's GEMM launches over `buf`: one per role over every model (models) or the product's own (buf of
    one model)."""
    out = []
    for role, i, p in plan_list:
        if role == "forward":
            A, B, C, extra = buf.acts[i], buf.w16[i], buf.acts[i + 1], dict(bias=buf.bias[i])
        elif role == "dx":
            A, B, C, extra = buf.grads[i + 1], buf.w16[i], buf.grads[i], dict(act=buf.acts[i])
        else:
            A, B, C = buf.acts[i], buf.grads[i + 1], buf.lo[i]
            extra = dict(mom=buf.mom[i], w16=buf.w16[i], optim=buf.optim)
        if not models:
            extra["optim"] = buf.optim.view((OPTIM_WORDS,)) if "optim" in extra else None
            out.append(kg.gemm(kernel_of, p, A, B, C, **{k: v for k, v in extra.items() if v is not None}))
            continue
        n, (tm, tn) = buf.n, p.tiles
        per = lambda t: t.size // n  # noqa: E731 - one model's elements
        get = lambda name: extra.get(name) if extra.get(name) is not None else 0  # noqa: E731 - null pointers
        act = extra.get("act")
        out.append(kernel_of(p.kernel).bind(
            (tm * n, tn, 1), p.config.threads, p.smem_bytes, A, B, C, p.M, p.N, p.K, A.shape[1], B.shape[1],
            C.shape[1], p.k_chunk, get("bias"), get("act"), act.shape[1] if act is not None else 0, get("mom"), 0,
            get("w16"), get("optim"), 0, 0,
            per(A), per(B), per(C) * C.dtype.itemsize, p.N, per(act) if act is not None else 0, per(C), 1))
    return out


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both sweep experiments take."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=count(1), nargs="+", default=[8, 32, 128])
    p.add_argument("--hidden", type=count(8), nargs="+", default=[128, 256, 1024])
    p.add_argument("--batch", type=count(8), default=128)
    p.add_argument("--trials", type=count(1), default=20)
    p.add_argument("--roles", action="store_true", help="also time each launch alone")
    return p


def open_device(tool: str):
    """(device, stream, kernels) of GPU 0 for both sweep experiments, or None after one line saying why not."""
    try:
        from rawgpu.runtime.driver import Device, Stream
        from rawgpu.kernels import Kernels

        device = Device(0)
    except RawgpuError as exc:
        print(f"{tool}: error: {exc}", file=sys.stderr)
        return None
    return device, Stream(), Kernels(device.arch)


def main(argv=None) -> int:
    args = parser(__doc__).parse_args(argv)
    if (opened := open_device("gemm_models")) is None:
        return 1
    from rawgpu.runtime.driver import Module

    device, stream, kernels = opened
    arch = device.arch
    modules: dict[str, object] = {}

    def model_kernel(name: str):
        if name not in modules:
            built = compiler.compile_source("gemm.cu", arch, ("-DGEMM_MODELS=1",), kernel=name)
            modules[name] = Module.of(built)
        return modules[name].kernel(name)

    recipe = Recipe(hidden=256)  # the default recipe's SGD momentum 0.9 table
    words = optimizer.words(optimizer.hyperparameters(recipe))
    # 1. bit for bit against the product's kernels, model by model
    rng = np.random.default_rng(41)
    checked = plans(64, args.batch, device.sm_count, arch)
    if not check_bits("gemm_models", device, args.batch, lambda arena, n, h: Buffers(arena, n, h, args.batch),
                      lambda buf, models: launches(checked, buf, model_kernel if models else kernels, models),
                      stream, rng, words):
        return 1
    # 2. the time of a step's GEMMs over N models
    bw = copy_bandwidth(stream)
    print(f"# copy bandwidth {bw:.0f} GB/s; floor: every model's weights at 20 B each; median of {args.trials}")
    print(f"{'H':>5} {'N':>4} {'us/step':>9} {'us/model':>9} {'floor us':>9} {'% floor':>8}  tiles")
    for h in args.hidden:
        plan_list = plans(h, args.batch, device.sm_count, arch)
        weights = sum(a * b for a, b in zip(widths(h), widths(h)[1:]))
        for n in args.models:
            with Arena() as arena:
                buf = Buffers(arena, n, h, args.batch)
                arena.allocate()
                buf.fill(rng, words)
                run = launches(plan_list, buf, model_kernel, True)
                run = run[:1] + [launch.overlapping() for launch in run[1:]]
                us = time_graph(stream, lambda: [launch.run(stream) for launch in run], 1, args.trials)
                alone = [time_graph(stream, lambda launch=launch: launch.run(stream), 1, args.trials)
                         for launch in run] if args.roles else []
            floor = n * weights * 20 / (bw * 1e9) * 1e6
            tiles = " ".join(sorted({q.config.name for _, _, q in plan_list}))
            print(f"{h:>5} {n:>4} {us:>9.1f} {us / n:>9.2f} {floor:>9.1f} {100 * floor / us:>7.0f}%  {tiles}",
                  flush=True)
            for (role, i, q), t in zip(plan_list, alone):
                print(f"      {role:>7} {i} {q.kernel:>28} grid {q.tiles[0] * n}x{q.tiles[1]}: {t:7.1f} us, "
                      f"{100 * n * role_bytes(role, q) / (bw * 1e9) * 1e6 / t:3.0f}% of its bytes at copy rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
