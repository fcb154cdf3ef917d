"""Experiment: Hopper's warpgroup MMA (wgmma, sm_90a) against gemm.cu's mma.sync tiles and cuBLAS at large M.

    python dev/wgmma/run.py [--shapes 4096x1024x1024 ...] [--kernels wg_rc_128 ...] [--trials 20]

Builds gemm_wgmma.cu for sm_90a with NVRTC, checks every kernel against float64 on random inputs (C poisoned first),
then times each (CUDA events around a graph of 20 launches, median of trials) beside rawgpu's planned GEMM of that
shape and layout (a plain fp16 store) and torch.matmul (cuBLAS). Shapes are MxNxK; "rc" kernels compute A @ Bt^T
(dy @ W^T), "rr" ones A @ B (x @ W), "cr" ones At^T @ B (x^T @ dy, the weight gradient: M and N the layer's fan-in
and fan-out, K the batch). Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from rawgpu.runtime import compiler, driver
from benchmarks.timing import time_graph
from rawgpu.kernels import Kernels
from rawgpu.kernels import gemm as G
from rawgpu.runtime.memory import Arena

KERNELS = ("wg_rc_128", "wg_rc_256", "wg_rr_128", "wg_rr_128_swap", "wg_rr_256", "wg_rr_256_swap", "wg_cr_128",
           "wg_cr_256")
SHARED = {128: 6 * (128 * 64 * 2 + 128 * 64 * 2) + 1024, 256: 4 * (128 * 64 * 2 + 256 * 64 * 2) + 1024}


def build() -> driver.Module:
    module = compiler.compile_file(Path(__file__).parent / "gemm_wgmma.cu", "sm_90a")
    for name, r in sorted(module.resources.items()):
        print(f"# {name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads}, stack {r.stack_frame}")
    return driver.Module(module.cubin)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x1024x1024", "4096x1024x784", "1024x256x256",
                                                   "4096x4096x4096", "128x4096x4096"])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--trials", type=int, default=20)
    args = p.parse_args()
    device = driver.Device(0)
    module, kernels, stream = build(), Kernels(device.arch), driver.Stream()
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    print(f"# {device.name}; us per launch (TFLOP/s), median of {args.trials} x 20; err: rel. to float64")
    for shape in args.shapes:
        M, N, K = (int(x) for x in shape.split("x"))
        a = (rng.standard_normal((M, K)) / np.sqrt(K)).astype(np.float16)
        b = rng.standard_normal((K, N)).astype(np.float16)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        flops = 2 * M * N * K
        plans = {layout: G.plan_gemm(M, N, K, layout, "store", sm_count=device.sm_count, arch=device.arch)
                 for layout in ("rr", "rc", "cr")}
        with Arena() as arena:
            tA, tB, tBt = (arena.tensor("A", (M, K), np.float16), arena.tensor("B", (K, N), np.float16),
                           arena.tensor("Bt", (N, K), np.float16))
            tAt = arena.tensor("At", (K, M), np.float16)
            tC = arena.tensor("C", (M, N), np.float16)
            ws = arena.tensor("ws", max(1, max(q.workspace_floats for q in plans.values())), np.float32)
            tickets = arena.tensor("tickets", max(1, max(q.tickets for q in plans.values())), np.int32)
            arena.allocate()
            arena.zero()
            tA.upload(a), tB.upload(b), tBt.upload(np.ascontiguousarray(b.T)), tAt.upload(np.ascontiguousarray(a.T))
            cells = []
            for name in args.kernels:
                bn, rowb, cola = (256 if "256" in name else 128), "_rc_" not in name, "_cr_" in name
                kern = module.kernel(name, "ttpiii")
                kern.ensure_shared(SHARED[bn])
                map_a = (driver.tensor_map_2d(tAt.ptr, M, K, M * 2, 64, 64) if cola
                         else driver.tensor_map_2d(tA.ptr, K, M, K * 2, 64, 128))
                map_b = (driver.tensor_map_2d(tB.ptr, N, K, N * 2, 64, 64) if rowb
                         else driver.tensor_map_2d(tBt.ptr, K, N, K * 2, 64, bn))
                launch = kern.bind((-(-M // 128), -(-N // bn), 1), 384, SHARED[bn], map_a, map_b, tC, M, N, K)
                tC.fill_bytes(0xFF)
                launch.run(stream)
                stream.synchronize()
                got = tC.download().astype(np.float64)
                err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.isfinite(got).all() else float("nan")
                us = time_graph(stream, lambda: [launch.run(stream) for _ in range(20)], 20, args.trials)
                cells.append(f"{name} {us:8.2f} ({flops / us / 1e6:5.0f}) err {err:.1e}")
            for layout, at, bt in (("rr", tA, tB), ("rc", tA, tBt), ("cr", tAt, tB)):
                plan = plans[layout]
                launch = G.gemm(kernels, plan, at, bt, tC, workspace=ws, tickets=tickets)
                us = time_graph(stream, lambda: [launch.run(stream) for _ in range(20)], 20, args.trials)
                cells.append(f"rawgpu {layout} {plan.config.name}/{plan.splits} {us:8.2f} ({flops / us / 1e6:5.0f})")
            if torch is not None:
                ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
                tat = torch.from_numpy(np.ascontiguousarray(a.T)).cuda()
                ts = torch.cuda.current_stream()
                for label, lhs in (("A @ B", ta), ("At^T @ B", tat.t())):
                    times = []
                    for _ in range(args.trials):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record(ts)
                        for _ in range(20):
                            torch.matmul(lhs, tb)
                        e1.record(ts)
                        e1.synchronize()
                        times.append(e0.elapsed_time(e1) * 1e3 / 20)
                    us = statistics.median(times[1:])
                    cells.append(f"cuBLAS {label} {us:8.2f} ({flops / us / 1e6:5.0f})")
        print(f"{shape}:\n  " + "\n  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
