"""Time to 98% test accuracy from a cold start: rawgpu (empty kernel cache) against JAX (fresh process, no
compilation cache), both on the CLI's default recipe (784-256-256-256-10, batch 128, SGD momentum 0.9, lr 0.05
cosine to 0, 8 epochs, fp16 compute with fp32 masters, test accuracy after every epoch).

Each system runs in a new Python process; the clock starts before the interpreter does and stops when the first
epoch line with >= 98% test accuracy is printed. Usage: python dev/cold_start.py [--data-dir DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The JAX side: the same recipe written as a JAX user would, each epoch one jitted fori_loop over batches held on
# the GPU, then the test accuracy; one JSON line per epoch.
JAX_TRAINER = r"""
import json, math, sys
import numpy as np
import jax, jax.numpy as jnp
from rawgpu.data import load_mnist
d = load_mnist(sys.argv[1])
B, H, EPOCHS, LR, MU = 128, 256, 8, 0.05, 0.9
spe = len(d.train_labels) // B
total = spe * EPOCHS
f16, f32 = jnp.float16, jnp.float32
widths = (784, H, H, H, 10)
keys = jax.random.split(jax.random.PRNGKey(0), 8)
params = []
for i in range(4):
    bound = 1 / math.sqrt(widths[i])
    params.append((jax.random.uniform(keys[2 * i], (widths[i], widths[i + 1]), f32, -bound, bound),
                   jax.random.uniform(keys[2 * i + 1], (widths[i + 1],), f32, -bound, bound)))
vel = jax.tree_util.tree_map(jnp.zeros_like, params)
x_tr, y_tr = jnp.asarray(d.train_images), jnp.asarray(d.train_labels.astype(np.int32))
x_te, y_te = jnp.asarray(d.test_images), jnp.asarray(d.test_labels.astype(np.int32))

def forward(p, x):
    h = x.astype(f16)
    for i, (w, b) in enumerate(p):
        h = h @ w.astype(f16) + b.astype(f16)
        if i < 3:
            h = jax.nn.relu(h)
    return h.astype(f32)

def loss_fn(p, x, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(forward(p, x)), y[:, None], axis=1))

@jax.jit
def epoch(p, v, order, step0):
    def body(i, c):
        p, v = c
        idx = jax.lax.dynamic_slice(order, (i * B,), (B,))
        g = jax.grad(loss_fn)(p, x_tr[idx].astype(f32) / 255, y_tr[idx])
        lr = 0.5 * LR * (1 + jnp.cos(jnp.pi * (step0 + i) / total))
        v = jax.tree_util.tree_map(lambda v, g: MU * v + g, v, g)
        return jax.tree_util.tree_map(lambda p, v: p - lr * v, p, v), v
    return jax.lax.fori_loop(0, spe, body, (p, v))

@jax.jit
def accuracy(p):
    return jnp.mean(jnp.argmax(forward(p, x_te.astype(f32) / 255), axis=1) == y_te)

rng = np.random.default_rng(0)
for e in range(EPOCHS):
    order = jnp.asarray(rng.permutation(len(d.train_labels)).astype(np.int32))
    params, vel = epoch(params, vel, order, e * spe)
    print(json.dumps({"epoch": e + 1, "test_accuracy": float(accuracy(params))}), flush=True)
"""


def time_to_98(cmd: list[str], env: dict) -> tuple[float | None, float, float]:
    """(seconds to the first epoch line at >= 98%, best accuracy, whole process seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    reached, best = None, 0.0
    for line in proc.stdout:
        if line.startswith("{"):
            acc = json.loads(line)["test_accuracy"]
            best = max(best, acc)
            if acc >= 0.98 and reached is None:
                reached = time.perf_counter() - t0
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(f"{cmd[:3]} failed: {err.strip()[-2000:]}")
    return reached, best, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("RAWGPU_DATA", str(ROOT / ".data" / "mnist")))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAWGPU_DATA": args.data_dir}
    jax_env = {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    jax_env.pop("JAX_COMPILATION_CACHE_DIR", None)
    rows = {"rawgpu": [], "jax": []}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            rows["rawgpu"].append(time_to_98([sys.executable, "-m", "rawgpu.train", "--hidden", "256", "--json"],
                                             {**env, "RAWGPU_CACHE": cache}))
        rows["jax"].append(time_to_98([sys.executable, "-c", JAX_TRAINER, args.data_dir], jax_env))
    for name, runs in rows.items():
        reached = [r for r, _, _ in runs if r is not None]
        median = f"{statistics.median(reached):.1f} s" if reached else "not reached"
        print(f"{name:7} cold start to 98%: median {median} over {len(runs)} runs "
              f"({', '.join(f'{r:.1f}' if r else '-' for r, _, _ in runs)}); best accuracy "
              f"{max(b for _, b, _ in runs):.2%}; whole process {statistics.median(w for _, _, w in runs):.1f} s")
    r, j = (statistics.median([x for x, _, _ in rows[k] if x] or [float("nan")]) for k in ("rawgpu", "jax"))
    print(f"rawgpu / jax: {r / j:.2f} (target <= 0.33)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
