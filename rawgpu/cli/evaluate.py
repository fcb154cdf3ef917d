"""`python -m rawgpu.evaluate CHECKPOINT`: test loss, accuracy and the confusion matrix of a saved model, on the GPU
through the kernels training uses."""

from __future__ import annotations

import argparse
import json
import sys

from ..data.datasets import DATASET_NAMES
from ..runtime.errors import run_cli
from .common import add_device_option, add_version_option, program


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("evaluate"), description=__doc__,
                                epilog="Exit status: 0 done, 1 runtime error (checkpoint, data, GPU), 2 bad arguments.")
    p.add_argument("checkpoint", help="a checkpoint written by python -m rawgpu.train --save")
    p.add_argument("--dataset", choices=DATASET_NAMES, default=None,
                   help="the test set to use (default: the checkpoint's dataset)")
    p.add_argument("--data-dir", default=None, help="directory with the four IDX files (default: as rawgpu.train)")
    add_device_option(p)
    add_version_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    return p


def confusion_table(confusion, title: str):
    """A rich table: rows are the true classes, columns the predicted ones, the diagonal in bold."""
    from rich.table import Table

    c = len(confusion)
    table = Table(title=title, header_style="bold")
    table.add_column("true \\ predicted", justify="right")
    for j in range(c):
        table.add_column(str(j), justify="right")
    table.add_column("recall", justify="right")
    for i in range(c):
        total = int(confusion[i].sum())
        cells = [f"[bold]{confusion[i, j]}[/bold]" if i == j else str(confusion[i, j]) for j in range(c)]
        table.add_row(str(i), *cells, f"{confusion[i, i] / total:.1%}" if total else "n/a")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_cli(lambda: evaluate(parser, args))


def evaluate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..training.checkpoint import load
    from ..data.datasets import load_dataset

    ckpt = load(args.checkpoint)  # the file first: cheap
    name = args.dataset or ckpt.dataset.get("name")
    if name not in DATASET_NAMES:
        parser.error("argument --dataset: the checkpoint names no known dataset; pass one")
    if name == "idx" and args.data_dir is None:
        parser.error("argument --dataset: idx needs --data-dir DIR holding the four IDX files")
    data = load_dataset(name, args.data_dir)
    from ..training.trainer import Trainer

    with Trainer.load(ckpt, data=data, device=args.device) as trainer:
        result = trainer.evaluate()
    if args.json:
        print(json.dumps({"checkpoint": args.checkpoint, "dataset": data.name, "test_loss": result.loss,
                          "test_accuracy": result.accuracy, "confusion": result.confusion.tolist()}))
        return 0
    from rich.console import Console

    out = Console()
    out.print(f"{args.checkpoint}: {ckpt.recipe.name} on {data.name} ({len(data.test_labels)} test images)",
              markup=False, highlight=False)
    out.print(f"test loss {result.loss:.4f}  test accuracy {result.accuracy:.2%}", markup=False, highlight=False)
    out.print(confusion_table(result.confusion, "confusion matrix"))
    return 0

if __name__ == "__main__":
    sys.exit(main())
