"""`python -m rawgpu.evaluate CHECKPOINT`: test loss, accuracy and the confusion matrix of a saved model, on the GPU
through the kernels training uses."""

from __future__ import annotations

import argparse
import json
import sys

from ..data.datasets import DATASET_NAMES
from ..runtime.errors import run_cli
from .common import add_device_option, add_version_option, program


MAX_SHOWN_CLASSES = 20  # a wider confusion matrix is in --json only


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("evaluate"), description=__doc__,
                                epilog="Exit status: 0 done, 1 runtime error (checkpoint, data, GPU), 2 bad arguments.")
    p.add_argument("checkpoint", help="a checkpoint written by python -m rawgpu.train --save")
    p.add_argument("--dataset", choices=DATASET_NAMES, default=None,
                   help="the test set to use (default: the checkpoint's dataset)")
    p.add_argument("--data-dir", default=None, help="directory with the four IDX files (default: as rawgpu.train)")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="a table (.npy, .npz's x_test/y_test, CSV, Parquet) with the model's columns: every row is "
                        "scored (a model trained on a table needs it)")
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

    if args.data is not None and (args.dataset or args.data_dir):
        parser.error("argument --data: scores a table; drop --dataset and --data-dir")
    ckpt = load(args.checkpoint)  # the file first: cheap
    r = ckpt.recipe
    if args.data is not None:
        from ..data.datasets import Dataset

        data = Dataset.scored_table(args.data, ckpt.dataset.get("columns"), r.regression, r.classes)
    else:
        name = args.dataset or ckpt.dataset.get("name")
        if ckpt.dataset.get("columns") is not None and args.dataset is None:
            parser.error(f"argument --data: the model was trained on a table ({name}); pass a table to score")
        if name not in DATASET_NAMES:
            parser.error("argument --dataset: the checkpoint names no known dataset; pass one")
        if name == "idx" and args.data_dir is None:
            parser.error("argument --dataset: idx needs --data-dir DIR holding the four IDX files")
        data = load_dataset(name, args.data_dir)
    from ..training.trainer import Trainer

    with Trainer.load(ckpt, data=data, device=args.device) as trainer:
        result = trainer.evaluate()
    rows = f"{len(data.test_labels)} test {'rows' if data.is_table else 'images'}"
    if args.json:
        record = {"checkpoint": args.checkpoint, "dataset": data.name, "test_rows": len(data.test_labels),
                  "test_loss": result.loss}
        if r.regression:
            from .console import json_number

            record.update(test_rmse=result.rmse, test_mae=result.mae, test_r2=json_number(result.r2))
        else:
            record.update(test_accuracy=result.accuracy, confusion=result.confusion.tolist())
        print(json.dumps(record))
        return 0
    from rich.console import Console

    out = Console()
    out.print(f"{args.checkpoint}: {r.name} on {data.name} ({rows})", markup=False, highlight=False)
    if r.regression:
        out.print(f"test loss {result.loss:.4g}  RMSE {result.rmse:.4g}  MAE {result.mae:.4g}  R² {result.r2:.4f}",
                  markup=False, highlight=False)
        return 0
    out.print(f"test loss {result.loss:.4f}  test accuracy {result.accuracy:.2%}", markup=False, highlight=False)
    if r.classes <= MAX_SHOWN_CLASSES:
        out.print(confusion_table(result.confusion, "confusion matrix"))
    else:
        out.print(f"confusion matrix: {r.classes} x {r.classes}, in --json", markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
