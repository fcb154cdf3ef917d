"""gather.cu (kernels/gather.py): the table gather's instances, one per feature dtype, target kind and scaling; the
standardization's, one per feature dtype. gather_forward.cu (kernels/gather_forward.py): the table gather with the
first layer's forward, the same instances, and its block shape."""

from __future__ import annotations

from .abi import header

GATHER_TABLE_DTYPES = {"u8": "u8", "f16": "half_t", "f32": "float"}  # feature dtype -> its C type
# gather_batch's block: a thread per 16 columns up to this many (its launch bound: registers for any launch); wider
# rows take several 16-column steps a thread
GATHER_MAX_THREADS = 256
GATHER_TABLE_TARGETS = ("labels", "values")  # int32 class labels, or K float32 values


def gather_table_kernel(dtype: str, target: str, standardized: bool) -> str:
    return f"gather_table_{dtype}_{target}" + ("_std" if standardized else "")


def gather_table_kernels() -> list[str]:
    return [gather_table_kernel(d, t, s) for d in GATHER_TABLE_DTYPES for t in GATHER_TABLE_TARGETS
            for s in (False, True)]


def gather_forward_kernel(dtype: str, target: str, standardized: bool) -> str:
    return f"gather_forward_{dtype}_{target}" + ("_std" if standardized else "")


def gather_forward_kernels() -> list[str]:
    return [gather_forward_kernel(d, t, s) for d in GATHER_TABLE_DTYPES for t in GATHER_TABLE_TARGETS
            for s in (False, True)]


# gather_forward.cu's block: GF_ROWS batch rows by 2 GF_THREADS output columns; the first layer's padded inputs it
# takes (a thread gathers 8 of a row: GF_ROWS x GF_MAX_INPUTS / 8 <= GF_THREADS)
GF_ROWS, GF_THREADS, GF_MAX_INPUTS = 4, 64, 64


def column_kernel(step: str, dtype: str) -> str:
    """The standardization's kernels: column_sums_<dtype> (per chunk of rows) and column_scaling_<dtype>."""
    return f"column_{step}_{dtype}"


def column_kernels() -> list[str]:
    return [column_kernel(step, d) for step in ("sums", "scaling") for d in GATHER_TABLE_DTYPES]


# columns_to_rows: a table's columns (float32 or float64, as its reader holds them) into the rows the model keeps
# (fp16 or fp32); a block makes COLUMNS_TILE_ROWS whole rows of up to COLUMNS_MAX features through shared memory.
COLUMN_DTYPES = {"f32": "float", "f64": "double"}  # a column's dtype -> its C type
ROW_DTYPES = {"f16": "half_t", "f32": "float"}  # the rows' dtype -> its C type
COLUMNS_TILE_ROWS, COLUMNS_MAX, COLUMNS_THREADS = 128, 64, 256


def columns_kernel(column: str, row: str) -> str:
    return f"columns_to_rows_{column}_{row}"


def columns_kernels() -> list[str]:
    return [columns_kernel(c, r) for c in COLUMN_DTYPES for r in ROW_DTYPES]


def _table_instances(kernel) -> str:
    """X(name, In, STD, VALUES) of every table instance that `kernel(dtype, target, standardized)` names."""
    return " ".join(f"X({kernel(d, t, s)}, {c}, {'true' if s else 'false'}, {'true' if t == 'values' else 'false'})"
                    for d, c in GATHER_TABLE_DTYPES.items() for t in GATHER_TABLE_TARGETS for s in (False, True))


def gather_facts(arch: str):
    instances = (f"#define GATHER_MAX_THREADS {GATHER_MAX_THREADS}\n"
                 "// The table gather's kernels: X(name, In, STD, VALUES) each.\n"
                 f"#define GATHER_TABLE_FOR_EACH_KERNEL(X) {_table_instances(gather_table_kernel)}\n")
    for step in ("sums", "scaling"):
        each = " ".join(f"X({column_kernel(step, d)}, {c})" for d, c in GATHER_TABLE_DTYPES.items())
        instances += f"#define COLUMN_{step.upper()}_FOR_EACH_KERNEL(X) {each}\n"
    each = " ".join(f"X({columns_kernel(c, r)}, {cc}, {rc})" for c, cc in COLUMN_DTYPES.items()
                    for r, rc in ROW_DTYPES.items())
    instances += (f"#define COLUMNS_TILE_ROWS {COLUMNS_TILE_ROWS}\n#define COLUMNS_MAX {COLUMNS_MAX}\n"
                  f"#define COLUMNS_THREADS {COLUMNS_THREADS}\n"
                  f"// columns_to_rows's kernels: X(name, In, Out) each.\n#define COLUMNS_FOR_EACH_KERNEL(X) {each}\n")
    return {}, {"gather_instances.cuh": header(__name__, "gather.cu", instances)}


def gather_forward_facts(arch: str):
    text = (f"#define GF_ROWS {GF_ROWS}\n#define GF_THREADS {GF_THREADS}\n#define GF_MAX_INPUTS {GF_MAX_INPUTS}\n"
            "// The kernels: X(name, In, STD, VALUES) each.\n"
            f"#define GATHER_FORWARD_FOR_EACH_KERNEL(X) {_table_instances(gather_forward_kernel)}\n")
    return {}, {"gather_forward_instances.cuh": header(__name__, "gather_forward.cu", text)}
