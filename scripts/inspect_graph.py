"""Capture the training-step CUDA graph exactly as `python -m rawgpu.train` does and show what is in it.

Prints every node in execution order (kernel, grid, block, shared memory, registers from the ptxas report)
and the dependency count; writes the driver's own DOT (every parameter) and a readable DOT of ours
(kernel names as labels), and renders ours to SVG/PNG when Graphviz's `dot` is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rawgpu.model import recipe as rc
from rawgpu.runtime.errors import RawgpuError, StepUnsupported
from rawgpu.runtime.files import write_atomic
from rawgpu.cli.common import add_device_option, add_step_option, check_step_option, count, usage_error
from rawgpu.cli.tables import add_shape_options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/inspect_graph.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    rc.add_options(p, ("hidden", "layers", "activation", "batch", "optimizer", "momentum", "weight_decay", "accum"))
    add_shape_options(p)
    p.add_argument("--steps-per-graph", type=count(1, 100), default=1, help="steps in the graph (default 1)")
    add_step_option(p)
    add_device_option(p)
    p.add_argument("--out", default="step.dot", help="our readable DOT file (default step.dot); the driver's "
                   "verbose DOT goes beside it as <name>.driver.dot")
    p.add_argument("--format", choices=("svg", "png", "none"), default="svg",
                   help="render --out with Graphviz dot when installed (default svg)")
    return p


def readable_dot(nodes, edges, title: str) -> str:
    """A DOT graph a person can read: one box per node with kernel, grid x block and shared bytes; edges are
    (from, to) or (from, to, kind), a programmatic one (the later kernel starts while the earlier runs) dashed."""
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
    for n in nodes:
        label = (f"{n.index}: {n.kernel}\\ngrid {n.grid} block {n.block}\\nsmem {n.shared_bytes} B" if n.kernel
                 else f"{n.index}: {n.type}")
        lines.append(f'  n{n.index} [label="{label}"];')
    for a, b, *kind in edges:
        dashed = ' [style=dashed, label="overlaps"]' if kind == ["programmatic"] else ""
        lines.append(f"  n{a} -> n{b}{dashed};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    try:
        recipe = rc.from_args(args, rc.run_length(args.batch, 1, None)[0], inputs=args.inputs, classes=args.classes)
    except ValueError as exc:  # a setting the recipe refuses (rc.SettingError names it): a usage error
        usage_error(parser, exc)
    check_step_option(parser, recipe, args.step)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # a pipe: wide enough for kernel names
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails here, before any GPU work
        if not os.access(out.parent, os.W_OK) or out.is_dir():
            raise OSError(13, "not a writable file path", str(out))
        from rawgpu.training.session import Session

        session = Session(recipe, args.device, step_kind=args.step)
        console.print(f"kernels: {session.compile_note}")
        graph = session.capture_step(args.steps_per_graph)
        nodes, edges = graph.nodes(), graph.typed_edges()
        driver_dot = graph.to_dot(out.with_suffix(".driver.dot"))
    except StepUnsupported as exc:
        print(f"inspect_graph: error: argument --step: {exc}", file=sys.stderr)
        return 2
    except RawgpuError as exc:
        print(f"inspect_graph: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # an --out path that cannot be created or written
        print(f"inspect_graph: error: cannot write {exc.filename or args.out}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    dev = session.device
    table = Table(title=f"training step of {recipe.name}, batch {recipe.batch} on {dev.name} ({dev.arch}): "
                        f"{len(nodes)} nodes, {len(edges)} dependencies ({session.step_description})")
    for col in ("#", "type", "kernel", "grid", "block", "smem B", "regs", "deps", "starts"):
        table.add_column(col, justify="left" if col in ("type", "kernel") else "right")
    deps = {i: 0 for i in range(len(nodes))}
    overlapped = {b for _, b, kind in edges if kind == "programmatic"}
    for _, b, _ in edges:
        deps[b] += 1
    for n in nodes:
        res = session.kernels.resources(n.kernel) if n.kernel else None
        table.add_row(str(n.index), n.type, n.kernel, "x".join(map(str, n.grid)) if n.kernel else "",
                      "x".join(map(str, n.block)) if n.kernel else "", str(n.shared_bytes) if n.kernel else "",
                      str(res.registers) if res else "", str(deps[n.index]),
                      "overlapping" if n.index in overlapped else "after" if deps[n.index] else "")
    console.print(table)
    console.print("step kind " + session.choice.explain().replace("\n", "\n  "))
    if (inside := session.model.step.phases()) is not None:  # a step of one kernel: the phases inside its node
        title, columns, rows = inside
        phases = Table(title=title)
        for i, col in enumerate(columns):
            phases.add_column(col, justify="left" if i == 0 or col == "ends in" else "right")
        for row in rows:
            phases.add_row(*row)
        console.print(phases)
    write_atomic(out, readable_dot(nodes, edges, f"{recipe.name} batch {recipe.batch}").encode())
    console.print(f"wrote {out} (readable) and {driver_dot} (driver's verbose DOT)")
    if args.format != "none":
        dot = shutil.which("dot")
        if dot is None:
            console.print(f"Graphviz is not installed, so no {args.format.upper()}: install it (e.g. apt install "
                          f"graphviz) and run: dot -T{args.format} {out} -o {out.with_suffix('.' + args.format)}")
        else:
            image = out.with_suffix("." + args.format)
            result = subprocess.run([dot, f"-T{args.format}", str(out), "-o", str(image)], capture_output=True,
                                    text=True)
            if result.returncode:
                print(f"inspect_graph: error: dot failed: {result.stderr.strip()}", file=sys.stderr)
                return 1
            console.print(f"rendered {image}")
    graph.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
