"""The models step (steps/models.py) timed alone: one CUDA graph of one training step of N models 784-H-H-H-10, us per
step for all N against all N models' weight traffic at the copy rate (20 B per weight, as gemm_models.py counts it).

    PYTHONPATH=. python3 dev/sweep/models_step.py [--models 8 32 128] [--hidden 128 256 1024] [--recipe default|adam]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from gemm_models import parser  # beside this script
from rawgpu import steps
from rawgpu.bench.timing import copy_bandwidth, time_graph
from rawgpu.errors import RawgpuError
from rawgpu.recipe import TEST_ROWS, TRAIN_ROWS, Recipe


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--recipe", choices=("default", "adam"), default="default")
    args = p.parse_args(argv)
    try:
        from rawgpu.driver import Device, Stream
        from rawgpu.kernels import Kernels

        device = Device(0)
    except RawgpuError as exc:
        print(f"models_step: error: {exc}", file=sys.stderr)
        return 1
    stream, kernels = Stream(), Kernels(device.arch)
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
            stack = steps.plan_model(base, kernels=kernels, sm_count=device.sm_count, models=recipes)
            try:
                stack.allocate()
                stack.upload_data(data)
                stack.init_parameters(stream)
                stack.set_permutations([rng.permutation(TRAIN_ROWS) for _ in range(n)])
                run = stack.step_launches(1)
                us = time_graph(stream, lambda: [launch.run(stream) for launch in run], 1, args.trials)
            finally:
                stack.arena.close()
            weights = sum(a * b for a, b in zip(base.padded_widths, base.padded_widths[1:]))
            floor = n * weights * 20 / (bw * 1e9) * 1e6
            print(f"{h:>5} {n:>4} {us:>9.1f} {us / n:>9.2f} {floor:>9.1f} {100 * floor / us:>7.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
