"""NVRTC: our `.cu` sources -> cubin for one `sm_XY`, with the ptxas resource report and an on-disk cache.

We always build a cubin (SASS) for the exact architecture, never PTX: the driver then has nothing to JIT,
and an older driver than the NVRTC that built it still loads it. Every build also gets what rawgpu/contract/
says the source shares with Python (its -D defines and generated headers, held in memory). The cache key is a
hash of every source and header text, the generated ones included, the options, the NVRTC version and the arch,
so any edit rebuilds and nothing stale loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .. import contract
from ..contract.activation import DEFAULT_ACTIVATION
from .errors import CompileError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # rawgpu/: its cu/ and ptx/ folders
SOURCE_DIR = PACKAGE_DIR / "cu"
INCLUDE_DIR = PACKAGE_DIR / "ptx"
BASE_OPTIONS = ("-std=c++17", "-default-device", "-Xptxas=-v", "-lineinfo")
_CACHE_MAGIC = b"rawgpu-cubin-v2\n"  # v2: the kernels' signatures kept
# NVRTC honours the CUDA compute cache, and a build served from it prints no ptxas report, so resource
# reports would come back empty. We cache cubins ourselves, so NVRTC's cache is switched off, before NVRTC
# is first loaded (it reads the setting then). We never JIT PTX, so the driver loses nothing by it.
os.environ["CUDA_CACHE_DISABLE"] = "1"


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel: the numbers that decide occupancy and reveal local-memory use."""

    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_static: int = 0
    stack_frame: int = 0
    barriers: int = 0


@dataclass
class CompiledModule:
    """A cubin, the arch it is for, and the per-kernel resource report."""

    source: str
    arch: str
    cubin: bytes
    resources: dict[str, KernelResources] = field(default_factory=dict)
    log: str = ""
    cached: bool = False
    ptx: str | None = None  # the PTX NVRTC made on the way (a fresh build only; ptx_of reads it back from the cache)
    signatures: dict[str, str] = field(default_factory=dict)  # kernel -> its parameters' kinds (entry_signatures)


# A kernel's parameters as the driver passes them (driver.py's signature letters), read from the PTX entry: 8 bytes
# (a device address or an int64: p), 4 (int32: i; float: f), a 128-byte tensor map (t).
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(\[\d+\])?")
_PARAM_KINDS = {"u64": "p", "s64": "p", "b64": "p", "u32": "i", "s32": "i", "b32": "i", "f32": "f"}


def entry_signatures(ptx: str) -> dict[str, str]:
    """kernel -> its parameters' kinds, read from the `.entry` declarations of `ptx`: the one place a launcher's
    argument layout comes from (the kernel as compiled; nothing is typed twice)."""
    out = {}
    for body in ptx.split(".entry ")[1:]:
        name, rest = body.split("(", 1)
        kinds = []
        for m in _PARAM.finditer(rest.split(")", 1)[0]):
            kind = "t" if m[2] == "[128]" and m[1] == "b8" else None if m[2] else _PARAM_KINDS.get(m[1])
            if kind is None:
                raise CompileError(f"kernel {name.strip()}: a parameter of PTX type .{m[1]}{m[2] or ''} has no "
                                   "launcher kind (driver.py passes 8-, 4- and 128-byte tensor-map values)")
            kinds.append(kind)
        out[name.strip()] = "".join(kinds)
    return out


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CompileError(f"cuda-bindings is not installed ({exc}); install rawgpu with its CUDA stack: "
                           'pip install ".[cu13]" (or ".[cu12]")') from None
    return nvrtc


def _check(result, call: str):
    """nvrtc calls return `(nvrtcResult, *values)`; raise on anything but success."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CompileError(f"{call} failed: {name}")
    return values[0] if len(values) == 1 else (values or None)


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor), checked to belong to the same CUDA stack as the bindings: a CUDA 12 install beside a
    CUDA 13 one can hand the 12.x bindings NVRTC 13, whose cubins a CUDA-12-only driver cannot load."""
    from cuda.bindings import __version__ as bindings

    nvrtc = _nvrtc()
    try:
        version = tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    except CompileError:
        raise
    except Exception as exc:  # the library itself is missing: the bindings raise their own error types
        raise CompileError(f"NVRTC not found ({exc.__class__.__name__}: {exc}); install rawgpu with its CUDA stack: "
                           'pip install ".[cu13]" (or ".[cu12]")') from None
    if version[0] != int(bindings.split(".")[0]):
        raise CompileError(f"NVRTC {version[0]}.{version[1]} was loaded with cuda-bindings {bindings}: two CUDA stacks "
                           f'are installed; use a fresh virtual environment with pip install ".[cu{bindings.split(".")[0]}]"')
    return version  # type: ignore[return-value]


@lru_cache(maxsize=1)
def supported_archs() -> tuple[str, ...]:
    return tuple(f"sm_{a}" for a in _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def normalize_arch(arch: str | tuple[int, int]) -> str:
    """Accept 'sm_86', '86', (8, 6); check that this NVRTC can build a cubin for it."""
    if isinstance(arch, tuple):
        arch = f"sm_{arch[0]}{arch[1]}"
    typed = str(arch).strip()
    arch = typed.lower()
    if not arch.startswith("sm_"):
        arch = "sm_" + arch
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise CompileError(f"bad GPU architecture {typed!r}: expected a name like 'sm_86' (or '86')")
    if arch.rstrip("a") not in supported_archs():
        major, minor = nvrtc_version()
        raise CompileError(f"NVRTC {major}.{minor} cannot build for {arch}; it supports {', '.join(supported_archs())}")
    return arch


def cache_dir() -> Path:
    root = os.environ.get("RAWGPU_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "rawgpu") / "kernels"


def source_texts() -> dict[str, bytes]:
    """Every file a kernel source can see: the `.cu` files and all headers. Part of every cache key."""
    files = sorted(list(SOURCE_DIR.glob("*.cu")) + list(SOURCE_DIR.glob("*.cuh")) + list(INCLUDE_DIR.glob("*.cuh")))
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in files}


Generated = tuple[tuple[str, ...], dict[str, str]]


def cache_key(source: str, arch: str, options: tuple[str, ...], texts: dict[str, bytes] | None = None,
              generated: Generated | None = None, kernel: str | None = None,
              activation: str = DEFAULT_ACTIVATION) -> str:
    """generated: contract.build's (defines, headers) for this source, arch, kernel and activation (default: asked
    for now); a kernel built alone differs from the whole source by its generated instance list."""
    h = hashlib.sha256()
    texts = source_texts() if texts is None else texts
    defines, headers = contract.build(source, arch, kernel, activation) if generated is None else generated
    for name in sorted(texts):
        h.update(name.encode() + b"\0" + hashlib.sha256(texts[name]).digest())
    for name in sorted(headers):
        h.update(f"generated/{name}".encode() + b"\0" + hashlib.sha256(headers[name].encode()).digest())
    h.update(repr((source, kernel, contract.nvrtc_arch(source, arch), BASE_OPTIONS, tuple(defines), options,
                   nvrtc_version())).encode())
    return h.hexdigest()[:32]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, \d+ bytes cumulative stack size)?"
                   r"(?:, (\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Parse `-Xptxas -v` output into one KernelResources per entry function."""
    out: dict[str, KernelResources] = {}
    current: dict | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = {"name": m.group(1)}
            out[current["name"]] = KernelResources(**current)
        elif current is not None and (m := _PROPS.search(line)):
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            out[current["name"]] = KernelResources(**current)
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), shared_static=int(m.group(3) or 0))
            out[current["name"]] = KernelResources(**current)
    return out


def _nvrtc_compile(source: str, arch: str, options: tuple[str, ...],
                   generated: Generated | None = None, text: bytes | None = None) -> CompiledModule:
    """The cubin, its ptxas report and the PTX on the way. generated: contract.build's (defines, headers) for this
    source and arch (default: asked for now); text: the source's text (default: the file's)."""
    path = SOURCE_DIR / source
    if not path.is_file():
        raise CompileError(f"no kernel source {path}")
    defines, headers = contract.build(source, arch) if generated is None else generated  # headers: included by name
    opts = (*BASE_OPTIONS, f"-arch={contract.nvrtc_arch(source, arch)}", f"-I{INCLUDE_DIR}", f"-I{SOURCE_DIR}",
            *defines, *options)
    return _run_nvrtc(source, path.read_bytes() if text is None else text, headers, opts, arch)


def compile_file(path: Path, arch: str, options: tuple[str, ...] = ()) -> CompiledModule:
    """Build a kernel source outside rawgpu/cu (an experiment in dev/) for `arch` as it is, with our PTX headers on
    the include path and no contract defines; never cached."""
    path = Path(path)
    if not path.is_file():
        raise CompileError(f"no kernel source {path}")
    opts = (*BASE_OPTIONS, f"-arch={arch}", f"-I{INCLUDE_DIR}", f"-I{SOURCE_DIR}", *options)
    return _run_nvrtc(path.name, path.read_bytes(), {}, opts, arch)


def compile_variant(source: str, text: str, arch: str | tuple[int, int], options: tuple[str, ...] = (), *,
                    kernel: str | None = None) -> CompiledModule:
    """Build `text`, a changed copy of `rawgpu/cu/<source>` that dev/ makes (profiling marks, parts taken out), with
    everything the contract gives that source, for `arch` (or only `kernel`); never cached."""
    arch = normalize_arch(arch)
    return _nvrtc_compile(source, arch, tuple(options), contract.build(source, arch, kernel), text.encode())


def _run_nvrtc(name: str, text: bytes, headers: dict[str, str], options: tuple[str, ...],
               arch: str) -> CompiledModule:
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(text, name.encode(), len(headers),
                                           [h.encode() for h in headers.values()],
                                           [n.encode() for n in headers]), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise CompileError(f"NVRTC could not compile {name} for {arch} ({getattr(err, 'name', err)}):\n{log.strip()}")
        ptx = _program_output(nvrtc, prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\0 ").decode()
        cubin = _program_output(nvrtc, prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledModule(name, arch, cubin, parse_ptxas_report(log), log, ptx=ptx, signatures=entry_signatures(ptx))


def _program_output(nvrtc, prog, get_size, get) -> bytes:
    size = _check(get_size(prog), get_size.__name__)
    out = b" " * size
    _check(get(prog, out), get.__name__)
    return out


def ptx_of(source: str, arch: str | tuple[int, int], kernel: str | None = None) -> dict[str, str]:
    """The PTX NVRTC made of `rawgpu/cu/<source>` (or of its `kernel` alone) on the way to the cubin for `arch`, per
    entry function (name -> body): for reading what a kernel compiles to, and for tests of which instructions it
    holds. Kept beside the cache entry, so a build serves both; never loaded (the driver gets cubins)."""
    arch = normalize_arch(arch)
    generated = contract.build(source, arch, kernel)
    path = _cache_path(source, arch, (), None, generated, kernel)
    try:
        text = path.with_suffix(".ptx").read_text()
    except OSError:  # not built yet, or built before the PTX was kept: build it (the cubin entry too)
        module = _nvrtc_compile(source, arch, (), generated=generated)
        _keep(path, module)
        text = module.ptx
    entries = text.split(".entry ")[1:]
    return {body.split("(", 1)[0].strip(): body for body in entries}


def _write_cache(path: Path, module: CompiledModule) -> None:
    meta = {"source": module.source, "arch": module.arch, "sha256": hashlib.sha256(module.cubin).hexdigest(),
            "log": module.log, "signatures": module.signatures}
    path.parent.mkdir(parents=True, exist_ok=True)
    if module.ptx is not None:  # first: an entry whose PTX is missing is rebuilt by ptx_of, not the reverse
        _write_file(path.with_suffix(".ptx"), module.ptx.encode())
    _write_file(path, _CACHE_MAGIC + json.dumps(meta).encode() + b"\n" + module.cubin)


def _write_file(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the old entry or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_cache(path: Path) -> CompiledModule | None:
    """The cached module, or None when absent or corrupt (a corrupt entry is deleted so it gets rebuilt)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(_CACHE_MAGIC):
            raise ValueError("bad magic")
        header, cubin = data[len(_CACHE_MAGIC):].split(b"\n", 1)
        meta = json.loads(header)
        if hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
            raise ValueError("cubin hash mismatch")
        log = meta["log"]  # the report is parsed again, so a fixed parser also reads the entries built before it
        return CompiledModule(meta["source"], meta["arch"], cubin, parse_ptxas_report(log), log, cached=True,
                              signatures=dict(meta["signatures"]))  # an entry from before they were kept: rebuilt
    except (ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)
        return None


def _cache_path(source: str, arch: str, options: tuple[str, ...], texts: dict[str, bytes] | None = None,
                generated: Generated | None = None, kernel: str | None = None,
                activation: str = DEFAULT_ACTIVATION) -> Path:
    stem = Path(source).stem + (f"-{kernel}" if kernel else "")
    return cache_dir() / f"{stem}-{arch}-{cache_key(source, arch, options, texts, generated, kernel, activation)}.cubin"


def is_cached(source: str, arch: str | tuple[int, int], options: tuple[str, ...] = (), kernel: str | None = None,
              activation: str = DEFAULT_ACTIVATION) -> bool:
    """Whether a build of `source` (or of its `kernel` alone) for `arch` and `activation` sits in the cache."""
    return _cache_path(source, normalize_arch(arch), tuple(options), kernel=kernel, activation=activation).is_file()


def compile_source(source: str, arch: str | tuple[int, int], options: tuple[str, ...] = (), *,
                   kernel: str | None = None, activation: str = DEFAULT_ACTIVATION, use_cache: bool = True,
                   texts: dict[str, bytes] | None = None) -> CompiledModule:
    """Build `rawgpu/cu/<source>` for `arch` (or only `kernel`, one of contract.split_kernels(source)), applying
    `activation` where the source applies one, from the cache when an identical build exists."""
    arch = normalize_arch(arch)
    options = tuple(options)
    generated = contract.build(source, arch, kernel, activation)  # one answer for the key and the build
    path = _cache_path(source, arch, options, texts, generated, kernel)
    if use_cache and (hit := _read_cache(path)) is not None:
        return hit
    module = _nvrtc_compile(source, arch, options, generated=generated)
    if use_cache:
        _keep(path, module)
    return module


def _keep(path: Path, module: CompiledModule) -> None:
    try:
        _write_cache(path, module)
    except OSError:
        pass  # a read-only cache costs speed, not correctness


def all_sources() -> list[str]:
    return sorted(p.name for p in SOURCE_DIR.glob("*.cu"))


Unit = tuple[str, "str | None"]  # (source, one of its split kernels or None: the whole source)


def unit_of(source: str, kernel: str) -> Unit:
    """The unit of compilation that holds `kernel` of `source`."""
    return (source, kernel) if kernel in contract.split_kernels(source) else (source, None)


def all_units(arch: str | None = None) -> list[Unit]:
    """Every unit a session may compile (on `arch`: the instances built for it): each split kernel alone, every
    other source whole."""
    return [(s, k) for s in all_sources() for k in (contract.split_kernels(s, arch) or [None])]
