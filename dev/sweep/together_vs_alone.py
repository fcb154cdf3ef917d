"""A sweep trained together (one step for all models) against each model trained alone by Trainer: per model the
test accuracy after the run both ways, and the wall time of each.

    PYTHONPATH=. python3 dev/sweep/together_vs_alone.py [--epochs 2] [--lrs 0.05 0.1] [--seeds 0 1] [--hidden 256]
"""

from __future__ import annotations

import argparse
import sys
import time

from rawgpu import Grid, Sweep
from rawgpu.model.recipe import Recipe
from rawgpu.training.trainer import Trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--optimizer", default="sgd")
    args = p.parse_args(argv)
    base = Recipe(hidden=args.hidden, optimizer=args.optimizer)
    grid = Grid(axes=(("lr", tuple(args.lrs)),), seeds=tuple(args.seeds))
    sweep = Sweep(grid, base, epochs=args.epochs, together=True)
    t = time.perf_counter()
    sweep.fit()
    together = time.perf_counter() - t
    t, worst = time.perf_counter(), 0.0
    for r in sweep.results:
        with Trainer(r.recipe, data=sweep.data, epochs=args.epochs) as trainer:
            alone = trainer.fit()[-1].test_accuracy
        got = r.history[-1].test_accuracy
        worst = max(worst, abs(got - alone))
        print(f"model {r.index} ({r.describe()}): together {100 * got:.2f}%, alone {100 * alone:.2f}%, "
              f"difference {100 * (got - alone):+.2f} points", flush=True)
    alone_s = time.perf_counter() - t
    print(f"# {len(sweep.results)} models x {args.epochs} epochs: together {together:.1f} s, one after another "
          f"{alone_s:.1f} s; largest difference {100 * worst:.2f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
