"""Experiment: x^T @ dy with its update fused on a persistent ping-pong grid (pingpong.cu) against the product's
planned tile and cuBLAS's plain GEMM, on the weight gradients of the step's big layers (issue 65).

    PYTHONPATH=.:scripts python dev/pingpong/run.py [--shapes MxNxK ...] [--kernels pp_cr_sgd ...] [--trials 20]
                                                    [--configs wgpp wg128x2 ...]

Builds pingpong.cu appended to rawgpu/cu/gemm_wgmma.cu for sm_90a. Checks first: pp_cr_store against float64
(C poisoned), every update kernel bit for bit against the product's unsplit wg128 tile with the same optimiser
(momentum 0.9, or Adam) on fresh random inputs, the outputs poisoned where the update rewrites them. Then times
each kernel (CUDA events around a graph of launches rotating over copies beyond the L2, median of trials) beside the
product's planned GEMM of the same role and cuBLAS's plain fp16 GEMM (PyTorch). Shapes: M x N the weight (fan-in x
fan-out), K the batch. Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.gemm import bench_torch, gemm_shape
from benchmarks.timing import copies_for, time_graph
from rawgpu.cli.common import count
from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import Kernels
from rawgpu.kernels import gemm as G
from rawgpu.model import master, optimizer
from rawgpu.model.recipe import Recipe
from rawgpu.runtime import compiler, driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

HERE = Path(__file__).parent
KERNELS = {"pp_cr_store": ("store", 6, 2), "pp_cr_sgd": ("sgd", 4, 2), "pp_cr_sgd_e3": ("sgd", 4, 3),
           "pp_cr_sgd_s5": ("sgd", 5, 2), "pp_cr_sgd_s3e4": ("sgd", 3, 4), "pp_cr_sgd_s2e5": ("sgd", 2, 5),
           "pp_cr_adam": ("adam", 4, 2), "pp_cr_adam_s2e3": ("adam", 2, 3)}
EBUF = {"store": 8192, "sgd": 32768, "adam": 49152}


def compile_experiment() -> compiler.CompiledModule:
    """pingpong.cu appended to the product's gemm_wgmma.cu (its helpers and contract), for sm_90a; no GPU needed."""
    text = (compiler.SOURCE_DIR / "gemm_wgmma.cu").read_text() + '\n#line 1 "pingpong.cu"\n' + \
        (HERE / "pingpong.cu").read_text()
    return compiler.compile_variant("gemm_wgmma.cu", text, "sm_90", kernel="gemm_wg128_cr_store_f32")


def build() -> driver.Module:
    module = compile_experiment()
    for name, r in sorted(module.resources.items()):
        if name.startswith("pp_"):
            print(f"# {name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads}, stack {r.stack_frame}")
    return driver.Module(module.cubin, module.resources, module.signatures)


def recipe_for(epi: str) -> Recipe:
    return Recipe(optimizer="adam") if epi == "adam" else Recipe(momentum=0.9)


class Weights:
    """One copy of a layer's operands and update state in an arena: A (x, [K, M]), B (dy, [K, N]), the master
    halves, the states, and (store) C."""

    def __init__(self, arena: Arena, tag: str, M: int, N: int, K: int, states: int):
        self.A = arena.tensor(f"A{tag}", (K, M), np.float16)
        self.B = arena.tensor(f"B{tag}", (K, N), np.float16)
        self.w16 = arena.tensor(f"W16{tag}", (M, N), np.float16)
        self.lo = arena.tensor(f"lo{tag}", (M, N), np.int16)
        self.states = [arena.tensor(f"s{i}{tag}", (M, N), np.float32) for i in range(states)]

    def fill(self, rng, M, N, K):
        self.A.upload((rng.standard_normal((K, M)) * 0.5).astype(np.float16))
        self.B.upload((rng.standard_normal((K, N)) * 0.5).astype(np.float16))
        hi, lo = master.split((rng.standard_normal((M, N)) * 0.05).astype(np.float32))
        self.w16.upload(hi)
        self.lo.upload(lo)
        for s in self.states:
            s.upload(np.abs(rng.standard_normal((M, N))).astype(np.float32) * 1e-3)

    def snapshot(self):
        return [t.download().copy() for t in (self.w16, self.lo, *self.states)]

    def restore(self, snap):
        for t, v in zip((self.w16, self.lo, *self.states), snap):
            t.upload(v)


def operand_sets(arena: Arena, rng, opt: str, M: int, N: int, K: int, copies: int, lr: float):
    """`copies` fresh sets of a layer's operands (opt: "sgd" with momentum or "adam") and the optimiser's table at
    learning rate lr, in `arena` (allocated here): the limits and timeline experiments' inputs."""
    sets = [Weights(arena, str(i), M, N, K, 2 if opt == "adam" else 1) for i in range(copies)]
    optim = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
    arena.allocate()
    arena.zero()
    for w in sets:
        w.fill(rng, M, N, K)
    optim.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(recipe_for(opt)), 3, lr)))
    return sets, optim


def same_update(outs, before) -> tuple[list[int], int, bool]:
    """Two builds' (w16, lo, states) after the same update from `before`: differing bytes per array, how many lo
    elements the first changed, and whether they agree with the update doing something (the variant checks')."""
    diff = [int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8))) for a, b in zip(*outs)]
    changed = int(np.count_nonzero(outs[0][1] != before[1]))
    return diff, changed, not any(diff) and changed > 0


def pp_launch(kern, sm_count, epi, stages, ebufs, w: Weights, M, N, K, optim, out=None):
    tmap = driver.tensor_map_2d
    map_a = tmap(w.A.ptr, M, K, 2 * M, 64, 64)
    map_b = tmap(w.B.ptr, N, K, 2 * N, 64, 64)
    if epi == "store":
        map_w = tmap(out.ptr, N, M, 2 * N, 64, 64)
        map_lo = map_mom = map_var = map_w
    else:
        map_w, map_lo = tmap(w.w16.ptr, N, M, 2 * N, 64, 64), tmap(w.lo.ptr, N, M, 2 * N, 64, 64)
        f32 = [tmap(s.ptr, 2 * N, M, 4 * N, 64, 64) for s in w.states]  # fp32 as pairs of 16-bit elements
        map_mom = f32[0] if f32 else map_w
        map_var = f32[1] if len(f32) > 1 else map_w
    tiles = -(-M // 128) * -(-N // 128)
    smem = stages * 32768 + ebufs * EBUF[epi] + 1024
    kern.ensure_shared(smem)
    return kern.bind(min(tiles, sm_count), 384, smem, map_a, map_b, map_w, map_lo, map_mom, map_var, M, N, K, optim,
                     int(epi != "store" and bool(w.states)))


def product_launch(kernels, device, epi, w: Weights, M, N, K, optim, ws, tickets, config=None, splits=None):
    plan = G.plan_gemm(M, N, K, "cr", epi, "f32", sm_count=device.sm_count, arch=device.arch, states=len(w.states),
                       config=config, splits=splits, capacity=G.cluster_capacity(kernels))
    mom = w.states[0] if w.states else None
    var = w.states[1] if len(w.states) > 1 else None
    return plan, G.gemm(kernels, plan, w.A, w.B, w.lo, mom=mom, var=var, w16=w.w16, optim=optim, workspace=ws,
                        tickets=tickets)


def check(module, kernels, device, stream, rng, shapes, names) -> bool:
    ok = True
    for M, N, K in shapes:
        for name in names:
            epi, stages, ebufs = KERNELS[name]
            states = {"store": 0, "sgd": 1, "adam": 2}[epi]
            with Arena() as arena:
                w = Weights(arena, "", M, N, K, states)
                C = arena.tensor("C", (M, N), np.float16)
                optim = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
                ws = arena.tensor("ws", (1 << 20,), np.float32)
                tickets = arena.tensor("tickets", (1 << 12,), np.int32)
                arena.allocate()
                arena.zero()
                w.fill(rng, M, N, K)
                if epi != "store":
                    optim.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(recipe_for(epi)), 3,
                                                                       1e-2)))
                launch = pp_launch(module.kernel(name), device.sm_count, epi, stages, ebufs, w, M, N, K, optim, C)
                if epi == "store":
                    C.fill_bytes(0xFF)
                    launch.run(stream)
                    stream.synchronize()
                    ref = w.A.download().astype(np.float64).T @ w.B.download().astype(np.float64)
                    got = C.download().astype(np.float64)
                    err = float(np.abs(got - ref).max() / np.abs(ref).max()) if np.isfinite(got).all() else np.inf
                    good = err < 2e-3
                    print(f"check {name} {M}x{N}x{K}: max error {err:.2e} of the largest |C| (float64)"
                          f" {'ok' if good else 'FAIL'}")
                else:
                    before = w.snapshot()
                    _, prod = product_launch(kernels, device, epi, w, M, N, K, optim, ws, tickets, "wg128", 1)
                    prod.run(stream)
                    stream.synchronize()
                    want = w.snapshot()
                    w.restore(before)
                    launch.run(stream)
                    stream.synchronize()
                    got = w.snapshot()
                    diff = [int(np.count_nonzero(g.view(np.uint8) != x.view(np.uint8))) for g, x in zip(got, want)]
                    changed = int(np.count_nonzero(want[1] != before[1]))
                    good = not any(diff) and changed > 0
                    print(f"check {name} {M}x{N}x{K}: differing bytes vs wg128 (w16, lo, states) {diff}, "
                          f"{changed} lo changed {'ok' if good else 'FAIL'}")
                ok &= good
    return ok


def timing(module, kernels, device, stream, rng, shapes, names, trials, configs=()) -> None:
    print(f"# {device.name}: us per launch, median of {trials} graph replays; cuBLAS: plain fp16 x^T @ dy")
    for M, N, K in shapes:
        cells = []
        for epi in ("sgd", "adam", "store"):
            mine = [n for n in names if KERNELS[n][0] == epi]
            if not mine:
                continue
            states = {"store": 0, "sgd": 1, "adam": 2}[epi]
            per_copy = 2 * (M + N) * K + M * N * (4 + 4 * states if epi != "store" else 2)
            copies = copies_for(per_copy, device.l2_bytes, cap=16)
            with Arena() as arena:
                sets = [Weights(arena, str(i), M, N, K, states) for i in range(copies)]
                outs = [arena.tensor(f"C{i}", (M, N), np.float16) for i in range(copies)]
                optim = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
                ws = arena.tensor("ws", (1 << 22,), np.float32)
                tickets = arena.tensor("tickets", (1 << 14,), np.int32)
                arena.allocate()
                arena.zero()
                for w in sets:
                    w.fill(rng, M, N, K)
                opt = recipe_for("adam" if epi == "adam" else "sgd")
                optim.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(opt), 3, 1e-6)))
                launches = 20
                for name in mine:
                    _, stages, ebufs = KERNELS[name]
                    binds = [pp_launch(module.kernel(name), device.sm_count, epi, stages, ebufs, w, M, N, K, optim,
                                       o) for w, o in zip(sets, outs)]
                    us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(launches)],
                                    launches, trials)
                    cells.append(f"{name} {us:8.2f}")
                for config in ((None, *configs) if epi != "store" else ()):  # the planned tile, then those named
                    plan = None
                    binds = []
                    for w in sets:
                        plan, b = product_launch(kernels, device, epi, w, M, N, K, optim, ws, tickets, config,
                                                 1 if config else None)
                        binds.append(b)
                    us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(launches)],
                                    launches, trials)
                    cells.append(f"product {epi} {plan.config.name}/{plan.splits}{'' if config else ' (planned)'}"
                                 f" {us:8.2f}")
        cub = bench_torch("dW+sgd", M, N, K, 20, trials, device.l2_bytes)
        if cub is not None:
            cells.append(f"cuBLAS plain {cub:8.2f}")
        print(f"{M}x{N}x{K}:\n  " + "\n  ".join(cells), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", metavar="MxNxK",
                   default=[(4096, 4096, 1024), (4096, 4096, 4096), (8192, 8192, 1024)])
    p.add_argument("--check-shapes", type=gemm_shape, nargs="+", metavar="MxNxK",
                   default=[(1000, 776, 200), (4096, 4096, 1024), (784, 4096, 1024)])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--trials", type=count(1), default=20)
    p.add_argument("--configs", nargs="*", default=[], choices=[c for c in G.CONFIGS if G.CONFIGS[c].wgmma],
                   help="the product's tiles to time too (unsplit), beside the planned one: wgpp wg128x2 ...")
    args = p.parse_args(argv)
    for M, N, K in args.shapes + args.check_shapes:  # x^T [K, M] and dy [K, N] rows: whole 16-byte pieces
        if M % 8 or N % 8:
            p.error(f"{M}x{N}x{K}: M and N must be multiples of 8 (the copy engine's rows)")
    return run_cli(lambda: run(args), "pingpong")


def hopper(tool: str):
    """GPU 0 where it runs warpgroup MMA (sm_90); else None, after one line naming `tool` on stderr."""
    device = driver.Device(0)
    if device.arch != "sm_90":
        print(f"{tool}: error: warpgroup MMA needs sm_90; this GPU is {device.arch}", file=sys.stderr)
        return None
    return device


def run(args) -> int:
    if (device := hopper("pingpong")) is None:
        return 1
    module, kernels, stream = build(), Kernels(device.arch), driver.Stream()
    rng = np.random.default_rng(0)
    if not check(module, kernels, device, stream, rng, args.check_shapes, args.kernels):
        print("pingpong: a check failed; no timing", file=sys.stderr)
        return 1
    timing(module, kernels, device, stream, rng, args.shapes, args.kernels, args.trials, args.configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
