"""Fingerprints of training runs, for checking that a refactor changed no bit: for each case (recipe x step kind),
train N steps from a fixed seed on MNIST through the session's captured step graph, evaluate, and print one line
with the step kind `auto` took and sha256 of the fp32 master parameters and of the metrics.

Run it with two checkouts' `rawgpu` on PYTHONPATH and diff the outputs:
    PYTHONPATH=/path/to/old python3 dev/fingerprint_steps.py --data-dir .data/mnist > old.txt
    PYTHONPATH=. python3 dev/fingerprint_steps.py --data-dir .data/mnist > new.txt && diff old.txt new.txt
It speaks the API of the layered house (rawgpu.training.session, rawgpu.model.recipe), the one before it
(rawgpu.session, rawgpu.recipe) and the one before rawgpu/steps/.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

# (hidden, layers, batch, momentum, schedule, accum, kind): every step kind and form the GPU offers
CASES = [
    (128, 3, 32, 0.0, "constant", "fp32", "auto"),  # cluster on sm_90
    (128, 3, 32, 0.0, "cosine", "fp32", "cluster"),
    (256, 3, 32, 0.0, "constant", "fp32", "auto"),  # layered, short form on sm_90
    (1024, 3, 32, 0.0, "cosine", "fp32", "layered"),
    (4096, 3, 32, 0.0, "constant", "fp32", "auto"),
    (256, 3, 128, 0.9, "cosine", "fp32", "auto"),  # the CLI's default recipe: fused
    (192, 2, 48, 0.9, "cosine", "fp32", "fused"),
    (1024, 3, 128, 0.9, "cosine", "fp32", "auto"),  # layered, 19 kernels
    (2048, 3, 128, 0.9, "linear", "fp32", "layered"),
    (1000, 3, 64, 0.0, "cosine", "fp16", "auto"),  # fp16 accumulation: layered
    (100, 2, 50, 0.9, "cosine", "fp32", "layered"),  # padded widths
]


def session_for(recipe_kw: dict, kind: str, device: int):
    try:
        from rawgpu.model.recipe import Recipe
        from rawgpu.training.session import Session
    except ImportError:  # a checkout from before the folders by layer
        from rawgpu.recipe import Recipe
        from rawgpu.session import Session

    session = Session(Recipe(**recipe_kw), device, step_kind=kind)
    return session, session.model.kind


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="MNIST directory (default: $RAWGPU_DATA, the cache, download)")
    p.add_argument("--steps", type=int, default=300, help="training steps per case (default 300)")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    try:
        from rawgpu.data.datasets import load_mnist
    except ImportError:  # a checkout from before the folders by layer
        from rawgpu.data import load_mnist

    data = load_mnist(args.data_dir)
    for hidden, layers, batch, momentum, schedule, accum, kind in CASES:
        kw = dict(hidden=hidden, layers=layers, batch=batch, lr=0.02, momentum=momentum, schedule=schedule,
                  total_steps=args.steps, accum=accum, seed=7)
        session, took = session_for(kw, kind, args.device)
        model, stream = session.model, session.stream
        model.upload_data(data)
        model.init_parameters(stream)
        rng = np.random.default_rng(11)
        graph = session.capture_step(1)
        done = 0
        while done < args.steps:
            model.set_permutation(rng.permutation(60000))
            model.zero_metrics().run(stream)
            n = min(model.recipe.steps_per_epoch, args.steps - done)
            for _ in range(n):
                graph.launch(stream)
            done += n
        eval_graph = session.capture_eval()
        eval_graph.launch(stream)
        stream.synchronize()
        params = [x for pair in model.parameters() for x in pair]
        metrics = np.array([*model.train_metrics(), *model.eval_metrics(), model.step_count()], np.float64)
        print(f"h{hidden} l{layers} b{batch} mu{momentum} {schedule} {accum} {kind} -> {took}: "
              f"params {digest(*params)} metrics {digest(metrics)} eval acc {metrics[3]:.4f}", flush=True)
        graph.close()
        eval_graph.close()
        model.arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
