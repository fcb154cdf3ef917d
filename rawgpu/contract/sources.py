"""What each kernel source is compiled with: the families' facts it includes, gathered for one build."""

from __future__ import annotations

import argparse
import re

from .activation import DEFAULT_ACTIVATION
from .arch import PLANNING_ARCH
from .activation import activation_facts
from .cluster import CS_TILE_COUNTS, cluster_facts, cluster_kernel_name
from .dx_sgd import dx_sgd_facts
from .dx_update import (DXU_BATCHES, DXU_FAMILIES, dx_update_facts, dxu_kernel_name, dxu_kernels,
                        dxu_stream_kernel_name, dxu_stream_kernels)
from .elementwise import elementwise_facts
from .fused import FS_KERNELS, fused_facts
from .gather import gather_facts, gather_forward_facts
from .gemm import (GEMM_SOURCE, GEMM_TMA_SOURCE, GEMM_WGMMA_SOURCE, all_kernel_names, epilogue_facts, gemm_facts,
                   gemm_tma_facts, gemm_wgmma_facts)
from .head import head_facts, head_kernels, head_models_facts
from .loss import loss_facts
from .narrow_update import narrow_update_facts
from .model_axis import (GATHER_MODELS_SOURCE, DX_UPDATE_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE, GEMM_MODELS_SOURCE,
                     HEAD_MODELS_SOURCE, LOSS_MODELS_SOURCE, gemm_model_kernels, gemm_models_facts)
from .optim import optim_facts, schedule_facts

# Per source, the facts of every shared header it includes (step_math.cuh: the schedule; optim.cuh: the optimiser;
# gemm_epilogue.cuh: the cluster splits, and it includes optim.cuh and activation.cuh: the activation) and its own.
# A source missing a define it needs stops at an #error naming the contract.
SOURCES = {
    "cluster_step.cu": (schedule_facts, cluster_facts),
    "gather.cu": (schedule_facts, optim_facts, gather_facts),
    "gather_forward.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, gather_forward_facts),
    "dx_sgd.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, dx_sgd_facts),
    "dx_update.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, dx_update_facts),
    "elementwise.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, elementwise_facts),
    "fused_step.cu": (schedule_facts, optim_facts, fused_facts),
    GEMM_SOURCE: (optim_facts, epilogue_facts, activation_facts, gemm_facts),
    GEMM_TMA_SOURCE: (optim_facts, epilogue_facts, activation_facts, gemm_tma_facts),
    GEMM_WGMMA_SOURCE: (optim_facts, epilogue_facts, activation_facts, gemm_wgmma_facts),
    "head.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, loss_facts, head_facts),
    "loss.cu": (loss_facts,),
    "narrow_update.cu": (schedule_facts, optim_facts, epilogue_facts, activation_facts, narrow_update_facts),
    # the models step's: a family's source with its model axis (contract/model_axis.py)
    GATHER_MODELS_SOURCE: (schedule_facts, optim_facts, gather_facts),
    DX_UPDATE_MODELS_SOURCE: (schedule_facts, optim_facts, epilogue_facts, activation_facts, dx_update_facts),
    ELEMENTWISE_MODELS_SOURCE: (schedule_facts, optim_facts, epilogue_facts, activation_facts, elementwise_facts),
    GEMM_MODELS_SOURCE: (optim_facts, epilogue_facts, activation_facts, gemm_models_facts),
    HEAD_MODELS_SOURCE: (schedule_facts, optim_facts, epilogue_facts, activation_facts, loss_facts, head_models_facts),
    LOSS_MODELS_SOURCE: (loss_facts,),
}

# They list instances: built one at a time too.
_INSTANCE_FACTS = (cluster_facts, fused_facts, gemm_facts, gemm_tma_facts, gemm_wgmma_facts, dx_update_facts,
                   head_facts, head_models_facts, gemm_models_facts)


# The sources that run Hopper's warpgroup MMA on sm_90: gemm_wgmma.cu's tiles, dx_update.cu's weight gradient
# (contract/dx_update.py: dxu_wgmma).
SM90A_SOURCES = (GEMM_WGMMA_SOURCE, "dx_update.cu", DX_UPDATE_MODELS_SOURCE)


def nvrtc_arch(source: str, arch: str) -> str:
    """The architecture NVRTC builds `source` for on a GPU of `arch`: warpgroup MMA needs sm_90's arch-specific
    features (sm_90a; the cubin loads on sm_90 parts only, the only ones with wgmma)."""
    return "sm_90a" if source in SM90A_SOURCES and arch == "sm_90" else arch


def split_kernels(source: str, arch: str | None = None) -> list[str]:
    """The kernels of a source of many template instances, each of which builds alone (a unit of compilation and
    of the cache), so that a step compiles only what it launches; [] for a source that builds whole. arch: only
    those built for that GPU (dx_update.cu builds no instance whose pipeline does not fit it)."""
    if source in (GEMM_SOURCE, GEMM_TMA_SOURCE, GEMM_WGMMA_SOURCE):
        return all_kernel_names(source)
    if source == "cluster_step.cu":
        return [cluster_kernel_name(t) for t in CS_TILE_COUNTS]
    if source == "fused_step.cu":
        return list(FS_KERNELS)
    if source in ("dx_update.cu", DX_UPDATE_MODELS_SOURCE):
        kernels = dxu_kernels(arch) if arch else [dxu_kernel_name(bb, f) for bb in DXU_BATCHES for f in DXU_FAMILIES]
        if source == DX_UPDATE_MODELS_SOURCE:  # the streamed update has a model axis only
            kernels += dxu_stream_kernels(arch) if arch else [dxu_stream_kernel_name(bb, f) for bb in DXU_BATCHES
                                                               for f in DXU_FAMILIES]
        return kernels
    if source == "head.cu":
        return head_kernels()
    if source == HEAD_MODELS_SOURCE:
        return head_kernels(("xent",))
    if source == GEMM_MODELS_SOURCE:
        return gemm_model_kernels()
    return []


def build(source: str, arch: str, kernel: str | None = None, activation: str = DEFAULT_ACTIVATION
          ) -> tuple[tuple[str, ...], dict[str, str]]:
    """What `source` is compiled with for `arch` (an 'sm_XY' name): the `-DNAME=value` options and the generated
    headers (include name -> text). A source that shares nothing gets ((), {}). kernel: one of split_kernels(source),
    built alone (the generated instance list names it only). activation: the one a source that applies it is built
    for (recipe.ACTIVATIONS; the others ignore it)."""
    if kernel is not None and kernel not in split_kernels(source, arch):
        raise ValueError(f"{source} has no kernel {kernel} that builds alone for {arch}")
    defines: dict[str, int] = {}
    headers: dict[str, str] = {}
    for facts in SOURCES.get(source, ()):
        if facts is activation_facts:
            d, h = facts(arch, activation)
        else:
            d, h = facts(arch, kernel) if facts in _INSTANCE_FACTS else facts(arch)
        defines.update(d)
        headers.update(h)
    return tuple(f"-D{name}={value}" for name, value in defines.items()), dict(sorted(headers.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rawgpu.contract",
                                 description="Print the defines and generated headers NVRTC gets for a source.")
    ap.add_argument("source", nargs="*", metavar="SOURCE",
                    help=f"sources (default: all of {', '.join(sorted(SOURCES))})")
    ap.add_argument("--arch", default=PLANNING_ARCH, help=f"the GPU architecture, e.g. sm_86 (default {PLANNING_ARCH})")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d{2,3}a?", args.arch):
        ap.error(f"argument --arch: expected a name like sm_86, got {args.arch!r}")
    if unknown := [name for name in args.source if name not in SOURCES]:
        ap.error(f"argument SOURCE: no kernel source {', '.join(unknown)}; the sources: {', '.join(sorted(SOURCES))}")
    for source in args.source or sorted(SOURCES):
        defines, headers = build(source, args.arch)
        print(f"==== {source} for {args.arch}: {' '.join(defines) or 'no defines'}")
        for name, text in headers.items():
            print(f"---- {name}\n{text}")
    return 0
