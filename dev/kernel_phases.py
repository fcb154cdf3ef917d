"""Where a layered-step kernel's time goes: per-mark SM cycles of cu/head.cu or cu/dx_update.cu inside the step.

Builds the source with its profiling define (-DHEAD_PROFILE: thread 0 of CTA 0 stamps clock64 at every HEAD_MARK;
-DDXU_PROFILE: thread 0 of block (0, 0, 0) at every DXU_MARK), runs the step on MNIST with that build in place of
the kernel's --launch-th launch in the step (0: the first), one step at a time, and prints the median cycles that
close at each mark over --steps steps (after 20 warm-up steps), with the SM clock measured from %globaltimer over the
same span.

    python dev/kernel_phases.py --kernel head|dx_update --hidden 256 [--launch N] [--batch 128]
                                [--optimizer sgd|adam] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rawgpu.runtime import compiler
from rawgpu.data.datasets import load_mnist
from rawgpu.runtime.driver import Launch, Module, copy_device_to_host, copy_host_to_device
from rawgpu.model.recipe import Recipe
from rawgpu.training.session import Session

KERNELS = {  # source, define, stamp buffer, marks in the order they are passed
    "head": ("head.cu", "-DHEAD_PROFILE", "head_profile",
             {0: "entry", 1: "prologue loads issued", 2: "prior grid done", 3: "h loaded", 4: "partial logits",
              5: "partials received", 12: "own rows: logits summed", 13: "softmax", 6: "dlogits sent",
              7: "dlogits received", 8: "CTA 0: bias, metrics", 9: "dh", 10: "G + update", 15: "write-back"}),
    "dx_update": ("dx_update.cu", "-DDXU_PROFILE", "dxu_profile",
                  {0: "entry", 1: "prologue loads issued", 2: "prior grid done", 3: "chunk 0 landed",
                   4: "chunk 0: bias partials, dx", 5: "chunk 0: G", 6: "chunk 0: update", 7: "chunks written back",
                   8: "dx partials", 15: "dx summed and stored"}),
}
SLOTS = 16  # RG_PROFILE_MARKS (rawgpu/ptx/profile.cuh)


def profile(kernel: str, hidden: int, recipe_kw: dict, steps: int, which: int) -> None:
    source, define, buffer, names = KERNELS[kernel]
    session = Session(Recipe(hidden=hidden, total_steps=10 * steps, **recipe_kw))
    model, stream = session.model, session.stream
    model.upload_data(load_mnist())
    model.init_parameters(stream)
    model.set_permutation(np.random.default_rng(0).permutation(60000))
    built = compiler.compile_source(source, session.device.arch, (define,))
    module = Module(built.cubin, built.resources)
    stamps, nbytes = module.global_address(buffer)
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
    rows = []
    host = np.zeros(nbytes // 8, np.uint64)
    for i in range(steps + 20):
        copy_host_to_device(stamps, np.zeros_like(host))
        for launch in launches:
            launch.run(stream)
        stream.synchronize()
        copy_device_to_host(host, stamps)
        if i >= 20:
            rows.append(host.astype(np.int64).copy())
    stamps_all = np.array(rows)
    marks = list(names)
    cycles = stamps_all[:, marks[-1]] - stamps_all[:, 0]
    ns = stamps_all[:, SLOTS + 1] - stamps_all[:, SLOTS]
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
    p.add_argument("--kernel", choices=sorted(KERNELS), default="head")
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
