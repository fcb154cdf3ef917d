"""The models step (steps/models.py) timed alone: one CUDA graph of one training step of N models 784-H-H-H-10, us per
step for all N against all N models' weight traffic at the copy rate (20 B per weight, as gemm_models.py counts it).

    PYTHONPATH=. python3 dev/sweep/models_step.py [--models 8 32 128] [--hidden 128 256 1024] [--recipe default|adam]
        [--roles] [--no-overlap] [--head-ctas 2 4 8] [--first-splits 1 2 4] [--no-stream]
        [--first-config 32x128] [--hidden-splits 2]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from gemm_models import open_device, parser  # beside this script
from rawgpu import steps
from benchmarks.timing import copy_bandwidth, time_graph
from rawgpu.model.recipe import TEST_ROWS, TRAIN_ROWS, Recipe


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--recipe", choices=("default", "adam"), default="default")
    p.add_argument("--no-overlap", action="store_true", help="launches one after another (no programmatic launch)")
    p.add_argument("--head-ctas", type=int, nargs="+", default=[0], help="the head's CTAs per model (0: the plan's)")
    p.add_argument("--first-splits", type=int, nargs="+", default=[0],
                   help="the first layer's column ranges in its one pass (0: the plan's)")
    p.add_argument("--first-config", default=None, help="the first layer's forward tile config (default: the plan's)")
    p.add_argument("--no-stream", action="store_true",
                   help="the first layer's update a block a band (the band kernel), not streamed over runs of chunks")
    p.add_argument("--hidden-splits", type=int, default=0,
                   help="the hidden layers' one passes in this many column ranges, adding dx in a cluster (0: none)")
    args = p.parse_args(argv)
    if (opened := open_device("models_step")) is None:
        return 1
    device, stream, kernels = opened
    rng = np.random.default_rng(0)
    data = type("Data", (), dict(train_images=rng.integers(0, 256, (TRAIN_ROWS, 784), dtype=np.uint8),
                                 train_labels=rng.integers(0, 10, TRAIN_ROWS).astype(np.uint8),
                                 test_images=rng.integers(0, 256, (TEST_ROWS, 784), dtype=np.uint8),
                                 test_labels=rng.integers(0, 10, TEST_ROWS).astype(np.uint8)))
    bw = copy_bandwidth(stream)
    print(f"# {device.name}: copy bandwidth {bw:.0f} GB/s; median of {args.trials}")
    print(f"{'H':>5} {'N':>4} {'us/step':>9} {'us/model':>9} {'floor us':>9} {'% floor':>8}")
    for h in args.hidden:
        for n in args.models:
            extra = dict(optimizer="adam", lr=1e-3) if args.recipe == "adam" else {}
            base = Recipe(hidden=h, batch=args.batch, train_rows=TRAIN_ROWS, test_rows=TEST_ROWS, total_steps=1000,
                          **extra)
            recipes = [replace(base, seed=i, lr=base.lr * (1 + i % 4)) for i in range(n)]
            for ctas, splits in ((c, s) for c in args.head_ctas for s in args.first_splits):
                us, alone = one(args, base, recipes, kernels, device, stream, data, rng, ctas, splits)
                weights = sum(a * b for a, b in zip(base._padded_widths, base._padded_widths[1:]))
                floor = n * weights * 20 / (bw * 1e9) * 1e6
                knobs = f"  head ctas {ctas or 'plan'}, first splits {splits or 'plan'}" if len(args.head_ctas) + len(
                    args.first_splits) > 2 else ""
                print(f"{h:>5} {n:>4} {us:>9.1f} {us / n:>9.2f} {floor:>9.1f} {100 * floor / us:>7.0f}%{knobs}",
                      flush=True)
                for name, grid, t in alone:
                    print(f"      {name:>40} grid {grid}: {t:7.1f} us")
    return 0


def one(args, base, recipes, kernels, device, stream, data, rng, ctas: int, splits: int):
    """us per step of the models step for `recipes` (ctas, splits: the head's CTAs and the first layer's ranges
    instead of the plan's, where not 0), and each launch alone where asked."""
    from rawgpu.kernels import dx_update as ku
    from rawgpu.kernels import gemm as kg
    from rawgpu.kernels import head as kh
    from rawgpu.steps.base import StepOptions

    n = len(recipes)
    stack = steps.plan_model(base, kernels=kernels, sm_count=device.sm_count, models=recipes,
                             options=StepOptions(overlap=not args.no_overlap))
    step, padded = stack.step, base._padded_widths
    if ctas and step.head is not None:
        step.head = kh.plan_head(base.batch, padded[-2], base.optimizer, ctas=ctas)
    if args.no_stream and step.stream_first:
        step.stream_first = False
        step.bwd[0] = ku.plan_dx_update(base.batch, padded[0], padded[1], base.optimizer, stack.arch,
                                        max(1, stack.sm_count // n), cluster=False, dx=False, roles=1)
    if splits and step.bwd[0] is not None:
        step.stream_first = False
        step.bwd[0] = ku.plan_dx_update(base.batch, padded[0], padded[1], base.optimizer, stack.arch, 1,
                                        splits=min(splits, -(-padded[1] // ku.BN)), cluster=False, dx=False, roles=1)
    if args.hidden_splits:
        step.bwd = step.bwd[:1] + [ku.plan_dx_update(p.B, p.IN, p.N, base.optimizer, stack.arch, 1,
                                                     splits=args.hidden_splits, cluster=True, dx=True, roles=1)
                                   if p is not None else None for p in step.bwd[1:]]
    if args.first_config:
        step.fwd[0] = kg.plan_gemm(base.batch, padded[1], padded[0], "rr", "bias_act", "f32", stack.sm_count,
                                   splits=1, arch=stack.arch, config=args.first_config, cluster=False)
    try:
        stack.allocate()
        stack.upload_data(data)
        stack.init_parameters(stream)
        stack.set_permutations([rng.permutation(TRAIN_ROWS) for _ in range(n)])
        run = stack.step_launches(1)
        us = time_graph(stream, lambda: [launch.run(stream) for launch in run], 1, args.trials)
        alone = [(launch.kernel.name, launch.grid, time_graph(stream, lambda launch=launch: [
            launch.run(stream) for _ in range(10)], 10, args.trials)) for launch in run] if args.roles else []
        return us, alone
    finally:
        stack.arena.close()


if __name__ == "__main__":
    sys.exit(main())
