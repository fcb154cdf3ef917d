"""Experiment: the layered step's side streams arranged other ways, each checked bit for bit against one chain, then
timed as dev/step_kernels.py times a step (CUDA events around graph replays, median of trials).

    python dev/step_sides.py --hidden H [H ...] [--batch B] [--optimizer sgd|adam|adamw] [--repeats N]

Arrangements, from the product's launch list (steps/layered.py):
  chain              every launch in one chain (StepOptions(branches=False))
  product            the weight updates on one side stream, the bias updates on another, and the first layer's dW
                     GEMM (forked where the second layer's is, after the last dx GEMM) on a third side of its own
  first-dw-weights   the first layer's dW GEMM queued behind the second layer's on the weights' side (the product
                     before, 2026-11-27; this experiment moved it to a side of its own)
  first-dw-biases    the first layer's dW GEMM on the biases' side, after the first layer's bias update
Only the step above batch 256 (or with --batch at most 256 and the short form's kinds ruled out) has side streams.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.timing import time_graph
from rawgpu.cli.common import count
from rawgpu.data.datasets import load_mnist
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.graph import capture
from rawgpu.model.mlp import run_launches
from rawgpu.model.recipe import Recipe
from rawgpu.training.session import Session
from rawgpu.steps import StepOptions

ARRANGEMENTS = ("chain", "product", "first-dw-weights", "first-dw-biases")


def arranged(launches: list, how: str, sides) -> list:
    """One step's launches (the product's) with the first layer's dW GEMM moved as `how` says. It keeps the split-K
    scratch of the product's first side, which no other dW GEMM touches (they run one after another here)."""
    if how == "product":
        return launches
    first_dw = max(i for i, launch in enumerate(launches) if "_cr_" in launch.kernel.name)
    out = list(launches)
    if how == "first-dw-weights":
        out[first_dw] = launches[first_dw].beside(sides.weights)
    else:  # after the first layer's bias update on the biases' side, which forks at the same point
        moved = launches[first_dw].beside(sides.biases)
        out.pop(first_dw)
        out.insert(len(out) - 1, moved)
    return out


def parameters_after(session: Session, launches: list, steps: int) -> list[np.ndarray]:
    """The model's parameters after `steps` steps of `launches` (one step's), from the session's initial ones."""
    model, stream = session.model, session.stream
    model.init_parameters(stream)
    graph = capture(stream, run_launches(launches * steps, stream))
    graph.launch(stream)
    stream.synchronize()
    graph.close()
    return [a for w, b in model.parameters() for a in (w, b)]


def profile(hidden: int, recipe_kw: dict, repeats: int, data) -> None:
    recipe = Recipe(hidden=hidden, total_steps=1000, **recipe_kw)
    reference = None
    for branches in (False, True):  # one session at a time: the chain's, then the product's
        session = Session(recipe, options=StepOptions(branches=branches))
        model, stream = session.model, session.stream
        try:
            model.upload_data(data)
            model.set_permutation(np.random.default_rng(0).permutation(60000))
            sides = model.step.sides if model.step.kind == "layered" else None
            if branches and sides is None:
                print(f"H={hidden} batch {recipe.batch}: no side streams ({session.step_description})")
                return
            for how in ARRANGEMENTS[1:] if branches else ARRANGEMENTS[:1]:
                launches = model.step_launches(1)
                launches = arranged(launches, how, sides) if branches else launches
                params = parameters_after(session, launches, 20)
                reference = reference if reference is not None else params
                same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(params, reference))
                us = time_graph(stream, run_launches(launches * repeats, stream), repeats, 10)
                print(f"H={hidden} batch {recipe.batch} {how:<16} {us:8.2f} us per step   "
                      f"bits {'the same' if same else 'DIFFER'}")
        finally:
            session.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=count(1), nargs="+", default=[256])
    p.add_argument("--batch", type=count(1), default=1024)
    p.add_argument("--optimizer", default=None, choices=("sgd", "adam", "adamw"),
                   help="the optimiser (default: the recipe's)")
    p.add_argument("--repeats", type=count(1), default=20, help="steps per timed graph")
    args = p.parse_args()
    kw = {"batch": args.batch} | ({"optimizer": args.optimizer} if args.optimizer else {})

    def work() -> int:
        data = load_mnist()
        for h in args.hidden:
            profile(h, kw, args.repeats, data)
        return 0

    return run_cli(work, "step_sides")


if __name__ == "__main__":
    sys.exit(main())
