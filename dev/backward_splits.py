"""The one-pass backward with an optimiser (kernels/dx_update.py; --optimizer plain: kernels/dx_sgd.py, batch <= 32)
alone, at every column-range count: what plan_dx_update's (plan_dx_sgd's) split rule should be.

    python dev/backward_splits.py [--sizes 256 1024 4096] [--batch 128] [--optimizer sgd|adam|plain] [--splits 1 2 4 8]
                                  [--sum cluster workspace] [--roles 1 2]

Each layer shape of a step (784 x H without dx, H x H with dx), timed as bench.py times a GEMM: a CUDA graph of
launches over copies of the weights and state past the L2, each overlapping the one before on sm_90, the median of
the trials; the default plan first, then each split count, with the % of copy bandwidth the weight bytes reach;
each line once per way the column ranges add their dx (--sum: in a cluster, through the workspace; cu/one_pass.cuh).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rawgpu, from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "scripts"))  # bench.py

import bench  # noqa: E402
from gemm_variants import open_gpu  # noqa: E402
from rawgpu import master, optimizer  # noqa: E402
from rawgpu.contract import OPTIM_WORDS  # noqa: E402
from rawgpu.kernels import dx_sgd as D  # noqa: E402
from rawgpu.kernels import dx_update as U  # noqa: E402
from rawgpu.memory import Arena  # noqa: E402
from rawgpu.recipe import Recipe, cdiv  # noqa: E402


def time_backward(device, stream, kernels, rng, B, IN, N, opt, with_dx, splits, launches, trials,
                  cluster=None, roles=None) -> tuple[float, int]:
    recipe = Recipe(optimizer=opt) if opt != "sgd" else Recipe(momentum=0.9)
    states = recipe.state_tensors
    plan = U.plan_dx_update(B, IN, N, opt, device.arch, device.sm_count, splits,
                            capacity=bench.G.cluster_capacity(kernels), cluster=cluster, dx=with_dx,
                            roles=roles if with_dx else None)
    n = bench.copies_for(IN * N * (8 + 8 * states), device.l2_bytes)
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
        return bench.time_graph(stream, lambda: [b.run(stream) for b in runs], launches, trials), plan.splits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=bench.positive, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batch", type=bench.positive, default=128)
    p.add_argument("--optimizer", choices=("sgd", "adam", "plain"), default="sgd",
                   help="sgd: with momentum; plain: SGD without state, the batch-32 kernel (kernels/dx_sgd.py)")
    p.add_argument("--splits", type=bench.positive, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--sum", nargs="+", choices=("cluster", "workspace"), default=["cluster", "workspace"],
                   help="how the column ranges add their dx (cluster: where the plan can; default both)")
    p.add_argument("--roles", type=int, nargs="+", choices=(1, 2), default=[None],
                   help="1 block per piece for dx and the update, or 2 (blocks of their own); default: the plan's")
    p.add_argument("--launches", type=bench.positive, default=20)
    p.add_argument("--trials", type=bench.positive, default=15)
    args = p.parse_args(argv)
    if args.optimizer == "plain" and args.batch > D.MAX_BATCH:
        p.error(f"--optimizer plain runs the batch-{D.MAX_BATCH} kernel: --batch must be <= {D.MAX_BATCH}")
    if any(h % 8 for h in args.sizes):
        p.error("--sizes must be multiples of 8")
    if (gpu := open_gpu(0, [], "backward_splits")) is None:
        return 2
    device, stream, kernels, rng = gpu
    bw = bench.copy_bandwidth(stream)
    per_weight = {"plain": 8, "sgd": 16, "adam": 24}[args.optimizer]
    print(f"# {device.name}; copy {bw:.0f} GB/s; batch {args.batch}, {args.optimizer}; us per launch "
          f"(% of copy at {per_weight} B per weight)")
    for h in args.sizes:
        for IN, with_dx, ways in ((784, False, ["-"]), (h, True, args.sum)):
            chunks = cdiv(h, D.BN if args.optimizer == "plain" else U.BN)
            for way, roles in ((w, r) for w in ways for r in (args.roles if with_dx else [None])):
                line = f"{h:>5} {IN}x{h} {'dx+update' if with_dx else 'update':>9} {way:>9}"
                line += f" roles {roles}:" if roles else ":"
                for s in [None] + [s for s in args.splits if s <= chunks]:
                    cluster = False if way == "workspace" else None  # cluster: wherever the rule lets it
                    if args.optimizer == "plain":
                        us, used = bench.bench_dx_sgd(device, stream, kernels, args.batch, IN, h, args.launches,
                                                      args.trials, rng, overlap=True, with_dx=with_dx, splits=s,
                                                      cluster=cluster if with_dx else None,
                                                      roles=roles if with_dx else None)
                    else:
                        us, used = time_backward(device, stream, kernels, rng, args.batch, IN, h, args.optimizer,
                                                 with_dx, s, args.launches, args.trials, cluster, roles)
                    pct = 100 * per_weight * IN * h / (us * 1e3) / bw
                    line += f"  {'default ' if s is None else ''}{used}: {us:.2f} ({pct:.0f}%)"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
