"""The models step's kernels (steps/models.py): today's kernels built with a model axis, one launch over every model
of a sweep. Each is a small source that sets its family's MODELS define and includes the family's source, so a model
runs the very arithmetic of the kernel it comes from; the product's own builds keep the define at 0."""

from __future__ import annotations

from .abi import header
from .gemm import (_C_LAYOUT, CONFIGS, PERSIST_BLOCKS_PER_SM, config_typedef, instance_name, kernel_name,
                   stream_stages)

GEMM_MODELS_SOURCE = "gemm_models.cu"
GATHER_MODELS_SOURCE = "gather_models.cu"
LOSS_MODELS_SOURCE = "loss_models.cu"
ELEMENTWISE_MODELS_SOURCE = "elementwise_models.cu"
DX_UPDATE_MODELS_SOURCE = "dx_update_models.cu"  # dx_update.cu's instances (contract/dx_update.py)
HEAD_MODELS_SOURCE = "head_models.cu"  # head.cu's instances (contract/head.py)

# The tiles a step of many models takes: a model's m tiles fill no GPU, N models do, so no split-K and no tile that
# streams one model's weight over every SM; 32 rows for batches of at most 32, else 64 (dev/sweep: the fastest).
MODEL_CONFIGS = ("32x128", "64x128")
MODEL_ROLES = (("rr", "bias"), ("rr", "bias_act"), ("rc", "dact"), ("cr", "sgd"), ("cr", "adam"))
MODEL_ACCUM = "f32"  # fp16 accumulation recipes are not swept in one step (steps/models.py says so)


def gemm_model_kernels() -> list[str]:
    return sorted(kernel_name(c, lay, epi, MODEL_ACCUM) for c in MODEL_CONFIGS for lay, epi in MODEL_ROLES)


def _gemm_models_header(kernel: str | None) -> str:
    """gemm.cu's instance header for the model-axis build: the model tiles' typedefs and their instances (f32
    only); with `kernel`, that one kernel alone."""
    lines = [line for name in MODEL_CONFIGS for line in config_typedef(CONFIGS[name])] + [""]
    for name in MODEL_CONFIGS:
        c = CONFIGS[name]
        for lay, epi in MODEL_ROLES:
            inst = instance_name(c.name, lay, epi)
            line = f"GEMM_INSTANCE({inst}_{MODEL_ACCUM}, {c.c_name}, {_C_LAYOUT[lay[0]]}, {_C_LAYOUT[lay[1]]}, " \
                   f"EPI_{epi.upper()}, false)"
            if kernel is None or kernel == f"{inst}_{MODEL_ACCUM}":
                lines.append(line)
    return "\n".join(lines) + "\n"


def gemm_models_facts(arch: str, kernel: str | None = None):
    defines = {"STREAM_STAGES": stream_stages(arch), "PERSIST_BLOCKS_PER_SM": PERSIST_BLOCKS_PER_SM}
    return defines, {"gemm_instances.cuh": header(__name__, GEMM_MODELS_SOURCE, _gemm_models_header(kernel))}


__all__ = ["GATHER_MODELS_SOURCE", "DX_UPDATE_MODELS_SOURCE", "ELEMENTWISE_MODELS_SOURCE", "HEAD_MODELS_SOURCE", "GEMM_MODELS_SOURCE",
           "LOSS_MODELS_SOURCE", "MODEL_ACCUM", "MODEL_CONFIGS", "MODEL_ROLES", "gemm_model_kernels",
           "gemm_models_facts"]
