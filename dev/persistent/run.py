"""Experiment: the cost of one dependent phase in a persistent step with the weights on chip (phase_chain.cu).

    python dev/persistent/run.py [--sizes 256 512] [--columns 8 16] [--chunks 1 4] [--layers 1 2 4 8]

For each hidden size H, columns per CTA n (C = H / n CTAs) and K chunk count, checks the chain of layers against
float64 (fp16 rounding of every stored activation, outputs poisoned first), then times launches of 1, 2, 4, 8
layers (CUDA events around a graph of 20 launches, median of trials) and fits us = fixed + per_layer x layers:
`per_layer` is what one dependent phase of such a step costs, to set beside the layered step's critical path per
forward kernel (dev/step_kernels.py --drop). Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from rawgpu.runtime import compiler, driver
from benchmarks.timing import time_graph
from rawgpu.runtime.memory import Arena

ROWS, THREADS = 128, 256


def build(arch: str) -> tuple[bytes, str]:
    """phase_chain.cu's cubin for `arch` and ptxas's report."""
    module = compiler.compile_file(Path(__file__).parent / "phase_chain.cu", arch)
    return module.cubin, module.log


def reference(x: np.ndarray, w: np.ndarray, layers: int) -> np.ndarray:
    h = x.astype(np.float64)
    for _ in range(layers):
        h = np.maximum(h @ w.astype(np.float64), 0).astype(np.float16).astype(np.float64)
    return h


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    p.add_argument("--columns", type=int, nargs="+", default=[8, 16], choices=[8, 16, 32],
                   help="columns per CTA (phase_chain.cu's instances)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--modes", type=int, nargs="+", default=[0], choices=range(8),
                   help="phase_chain.cu's mode bits: 1 one arrival per CTA, 2 no input copy, 4 no mma")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--compile-only", action="store_true", help="build for sm_90 and print ptxas's report")
    args = p.parse_args()
    if args.compile_only:
        print(build("sm_90")[1])
        return 0
    device = driver.Device(0)
    module, stream = driver.Module(build(device.arch)[0]), driver.Stream()
    rng = np.random.default_rng(0)
    print(f"# {device.name}; batch {ROWS}; us per launch, median of {args.trials} x 20 launches")
    for H in args.sizes:
        x = rng.standard_normal((ROWS, H)).astype(np.float16)
        w = (rng.standard_normal((H, H)) * np.sqrt(2.0 / H)).astype(np.float16)
        deepest = max(args.layers)
        for n in args.columns:
            C = H // n
            if H % n or C > device.sm_count:
                print(f"H {H} n {n}: {C} CTAs do not fit one wave of {device.sm_count} SMs; skipped")
                continue
            kern = module.kernel(f"phase_chain_n{n // 8}", "ppppiiii")
            shared = (ROWS + n) * (H + 8) * 2
            kern.ensure_shared(shared)
            for chunks in args.chunks:
                if H % (32 * chunks) or chunks > 4:  # k steps of 32 per chunk; at most 4 copy groups
                    print(f"H {H} chunks {chunks}: needs H a multiple of 32 x chunks and chunks <= 4; skipped")
                    continue
                with Arena() as arena:
                    tx, tw = arena.tensor("x", (ROWS, H), np.float16), arena.tensor("w", (H, H), np.float16)
                    act = arena.tensor("act", (deepest, ROWS, H), np.float16)
                    flags = arena.tensor("flags", deepest, np.uint64)
                    arena.allocate()
                    arena.zero()
                    tx.upload(x), tw.upload(w)
                    act.fill_bytes(0xFF)  # NaN everywhere: a row or column never written fails the check
                    kern.bind(C, THREADS, shared, tx, tw, act, flags, H, deepest, chunks, 0).run(stream)
                    stream.synchronize()
                    got = act.download().astype(np.float64)
                    errs = [float(np.linalg.norm(got[i] - reference(x, w, i + 1)) /
                                  np.linalg.norm(reference(x, w, i + 1))) for i in range(deepest)]
                    if not all(np.isfinite(errs)) or max(errs) > 2e-2:
                        print(f"H {H} n {n} chunks {chunks}: WRONG, per layer rel. error {errs}")
                        continue
                    for mode in args.modes:
                        flags.fill_bytes(0)  # a counter must start at a multiple of its mode's arrivals per layer
                        times = {}
                        for L in args.layers:
                            launch = kern.bind(C, THREADS, shared, tx, tw, act, flags, H, L, chunks, mode)
                            times[L] = time_graph(stream, lambda: [launch.run(stream) for _ in range(20)],
                                                  20, args.trials)
                        slope, fixed = np.polyfit(list(times), list(times.values()), 1)
                        cells = "  ".join(f"{L}: {t:6.2f}" for L, t in times.items())
                        print(f"H {H:5d}  {C:3d} CTAs x {n:2d} columns  chunks {chunks}  mode {mode}  {cells}  ->  "
                              f"{slope:5.2f} us per layer + {fixed:5.2f}   (max rel. error {max(errs):.1e})",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
