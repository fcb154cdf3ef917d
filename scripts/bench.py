"""Benchmarks, all timed in one run on one GPU.

`python scripts/bench.py [train] [--recipe seed|default|adam] [--batch B] [--optimizer O]`: a training recipe on MLP
784-H-H-H-10, fp16 compute, fp32 masters, over shuffled MNIST on the GPU, for rawgpu and every importable peer
(PyTorch eager, CUDA graph, torch.compile max-autotune; JAX jit and one fori_loop program), all from the same init,
batches, per-step learning rates and optimiser, against the recipe's weight-traffic and launch floors. seed: the
reference workload (batch 32, plain SGD lr 0.003, 5000 steps); default: the CLI's default recipe (batch 128, SGD
momentum 0.9, lr 0.05 cosine to 0, 8 epochs); adam: batch 128, Adam lr 1e-3, betas 0.9/0.999, eps 1e-8, cosine, 8
epochs. `--hidden 1024 512 256` times that one architecture (a width per layer) instead of --sizes' H;
`--activation gelu` (silu, tanh, ...) trains rawgpu and every peer with that activation. Writes a table, a JSON
file and (with matplotlib, for --sizes) a PNG plot to --out.

`python scripts/bench.py train --workload NAME|all`: the same systems on a generated table instead of MNIST
(benchmarks/workloads.py: covertype-like, higgs-like, embeddings, cifar100-like, regression; all: each in turn) on
the GPU (the peers keep its features in their own dtype, rawgpu float features as fp16), standardized alike where
they are float32 columns (a regression's targets too), an MLP of 3 hidden layers of each of the workload's widths
(or --sizes / --hidden), its recipe and batch (or --recipe / --batch), --steps 2000 timed steps. Prints us/step, steps/s, samples/s, the speed-up over the fastest peer and the test
accuracy (a regression's test RMSE, in the targets' units) after those steps, and per row PASS or FAIL against the
targets (>= 1.3x the fastest peer; accuracy within 0.2 points of the best peer's, RMSE within 1%); writes
bench_workload.json to --out.

`python scripts/bench.py sweep [--models 1 8 32 128] [--sizes 128 256 1024] [--recipe default|adam]`: many models
per step (issue 41): rawgpu's models step training all N at once, JAX vmap and torch.func doing the same
(peers/sweeps.py) and N rawgpu runs one after another, against all N models' weight traffic at the copy bandwidth.

`python scripts/bench.py gemm`: every MLP GEMM at batch 32 against the copy-bandwidth floor and cuBLAS.

`python scripts/bench.py read [--gigabytes 1]`: reading a CSV and a Parquet file of that size with rawgpu's reader
(data/tables.py: parse, check, features and targets as the GPU takes them) against pyarrow's own read (no GPU).

Method: each measured unit is a CUDA graph of `--launches` back-to-back launches that rotate over enough copies
of the operands to exceed twice the L2 cache (so big weights come from DRAM, as in training); CUDA events time
each replay, after warm-up; the median over `--trials` replays, divided by the launches, is reported.

Experiments live in dev/ (dev/README.md): other tile configs and the tile/split sweep (dev/gemm_variants.py), the
step under other L2 budgets and fused-step grids (dev/step_variants.py). They and this file time with the same code,
benchmarks (timing, gemm, training): keep its signatures stable. rawgpu comes from the installed package, or from
the checkout with PYTHONPATH=.; the peers are scripts/peers, found beside this file (a script's folder is on its path).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rawgpu.runtime import driver as drv
from benchmarks.gemm import bench_dx_sgd, bench_ours, bench_torch, min_bytes, mlp_gemms
from benchmarks.power import PowerLog, span_seconds
from benchmarks.power import describe as describe_power
from benchmarks.timing import copy_bandwidth, launch_floor
from benchmarks.training import (HIDDEN, RECIPES, bench_rank, bench_rawgpu, bench_rawgpu_models, describe,
                                 rawgpu_recipe, with_optimizer)
from benchmarks.workloads import WORKLOADS
from rawgpu.cli.common import parallel_problem
from rawgpu.runtime.errors import RawgpuError
from rawgpu.runtime.files import write_atomic
from rawgpu.kernels import Kernels
from rawgpu.kernels import dx_sgd as D
from rawgpu.kernels import gemm as G
from rawgpu.model.recipe import ACTIVATIONS, DEFAULTS, OPTIMIZER_DEFAULTS, Option, argument_type
from rawgpu.steps import MODES, ONE_GPU


def cmd_gemm(args) -> int:
    device = drv.Device(args.device)
    stream = drv.Stream()
    kernels = Kernels(device.arch)
    rng = np.random.default_rng(0)
    overlap = G.sm90_or_later(device.arch) and not args.no_overlap  # programmatic dependent launch needs sm_90+
    bw = copy_bandwidth(stream)
    print(f"# {device.name} ({device.arch}, {device.sm_count} SMs, L2 {device.l2_bytes >> 20} MiB), "
          f"{dt.date.today()}; measured copy bandwidth {bw:.0f} GB/s (read + write)")
    print(f"# median of {args.trials} graph replays x {args.launches} launches"
          + (f", each after {args.sustained:g} s of its own replays" if args.sustained else ", bursts")
          + f"; batch {args.batch}; fp32 accumulation")
    print("# fused: the step's kernel, launched as the step launches it" + (" (overlapping the launch before)" if overlap
          else "") + "; plain: C = A @ B stored in fp16, launched after the launch before has finished, as cuBLAS is"
          + ("; +overlap: the same plain GEMM overlapping the launch before" if overlap else ""))
    head = (f"{'H':>5} {'role':>7} {'layer':>10} {'MxNxK':>17} {'split':>5} {'fused us':>9} {'GB/s':>6} {'%copy':>6} "
            f"{'plain us':>9} {'TFLOP/s':>7} {'cuBLAS us':>9} {'cuBLAS/plain':>12}"
            + (f" {'+overlap us':>11} {'cuBLAS/that':>11}" if overlap else ""))
    print(head)
    rows = []
    for h in args.sizes:
        for role, layer, M, N, K, layout, epi in mlp_gemms(h, args.batch):
            fused, splits = bench_ours(device, stream, kernels, role, M, N, K, layout, epi, args.launches, args.trials,
                                       rng, overlap=overlap, sustained=args.sustained)
            plain, _ = bench_ours(device, stream, kernels, role, M, N, K, layout, "store", args.launches, args.trials,
                                  rng, sustained=args.sustained)
            ref = None if args.no_torch else bench_torch(role, M, N, K, args.launches, args.trials, device.l2_bytes,
                                                         args.sustained)
            gbs = min_bytes(role, M, N, K, True) / (fused * 1e-6) / 1e9
            tflops = 2 * M * N * K / (plain * 1e-6) / 1e12
            row = dict(hidden=h, role=role, layer=layer, M=M, N=N, K=K, splits=splits, fused_us=fused, fused_gbs=gbs,
                       pct_copy=100 * gbs / bw, plain_us=plain, plain_tflops=tflops, cublas_us=ref,
                       cublas_over_plain=(ref / plain) if ref else None, fused_overlapping=overlap)
            tail = ""
            if overlap:
                plain_o, _ = bench_ours(device, stream, kernels, role, M, N, K, layout, "store", args.launches,
                                        args.trials, rng, overlap=True, sustained=args.sustained)
                row.update(plain_overlap_us=plain_o, cublas_over_plain_overlap=(ref / plain_o) if ref else None)
                tail = f" {plain_o:>11.2f} {(f'{ref / plain_o:.2f}x' if ref else '-'):>11}"
            if role == "dW+sgd" and D.supported(args.batch, False, "f32"):
                # the layer's whole backward in one pass: dx (the row above this one) + dW + SGD; the first layer's
                # update alone (its input needs no gradient)
                first = layer == f"784x{h}"
                us, sp = bench_dx_sgd(device, stream, kernels, args.batch, M, N, args.launches, args.trials, rng,
                                      overlap=overlap, with_dx=not first, sustained=args.sustained)
                nbytes = M * N * 8 + 2 * args.batch * (M + N + (0 if first else M))
                row.update(fused_bwd_us=us, fused_bwd_pct_copy=100 * nbytes / (us * 1e3) / bw, fused_bwd_splits=sp)
                print(f"      one pass ({'dW + SGD' if first else 'dx + dW + SGD'}): {us:.2f} us, split {sp}, "
                      f"{100 * nbytes / (us * 1e3) / bw:.1f}% of copy at 8 B/weight")
            rows.append(row)
            print(f"{h:>5} {role:>7} {layer:>10} {f'{M}x{N}x{K}':>17} {splits:>5} {fused:>9.2f} {gbs:>6.0f} "
                  f"{row['pct_copy']:>5.1f}% {plain:>9.2f} {tflops:>7.1f} "
                  f"{(f'{ref:.2f}' if ref else '-'):>9} {(f'{ref / plain:.2f}x' if ref else '-'):>12}{tail}", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(dict(device=device.name, arch=device.arch, date=str(dt.date.today()),
                                                copy_gbs=bw, batch=args.batch, rows=rows), indent=1).encode())
    return 0


def cmd_train_gpus(args) -> int:
    """--gpus: rawgpu alone on one GPU and split over N of them, each H: us/step, speed-up, time in the sums."""
    from rawgpu.data.datasets import load_mnist

    sizes = train_sizes(args)
    smallest = sizes[0] if args.hidden else min(sizes)
    if why := parallel_problem(rawgpu_recipe(smallest, args.train_recipe, 1000, 0), args.parallel, args.gpus):
        print(f"bench: error: argument --parallel: {why}", file=sys.stderr)
        return 2
    device = drv.Device(args.device)
    count = drv.device_count()
    if max(args.gpus) > count:
        print(f"bench: error: argument --gpus: {max(args.gpus)} GPUs asked for, this machine has {count}",
              file=sys.stderr)
        return 2
    from rawgpu.runtime import nccl
    from rawgpu.runtime.ranks import run_ranks

    if max(args.gpus) > 1:
        if (why := nccl.available()) is not None:
            print(f"bench: error: argument --gpus: {why}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mnist, recipe = load_mnist(args.data_dir), args.train_recipe
    cu_major, cu_minor = drv.driver_version()
    print(f"# {count} x {device.name} ({device.arch}), driver CUDA {cu_major}.{cu_minor}, {dt.date.today()}; recipe "
          f"{args.recipe}: {args.steps} steps, {describe(recipe)}; --parallel {args.parallel}, one process per GPU")
    print(f"{'H':>5} {'GPUs':>5} {'split':>6} {'us/step':>9} {'vs 1 GPU':>9} {'in sums':>14} {'test acc':>8}")
    rows = []
    for h in sizes:
        label = h if isinstance(h, int) else "-".join(map(str, h))
        one = bench_rawgpu(h, args.steps, args.seed, mnist, args.device, steps_per_launch=args.steps_per_launch,
                           recipe=recipe)
        one.pop("init")
        row = dict(hidden=h, one_gpu=one, split=[])
        print(f"{label:>5} {1:>5} {'-':>6} {one['us_per_step']:>9.1f} {'1.00x':>9} {'-':>14} "
              f"{100 * one['test_accuracy']:>7.2f}%", flush=True)
        for n in sorted(set(args.gpus) - {1}):
            ranks = run_ranks(bench_rank, n, h, args.steps, args.seed, mnist, recipe, args.steps_per_launch, 50,
                              args.parallel, unique_id=nccl.new_unique_id())
            us = max(r["us_per_step"] for r in ranks)  # the ranks wait for each other: the slowest is the step
            sums = us - max(r["us_without_sums"] for r in ranks)
            row["split"].append(dict(gpus=n, parallel=ranks[0]["split"], us_per_step=us,
                                     speedup=one["us_per_step"] / us, us_in_sums=sums,
                                     test_accuracy=ranks[0]["test_accuracy"], ranks=ranks))
            print(f"{label:>5} {n:>5} {ranks[0]['split']:>6} {us:>9.1f} {one['us_per_step'] / us:>8.2f}x {sums:>7.1f} ({100 * sums / us:3.0f}%) "
                  f"{100 * ranks[0]['test_accuracy']:>7.2f}%", flush=True)
        rows.append(row)
    results = dict(device=device.name, gpus=count, arch=device.arch, driver=f"CUDA {cu_major}.{cu_minor}",
                   date=str(dt.date.today()), recipe=args.recipe, steps=args.steps, **recipe, rows=rows)
    write_atomic(out / "bench_train_gpus.json", json.dumps(results, indent=1).encode())
    print(f"# wrote {out / 'bench_train_gpus.json'}")
    return 0


def run_peer(system: str, h: int | tuple[int, ...], steps: int, seed: int, data, init, recipe: dict | None = None) -> dict:
    from peers import jax_peers, torch_peers
    from peers.common import Workload

    module = torch_peers if system in torch_peers.SYSTEMS else jax_peers
    rr = rawgpu_recipe(h, {**RECIPES["seed"], **(recipe or {})}, steps, seed)  # every setting resolved
    w = Workload(hidden=h, steps=steps, seed=seed, init=init, batch=rr.batch, lr=rr.lr, momentum=rr.momentum,
                 schedule=rr.schedule, optimizer=rr.optimizer, nesterov=rr.nesterov, betas=(rr.beta1, rr.beta2),
                 eps=rr.eps, weight_decay=rr.weight_decay, activation=rr.activation)
    r = module.run(system, w, data)
    return dict(system=system, us_per_step=r.us_per_step, test_accuracy=r.test_accuracy, final_loss=r.final_loss,
                note=r.note)


PEERS = ("torch-eager", "torch-graph", "torch-compile", "jax-jit", "jax-fori")


def available_peers(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    """The wanted peers that can run, and why the others cannot. Only a wanted framework is probed: probing starts it
    on every GPU (jax leaves its own context current; the caller makes its device current again)."""
    from peers import jax_peers, torch_peers

    reasons = {}
    for module in (torch_peers, jax_peers):
        if set(module.SYSTEMS) & set(wanted) and (why := module.available()) is not None:
            reasons.update({s: why for s in module.SYSTEMS})
    return [p for p in wanted if p not in reasons], {p: reasons[p] for p in wanted if p in reasons}


def plot(results: dict, path: Path) -> str:
    """Time per step vs H (log-log), one line per system, and rawgpu's speed-up over the fastest peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    rows = results["rows"]
    systems = sorted({r["system"] for row in rows for r in row["systems"]}, key=lambda s: (s != "rawgpu", s))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    hs = [row["hidden"] for row in rows]
    for s in systems:
        pts = [(row["hidden"], r["us_per_step"]) for row in rows for r in row["systems"] if r["system"] == s]
        a.plot(*zip(*pts), marker="o", label=s, linewidth=2.5 if s == "rawgpu" else 1.2)
    a.plot(hs, [row["floor_us"] for row in rows], "k--", label="floor (weights / copy bw, or launches)")
    a.set(xscale="log", yscale="log", xlabel="hidden width H", ylabel="us per training step",
          title=f"{results['device']}, {results['date']}")
    a.legend(fontsize=8)
    b.plot(hs, [row.get("speedup") or 0 for row in rows], marker="o")
    b.axhline(1.0, color="k", linewidth=0.8)
    b.set(xscale="log", xlabel="hidden width H", ylabel="x faster than the fastest peer", title="rawgpu speed-up")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_atomic(path, png.getvalue())
    return f"wrote {path}"


def versus(s: dict, ours: dict, speedup: float | None) -> str:
    """A row's "vs best peer" cell: rawgpu's speed-up over the fastest peer, or how much slower a peer is."""
    if s is ours:
        return f"{speedup:.2f}x" if speedup else "-"
    return f"{s['us_per_step'] / ours['us_per_step']:.2f}x slower" if s["us_per_step"] else "-"


def train_sizes(args) -> list:
    """The models `bench.py train` times: each --sizes H (784-H-H-H-10), or the one --hidden architecture (one
    width keeps its meaning: H x 3)."""
    if not args.hidden:
        return list(args.sizes)
    return [args.hidden[0] if len(args.hidden) == 1 else tuple(args.hidden)]


def cmd_train(args) -> int:
    from rawgpu.data.datasets import load_mnist

    if args.gpus:
        return cmd_train_gpus(args)
    if args.workload:
        return cmd_train_workloads(args)

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # an unusable --out fails here, before any GPU work
    device = drv.Device(args.device)
    stream = drv.Stream()
    kernels = Kernels(device.arch)
    mnist = load_mnist(args.data_dir)
    peers, missing = available_peers(args.peers)
    device.make_current()
    for p, why in missing.items():
        print(f"# peer {p} skipped: {why}")
    # seconds per system, set-up included; start-up: the device, the dataset and the peers' imports
    wall: dict[str, float] = {"start-up": time.perf_counter() - started}
    power = PowerLog(device.pci_bus_id).start()  # whether each system ran at full clock or at the power limit
    spans: dict[str, tuple[float, float]] = {}  # each system's last run, on power's clock

    def clocked(system: str, fn, *a, **kw):
        t0, m0 = time.perf_counter(), time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            wall[system] = wall.get(system, 0.0) + time.perf_counter() - t0
            spans[system] = (m0, time.monotonic())

    bw = copy_bandwidth(stream)
    cu_major, cu_minor = drv.driver_version()
    recipe = args.train_recipe
    print(f"# {device.name} ({device.arch}, {device.sm_count} SMs), driver CUDA {cu_major}.{cu_minor}, "
          f"{dt.date.today()}; copy bandwidth {bw:.0f} GB/s; recipe {args.recipe}: {args.steps} steps, "
          f"{describe(recipe)}")
    peer_data = None
    if peers:
        from peers.common import mnist_arrays

        peer_data = mnist_arrays(args.data_dir)
    rows = []
    print(f"{'H':>5} {'system':>14} {'us/step':>9} {'steps/s':>9} {'vs best peer':>12} {'% floor':>8} {'test acc':>8}")
    for h in train_sizes(args):
        label = h if isinstance(h, int) else "-".join(map(str, h))
        ours = clocked("rawgpu", bench_rawgpu, h, args.steps, args.seed, mnist, args.device,
                       steps_per_launch=args.steps_per_launch, recipe=recipe)
        systems = [ours]
        for variant in args.rawgpu_variants:  # the other step kinds, side by side
            try:
                systems.append(clocked(f"rawgpu-{variant}", bench_rawgpu, h, args.steps, args.seed, mnist,
                                       args.device, step_kind=variant, steps_per_launch=args.steps_per_launch,
                                       recipe=recipe))
                systems[-1].pop("init")
            except RawgpuError as exc:  # e.g. the cluster step at a width it does not hold
                systems.append(dict(system=f"rawgpu-{variant}", us_per_step=None, test_accuracy=None,
                                    note=f"n/a: {exc}"[:300]))
        for p in peers:
            try:
                systems.append(clocked(p, run_peer, p, h, args.steps, args.seed, peer_data, ours["init"], recipe))
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, the run goes on
                systems.append(dict(system=p, us_per_step=None, test_accuracy=None, note=f"failed: {exc}"[:300]))
            device.make_current()
        # bytes per parameter: an fp32 master beside the fp16 copy (12; docs/design.md), or the split master's 10
        # (rawgpu/model/master.py); each fp32 optimiser value is read and written (8 more: momentum; 16: Adam's moments)
        state_bytes = 8 * rawgpu_recipe(h, recipe, 1, 0)._state_tensors
        weight_floor = (12 + state_bytes) * ours["parameters"] / (bw * 1e9) * 1e6
        split_floor = (10 + state_bytes) * ours["parameters"] / (bw * 1e9) * 1e6
        nodes_floor = launch_floor(stream, kernels, ours["nodes"])
        floor = max(weight_floor, nodes_floor)
        timed = [s for s in systems[1:] if s["us_per_step"] and not s["system"].startswith("rawgpu")]
        best = min(timed, key=lambda s: s["us_per_step"]) if timed else None
        row = dict(hidden=h, parameters=ours["parameters"], weight_floor_us=weight_floor,
                   split_master_floor_us=split_floor, launch_floor_us=nodes_floor,
                   floor_us=floor, best_peer=best["system"] if best else None,
                   speedup=best["us_per_step"] / ours["us_per_step"] if best else None, systems=systems)
        rows.append(row)
        ours.pop("init")
        for s in systems:
            us, vs = s["us_per_step"], versus(s, ours, row["speedup"])
            acc = f"{100 * s['test_accuracy']:.2f}%" if s.get("test_accuracy") is not None else "-"
            print(f"{label:>5} {s['system']:>14} {(f'{us:.1f}' if us else 'failed'):>9} "
                  f"{(f'{1e6 / us:.0f}' if us else '-'):>9} {vs:>12} "
                  f"{(f'{100 * floor / us:.0f}%' if us else '-'):>8} {acc:>8}"
                  + ("" if us else f"  {s['note']}"), flush=True)
        print(f"{label:>5} {'floor':>14} {floor:>9.1f}   (weights at {12 + state_bytes} B each {weight_floor:.1f} us at "
              f"{bw:.0f} GB/s, at the split master's {10 + state_bytes} B {split_floor:.1f} us, rawgpu at "
              f"{100 * split_floor / ours['us_per_step']:.0f}%"
              f" of that; {ours['nodes']} empty nodes {nodes_floor:.1f} us)", flush=True)
        for s in systems:  # NVML's readings under load during each system's run (set-up and warm-up included)
            s["power"] = power.summary(*spans[s["system"]]) if s["system"] in spans else None
        print(f"# power at H={label}: " + "; ".join(
            f"{s['system']} {describe_power(s['power'], span_seconds(spans.get(s['system'])))}" for s in systems),
            flush=True)
    power.stop()
    wall["total"] = time.perf_counter() - started
    print("# wall time (set-up, warm-up and compiles included): "
          + ", ".join(f"{name} {sec:.1f} s" for name, sec in wall.items()), flush=True)
    results = dict(device=device.name, arch=device.arch, driver=f"CUDA {cu_major}.{cu_minor}",
                   date=str(dt.date.today()), copy_gbs=bw, recipe=args.recipe, steps=args.steps, **recipe, rows=rows,
                   wall_s=wall)
    write_atomic(out / "bench_train.json", json.dumps(results, indent=1).encode())
    drawn = plot(results, out / "bench_train.png") if not args.hidden else "no plot of one architecture"
    print(f"# wrote {out / 'bench_train.json'}; {drawn}")
    return 0


def cmd_train_workloads(args) -> int:
    """--workload: rawgpu and every peer on each workload's generated table, each of its widths: speed, quality and
    the targets (benchmarks/tables.py)."""
    from benchmarks import tables

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # an unusable --out fails here, before any GPU work
    device = drv.Device(args.device)
    peers, missing = available_peers(args.peers)
    device.make_current()
    for p, why in missing.items():
        print(f"# peer {p} skipped: {why}")
    cu_major, cu_minor = drv.driver_version()
    results = dict(device=device.name, arch=device.arch, driver=f"CUDA {cu_major}.{cu_minor}",
                   date=str(dt.date.today()), steps=args.steps, seed=args.seed, workloads=[])
    print(f"# {device.name} ({device.arch}, {device.sm_count} SMs), driver CUDA {cu_major}.{cu_minor}, "
          f"{dt.date.today()}; {args.steps} timed steps per system, seed {args.seed}")
    verdicts = []
    for w in tables.selected(args.workload):
        sizes, name, recipe = tables.settings(args, w)
        t0 = time.perf_counter()
        data = tables.load(w, args.seed)
        first = tables.table_recipe(sizes[0], recipe, args.steps, args.seed, w, data)
        scaling = tables.scalings(data, first)  # the same for every width: the data's
        print(f"# {data.describe()} (generated in {time.perf_counter() - t0:.0f} s); on the GPU as "
              f"{first.input_dtype} (rawgpu), {w.dtype} (peers){', standardized' if first.standardize else ''}; "
              f"recipe {name}: {describe(recipe)}")
        print(f"{'H':>5} {'system':>14} {'us/step':>9} {'steps/s':>9} {'samples/s':>10} {'vs best peer':>12} "
              f"{'test rmse' if first.regression else 'test acc':>9}")
        rows = []
        for h in sizes:
            label = h if isinstance(h, int) else "-".join(map(str, h))
            rr = tables.table_recipe(h, recipe, args.steps, args.seed, w, data)
            ours = tables.bench_rawgpu(rr, args.steps, data, args.device, scaling, args.steps_per_launch)
            systems = [ours]
            for p in peers:
                try:
                    systems.append(tables.run_peer(p, rr, args.steps, data, ours["init"], scaling))
                except Exception as exc:  # noqa: BLE001 - a failing peer is reported in one line, the run goes on
                    why = " ".join(f"{type(exc).__name__}: {exc}".split())
                    systems.append(dict(system=p, us_per_step=None, test_accuracy=None, note=f"failed: {why}"[:300]))
                device.make_current()
            ours.pop("init")
            target = tables.targets(ours, systems[1:], rr.regression)
            rows.append(dict(hidden=h, parameters=rr.parameters, batch=rr.batch, targets=target,
                             speedup=target["speedup"] if target else None, systems=systems))
            for s in systems:
                us, vs = s["us_per_step"], versus(s, ours, target["speedup"] if target else None)
                if us:
                    s.update(steps_per_s=1e6 / us, samples_per_s=rr.batch * 1e6 / us)
                print(f"{label:>5} {s['system']:>14} {(f'{us:.1f}' if us else 'failed'):>9} "
                      f"{(f'{1e6 / us:.0f}' if us else '-'):>9} {(f'{rr.batch * 1e6 / us:.0f}' if us else '-'):>10} "
                      f"{vs:>12} {tables.quality(s):>9}" + ("" if us else f"  {s['note']}"), flush=True)
            verdicts.append(f"{w.name} H={label}: {tables.verdict(target)}")
        results["workloads"].append(dict(name=w.name, rows_total=w.rows, features=w.features, dtype=w.dtype,
                                         classes=w.classes, outputs=w.outputs, loss=w.loss, recipe=name, **recipe,
                                         input_dtype=first.input_dtype, standardize=first.standardize,
                                         train_rows=first.train_rows, test_rows=first.test_rows, rows=rows))
        write_atomic(out / "bench_workload.json", json.dumps(results, indent=1).encode())  # each workload's at once
        del data
    print("# targets (>= 1.3x the fastest peer; test accuracy within 0.2 points of the best peer's, RMSE within 1%):")
    for line in verdicts:
        print(f"#   {line}")
    print(f"# wrote {out / 'bench_workload.json'}")
    return 0


SWEEP_PEERS = ("jax-vmap", "torch-func")


def sweep_grid(n: int) -> tuple[int, int]:
    """(learning rates, seeds) of a benchmark sweep of n models: 4 learning rates around the recipe's (1 below 4
    models), times seeds."""
    rates = min(4, n)
    return rates, n // rates


def cmd_sweep(args) -> int:
    """Many models per step: every --models N at every --sizes H, the peers training all N at once beside N
    one-after-another rawgpu runs, against all N models' weight traffic at the copy bandwidth."""
    from peers import sweeps
    from peers.common import Workload, mnist_arrays

    from rawgpu.data.datasets import load_mnist

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = drv.Device(args.device)
    stream = drv.Stream()
    peers = []
    for p in args.peers:
        if (why := sweeps.available(p)) is None:
            peers.append(p)
        else:
            print(f"# peer {p} skipped: {why}")
    device.make_current()  # a probe started its framework on every GPU
    bw = copy_bandwidth(stream)
    recipe = args.train_recipe
    cu_major, cu_minor = drv.driver_version()
    print(f"# {device.name} ({device.arch}), driver CUDA {cu_major}.{cu_minor}, {dt.date.today()}; copy bandwidth "
          f"{bw:.0f} GB/s; recipe {args.recipe}: {args.steps} steps, {describe(recipe)}; model i: seed i // lrs, lr "
          f"the recipe's x 4^(2 j / (lrs - 1) - 1), j = i % lrs")
    print(f"{'H':>5} {'N':>4} {'system':>18} {'us/step':>9} {'us/model':>9} {'% floor':>8} {'acc min':>8} "
          f"{'acc max':>8}")
    mnist, peer_data, rows = load_mnist(args.data_dir), mnist_arrays(args.data_dir) if peers else None, []
    power = PowerLog(device.pci_bus_id).start()  # whether each system ran at full clock or at the power limit
    for h in args.sizes:
        rr = rawgpu_recipe(h, recipe, args.steps, 0)
        m0 = time.monotonic()
        one = bench_rawgpu(h, args.steps, 0, mnist, args.device, steps_per_launch=args.steps_per_launch,
                           recipe=recipe)
        one_span = (m0, time.monotonic())
        base = Workload(hidden=h, steps=args.steps, batch=rr.batch, lr=rr.lr, momentum=rr.momentum,
                        schedule=rr.schedule, optimizer=rr.optimizer, nesterov=rr.nesterov,
                        betas=(rr.beta1, rr.beta2), eps=rr.eps, weight_decay=rr.weight_decay,
                        activation=rr.activation)
        per_weight = sweeps.floor_bytes_per_weight(base)
        for n in args.models:
            rates, seeds = sweep_grid(n)
            grid = sweeps.lr_grid(rr.lr, rates)
            sweep = sweeps.Sweep(base, tuple(i // rates for i in range(n)), tuple(grid[i % rates] for i in range(n)))
            floor = n * sweeps.parameters(h) * per_weight / (bw * 1e9) * 1e6
            m0 = time.monotonic()
            together = bench_rawgpu_models([replace(rr, seed=i // rates, lr=grid[i % rates]) for i in range(n)],
                                           args.steps, mnist, args.device)
            spans = {"rawgpu-models": (m0, time.monotonic()), "rawgpu-sequential": one_span}
            results = [dict(system="rawgpu-models", **together, note="all N in one step (the models step)"),
                       dict(system="rawgpu-sequential", us_per_step=n * one["us_per_step"],
                            accuracies=[one["test_accuracy"]], note="N one-model runs one after another: N x one "
                            "model's step (its accuracy: model 0's lr and seed)")]
            for p in peers:
                m0 = time.monotonic()
                try:
                    r = sweeps.run(p, sweep, peer_data)
                    results.append(dict(system=p, us_per_step=r.us_per_step, accuracies=r.accuracies, note=r.note))
                except Exception as exc:  # noqa: BLE001 - a failing peer is reported, the run goes on
                    results.append(dict(system=p, us_per_step=None, accuracies=[], note=f"failed: {exc}"[:300]))
                spans[p] = (m0, time.monotonic())
                device.make_current()
            for r in results:  # NVML's readings under load during each system's run (set-up included)
                r["power"] = power.summary(*spans[r["system"]])
            for r in results:
                us, acc = r["us_per_step"], r["accuracies"]
                cells = ((f"{us:.1f}", f"{us / n:.2f}", f"{100 * floor / us:.0f}%") if us else ("failed", "-", "-"))
                accs = (f"{100 * min(acc):.2f}%", f"{100 * max(acc):.2f}%") if acc else ("-", "-")
                print(f"{h:>5} {n:>4} {r['system']:>18} {cells[0]:>9} {cells[1]:>9} {cells[2]:>8} {accs[0]:>8} "
                      f"{accs[1]:>8}" + ("" if us else f"  {r['note']}"), flush=True)
            print(f"{h:>5} {n:>4} {'floor':>18} {floor:>9.1f}   ({n} models x {sweeps.parameters(h)} weights at "
                  f"{per_weight} B each, {bw:.0f} GB/s; {rates} lr x {seeds} seeds)", flush=True)
            print(f"# power at H={h}, N={n}: " + "; ".join(
                f"{r['system']} {describe_power(r['power'], span_seconds(spans.get(r['system'])))}" for r in results),
                flush=True)
            rows.append(dict(hidden=h, models=n, lrs=grid, seeds=seeds, floor_us=floor, systems=results))
    power.stop()
    results = dict(device=device.name, arch=device.arch, driver=f"CUDA {cu_major}.{cu_minor}",
                   date=str(dt.date.today()), copy_gbs=bw, recipe=args.recipe, steps=args.steps, **recipe, rows=rows)
    write_atomic(out / "bench_sweep.json", json.dumps(results, indent=1).encode())
    print(f"# wrote {out / 'bench_sweep.json'}")
    return 0


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_read(args) -> int:
    """Reading a table file (benchmarks/reading.py): no GPU needed."""
    from benchmarks import reading

    print(f"# reading tables of about {args.gigabytes:g} GB, {dt.date.today()}, median of {args.trials} reads")
    reading.run(Path(args.dir), args.gigabytes, args.trials)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked and resolved (the train recipe, its steps); a bad one exits with argparse's usage
    error."""
    p = argparse.ArgumentParser(prog="python scripts/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    t = sub.add_parser("train", help="the reference training workload: rawgpu vs PyTorch and JAX (the default)")
    t.add_argument("--sizes", type=positive, nargs="+", default=None,
                   help=f"hidden widths H (default {' '.join(map(str, HIDDEN))}, or the workload's)")
    t.add_argument("--hidden", type=positive, nargs="+", default=None, metavar="W",
                   help="one model of these hidden widths instead of --sizes, a width per layer (1024 512 256); the "
                        "peers train the same architecture")
    t.add_argument("--recipe", choices=tuple(RECIPES), default=None,
                   help="what every system trains: seed (batch 32, plain SGD lr 0.003, 5000 steps), default (the "
                        "CLI's default: batch 128, momentum 0.9, lr 0.05 cosine, 8 epochs) or adam (batch 128, Adam "
                        "lr 1e-3, betas 0.9/0.999, eps 1e-8, cosine, 8 epochs) (default seed, or the workload's)")
    t.add_argument("--batch", type=positive, default=None,
                   help="the recipe's batch, overridden (<= 60000, or the workload's training rows)")
    t.add_argument("--workload", choices=(*WORKLOADS, "all"), default=None,
                   help="a generated table instead of MNIST (benchmarks/workloads.py), or all of them in turn: its "
                        "widths, recipe and batch unless given, 2000 timed steps unless --steps; writes "
                        "bench_workload.json")
    t.add_argument("--activation", choices=tuple(ACTIVATIONS), default=DEFAULTS["activation"],
                   help="the hidden layers' activation, in rawgpu and every peer (default relu)")
    t.add_argument("--optimizer", choices=tuple(OPTIMIZER_DEFAULTS), default=None,
                   help="the recipe's optimiser, overridden (its lr and weight decay then the CLI's defaults for it)")
    t.add_argument("--steps", type=positive, default=None,
                   help="timed training steps per system (default: the recipe's: 5000, or its epochs' steps; "
                        "2000 with --workload)")
    t.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS, metavar="PEER",
                   help=f"peers to run (default all importable: {' '.join(PEERS)}); none: --peers with no names")
    t.add_argument("--out", default="bench-results",
                   help="directory for bench_train.json and bench_train.png (bench_workload.json with --workload)")
    t.add_argument("--seed", type=int, default=0, help="init and shuffle seed (default 0)")
    t.add_argument("--data-dir", default=None, help="MNIST directory (default: $RAWGPU_DATA, the cache, download)")
    t.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    t.add_argument("--quick", action="store_true",
                   help="H 256 and 4096 (with --workload: its widths), 1000 steps, torch-graph and jax-fori only")
    t.add_argument("--steps-per-launch", type=positive, default=100,
                   help="rawgpu training steps per graph launch (default 100; JAX's fori_loop peer runs all steps as "
                        "one program)")
    t.add_argument("--rawgpu-variants", nargs="*", default=[],
                   choices=ONE_GPU + ("serial", "long", "chain"),
                   help="also time these rawgpu step implementations (rows rawgpu-cluster, rawgpu-fused, "
                        "rawgpu-layered; rawgpu-serial: the default step without programmatic dependent launch; "
                        "rawgpu-long: the layered step without its short form; rawgpu-chain: the default step with "
                        "every launch in one chain, no side streams)")
    t.add_argument("--gpus", type=positive, nargs="+", default=None, metavar="N",
                   help="rawgpu alone, on one GPU and on N GPUs of this machine (split as --parallel says, one "
                        "process per GPU; needs rawgpu[multi]): us/step, speed-up over one GPU, time in the "
                        "all-reduces; no peers")
    t.add_argument("--parallel", choices=MODES, default="auto",
                   help="with --gpus: how the GPUs share the model, as rawgpu.train's --parallel (default auto)")
    w = sub.add_parser("sweep", help="many models per step: JAX vmap and torch.func beside N rawgpu runs")
    w.add_argument("--models", type=positive, nargs="+", default=[1, 8, 32, 128], help="models per sweep N")
    w.add_argument("--sizes", type=positive, nargs="+", default=[128, 256, 1024], help="hidden widths H")
    w.add_argument("--recipe", choices=tuple(RECIPES), default="default", help="what every model trains (default: "
                   "the CLI's default recipe)")
    w.add_argument("--steps", type=positive, default=500, help="timed steps (default 500; the schedule runs over them)")
    w.add_argument("--steps-per-launch", type=positive, default=100, help="rawgpu steps per graph launch")
    w.add_argument("--peers", nargs="*", default=list(SWEEP_PEERS), choices=SWEEP_PEERS, metavar="PEER",
                   help=f"peers to run (default all importable: {' '.join(SWEEP_PEERS)})")
    w.add_argument("--out", default="bench-results", help="directory for bench_sweep.json")
    w.add_argument("--data-dir", default=None, help="MNIST directory (default: $RAWGPU_DATA, the cache, download)")
    w.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    g = sub.add_parser("gemm", help="every MLP GEMM shape vs the copy-bandwidth floor and cuBLAS")
    g.add_argument("--sizes", type=positive, nargs="+", default=list(HIDDEN))
    g.add_argument("--batch", type=positive, default=32)
    g.add_argument("--launches", type=positive, default=20)
    g.add_argument("--trials", type=positive, default=30)
    g.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    g.add_argument("--no-torch", action="store_true", help="skip the cuBLAS comparison")
    g.add_argument("--json", default=None, help="write every figure to this JSON file")
    g.add_argument("--no-overlap", action="store_true",
                   help="launch every kernel only after the one before has finished (default on sm_90+: the step's "
                        "kernels overlap the launch before, programmatic dependent launch; plain is timed both ways)")
    g.add_argument("--sustained", type=argument_type("--sustained", Option(None, float, 0.0, 3600.0)), default=0.0,
                   metavar="S",
                   help="replay each graph S seconds before timing it, so that it runs at the clock the GPU holds under "
                        "it as in a training run (default 0: bursts, before the power controller acts; docs/perf.md: "
                        "Power)")
    g.add_argument("--quick", action="store_true", help="sizes 256 and 8192, fewer trials")
    r = sub.add_parser("read", help="reading a CSV and a Parquet file: rawgpu's reader vs pyarrow's own read")
    r.add_argument("--gigabytes", type=float, default=1.0, help="the CSV file's size (default 1 GB)")
    r.add_argument("--dir", default="bench-tables", help="where the files are generated once (default bench-tables)")
    r.add_argument("--trials", type=positive, default=3, help="reads of each file, the median reported (default 3)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "sweep", "gemm", "read", "-h", "--help"):
        argv.insert(0, "train")  # train is the default subcommand
    args = p.parse_args(argv)
    if args.cmd == "gemm" and args.quick:
        args.sizes, args.trials = [256, 8192], 10
    if args.cmd == "train" and args.workload:
        from benchmarks import tables

        if args.gpus or args.rawgpu_variants:
            p.error(f"argument --workload: {'--gpus' if args.gpus else '--rawgpu-variants'} times MNIST only")
        rows = min(tables.train_rows(w) for w in tables.selected(args.workload))
        if args.batch is not None and args.batch > rows:
            p.error(f"argument --batch: at most the {rows} training rows of --workload {args.workload}, got "
                    f"{args.batch}")
        args.steps = 1000 if args.quick else args.steps or tables.STEPS
        if args.quick:
            args.peers = [x for x in args.peers if x in ("torch-graph", "jax-fori")]
        return args  # the recipe, widths and batch are each workload's (tables.settings)
    if args.cmd == "train":
        args.recipe = args.recipe or "seed"
        args.sizes = args.sizes or list(HIDDEN)
        if args.batch is not None and args.batch > 60000:
            p.error(f"argument --batch: at most the 60000 training images, got {args.batch}")
        recipe = with_optimizer(RECIPES[args.recipe], args.optimizer or RECIPES[args.recipe]["optimizer"])
        recipe["batch"] = args.batch or recipe["batch"]
        recipe["activation"] = args.activation
        run_steps = recipe.pop("steps", None) or recipe.pop("epochs") * (60000 // recipe["batch"])
        args.steps = args.steps or run_steps
        args.train_recipe = recipe
    if args.cmd == "sweep":
        args.train_recipe = {k: v for k, v in RECIPES[args.recipe].items() if k not in ("steps", "epochs")}
    if args.cmd == "train" and args.quick:
        args.sizes, args.steps = [256, 4096], 1000
        args.peers = [x for x in args.peers if x in ("torch-graph", "jax-fori")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    made = args.cmd in ("train", "sweep") and not Path(args.out).exists()  # made before any GPU work
    try:
        return {"train": cmd_train, "sweep": cmd_sweep, "gemm": cmd_gemm, "read": cmd_read}[args.cmd](args)
    except RawgpuError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. an --out directory that cannot be created or written
        print(f"bench: error: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1
    finally:
        if made and Path(args.out).is_dir() and not any(Path(args.out).iterdir()):
            Path(args.out).rmdir()  # a run that wrote nothing (no GPU, say) leaves no empty folder


if __name__ == "__main__":
    sys.exit(main())
