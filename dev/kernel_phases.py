"""Where a layered-step kernel's time goes: per-mark SM cycles of cu/head.cu or cu/dx_update.cu inside the step.

Builds the source with its `// mark N: ...` comments made stamps (dev/variants.py: thread 0 of block (0, 0, 0)
stamps clock64 and %globaltimer), runs the step on MNIST with that build in place of the kernel's --launch-th launch
in the step (0: the first), one step at a time, and prints the median cycles that close at each mark over --steps
steps (after 20 warm-up steps), with the SM clock measured from %globaltimer over the same span.

    python dev/kernel_phases.py --kernel head|dx_update --hidden 256 [--launch N] [--batch 128]
                                [--optimizer sgd|adam] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import variants  # beside this script: its folder is on the path
from rawgpu.data.datasets import load_mnist
from rawgpu.runtime.driver import Launch
from rawgpu.model.recipe import Recipe
from rawgpu.training.session import Session

SOURCES = {"head": "head.cu", "dx_update": "dx_update.cu"}


def profile(kernel: str, hidden: int, recipe_kw: dict, steps: int, which: int) -> None:
    source = SOURCES[kernel]
    text = variants.source_text(source)
    names = variants.marks(text)
    session = Session(Recipe(hidden=hidden, total_steps=10 * steps, **recipe_kw))
    model, stream = session.model, session.stream
    model.upload_data(load_mnist())
    model.init_parameters(stream)
    model.set_permutation(np.random.default_rng(0).permutation(60000))
    module = variants.load(source, variants.instrument(text, source), session.device.arch)
    launches, seen, profiled = [], 0, None
    for launch in model.step_launches(1):
        if launch.kernel.name.startswith(kernel + "_") and (seen := seen + 1) == which + 1:
            swapped = module.kernel(launch.kernel.name, launch.kernel.signature)
            swapped.allow_cluster(launch.cluster)
            launch = Launch(swapped, launch.grid, launch.block, launch.shared_bytes, launch.args,
                            cluster=launch.cluster_dims, programmatic=launch.programmatic)
            profiled = launch
        launches.append(launch)
    if profiled is None:
        raise SystemExit(f"the step has no {kernel} launch number {which}")
    clock_rows, ns_rows = [], []
    for i in range(steps + 20):
        variants.clear_marks(module)
        for launch in launches:
            launch.run(stream)
        stream.synchronize()
        ns_at, cycles_at = variants.read_marks(module)
        if i >= 20:
            clock_rows.append(cycles_at)
            ns_rows.append(ns_at)
    stamps_all, times = np.array(clock_rows), np.array(ns_rows)
    # block (0, 0, 0) stamps; a mark on a path its role skips (the update's, where dx and the update run apart) never
    # comes
    marks = [m for m in names if (stamps_all[:, m] != 0).all()]
    if skipped := [names[m] for m in names if m not in marks]:
        print(f"  (not reached by block (0, 0, 0): {', '.join(skipped)})")
    cycles = stamps_all[:, marks[-1]] - stamps_all[:, 0]
    ns = times[:, marks[-1]] - times[:, 0]
    ghz = float(np.median(cycles / np.maximum(ns, 1)))
    print(f"H={hidden} {profiled.kernel.name}, grid {profiled.grid}: {np.median(ns) / 1e3:.2f} us from entry to exit "
          f"(SM clock {ghz:.2f} GHz)")
    for prev, mark in zip(marks, marks[1:]):
        d = np.median(stamps_all[:, mark] - stamps_all[:, prev])
        print(f"  {names[mark]:<32} {d:8.0f} cycles {d / ghz / 1e3:7.2f} us")
    module.close()
    session.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(SOURCES), default="head")
    p.add_argument("--launch", type=int, default=0, help="which of the step's launches of that kernel (0: the first)")
    p.add_argument("--hidden", type=int, nargs="+", default=[256])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--optimizer", default=None, help="sgd, adam or adamw (default: the recipe's)")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    kw = {"batch": args.batch}
    if args.optimizer is not None:
        kw["optimizer"] = args.optimizer
    for h in args.hidden:
        profile(args.kernel, h, kw, args.steps, args.launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
