"""Experiment: whole layered steps with the planner's wg256 GEMMs on wg256mc, the 2-CTA pair that shares B's k-tiles
by TMA multicast (compiled for x @ W alone), checked bit for bit against the planner's step, then timed as
dev/step_sides.py times a step (CUDA events around graph replays, median of trials).

    python dev/step_multicast.py --hidden H [H ...] [--batch B] [--optimizer sgd|adam|adamw] [--repeats N]

The pair is not chosen by rawgpu/kernels/gemm.py yet: this script swaps it in by wrapping choose_config in its own
process, where the pair has an instance for the GEMM's layout and epilogue.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rawgpu.bench.timing import time_graph
from rawgpu.cli import count
from rawgpu.data import load_mnist
from rawgpu.errors import RawgpuError
from rawgpu.kernels import gemm as kg
from rawgpu.mlp import run_launches
from rawgpu.recipe import Recipe
from rawgpu.session import Session
from step_sides import parameters_after  # dev/ is the script's directory, first on sys.path

PAIRS = {"wg256": "wg256mc"}
_planner = kg.choose_config


def paired_config(M, K, epilogue, layout="rr", *args, **kw) -> str:
    """choose_config's tile, or its multicast pair where the pair compiles this layout and epilogue."""
    name = _planner(M, K, epilogue, layout, *args, **kw)
    pair = PAIRS.get(name)
    return pair if pair and (pair, layout, epilogue) in kg.INSTANCES else name


def profile(hidden: int, recipe_kw: dict, repeats: int, data) -> None:
    recipe = Recipe(hidden=hidden, total_steps=1000, **recipe_kw)
    reference = None
    for paired in (False, True):  # one session at a time: the planner's step, then the pairs'
        kg.choose_config = paired_config if paired else _planner
        session = Session(recipe)
        model, stream = session.model, session.stream
        try:
            model.upload_data(data)
            model.set_permutation(np.random.default_rng(0).permutation(60000))
            launches = model.step_launches(1)
            names = sorted({launch.kernel.name for launch in launches if "_wg" in launch.kernel.name})
            params = parameters_after(session, launches, 20)
            reference = reference if reference is not None else params
            same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(params, reference))
            us = time_graph(stream, run_launches(launches * repeats, stream), repeats, 10)
            print(f"H={hidden} batch {recipe.batch} {'pairs' if paired else 'planner':<8} {us:8.2f} us per step   "
                  f"bits {'the same' if same else 'DIFFER'}   {' '.join(names)}", flush=True)
        finally:
            session.close()
            kg.choose_config = _planner


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=count(1), nargs="+", default=[1024, 4096])
    p.add_argument("--batch", type=count(1), default=4096)
    p.add_argument("--optimizer", default=None, choices=("sgd", "adam", "adamw"),
                   help="the optimiser (default: the recipe's)")
    p.add_argument("--repeats", type=count(1), default=20, help="steps per timed graph")
    args = p.parse_args()
    kw = {"batch": args.batch} | ({"optimizer": args.optimizer} if args.optimizer else {})
    try:
        data = load_mnist()
        for h in args.hidden:
            profile(h, kw, args.repeats, data)
    except RawgpuError as exc:
        print(f"step_multicast: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
