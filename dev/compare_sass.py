"""Is every kernel's machine code unchanged? Compare this checkout's SASS with a baseline copy of the package.

A refactor of the build (generated headers, -D defines, moved tables) must not change what runs. Each side builds
every rawgpu/cu source for an arch in its own process (the package imported from the given root, compiled into a
cache directory) and hashes each kernel's `.text.<name>` section of the cubin: the instructions alone. Line tables
(-lineinfo) and the ptxas report live elsewhere in the ELF, so edits that only move lines do not count.

    mkdir -p /tmp/base && git -C /work/main archive HEAD rawgpu | tar -x -C /tmp/base
    python dev/compare_sass.py /tmp/base --arch sm_80 --arch sm_86 --arch sm_90 [--source gather.cu ...]
                               [--renamed data.cu=gather.cu ...]

--source compares those sources alone; --renamed compares a source the checkout renamed under its new name.

Exit status 0 when every kernel of both sides is present in both and identical. Uses only the standard library
(and, in the child processes, the package under test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 file (a cubin)."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = []
    for i in range(shnum):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size (the rest is not needed)
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize)
        headers.append((name, kind, offset, size))
    _, _, str_off, str_size = headers[shstrndx]
    strtab = blob[str_off:str_off + str_size]
    out = {}
    for name, kind, offset, size in headers:
        label = strtab[name:strtab.index(b"\0", name)].decode()
        out[label] = b"" if kind == 8 else blob[offset:offset + size]  # SHT_NOBITS holds no bytes in the file
    return out


def kernel_text_hashes(cubin: bytes) -> dict[str, str]:
    """Kernel name -> sha256 of its `.text.<name>` section."""
    return {name[len(".text."):]: hashlib.sha256(data).hexdigest()
            for name, data in elf_sections(cubin).items() if name.startswith(".text.")}


def dump(arch: str, out: Path, jobs: int, sources: list[str] | None = None) -> None:
    """Child mode: build every source of the importable `rawgpu` for `arch` (RAWGPU_CACHE says where) and write
    {"package": path, "kernels": {source/kernel: sha256}, "resources": {source/kernel: ptxas numbers}}."""
    import rawgpu

    try:
        from rawgpu.runtime import compiler
    except ImportError:  # a baseline from before the folders by layer
        from rawgpu import compiler

    def build(source: str):
        return source, compiler.compile_source(source, arch)

    kernels, resources = {}, {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # NVRTC releases the GIL
        for source, module in pool.map(build, sources or compiler.all_sources()):
            for name, digest in kernel_text_hashes(module.cubin).items():
                kernels[f"{source}/{name}"] = digest
            for name, r in module.resources.items():
                resources[f"{source}/{name}"] = [r.registers, r.shared_static, r.stack_frame, r.spill_stores,
                                                 r.spill_loads, r.barriers]
    out.write_text(json.dumps({"package": str(Path(rawgpu.__file__).parent), "kernels": kernels,
                               "resources": resources}, indent=1, sort_keys=True))


def run_side(root: Path, arch: str, cache: Path, out: Path, jobs: int, sources: list[str] | None = None) -> dict:
    """Dump one side in a fresh interpreter whose `rawgpu` is the one under `root`."""
    env = dict(os.environ, PYTHONPATH=str(root), RAWGPU_CACHE=str(cache))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--dump", arch, str(out), "--jobs", str(jobs)]
    for source in sources or []:
        cmd += ["--source", source]
    subprocess.run(cmd, env=env, check=True, cwd=tempfile.gettempdir())
    result = json.loads(out.read_text())
    if Path(result["package"]).resolve() != (root / "rawgpu").resolve():
        raise SystemExit(f"the child imported {result['package']}, not {root / 'rawgpu'}: check PYTHONPATH")
    return result


def compare(base: dict, new: dict, renamed: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """(kernels compared, problems). renamed: a baseline source's name -> its name in the checkout."""
    problems, renamed = [], renamed or {}

    def now(key: str) -> str:
        source, kernel = key.split("/", 1)
        return f"{renamed.get(source, source)}/{kernel}"
    a = {now(k): v for k, v in base["kernels"].items()}
    base = dict(base, resources={now(k): v for k, v in base["resources"].items()})
    b = new["kernels"]
    for name in sorted(set(a) - set(b)):
        problems.append(f"only in the baseline: {name}")
    for name in sorted(set(b) - set(a)):
        problems.append(f"only in the checkout: {name}")
    both = sorted(set(a) & set(b))
    for name in both:
        if a[name] != b[name]:
            problems.append(f"machine code differs: {name}")
        elif base["resources"].get(name) != new["resources"].get(name):
            was, now = base["resources"].get(name), new["resources"].get(name)
            problems.append(f"ptxas report differs: {name}: {was} -> {now}")
    return len(both), problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", type=Path, help="directory holding the baseline rawgpu/ package")
    ap.add_argument("--arch", action="append", help="sm_XY; repeatable (default sm_80, sm_86, sm_90)")
    ap.add_argument("--checkout", type=Path, default=CHECKOUT, help="directory holding the rawgpu/ under test")
    ap.add_argument("--cache", type=Path, help="kernel cache for both sides (keys differ with any source change, so "
                                               "sharing is safe); default: a temporary directory")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel builds per side")
    ap.add_argument("--json", type=Path, help="write the per-arch results here")
    ap.add_argument("--source", action="append", help="only this rawgpu/cu source (repeatable; default: every one)")
    ap.add_argument("--renamed", action="append", default=[], metavar="OLD=NEW",
                    help="a source the checkout renamed (repeatable): its kernels are compared under the new name")
    ap.add_argument("--dump", nargs=2, metavar=("ARCH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dump:
        dump(args.dump[0], Path(args.dump[1]), args.jobs, args.source)
        return 0
    if args.base is None:
        ap.error("the baseline directory is required")
    archs = args.arch or ["sm_80", "sm_86", "sm_90"]
    failed, report = False, {}
    with tempfile.TemporaryDirectory(prefix="compare-sass-") as tmp:
        cache = args.cache or Path(tmp) / "cache"
        for arch in archs:
            renamed = dict(r.split("=", 1) for r in args.renamed)
            was = {new_name: old for old, new_name in renamed.items()}
            base_sources = [was.get(s, s) for s in args.source] if args.source else None
            base = run_side(args.base.resolve(), arch, cache, Path(tmp) / f"base-{arch}.json", args.jobs, base_sources)
            new = run_side(args.checkout.resolve(), arch, cache, Path(tmp) / f"new-{arch}.json", args.jobs, args.source)
            count, problems = compare(base, new, renamed)
            report[arch] = {"compared": count, "problems": problems, "baseline": base["kernels"],
                            "checkout": new["kernels"]}
            verdict = "all identical" if not problems else f"{len(problems)} problem(s)"
            print(f"{arch}: {count} kernels compared, {verdict}")
            for p in problems:
                print(f"  {p}")
            failed |= bool(problems)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
