"""Per-kernel GPU time of one training step: each launch of the step alone, repeated in a graph, then the whole step.

    python dev/step_kernels.py --hidden H [H ...] [--batch B] [--optimizer sgd|adam|adamw] [--momentum MU]
                               [--step KIND] [--activation A] [--repeats N] [--drop] [--chain] [--workload W]
                               [--no-fold]

Where a step's time goes, kernel by kernel (a kernel alone does not overlap the one before it, so the parts add up
to more than the whole). --drop also times the step without each launch in turn: what that launch adds to the
step's critical path, i.e. what fusing it into a neighbour could save at most (the numbers, not the results, count).
--chain: the layered step with every launch in one chain (StepOptions(branches=False)); --drop needs it where the step
has side streams (a launch dropped from a fork or join would leave the graph unjoined).
--workload W: the step of a benchmark workload (scripts/benchmarks/workloads.py: its shape, task, recipe and
standardization, as `bench.py train --workload W` trains it; 65536 of its generated rows) instead of MNIST's.
--no-fold: a narrow table's gather and first layer as two launches (StepOptions(fold=False)), as before they folded.
Timed as scripts/bench.py times (benchmarks.timing.time_graph): CUDA events around graph replays, median of trials.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.timing import time_graph
from rawgpu.data.datasets import load_mnist
from rawgpu.model.recipe import ACTIVATIONS, Recipe
from rawgpu.training.session import Session
from rawgpu.steps import StepOptions


WORKLOAD_ROWS = 65536  # of a workload's generated table: enough for the permutation, quick to make


def mnist_run(hidden: int, recipe_kw: dict):
    return Recipe(hidden=hidden, total_steps=1000, **recipe_kw), load_mnist()


def workload_run(name: str, hidden: int, recipe_kw: dict):
    """(the recipe, the data) of `bench.py train --workload name` at width hidden; recipe_kw's optimiser, momentum and
    activation as given (the batch: the workload's unless --batch names one)."""
    from benchmarks import tables
    from benchmarks.training import RECIPES, with_optimizer
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS[name]
    recipe = with_optimizer(RECIPES[w.recipe], recipe_kw.get("optimizer") or RECIPES[w.recipe]["optimizer"])
    recipe = {**recipe, "batch": recipe_kw.get("batch") or w.batch or recipe["batch"],
              "activation": recipe_kw.get("activation", "relu")}
    if "momentum" in recipe_kw:
        recipe["momentum"] = recipe_kw["momentum"]
    data = tables.load(w, 0, rows=min(w.rows, WORKLOAD_ROWS))
    return tables.table_recipe(hidden, recipe, 1000, 0, w, data), data


def profile(recipe: Recipe, data, kind: str, repeats: int, drop: bool, chain: bool, fold: bool = True) -> None:
    session = Session(recipe, step_kind=kind, options=StepOptions(branches=not chain, fold=fold))
    model, stream = session.model, session.stream
    if recipe.regression:
        from rawgpu.model.mlp import target_scaling

        model.set_target_scaling(*target_scaling(data.train_labels))
    model.upload_data(data)
    if recipe.standardize:
        model.compute_scaling(stream)
    model.init_parameters(stream)
    model.set_permutation(np.random.default_rng(0).permutation(recipe.train_rows))
    launches = model.step_launches(1)
    for launch in launches * 3:
        launch.run(stream)
    whole = time_graph(stream, lambda: [launch.run(stream) for _ in range(repeats) for launch in launches],
                       repeats, 10)
    print(f"{data.name} H={recipe.hidden_label} {recipe.activation} {session.step_description}: {whole:.1f} us per "
          "step")
    parts = []
    for launch in launches:
        alone = launch.alone()
        us = time_graph(stream, lambda: [alone.run(stream) for _ in range(repeats)], repeats, 10)
        parts.append(us)
        grid = "x".join(map(str, launch.grid))
        print(f"  {launch.kernel.name:<34} grid {grid:<12} {us:8.2f} us")
    print(f"  {'sum of the parts':<47} {sum(parts):8.2f} us")
    if drop and any(launch.side or launch.joins for launch in launches):
        print("  --drop: this step has side streams; run it with --chain")
    elif drop:
        for i, skipped in enumerate(launches):
            rest = launches[:i] + launches[i + 1:]
            us = time_graph(stream, lambda: [launch.run(stream) for _ in range(repeats) for launch in rest],
                            repeats, 10)
            print(f"  without {skipped.kernel.name:<34} {us:8.2f} us per step ({whole - us:+.2f} us)")
    session.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[256])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--optimizer", default=None, help="sgd, adam or adamw (default: the recipe's)")
    p.add_argument("--momentum", type=float, default=None)
    p.add_argument("--step", default="auto", help="the step kind (default auto)")
    p.add_argument("--activation", default="relu", choices=tuple(ACTIVATIONS),
                   help="the hidden layers' activation (default relu)")
    p.add_argument("--repeats", type=int, default=20, help="launches per timed graph")
    p.add_argument("--drop", action="store_true", help="also time the step without each launch in turn")
    p.add_argument("--chain", action="store_true", help="every launch in one chain (no side streams)")
    p.add_argument("--no-fold", action="store_true", help="a table's gather and first layer as two launches")
    p.add_argument("--workload", default=None, help="a benchmark workload's step instead of MNIST's (bench.py train "
                   "--workload's names: scripts/benchmarks/workloads.py)")
    args = p.parse_args()
    kw = {"batch": args.batch, "activation": args.activation}
    kw.update({k: v for k, v in (("optimizer", args.optimizer), ("momentum", args.momentum)) if v is not None})
    if args.workload is not None:
        from benchmarks.workloads import WORKLOADS

        if args.workload not in WORKLOADS:
            p.error(f"argument --workload: one of {', '.join(WORKLOADS)}, not {args.workload!r}")
        if "--batch" not in sys.argv:
            kw.pop("batch")
    for h in args.hidden:
        recipe, data = mnist_run(h, kw) if args.workload is None else workload_run(args.workload, h, kw)
        profile(recipe, data, args.step, args.repeats, args.drop, args.chain, not args.no_fold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
