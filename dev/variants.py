"""Experiment builds of the product's kernels, made here so that rawgpu/cu/ carries no experiment-only paths.

Two kinds of change, both on the text of `rawgpu/cu/<source>` and built with everything the contract gives that
source (compiler.compile_variant, never cached):

- marks: a product kernel names the points worth timing with comments, `// mark N: what ends here`,
  `// mark N if COND: ...` (only where COND holds) or `// mark next` (numbered in the order they run, from 0).
  `instrument` turns each into a stamp: thread 0 of block (0, 0, 0) writes %globaltimer and clock64 into
  rg_marks[2 i] and rg_marks[2 i + 1], a __device__ array of RG_MARKS pairs (-DRG_MARKS=n, default 32) that
  `read_marks` brings back. The comments cost the product nothing; the names in them are the profilers' labels.
- patches: `patch` replaces pieces of the text, each of which must occur exactly once, so that a product change
  stops the experiment with a line naming what moved instead of timing something else.

Used by dev/kernel_phases.py, dev/cluster_phases.py, dev/fused_phases.py, dev/backward/limits.py and
dev/sweep/stream_limits.py (VariantKernels: the product's launchers over a variant's build).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from rawgpu.kernels import Kernels
from rawgpu.runtime import compiler
from rawgpu.runtime.driver import Module, copy_device_to_host, copy_host_to_device

MARK = re.compile(r"^(?P<indent>[ \t]*)// mark (?P<at>\d+|next)(?: if (?P<cond>.+?))?(?:: (?P<name>.*))?$", re.M)
STAMPS = r'''
// dev/variants.py: the stamps of the `// mark` comments (thread 0 of block (0, 0, 0); read back by read_marks)
#ifndef RG_MARKS
#define RG_MARKS 32
#endif
__device__ unsigned long long rg_marks[2 * RG_MARKS];
#define RG_MARK(i)                                                                                   \
    do {                                                                                             \
        const int i_ = (i);                                                                          \
        if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && i_ < RG_MARKS) { \
            unsigned long long t_;                                                                   \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                   \
            rg_marks[2 * i_] = t_;                                                                   \
            rg_marks[2 * i_ + 1] = clock64();                                                        \
        }                                                                                            \
    } while (0)
'''


class VariantError(Exception):
    """The product's source no longer has what an experiment changes (one line: what, in which file)."""


def source_text(source: str) -> str:
    return (compiler.SOURCE_DIR / source).read_text()


def marks(text: str) -> dict[int, str]:
    """The numbered marks of a source in the order they run: number -> the name its comment gives (a number marked
    on two paths, such as an early return and the end, stands at its last place, with that name)."""
    out: dict[int, str] = {}
    for m in MARK.finditer(text):
        if m["at"] != "next":
            out.pop(int(m["at"]), None)
            out[int(m["at"])] = m["name"] or f"mark {m['at']}"
    return out


def instrument(text: str, source: str = "the source") -> str:
    """`text` with every `// mark` comment a stamp (module docstring)."""
    found = list(MARK.finditer(text))
    if not found:
        raise VariantError(f"{source} has no '// mark' comments")
    declared = False

    def stamp(m: re.Match) -> str:
        nonlocal declared
        at = m["at"]
        prefix = ""
        if at == "next":  # the first one, at the body's top level, declares the count
            at, prefix, declared = "rg_mark++", "" if declared else "int rg_mark = 0; ", True
        call = f"RG_MARK({at});"
        return m["indent"] + prefix + (f"if ({m['cond']}) {call}" if m["cond"] else call)

    body = MARK.sub(stamp, text)
    last_include = max(m.end() for m in re.finditer(r"^#include .*$", body, re.M))
    return body[:last_include] + "\n" + STAMPS + body[last_include:]


def patch(text: str, edits: list[tuple[str, str]], source: str = "the source") -> str:
    """`text` with each (old, new) of `edits` replaced, in order; each old must occur exactly once."""
    for old, new in edits:
        if (n := text.count(old)) != 1:
            first = old.strip().splitlines()[0]
            raise VariantError(f"{source}: {first!r} occurs {n} times (expected once): the experiment needs updating")
        text = text.replace(old, new)
    return text


def masked(source: str, edits: dict[int, list[tuple[str, str]]], mask: int) -> str:
    """`source`'s text with the edits of every bit of `mask` applied (patch), in the order `edits` lists the bits:
    the ablation experiments' parts taken out."""
    text = source_text(source)
    for bit, pieces in edits.items():
        if mask & bit:
            text = patch(text, pieces, source)
    return text


def build(source: str, text: str, arch: str, options: tuple[str, ...] = (), kernel: str | None = None):
    """The variant's compiled module (compiler.CompiledModule)."""
    return compiler.compile_variant(source, text, arch, options, kernel=kernel)


class VariantKernels(Kernels):
    """The package's kernels for `arch` with `source`'s units built from `text` (a variant: built apart, never
    cached; None: the package's own build), so that an experiment times the product's launchers over it."""

    def __init__(self, arch: str, source: str, text: str | None):
        super().__init__(arch)
        self.variant = (source, text)

    def _build(self, unit):
        source, text = self.variant
        if unit[0] != source or text is None:
            return super()._build(unit)
        return build(source, text, self.arch, kernel=unit[1])


TENSOR_OPS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(HGMMA|HMMA)\.(\S+) (.*)$", re.M)


def keep_gradient(dest: str, indent: str = "    ") -> str:
    """C text for a variant that takes out the only reader of G's accumulators (float gacc[GF][4]): a store that never
    runs (lr is never NaN) reading one value of each fragment, so that the compiler keeps G's multiply."""
    return (f"{indent}if (o.lr != o.lr) {{  // never: keeps G's multiply\n{indent}    float s = 0.f;\n"
            f"{indent}    for (int f = 0; f < GF; ++f) s += gacc[f][0];\n"
            f"{indent}    *reinterpret_cast<float*>({dest}) = s;\n{indent}}}\n")


def nvdisasm() -> str | None:
    """NVIDIA's disassembler: on PATH, or from the nvidia-cuda-nvdisasm wheel (the test extra); None if neither."""
    if found := shutil.which("nvdisasm"):
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(candidate)
    return None


def tensor_ops(cubin: bytes) -> dict[str, int]:
    """Kernel -> its tensor-core instructions (HGMMA, HMMA) that compute something. A part taken out that leaves no
    accumulator read lets the compiler drop the multiply (one HGMMA.64x8x16 on RZ stays, not counted here): an
    ablation must show that its multiply survived. Needs nvdisasm (RuntimeError without it)."""
    if (tool := nvdisasm()) is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra has it)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    counts = {}
    for section in re.split(r"^\s*\.section\s+\.text\.", sass, flags=re.M)[1:]:
        name = section.split(",", 1)[0].strip()
        counts[name] = sum(1 for op in TENSOR_OPS.finditer(section) if "RZ, gdesc[URZ], RZ" not in op.group(3))
    return counts


def load(source: str, text: str, arch: str, options: tuple[str, ...] = ()) -> Module:
    built = build(source, text, arch, options)
    return Module.of(built)


def clear_marks(module: Module) -> None:
    address, nbytes = module.global_address("rg_marks")
    copy_host_to_device(address, np.zeros(nbytes // 8, np.uint64))


def read_marks(module: Module) -> tuple[np.ndarray, np.ndarray]:
    """(%globaltimer ns, SM clock cycles) at each mark, as int64 arrays indexed by the mark's number."""
    address, nbytes = module.global_address("rg_marks")
    host = np.zeros(nbytes // 8, np.uint64)
    copy_device_to_host(host, address)
    pairs = host.astype(np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]
