"""Experiment: what the head costs at many classes (issue 64: at most 15% of the step at H = 1024, batch 128).

The layered step of 768 fp16 features -> H x 3 -> C classes, timed as bench.py times a step (a graph of --launches
steps, CUDA events, the median of --trials), at C = 16 (the one-tile head kernel) and at each --classes; the head's
share of a step is (step(C) - step(16) + head(16)) / step(C), head(16) estimated by its weight share at 16 classes,
and beside it the head's share of the weights: the share a weight-bound step cannot go below.

    PYTHONPATH=.:scripts python dev/head_share.py [--hidden 1024] [--batch 128] [--classes 100 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.timing import time_graph
from rawgpu.data.datasets import Dataset
from rawgpu.model.recipe import Recipe
from rawgpu.training.session import Session
from rawgpu.training.trainer import fit_to_data

INPUTS, ROWS = 768, 65536


def step_us(hidden: int, batch: int, classes: int, optimizer: str, launches: int, trials: int) -> tuple[float, str]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS + 1024, INPUTS)).astype(np.float16)
    y = rng.integers(0, classes, ROWS + 1024)
    data = Dataset.from_arrays(x[:ROWS], y[:ROWS], x[ROWS:], y[ROWS:], classes=classes)
    recipe = fit_to_data(Recipe(hidden=hidden, layers=3, batch=batch, optimizer=optimizer, total_steps=10**6), data)
    session = Session(recipe, 0)
    model, stream = session.model, session.stream
    model.upload_data(data)
    model.init_parameters(stream)
    model.set_permutation(rng.permutation(ROWS))
    launches_of_step = model.step_launches()

    def issue():
        for _ in range(launches):
            for launch in launches_of_step:
                launch.run(stream)
    us = time_graph(stream, issue, launches, trials)
    how = session.step_description
    session.close()
    return us, how


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--classes", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--launches", type=int, default=50)
    p.add_argument("--trials", type=int, default=20)
    a = p.parse_args()
    h = a.hidden
    hidden_weights = INPUTS * h + 2 * h * h
    base, how = step_us(h, a.batch, 16, a.optimizer, a.launches, a.trials)
    base_head = base * (h * 16) / (hidden_weights + h * 16)
    print(f"# {INPUTS}-{h}x3-C, batch {a.batch}, {a.optimizer}; 16 classes: {base:.1f} us/step ({how})")
    for c in a.classes:
        us, how = step_us(h, a.batch, c, a.optimizer, a.launches, a.trials)
        head = us - base + base_head
        weights = h * c / (hidden_weights + h * c)
        print(f"classes {c:5d}: {us:8.1f} us/step, head {head:7.1f} us = {100 * head / us:5.1f}% of the step; "
              f"the head holds {100 * weights:.1f}% of the weights ({how})", flush=True)


if __name__ == "__main__":
    main()
