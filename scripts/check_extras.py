"""Check that each CUDA stack, with every extra, resolves to that stack's packages alone (CI runs this).

    PYTHONPATH=. python scripts/check_extras.py [--report-only FILE STACK]

From the repository root, before rawgpu is installed (as CI runs it): PYTHONPATH=. finds rawgpu/install.py's tables
in the checkout, which need nothing but the standard library.

For cu13 and cu12, `pip install --dry-run --ignore-installed --report` resolves ".[STACK,MULTI,plot,tables,test]" (MULTI:
rawgpu/install.py's NCCL extra for the stack) from the package index, and every package the resolution would install
is checked: none built for the other stack (a name ending in -cu12 or -cu13), and cuda-bindings of the stack's major
version. Then the wrong pairs (".[cu12,multi]", ".[cu13,multi-cu12]": a stack with the other's NCCL) must not
resolve at all: each NCCL extra pins its stack's cuda-bindings. One line per stack and per wrong pair; exit 1 if any
mixes or a wrong pair resolves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rawgpu.runtime.install import MULTI, STACKS

ROOT = Path(__file__).resolve().parent.parent


def mixing(report: dict, stack: str) -> list[str]:
    """The packages of a pip report that do not belong with `stack` (cu12 or cu13)."""
    other = next(s for s in STACKS if s != stack)
    bad = []
    for item in report.get("install", []):
        name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
        if name.endswith(f"-{other}") or (name == "cuda-bindings" and version.split(".")[0] != stack[2:]):
            bad.append(f"{name} {version}")
    return bad


def resolve(stack: str) -> dict:
    extras = f"{stack},{MULTI[stack]},plot,tables,test"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{ROOT}[{extras}]"], check=True)
        return json.loads(report.read_text())


def wrong_pair_resolves(stack: str) -> str | None:
    """Whether `stack` with the other stack's NCCL extra resolves (it must not): the extras, or None when pip
    refuses them as conflicting."""
    other = next(s for s in STACKS if s != stack)
    extras = f"{stack},{MULTI[other]}"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        f"{ROOT}[{extras}]"], capture_output=True, text=True)
    return extras if p.returncode == 0 or "conflict" not in p.stderr.lower() else None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report-only"]:  # check a report made elsewhere
        reports = {argv[2]: json.loads(Path(argv[1]).read_text())}
    else:
        reports = {stack: resolve(stack) for stack in STACKS}
    failed = 0
    for stack, report in reports.items():
        bad = mixing(report, stack)
        count = len(report.get("install", []))
        print(f"check_extras: {stack}: {count} packages" + (f", MIXED: {', '.join(bad)}" if bad else ", one stack"))
        failed += bool(bad)
    if argv[:1] != ["--report-only"]:
        for stack in STACKS:
            other = next(s for s in STACKS if s != stack)
            wrong = wrong_pair_resolves(stack)
            print(f"check_extras: {stack} with {MULTI[other]}: " + ("RESOLVES (mixes the stacks)" if wrong else
                                                                    "refused by pip, as it must be"))
            failed += bool(wrong)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
