"""`python -m rawgpu.predict CHECKPOINT FILES...`: the predicted class and probabilities of each image (IDX, .npy or
PNG files of the model's image size), or of each row of a table (.npy, .npz, CSV, Parquet with the model's feature
columns) for a model trained on one, or a regression's values; on the GPU through the kernels training uses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runtime.errors import run_cli
from .common import add_device_option, add_version_option, program

SHOWN = 20  # images listed on the terminal; --out writes them all


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("predict"), description=__doc__,
                                epilog="Exit status: 0 done, 1 runtime error (checkpoint, images, GPU), 2 bad arguments.")
    p.add_argument("checkpoint", help="a checkpoint written by python -m rawgpu.train --save")
    p.add_argument("images", nargs="+", metavar="FILES",
                   help="IDX image files (raw or .gz), .npy arrays or PNG images (colour is turned to gray, nothing is "
                        "resized); for a model trained on a table, table files with its feature columns")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write every prediction to FILE.csv or FILE.json instead of listing them")
    add_device_option(p)
    add_version_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is not None:
        out = Path(args.out).expanduser()
        if out.suffix.lower() not in (".csv", ".json"):
            parser.error(f"argument --out: {args.out} must end in .csv or .json")
        if not out.parent.is_dir():
            parser.error(f"argument --out: no directory {out.parent}")
    return run_cli(lambda: predict(args))


def predict(args: argparse.Namespace) -> int:
    from ..training.checkpoint import load
    from ..data.images import read_images, write_predictions

    ckpt = load(args.checkpoint)  # files first: cheap, before the GPU
    r, columns = ckpt.recipe, ckpt.dataset.get("columns")
    if columns is not None or r._input_dtype != "u8":  # a table's model: rows of features
        images, names = read_rows(args.images, (columns or {}).get("features"), r.inputs)
    else:
        shape = ckpt.dataset.get("image_shape") or (1, r.inputs)
        images, names = read_images(args.images, tuple(shape))
    from ..training.trainer import Trainer

    with Trainer.load(ckpt, data=None, device=args.device) as trainer:
        probabilities = trainer.predict(images)
    if args.out is not None:
        write_predictions(args.out, names, probabilities, values=r.regression)
        print(f"{len(names)} predictions written to {args.out}")
        return 0
    if r.regression:
        return _show_values(names, probabilities)
    from rich.console import Console
    from rich.table import Table

    table = Table(header_style="bold")
    for column in ("image", "predicted", "probability", "runner-up"):
        table.add_column(column, justify="left" if column == "image" else "right")
    for name, p in list(zip(names, probabilities))[:SHOWN]:
        first, second = p.argsort()[::-1][:2]
        table.add_row(name, str(first), f"{p[first]:.1%}", f"{second} ({p[second]:.1%})")
    console = Console()
    console.print(table)
    if len(names) > SHOWN:
        console.print(f"... {len(names) - SHOWN} more: --out FILE.csv writes them all", markup=False)
    return 0


def read_rows(paths: list[str], features, width: int):
    """Every row of the table files, [N, width], named FILE:ROW (1-based, as the file's data rows count)."""
    import numpy as np

    from ..data.tables import read_features

    parts, names = [], []
    for path in paths:
        x = read_features(path, features, width)
        parts.append(x)
        names += [f"{Path(path).name}:{i + 1}" for i in range(len(x))]
    dtype = parts[0].dtype if all(p.dtype == parts[0].dtype for p in parts) else np.float32
    return np.concatenate([p.astype(dtype) for p in parts]), names


def _show_values(names: list[str], values) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(header_style="bold")
    table.add_column("row")
    for k in range(values.shape[1]):
        table.add_column("value" if values.shape[1] == 1 else f"v{k}", justify="right")
    for name, v in list(zip(names, values))[:SHOWN]:
        table.add_row(name, *(f"{x:.6g}" for x in v))
    console = Console()
    console.print(table)
    if len(names) > SHOWN:
        console.print(f"... {len(names) - SHOWN} more: --out FILE.csv writes them all", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
