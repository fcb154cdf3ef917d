"""Check that each CUDA stack, with every extra, resolves to that stack's packages alone (CI runs this).

    PYTHONPATH=. python scripts/check_extras.py [--report-only FILE STACK]

From the repository root, before rawgpu is installed (as CI runs it): PYTHONPATH=. finds rawgpu/install.py's tables
in the checkout, which need nothing but the standard library.

For cu13 and cu12, `pip install --dry-run --ignore-installed --report` resolves ".[STACK,MULTI,plot,test]" (MULTI:
rawgpu/install.py's NCCL extra for the stack) from the package index, and every package the resolution would install
is checked: none built for the other stack (a name ending in -cu12 or -cu13), and cuda-bindings of the stack's major
version. One line per stack; exit 1 if any mixes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rawgpu.install import MULTI, STACKS

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
    extras = f"{stack},{MULTI[stack]},plot,test"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{ROOT}[{extras}]"], check=True)
        return json.loads(report.read_text())


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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
