"""`bench.py train --workload`: the generated tables of workloads.py as every system trains them. What each run takes
from its workload (widths, recipe, batch), the preprocessing rawgpu and the peers share (computed once on the host),
rawgpu's timed run of a table and a peer's, and each row's targets against the peers."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from rawgpu.model.recipe import Recipe
from .training import RECIPES, rawgpu_recipe, timed_run, with_optimizer
from .workloads import WORKLOADS, Workload, generate

STEPS = 2000  # timed steps per system unless --steps says otherwise
SPEEDUP_TARGET = 1.3  # rawgpu over the fastest peer
ACCURACY_SLACK = 0.002  # rawgpu's test accuracy at most 0.2 points below the best peer's
RMSE_SLACK = 0.01  # rawgpu's test RMSE at most 1% above the best peer's


def selected(name: str) -> list[Workload]:
    """The workloads `--workload name` runs: that one, or every one for "all"."""
    return list(WORKLOADS.values()) if name == "all" else [WORKLOADS[name]]


def train_rows(w: Workload) -> int:
    """The training rows of w's generated table (workloads.generate holds test_rows out)."""
    return w.rows - w.test_rows


def standardizes(w: Workload) -> bool:
    """Whether w's features are standardized: float columns of their own scales and offsets are; fp16 embeddings
    (unit scale already) and uint8 pixels (read as / 255) are not."""
    return w.dtype == "float32"


def settings(args, w: Workload) -> tuple[list, str, dict]:
    """(the hidden widths to time, the recipe's name, the recipe) of workload w under `bench.py train`'s arguments:
    --hidden or --sizes, else the workload's widths (each H: 3 layers of H); --recipe, else the workload's; --batch,
    else the workload's, else the recipe's; --optimizer and --activation as given."""
    name = args.recipe or w.recipe
    recipe = with_optimizer(RECIPES[name], args.optimizer or RECIPES[name]["optimizer"])
    recipe = {k: v for k, v in recipe.items() if k not in ("steps", "epochs")}  # the run is --steps long
    recipe.update(batch=args.batch or w.batch or recipe["batch"], activation=args.activation)
    if args.hidden:
        sizes = [args.hidden[0] if len(args.hidden) == 1 else tuple(args.hidden)]
    else:
        sizes = list(args.sizes or w.hidden)
    return sizes, name, recipe


def load(w: Workload, seed: int, rows: int | None = None):
    """w's table (workloads.generate; rows: fewer, for tests) as a rawgpu Dataset."""
    from rawgpu.data.datasets import Dataset

    x, y, xt, yt = generate(w, seed, rows)
    return Dataset.from_arrays(x, y, xt, yt, classes=w.classes or None, regression=not w.classes, name=w.name)


def table_recipe(h, recipe: dict, steps: int, seed: int, w: Workload, data) -> Recipe:
    """rawgpu's Recipe of width h (3 layers of h, or a width per layer) for w's data: the benchmark recipe, w's loss,
    its standardization, and the data's shape and features' dtype (trainer.fit_to_data)."""
    from rawgpu.training.trainer import fit_to_data

    return fit_to_data(replace(rawgpu_recipe(h, recipe, steps, seed), loss=w.loss, standardize=standardizes(w)), data)


def scalings(data, recipe: Recipe) -> tuple:
    """(the features' (mean, inv_std) where the recipe standardizes, else None; a regression's targets' (mean,
    scale), else None), as rawgpu's trainer computes them from the training split: feature_scaling of the features
    as the GPU keeps them, target_scaling of the targets. rawgpu and every peer train with these."""
    from rawgpu.model.mlp import feature_scaling, kept_features, target_scaling

    features = (feature_scaling(kept_features(data.train_images, recipe.input_dtype, "training"))
                if recipe.standardize else None)
    return features, target_scaling(data.train_labels) if recipe.regression else None


def bench_rawgpu(recipe: Recipe, steps: int, data, device_index: int, scaling: tuple, steps_per_launch: int = 100,
                 warmup: int = 50) -> dict:
    """A table's run on rawgpu, timed as training.bench_rawgpu times MNIST's (timed_run: the default step, warm-up,
    re-initialisation, `steps` steps), then the test set: the dict of training.bench_rawgpu (init: the initial
    parameters, for the peers) with test_accuracy (None for a regression), test_rmse (None for a classification,
    else in the targets' units) and test_loss."""
    from rawgpu.steps import StepOptions
    from rawgpu.training.session import Session

    session = Session(recipe, device_index, step_kind="auto", options=StepOptions())
    if session.compile_seconds:
        print(f"# {recipe.name}: {session.compile_note}", flush=True)
    model = session.model
    try:
        us, accuracy, nodes, init, k = timed_run(session, steps, recipe.seed, data, warmup, steps_per_launch,
                                                 scaling)
        session.stream.synchronize()
        test_loss, _ = model.eval_metrics()
        errors = model.eval_errors()
        kind = model.kind
    finally:
        model.step.close()
        model.arena.close()
    how = session.step_description + (f", {k} steps per launch" if k > 1 else "")
    return dict(system="rawgpu", us_per_step=us, test_accuracy=None if recipe.regression else accuracy,
                test_rmse=errors[0] if errors else None, test_loss=test_loss, nodes=nodes, step_kind=kind,
                parameters=recipe.parameters, init=init, note=f"{nodes} graph node(s) per step; {how}")


def peer_workload(recipe: Recipe, steps: int, init, scaling: tuple):
    """The peers' Workload of the rawgpu recipe of a table: the same widths, batch, optimiser, schedule over `steps`,
    init, data shape, loss and standardizations."""
    from peers.common import Workload as PeerWorkload

    features, targets = scaling
    return PeerWorkload(hidden=tuple(recipe.hidden_widths), steps=steps, seed=recipe.seed, init=init,
                        batch=recipe.batch, lr=recipe.lr, momentum=recipe.momentum, schedule=recipe.schedule,
                        optimizer=recipe.optimizer, nesterov=recipe.nesterov, betas=(recipe.beta1, recipe.beta2),
                        eps=recipe.eps, weight_decay=recipe.weight_decay, activation=recipe.activation,
                        inputs=recipe.inputs, classes=recipe.classes, train_rows=recipe.train_rows,
                        loss="mse" if recipe.regression else "xent", scaling=features, target_scaling=targets)


def run_peer(system: str, recipe: Recipe, steps: int, data, init, scaling: tuple) -> dict:
    """One peer's run of a table (its data the Dataset's four arrays, kept on the GPU in their own dtype)."""
    from peers import jax_peers, torch_peers

    module = torch_peers if system in torch_peers.SYSTEMS else jax_peers
    arrays = (data.train_images, data.train_labels, data.test_images, data.test_labels)
    r = module.run(system, peer_workload(recipe, steps, init, scaling), arrays)
    return dict(system=system, us_per_step=r.us_per_step, test_accuracy=r.test_accuracy, test_rmse=r.test_rmse,
                final_loss=r.final_loss, note=r.note)


def quality(s: dict) -> str:
    """A system's test figure as the table prints it: accuracy in %, or a regression's RMSE."""
    if s.get("test_rmse") is not None:
        return f"{s['test_rmse']:.4f}"
    return f"{100 * s['test_accuracy']:.2f}%" if s.get("test_accuracy") is not None else "-"


def targets(ours: dict, peers: list[dict], regression: bool) -> dict | None:
    """The row's targets against the peers that ran (None where none did): rawgpu SPEEDUP_TARGET x faster than the
    fastest, and as good as the best: test accuracy within ACCURACY_SLACK of the best peer's, or test RMSE within
    RMSE_SLACK of it (a peer whose figure is not finite does not count)."""
    timed = [p for p in peers if p.get("us_per_step")]
    if not timed:
        return None
    fastest = min(timed, key=lambda p: p["us_per_step"])
    speedup = fastest["us_per_step"] / ours["us_per_step"]
    key = "test_rmse" if regression else "test_accuracy"
    figures = [p[key] for p in timed if p.get(key) is not None and math.isfinite(p[key])]
    mine = ours.get(key)
    if not figures:
        best, met = None, False
    elif regression:
        best = min(figures)
        met = mine is not None and mine <= best * (1 + RMSE_SLACK)
    else:
        best = max(figures)
        met = mine is not None and mine >= best - ACCURACY_SLACK
    return dict(fastest_peer=fastest["system"], speedup=speedup, speedup_target=SPEEDUP_TARGET,
                speedup_met=speedup >= SPEEDUP_TARGET, quality=key, best_peer_quality=best, rawgpu_quality=mine,
                quality_slack=RMSE_SLACK if regression else ACCURACY_SLACK, quality_met=met,
                passed=speedup >= SPEEDUP_TARGET and met)


def verdict(t: dict | None) -> str:
    """A row's targets in one line: PASS or FAIL and why."""
    if t is None:
        return "n/a (no peer ran)"
    speed = f"{t['speedup']:.2f}x over {t['fastest_peer']} ({'>=' if t['speedup_met'] else '<'} {SPEEDUP_TARGET}x)"
    if t["best_peer_quality"] is None:
        good = "no peer's quality to compare"
    elif t["quality"] == "test_rmse":
        good = f"RMSE {t['rawgpu_quality']:.4f} vs best peer {t['best_peer_quality']:.4f} (within 1%: " \
               f"{'yes' if t['quality_met'] else 'no'})"
    else:
        mine = t["rawgpu_quality"]
        good = (f"accuracy {100 * mine:.2f}% vs best peer {100 * t['best_peer_quality']:.2f}% (within 0.2 points: "
                f"{'yes' if t['quality_met'] else 'no'})")
    return f"{'PASS' if t['passed'] else 'FAIL'}: {speed}; {good}"
