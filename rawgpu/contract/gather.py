"""gather.cu (kernels/gather.py): the table gather's instances, one per feature dtype, target kind and scaling; the
standardization's, one per feature dtype."""

from __future__ import annotations

from .abi import header

GATHER_TABLE_DTYPES = {"u8": "u8", "f16": "half_t", "f32": "float"}  # feature dtype -> its C type
GATHER_TABLE_TARGETS = ("labels", "values")  # int32 class labels, or K float32 values


def gather_table_kernel(dtype: str, target: str, standardized: bool) -> str:
    return f"gather_table_{dtype}_{target}" + ("_std" if standardized else "")


def gather_table_kernels() -> list[str]:
    return [gather_table_kernel(d, t, s) for d in GATHER_TABLE_DTYPES for t in GATHER_TABLE_TARGETS
            for s in (False, True)]


def column_kernel(step: str, dtype: str) -> str:
    """The standardization's kernels: column_sums_<dtype> (per chunk of rows) and column_scaling_<dtype>."""
    return f"column_{step}_{dtype}"


def column_kernels() -> list[str]:
    return [column_kernel(step, d) for step in ("sums", "scaling") for d in GATHER_TABLE_DTYPES]


def gather_facts(arch: str):
    made = [f"X({gather_table_kernel(d, t, s)}, {c}, {'true' if s else 'false'}, {'true' if t == 'values' else 'false'})"
            for d, c in GATHER_TABLE_DTYPES.items() for t in GATHER_TABLE_TARGETS for s in (False, True)]
    instances = ("// The table gather's kernels: X(name, In, STD, VALUES) each.\n"
                 f"#define GATHER_TABLE_FOR_EACH_KERNEL(X) {' '.join(made)}\n")
    for step in ("sums", "scaling"):
        each = " ".join(f"X({column_kernel(step, d)}, {c})" for d, c in GATHER_TABLE_DTYPES.items())
        instances += f"#define COLUMN_{step.upper()}_FOR_EACH_KERNEL(X) {each}\n"
    return {}, {"gather_instances.cuh": header(__name__, "gather.cu", instances)}
