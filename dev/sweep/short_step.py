"""Issue 41's second question: with a model axis on the short form's kernels, how close does a step of N models come
to streaming their weights at copy rate? The launches of one training step of N models 784-H-H-H-10 at batch 128,
SGD with momentum: the forward GEMMs (gemm.cu, -DGEMM_MODELS=1, split as the planner splits one model given an N-th
of the SMs), the head's input and weight gradients (its cluster kernel stands in as two GEMMs), and each hidden
layer's one-pass backward (dx_update.cu, -DDXU_MODELS=1: dx, the weight's and the bias's momentum step in one pass),
each one launch over every model, overlapping where the GPU can. The gather, the loss and the counter are not here.

    PYTHONPATH=. python3 dev/sweep/short_step.py [--models 8 32 128] [--hidden 128 256 1024] [--roles]

First, for 3 models, every output equals, bit for bit, each model run alone through the product's kernels with the
same plans. Then us per step for all N against all N models' weights at 20 B each at the copy rate.
"""

from __future__ import annotations

import sys

import numpy as np

from gemm_models import MODEL_SIGNATURE, Buffers, check_bits, parser, widths  # beside this script
from rawgpu import compiler, optimizer
from rawgpu.bench.timing import copy_bandwidth, time_graph
from rawgpu.cli import count
from rawgpu.contract import OPTIM_WORDS
from rawgpu.errors import RawgpuError
from rawgpu.kernels import dx_update as ku
from rawgpu.kernels import gemm as kg
from rawgpu.memory import Arena
from rawgpu.recipe import Recipe

DXU_MODEL_SIGNATURE = ku.SIGNATURE + "qqqqq"  # DXU_MODEL_PARAMS in dx_update.cu


def plans(hidden: int, batch: int, sm_per_model: int, arch: str, forward: str | None = None,
          splits: int | None = None) -> list:
    """(role, layer, plan) of every launch of a step, in order, planned for one model given an N-th of the SMs;
    forward, splits: the forward GEMMs' tile config and split-K instead of the planner's."""
    w, out = widths(hidden), []
    for i in range(4):
        p = kg.plan_gemm(batch, w[i + 1], w[i], "rr", "bias_relu" if i < 3 else "bias", "f32", sm_per_model,
                         arch=arch, config=forward, splits=splits)
        if p.config.tma or p.config.persistent:
            p = kg.plan_gemm(batch, w[i + 1], w[i], "rr", "bias_relu" if i < 3 else "bias", "f32", sm_per_model,
                             arch=arch, config="stream")
        out.append(("forward", i, p))
    out.append(("dx", 3, kg.plan_gemm(batch, w[3], w[4], "rc", "drelu", "f32", sm_per_model, arch=arch)))
    out.append(("dW+sgd", 3, kg.plan_gemm(w[3], w[4], batch, "cr", "sgd", "f32", sm_per_model, arch=arch, states=1)))
    for i in range(2, -1, -1):
        out.append(("one pass", i, ku.plan_dx_update(batch, w[i], w[i + 1], "sgd", arch, sm_per_model, dx=i > 0)))
    return out


class StepBuffers(Buffers):
    """Buffers, with the biases' momentum and the split sums' scratch for N models."""

    def __init__(self, arena: Arena, n: int, hidden: int, batch: int, plan_list):
        super().__init__(arena, n, hidden, batch)
        self.mb = [arena.tensor(f"mb{i}", n * self.w[i + 1], np.float32) for i in range(4)]
        floats = max(max(p.workspace_floats for _, _, p in plan_list), 1)
        tickets = max(max(p.tickets for _, _, p in plan_list), 1)
        self.workspace = arena.tensor("workspace", n * floats, np.float32)
        self.tickets = arena.tensor("tickets", n * tickets, np.int32)

    def inputs(self) -> list:
        return super().inputs() + self.mb

    def outputs(self) -> list:
        return super().outputs() + self.bias[:3] + self.mb[:3]

    def fill(self, rng, words):
        host = super().fill(rng, words)
        for t in self.mb:
            v = rng.standard_normal(t.shape).astype(np.float32)
            t.upload(v)
            host[t.name] = v
        self.workspace.fill_bytes(0)
        self.tickets.fill_bytes(0)
        return host


def launches(plan_list, buf: StepBuffers, kernels, model_kernel, models: bool) -> list:
    out, n = [], buf.n
    opt1 = buf.optim.view((OPTIM_WORDS,))
    per = lambda t: t.size // n  # noqa: E731
    for role, i, p in plan_list:
        if role == "one pass":
            x, dy, dx = buf.acts[i], buf.grads[i + 1], (buf.grads[i] if i else None)
            if not models:
                out.append(ku.dx_update(kernels, p, x, dy, buf.lo[i], buf.w16[i], buf.mom[i], None, dx, opt1,
                                        buf.workspace, buf.tickets, bias=buf.bias[i], mb=buf.mb[i]))
                continue
            gx, gy, gz = p.grid
            out.append(model_kernel("dx_update.cu", p.kernel, DXU_MODEL_SIGNATURE).bind(
                (gx * n, gy, gz), p.threads, p.smem_bytes, x, dy, buf.lo[i], buf.w16[i], buf.mom[i], 0,
                dx if dx is not None else 0, buf.optim, p.B, p.IN, p.N, x.shape[1], dy.shape[1], buf.lo[i].shape[1],
                dx.shape[1] if dx is not None else 0, 0, p.n_chunk, buf.workspace, buf.tickets, 0.0, 0.0, 0.0,
                buf.bias[i], buf.mb[i], 0, per(x), per(dy), per(buf.lo[i]), per(dx) * 2 if dx is not None else 0,
                per(buf.bias[i]), cluster=p.cluster_dims))
            continue
        if role == "forward":
            A, B, C, extra = buf.acts[i], buf.w16[i], buf.acts[i + 1], dict(bias=buf.bias[i])
        elif role == "dx":
            A, B, C, extra = buf.grads[i + 1], buf.w16[i], buf.grads[i], dict(act=buf.acts[i])
        else:
            A, B, C, extra = buf.acts[i], buf.grads[i + 1], buf.lo[i], dict(mom=buf.mom[i], w16=buf.w16[i])
        if not models:
            if role == "dW+sgd":
                extra["optim"] = opt1
            out.append(kg.gemm(kernels, p, A, B, C, workspace=buf.workspace, tickets=buf.tickets, **extra))
            continue
        (tm, tn), get = p.tiles, (lambda name: extra.get(name) if extra.get(name) is not None else 0)
        act = extra.get("act")
        out.append(model_kernel("gemm.cu", p.kernel, MODEL_SIGNATURE).bind(
            (tm * n, tn, p.splits), p.config.threads, p.smem_bytes, A, B, C, p.M, p.N, p.K, A.shape[1], B.shape[1],
            C.shape[1], p.k_chunk, get("bias"), get("act"), act.shape[1] if act is not None else 0, get("mom"), 0,
            get("w16"), buf.optim if role == "dW+sgd" else 0, buf.workspace, buf.tickets,
            per(A), per(B), per(C) * C.dtype.itemsize, p.N, per(act) if act is not None else 0, per(C), 1,
            cluster=p.cluster_dims))
    return out


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--forward", default=None, help="the forward GEMMs' tile config (default: the planner's)")
    p.add_argument("--splits", type=count(1), default=None, help="the forward GEMMs' split-K (default: the planner's)")
    args = p.parse_args(argv)
    try:
        from rawgpu.driver import Device, Module, Stream
        from rawgpu.kernels import Kernels

        device = Device(0)
    except RawgpuError as exc:
        print(f"short_step: error: {exc}", file=sys.stderr)
        return 1
    arch, stream, kernels = device.arch, Stream(), Kernels(device.arch)
    define = {"gemm.cu": "-DGEMM_MODELS=1", "dx_update.cu": "-DDXU_MODELS=1"}
    modules: dict[str, object] = {}

    def model_kernel(source: str, name: str, signature: str):
        if name not in modules:
            built = compiler.compile_source(source, arch, (define[source],), kernel=name)
            modules[name] = Module(built.cubin, built.resources)
        return modules[name].kernel(name, signature)

    words = optimizer.words(optimizer.hyperparameters(Recipe(hidden=256)))
    rng = np.random.default_rng(41)
    checked = plans(64, args.batch, max(1, device.sm_count // 3), arch, args.forward, args.splits)
    if not check_bits("short_step", device, args.batch,
                      lambda arena, n, h: StepBuffers(arena, n, h, args.batch, checked),
                      lambda buf, models: launches(checked, buf, kernels, model_kernel, models), stream, rng, words):
        return 1
    bw = copy_bandwidth(stream)
    print(f"# copy bandwidth {bw:.0f} GB/s; floor: every model's weights at 20 B each; median of {args.trials}")
    print(f"{'H':>5} {'N':>4} {'us/step':>9} {'us/model':>9} {'floor us':>9} {'% floor':>8}  launches")
    for h in args.hidden:
        weights = sum(a * b for a, b in zip(widths(h), widths(h)[1:]))
        for n in args.models:
            plan_list = plans(h, args.batch, max(1, device.sm_count // n), arch, args.forward, args.splits)
            with Arena() as arena:
                buf = StepBuffers(arena, n, h, args.batch, plan_list)
                arena.allocate()
                buf.fill(rng, words)
                run = launches(plan_list, buf, kernels, model_kernel, True)
                run = run[:1] + [launch.overlapping() for launch in run[1:]]
                us = time_graph(stream, lambda: [launch.run(stream) for launch in run], 1, args.trials)
                alone = [time_graph(stream, lambda launch=launch: launch.run(stream), 1, args.trials)
                         for launch in run] if args.roles else []
            floor = n * weights * 20 / (bw * 1e9) * 1e6
            print(f"{h:>5} {n:>4} {us:>9.1f} {us / n:>9.2f} {floor:>9.1f} {100 * floor / us:>7.0f}%  {len(run)}",
                  flush=True)
            for (role, i, q), t in zip(plan_list, alone):
                print(f"      {role:>8} {i} {q.kernel:>28} grid {q.grid}: {t:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
