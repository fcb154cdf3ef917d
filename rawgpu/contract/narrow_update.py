"""narrow_update.cu (kernels/narrow_update.py): a narrow first layer's update, one instance per optimiser family."""

from __future__ import annotations

from .abi import header
from .gather import GF_MAX_INPUTS

# A block: NU_COLS columns of W by NU_KROWS of its rows, NU_THREADS threads; the first layers it takes: at most as many
# padded inputs as gather_forward takes (the tables whose first layer is narrow)
NU_COLS, NU_KROWS, NU_THREADS, NU_MAX_INPUTS = 32, 8, 256, GF_MAX_INPUTS
NU_FAMILIES = {"sgd": "EPI_SGD", "adam": "EPI_ADAM"}  # the optimiser family -> gemm_epilogue.cuh's update epilogue


def narrow_update_kernel(family: str) -> str:
    return f"narrow_update_{family}"


def narrow_update_facts(arch: str):
    each = " ".join(f"X({narrow_update_kernel(f)}, {epi})" for f, epi in NU_FAMILIES.items())
    text = (f"#define NU_COLS {NU_COLS}\n#define NU_KROWS {NU_KROWS}\n#define NU_THREADS {NU_THREADS}\n"
            f"// The kernels: X(name, EPI) each.\n#define NARROW_UPDATE_FOR_EACH_KERNEL(X) {each}\n")
    return {}, {"narrow_update_instances.cuh": header(__name__, "narrow_update.cu", text)}
