"""How much a table case's own ten training steps amplify a small error in each gradient (CPU, float64).

The GPU table tests (tests/test_tables_gpu.py) compare ten steps from a shared init with the float64 reference; that
check measures the kernels only where the model's dynamics do not amplify a step's rounding into the trajectory.
This trains the reference twice from one init, once with every gradient perturbed by a relative `--noise`, and prints
the 10-step trajectory error (tests/mlp_reference.update_errors, worst layer) per seed.

    PYTHONPATH=.:tests python dev/trajectory_gain.py --features 3000 --bytes --hidden 100 --batch 33 --classes 100 --lr 0.05 0.002
"""

from __future__ import annotations

import argparse

import mlp_reference as ref
import numpy as np

from rawgpu.model.recipe import Recipe, loss_scale


def trajectory_error(args, lr: float, seed: int) -> float:
    rng = np.random.default_rng(seed)
    rows = 4096
    if args.bytes:
        raw = rng.integers(0, 256, (rows, args.features)).astype(np.float32)
        x, z = (raw / np.float32(255)).astype(np.float16), (raw - 127.5) / 74.0
    else:
        z = rng.standard_normal((rows, args.features))
        x = z.astype(np.float16)
    teacher = rng.standard_normal((args.features, args.classes)) / np.sqrt(args.features)
    y = (z @ teacher + 0.3 * rng.standard_normal((rows, args.classes))).argmax(1)
    widths = [args.features, args.hidden, args.hidden, args.classes]
    init = [(rng.uniform(-1, 1, (a, b)) / np.sqrt(a), rng.uniform(-1, 1, b) / np.sqrt(a)) for a, b in zip(widths, widths[1:])]
    recipe = Recipe(hidden=args.hidden, layers=2, batch=args.batch, lr=lr, momentum=args.momentum, schedule="constant")
    scale, order, noise = loss_scale(args.batch), rng.permutation(rows), np.random.default_rng(seed + 1)
    clean, noisy, clean_state, noisy_state = init, init, None, None
    for s in range(10):
        at = order[s * args.batch:(s + 1) * args.batch]
        g = ref.loss_and_grads(clean, x[at], y[at], fp16_storage=True, grad_scale=scale)[2]
        h = ref.loss_and_grads(noisy, x[at], y[at], fp16_storage=True, grad_scale=scale)[2]
        h = [tuple(t * (1 + args.noise * noise.standard_normal(t.shape)) for t in pair) for pair in h]
        clean, clean_state = ref.optimizer_step(clean, g, recipe, lr, clean_state, s)
        noisy, noisy_state = ref.optimizer_step(noisy, h, recipe, lr, noisy_state, s)
    return max(ref.update_errors(noisy, clean, init))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", type=int, default=54)
    p.add_argument("--bytes", action="store_true", help="uint8 features kept raw (/255), else standard normal")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--classes", type=int, default=7)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, nargs="+", default=[0.05])
    p.add_argument("--noise", type=float, default=1e-3, help="relative perturbation of every gradient element")
    p.add_argument("--seeds", type=int, default=6)
    args = p.parse_args()
    for lr in args.lr:
        errors = [trajectory_error(args, lr, seed) for seed in range(args.seeds)]
        print(f"lr {lr}: 10-step trajectory error from {args.noise:g} gradient noise, per seed: "
              + " ".join(f"{e:.4f}" for e in errors))


if __name__ == "__main__":
    main()
