"""The tests' own reading of a kernel's parameters from its `extern "C" __global__` declaration in rawgpu/cu (the
product reads them from the compiled PTX: compiler.entry_signatures). Stand-ins for Kernels on the CPU use it to
check what a launcher binds without building anything: p for a pointer or an 8-byte integer, i int32, f float,
t a tensor map. The model axis's strides (*_MODEL_PARAMS) count in the *_models.cu sources alone."""

from __future__ import annotations

import re
from functools import lru_cache

from rawgpu.runtime.compiler import INCLUDE_DIR, SOURCE_DIR

_DECLARATION = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?'
                          r'([\w#]+)\s*\(([^)]*)\)')
_DEFINE = re.compile(r"^#define\s+(\w+)[ \t]+(.*)$", re.M)
_KINDS = {"int": "i", "i64": "q", "u64": "q", "float": "f"}  # q: an 8-byte integer (p in a build's signature)


def _text(path) -> str:
    return path.read_text().replace("\\\n", " ")  # macro bodies on one line


@lru_cache(maxsize=None)
def _declarations(source: str) -> list[tuple[str, str, bool]]:
    """(name or name pattern, signature, whether it takes the model axis) of every kernel declared in `source` (or
    the headers it includes)."""
    text = _text(SOURCE_DIR / source)
    headers = "".join(_text(p) for p in sorted(list(SOURCE_DIR.glob("*.cuh")) + list(INCLUDE_DIR.glob("*.cuh"))))
    for inc in re.findall(r'#include "(\w+\.cu)"', text):  # a source it includes (the *_models.cu)
        text += _text(SOURCE_DIR / inc)
    if not _DECLARATION.search(text):  # its kernels are declared by a header's macro (gemm_tma.cu)
        text += "".join(_text(SOURCE_DIR / inc) for inc in re.findall(r'#include "(\w+\.cuh)"', text)
                        if (SOURCE_DIR / inc).is_file())
    macros = {}
    for m in _DEFINE.finditer(headers + text):  # a *_MODEL_PARAMS has its model axis's and an empty definition
        if m[1].endswith("_PARAMS") and (m[2].strip() or m[1] not in macros):
            macros[m[1]] = m[2]
    out = []
    for match in _DECLARATION.finditer(text):
        name, params = match.groups()
        if name == "name":  # an X-macro's instances: named by the macro too (GATHER_TABLE makes gather_table_*)
            macro = re.findall(r"#define\s+(\w+)\(name\b", text[:match.start()])
            name = f"name:{macro[-1].lower()}" if macro else name
        letters = ""
        axis = source.endswith("_models.cu")  # built with the model axis: its strides follow
        takes_axis = "MODEL_PARAMS" in params
        for token in set(re.findall(r"\b\w+_PARAMS\b", params)):
            params = params.replace(token, macros[token] if axis or not token.endswith("MODEL_PARAMS") else "")
        for p in (p.strip() for p in params.split(",") if p.strip()):
            if "TensorMap" in p:
                letters += "t"
            elif "*" in p:
                letters += "p"
            else:
                letters += _KINDS[p.replace("const ", "").split()[0]]
        out.append((name, letters, takes_axis))
    return out


def signature(source: str, name: str, integers: bool = False) -> str:
    """The parameters of kernel `name` of `source`, by its declaration (a literal name first, else the one
    declaration that makes the instances: `name(...)` in an X-macro, `prefix_##N(...)`), as the build spells them;
    integers: an 8-byte integer q apart from a pointer p."""
    letters = _signature(source, name)
    return letters if integers else letters.replace("q", "p")


def _signature(source: str, name: str) -> str:
    decls = _declarations(source)
    for declared, letters, _ in decls:
        if declared == name:
            return letters
    axis = source.endswith("_models.cu")  # only the declarations with the model axis make its instances
    generic = [(declared, letters) for declared, letters, takes_axis in decls if (takes_axis or not axis)
               and (declared.startswith("name") or ("##" in declared and name.startswith(declared.split("##")[0])))]
    if len({letters for _, letters in generic}) > 1:  # several X-macros: the one whose name begins the kernel's
        # (a GEMM's after gemm_: WG_INSTANCE's gemm_wg64k_*, WGPP_INSTANCE's gemm_wgpp_*; DX_UPDATE_KERNEL's
        # dx_update_*, UPDATE_STREAM_KERNEL's update_stream_*), the longest that does
        stem = lambda d: d[5:].removesuffix("_instance").removesuffix("_kernel")  # noqa: E731
        begins = [(d, letters) for d, letters in generic if d.startswith("name:")
                  and (name.startswith(d[5:]) or name.removeprefix("gemm_").startswith(stem(d)))]
        longest = max((len(stem(d)) for d, _ in begins), default=0)
        generic = [(d, letters) for d, letters in begins if len(stem(d)) == longest]
    generic = [letters for _, letters in generic]
    if len(set(generic)) != 1:
        raise LookupError(f"no one declaration of {name} in {source}: {decls}")
    return generic[0]
