"""Experiment: the forward x @ W (+ bias, activation) and the input gradient dy @ W^T (x act'(z)) on the persistent
ping-pong grid (layers.cu), against the product's planned tile and cuBLAS (issue 65: every epilogue on the ping-pong
tile; the product runs only the updates there).

    PYTHONPATH=.:scripts python dev/pingpong/layers.py [--shapes MxNxK ...] [--kernels pp_rr_bias_act ...]
                                                       [--trials 20] [--sustained S]

Builds layers.cu appended to rawgpu/cu/gemm_wgmma.cu for sm_90a (the build's activation: relu). Checks first, on
fresh random inputs with the outputs poisoned: every kernel against float64 (x @ W, relu(x @ W + b), dy @ W^T, and
dy @ W^T where the saved h > 0) and bit for bit against the product's wg128 instance of the same role. Then times each
kernel beside the product's planned GEMM of its role and cuBLAS's plain fp16 GEMM (PyTorch), CUDA events around graphs
of 20 launches rotating over copies beyond the L2, median of trials; --sustained S replays each graph S seconds first
(the clock the GPU holds under it, as in training: docs/perf.md, Power). Shapes: M the batch's rows, N x K the layer
(fan-out x fan-in for x @ W; for dy @ W^T the fan-in is N). The *_none, *_nostores and *_nowrites kernels take the
epilogue, the copy engine's stores or the chunk writes out (timed, not checked). Lost against wg256mc (docs/history.md:
The forward and dx on the ping-pong tile); not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

from benchmarks.gemm import bench_torch, gemm_shape
from benchmarks.timing import copies_for, time_graph
from rawgpu.cli.common import count
from rawgpu.kernels import Kernels
from rawgpu.kernels import gemm as G
from rawgpu.model.recipe import Option, argument_type
from rawgpu.runtime import compiler, driver
from rawgpu.runtime.errors import run_cli
from rawgpu.runtime.memory import Arena

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("pingpong_run", HERE / "run.py")
_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_run)  # dev/pingpong/run.py: the sm_90 check, however this file is loaded
# kernel -> (layout, epilogue, stages, epilogue buffers): layers.cu's LAYER_INSTANCE lines
KERNELS = {"pp_rr_store": ("rr", "store", 6, 4), "pp_rr_bias_act": ("rr", "bias_act", 5, 4),
           "pp_rc_store": ("rc", "store", 6, 4), "pp_rc_dact": ("rc", "dact", 6, 4),
           "pp_rr_bias_act_s6e2": ("rr", "bias_act", 6, 2), "pp_rc_dact_s4e8": ("rc", "dact", 4, 8),
           "pp_rr_store_s4e8": ("rr", "store", 4, 8),
           # parts taken out (layers.cu's CUT), timed only: the epilogue, the stores, the consumer's chunk writes
           "pp_rr_none": ("rr", "none", 6, 4), "pp_rc_none": ("rc", "none", 6, 4),
           "pp_rr_nostores": ("rr", "none", 6, 4), "pp_rr_nowrites": ("rr", "none", 6, 4)}
EBUF = {"store": 8192, "bias_act": 16384, "dact": 8192, "none": 8192}
ROLE = {"rr": "fwd", "rc": "dx"}  # benchmarks.gemm's roles, for cuBLAS


def compile_experiment() -> compiler.CompiledModule:
    """layers.cu appended to the product's gemm_wgmma.cu (its helpers and contract), for sm_90a; no GPU needed."""
    text = (compiler.SOURCE_DIR / "gemm_wgmma.cu").read_text() + '\n#line 1 "layers.cu"\n' + \
        (HERE / "layers.cu").read_text()
    return compiler.compile_variant("gemm_wgmma.cu", text, "sm_90", kernel="gemm_wg128_rr_store_f32")


class Operands:
    """One copy of a layer's operands in an arena: A (x or dy, [M, K]), B (W [K, N], or W^T's rows [N, K] for
    dy @ W^T), the bias, C and the saved activation [M, N]."""

    def __init__(self, arena: Arena, tag: str, layout: str, M: int, N: int, K: int):
        self.A = arena.tensor(f"A{tag}", (M, K), np.float16)
        self.B = arena.tensor(f"B{tag}", (K, N) if layout == "rr" else (N, K), np.float16)
        self.bias = arena.tensor(f"bias{tag}", (N,), np.float32)
        self.C = arena.tensor(f"C{tag}", (M, N), np.float16)
        self.act = arena.tensor(f"act{tag}", (M, N), np.float16)

    def fill(self, rng):
        for t in (self.A, self.B):
            t.upload((rng.standard_normal(t.shape) * 0.5).astype(np.float16))
        self.bias.upload(rng.standard_normal(self.bias.shape).astype(np.float32))
        h = np.maximum(rng.standard_normal(self.act.shape), 0)  # relu's saved output: zero about half the time
        self.act.upload(h.astype(np.float16))


def layer_launch(kern, sm_count: int, name: str, o: Operands, M: int, N: int, K: int):
    layout, epi, stages, ebufs = KERNELS[name]
    tmap = driver.tensor_map_2d
    map_a = tmap(o.A.ptr, K, M, 2 * K, 64, 128)
    map_b = tmap(o.B.ptr, N, K, 2 * N, 64, 64) if layout == "rr" else tmap(o.B.ptr, K, N, 2 * K, 64, 128)
    map_c = tmap(o.C.ptr, N, M, 2 * N, 64, 64)
    map_act = tmap(o.act.ptr, N, M, 2 * N, 64, 64)
    smem = stages * 32768 + ebufs * EBUF[epi] + 1024
    kern.ensure_shared(smem)
    tiles = -(-M // 128) * -(-N // 128)
    return kern.bind(min(tiles, sm_count), 384, smem, map_a, map_b, map_c, map_act, M, N, K, o.bias, 0)


def product_launch(kernels, device, layout: str, epi: str, o: Operands, M, N, K, config=None, ws=None, tickets=None):
    """The product's GEMM of this role: the planned one, or `config` unsplit (ws, tickets: for a planned split)."""
    plan = G.plan_gemm(M, N, K, layout, epi, "f32", sm_count=device.sm_count, arch=device.arch, config=config,
                       splits=1 if config else None, capacity=G.cluster_capacity(kernels))
    return plan, G.gemm(kernels, plan, o.A, o.B, o.C, bias=o.bias if epi == "bias_act" else None,
                        act=o.act if epi == "dact" else None, workspace=ws, tickets=tickets)


def reference(layout: str, epi: str, o: Operands) -> np.ndarray:
    """float64: x @ W, relu(x @ W + b), dy @ W^T, or dy @ W^T where the saved h > 0 (the relu build)."""
    a, b = o.A.download().astype(np.float64), o.B.download().astype(np.float64)
    c = a @ (b if layout == "rr" else b.T)
    if epi == "bias_act":
        c = np.maximum(c + o.bias.download().astype(np.float64), 0)
    if epi == "dact":
        c = np.where(o.act.download() > 0, c, 0.0)
    return c


def check(module, kernels, device, stream, rng, shapes, names) -> bool:
    ok = True
    for M, N, K in shapes:
        for name in names:
            layout, epi, _, _ = KERNELS[name]
            if epi == "none":  # no outputs to check
                continue
            with Arena() as arena:
                o = Operands(arena, "", layout, M, N, K)
                arena.allocate()
                arena.zero()
                o.fill(rng)
                ref = reference(layout, epi, o)
                _, prod = product_launch(kernels, device, layout, epi, o, M, N, K, "wg128")
                o.C.fill_bytes(0xFF)
                prod.run(stream)
                stream.synchronize()
                want = o.C.download().copy()
                o.C.fill_bytes(0xFF)
                layer_launch(module.kernel(name), device.sm_count, name, o, M, N, K).run(stream)
                stream.synchronize()
                got = o.C.download()
            diff = int(np.count_nonzero(got.view(np.uint16) != want.view(np.uint16)))
            g64 = got.astype(np.float64)
            err = float(np.abs(g64 - ref).max() / np.abs(ref).max()) if np.isfinite(g64).all() else np.inf
            good = diff == 0 and err < 2e-3
            print(f"check {name} {M}x{N}x{K}: max error {err:.2e} of the largest |C| (float64), {diff} elements "
                  f"differ from wg128's {'ok' if good else 'FAIL'}", flush=True)
            ok &= good
    return ok


def timing(module, kernels, device, stream, rng, shapes, names, trials, sustained) -> None:
    how = f"each after {sustained:g} s of its replays" if sustained else "bursts"
    print(f"# {device.name}: us per launch, median of {trials} graph replays ({how}); cuBLAS: plain fp16")
    for M, N, K in shapes:
        cells = []
        for layout in ("rr", "rc"):
            mine = [n for n in names if KERNELS[n][0] == layout]
            if not mine:
                continue
            per_copy = 2 * (M * K + K * N + 2 * M * N)
            copies = copies_for(per_copy, device.l2_bytes, cap=16)
            with Arena() as arena:
                sets = [Operands(arena, str(i), layout, M, N, K) for i in range(copies)]
                ws = arena.tensor("ws", (1 << 22,), np.float32)
                tickets = arena.tensor("tickets", (1 << 14,), np.int32)
                arena.allocate()
                arena.zero()
                for o in sets:
                    o.fill(rng)
                launches = 20
                for name in mine:
                    binds = [layer_launch(module.kernel(name), device.sm_count, name, o, M, N, K) for o in sets]
                    us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(launches)],
                                    launches, trials, sustained)
                    cells.append(f"{name:<22} {us:8.2f}")
                for epi in dict.fromkeys(KERNELS[n][1] for n in mine if KERNELS[n][1] != "none"):
                    plan, binds = None, []
                    for o in sets:
                        plan, b = product_launch(kernels, device, layout, epi, o, M, N, K, ws=ws, tickets=tickets)
                        binds.append(b)
                    us = time_graph(stream, lambda: [binds[i % copies].run(stream) for i in range(launches)],
                                    launches, trials, sustained)
                    cells.append(f"product {layout} {epi} {plan.config.name}/{plan.splits} (planned) {us:8.2f}")
            cub = bench_torch(ROLE[layout], M, N, K, 20, trials, device.l2_bytes, sustained)
            if cub is not None:
                cells.append(f"cuBLAS plain {ROLE[layout]} {cub:8.2f}")
        print(f"{M}x{N}x{K}:\n  " + "\n  ".join(cells), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=gemm_shape, nargs="+", metavar="MxNxK",
                   default=[(4096, 4096, 4096), (1024, 4096, 4096), (2048, 8192, 8192), (1024, 8192, 8192)])
    p.add_argument("--check-shapes", type=gemm_shape, nargs="+", metavar="MxNxK",
                   default=[(1000, 776, 200), (4096, 4096, 1024), (300, 4096, 784)])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--trials", type=count(1), default=20)
    p.add_argument("--sustained", type=argument_type("--sustained", Option(None, float, 0.0, 3600.0)), default=0.0,
                   metavar="S", help="replay each graph S seconds before timing it (default 0: bursts)")
    args = p.parse_args(argv)
    for M, N, K in args.shapes + args.check_shapes:  # every row of A, B, C: whole 16-byte pieces
        if N % 8 or K % 8:
            p.error(f"{M}x{N}x{K}: N and K must be multiples of 8 (the copy engine's rows)")
    return run_cli(lambda: run(args), "pingpong layers")


def run(args) -> int:
    if (device := _run.hopper("pingpong layers")) is None:
        return 1
    compiled = compile_experiment()
    for name, r in sorted(compiled.resources.items()):
        if name.startswith("pp_"):
            print(f"# {name}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads}, stack {r.stack_frame}")
    module = driver.Module(compiled.cubin, compiled.resources, compiled.signatures)
    kernels, stream = Kernels(device.arch), driver.Stream()
    rng = np.random.default_rng(0)
    if not check(module, kernels, device, stream, rng, args.check_shapes, args.kernels):
        print("pingpong layers: a check failed; no timing", file=sys.stderr)
        return 1
    timing(module, kernels, device, stream, rng, args.shapes, args.kernels, args.trials, args.sustained)
    return 0


if __name__ == "__main__":
    sys.exit(main())
