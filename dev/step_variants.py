"""Training-step experiments beside `scripts/bench.py train`: the layered step's L2 cache hints at other budgets
(--l2-budgets) and the fused step with other grids (--fused-grid), each timed as bench.py times rawgpu
(benchmarks.training.bench_rawgpu: by default the reference workload of batch 32, lr 0.003, plain SGD on
MNIST; `--recipe` another of bench.py's; warm-up excluded, GPU time of `--steps` steps).

    python dev/step_variants.py --l2-budgets 0 0.3 0.9 [--sizes 4096 8192] [--recipe seed|default|adam]
    python dev/step_variants.py --fused-grid 66 132 [--sizes 256 512]

Per width: the default step (row rawgpu), the baseline of each family (the layered step at the default budget; the
fused step with one block per SM), then one row per setting with its ratio to that baseline. No peers: bench.py train
runs those.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from rawgpu.runtime import driver as drv
from benchmarks.training import HIDDEN, RECIPES, bench_rawgpu
from rawgpu.cli.common import count
from rawgpu.runtime.errors import RawgpuError
from rawgpu.runtime.files import write_atomic
from rawgpu.kernels.l2 import DEFAULT_BUDGET as DEFAULT_L2_BUDGET


def fraction(text: str) -> float:
    """argparse type: a number in 0..1 (a one-line usage error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {value}")
    return value


def timed_rows(args, h: int, mnist) -> list[dict]:
    """The rows of one width: default, then each family's baseline and settings (`baseline` names the row a setting
    is compared with)."""
    def measure(system: str, baseline: str | None = None, **kw) -> dict:
        try:
            r = bench_rawgpu(h, args.steps, args.seed, mnist, args.device,
                             steps_per_launch=args.steps_per_launch, recipe=RECIPES[args.recipe], **kw)
            r.pop("init")
        except (RawgpuError, ValueError) as exc:  # e.g. a step kind that does not hold this width
            r = dict(us_per_step=None, test_accuracy=None, step_kind=None, note=f"n/a: {exc}"[:300])
        r.update(system=system, baseline=baseline)
        return r

    ours = measure("rawgpu")
    rows = [ours]
    if args.l2_budgets:  # the budget is a hint of the layered step only
        base = ours if ours["step_kind"] == "layered" else measure("rawgpu-layered", step_kind="layered")
        rows += [base] if base is not ours else []
        for budget in args.l2_budgets:
            rows.append(measure(f"rawgpu-layered-l2={budget:g}", base["system"], step_kind="layered", l2_budget=budget))
    if args.fused_grid:
        base = ours if ours["step_kind"] == "fused" else measure("rawgpu-fused", step_kind="fused")
        rows += [base] if base is not ours else []
        for grid in args.fused_grid:
            rows.append(measure(f"rawgpu-fused-grid={grid}", base["system"], step_kind="fused", fused_grid=grid))
    return rows


def run(args) -> int:
    from rawgpu.data.datasets import load_mnist

    device = drv.Device(args.device)
    mnist = load_mnist(args.data_dir)
    recipe = RECIPES[args.recipe]
    print(f"# {device.name} ({device.arch}, {device.sm_count} SMs), {dt.date.today()}; {args.steps} steps, "
          f"{args.steps_per_launch} per launch, recipe {args.recipe} (batch {recipe['batch']})")
    print(f"{'H':>5} {'system':>24} {'us/step':>9} {'steps/s':>9} {'vs baseline':>12} {'test acc':>8}  step")
    results = []
    for h in args.sizes:
        rows = timed_rows(args, h, mnist)
        by_name = {r["system"]: r for r in rows}
        for r in rows:
            us, base = r["us_per_step"], by_name.get(r["baseline"] or "")
            vs = f"{base['us_per_step'] / us:.2f}x" if us and base and base["us_per_step"] else "-"
            acc = f"{100 * r['test_accuracy']:.2f}%" if r.get("test_accuracy") is not None else "-"
            print(f"{h:>5} {r['system']:>24} {(f'{us:.1f}' if us else '-'):>9} {(f'{1e6 / us:.0f}' if us else '-'):>9} "
                  f"{vs:>12} {acc:>8}  {r['note']}", flush=True)
        results.append(dict(hidden=h, systems=rows))
    if args.json:
        write_atomic(args.json, json.dumps(dict(device=device.name, arch=device.arch, date=str(dt.date.today()),
                                                steps=args.steps, recipe=args.recipe, rows=results), indent=1).encode())
        print(f"# wrote {args.json}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python dev/step_variants.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=count(1), nargs="+", default=list(HIDDEN), help="hidden widths H")
    p.add_argument("--steps", type=count(1), default=5000, help="timed training steps per row (default 5000)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="seed",
                   help="bench.py's recipe to time (default seed: batch 32, lr 0.003, plain SGD)")
    p.add_argument("--seed", type=int, default=0, help="init and shuffle seed (default 0)")
    p.add_argument("--data-dir", default=None, help="MNIST directory (default: $RAWGPU_DATA, the cache, download)")
    p.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    p.add_argument("--steps-per-launch", type=count(1), default=100,
                   help="training steps per graph launch (default 100, as bench.py train)")
    p.add_argument("--l2-budgets", type=fraction, nargs="*", default=[], metavar="F",
                   help="time the layered step keeping at most this share of the L2 per kept weight (rows "
                        f"rawgpu-layered-l2=F; 0: no cache hints; the default is {DEFAULT_L2_BUDGET})")
    p.add_argument("--fused-grid", type=count(1), nargs="*", default=[], metavar="G",
                   help="time the fused step with G blocks (rows rawgpu-fused-grid=G; the default is one per SM)")
    p.add_argument("--json", default=None, help="write every row to this JSON file")
    args = p.parse_args(argv)
    if not args.l2_budgets and not args.fused_grid:
        p.error("nothing to compare: give --l2-budgets F ... and/or --fused-grid G ... (bench.py train times the "
                "default step)")
    try:
        return run(args)
    except RawgpuError as exc:
        print(f"step_variants: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a --json path that cannot be written
        print(f"step_variants: error: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
