"""Your own table on a command line, one owner for train and sweep: --data and the flags that pick from it (--target,
--features, --test, --test-fraction), checked before anything expensive, and read into a Dataset."""

from __future__ import annotations

import argparse

from ..data.arrays import TEST_FRACTION
from ..model import recipe as rc

TASK_OPTIONS = ("loss", "input_dtype", "standardize")  # recipe options too: what the data is and how it is read
TABLE_FLAGS = ("target", "features", "test", "test_fraction")  # they pick from --data's file


def fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def add_table_options(group, split_seed: str = "--seed") -> None:
    """--data, --target, --features, --test, --test-fraction and the task's recipe options (TASK_OPTIONS)."""
    group.add_argument("--data", metavar="PATH", default=None,
                       help="your own table: .npy (rows x columns), .npz (x_train, y_train, x_test, y_test), CSV or "
                            "Parquet (CSV and Parquet need pyarrow: the tables extra); instead of --dataset")
    group.add_argument("--target", metavar="COLUMN", nargs="+", default=None,
                       help="--data: the target column (a regression's: one or more); default the last")
    group.add_argument("--features", metavar="COLUMN", nargs="+", default=None,
                       help="--data: the feature columns; default every column but the target")
    group.add_argument("--test", metavar="PATH", default=None,
                       help="--data: the test set, a file with the same columns; default a --test-fraction of the rows")
    group.add_argument("--test-fraction", metavar="F", type=fraction, default=None,
                       help=f"--data: the share of its rows held out for testing, chosen by {split_seed} (default "
                            f"{TEST_FRACTION:g})")
    rc.add_options(group, TASK_OPTIONS)


def add_shape_options(parser) -> None:
    """The data's shape without the data (a planned run: compile, the graph inspector): --inputs, --classes and the
    task's recipe options, in a group of their own."""
    shape = parser.add_argument_group("the data's shape (default MNIST's)")
    shape.add_argument("--inputs", type=rc.argument_type("inputs", rc.SHAPE_OPTIONS["inputs"]), default=rc.INPUTS,
                       help=f"features per row (default {rc.INPUTS})")
    shape.add_argument("--classes", type=rc.argument_type("classes", rc.SHAPE_OPTIONS["classes"]), default=rc.CLASSES,
                       help=f"classes, or a regression's outputs (default {rc.CLASSES})")
    rc.add_options(shape, TASK_OPTIONS)


def check_table_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, dataset_given: bool) -> None:
    """--data against --dataset/--data-dir, and the flags that pick from a table without one: one line, exit 2."""
    if args.data is not None:
        if dataset_given:
            parser.error("argument --dataset: --data names your own table; drop one of them")
        if getattr(args, "data_dir", None) is not None:
            parser.error("argument --data-dir: --data names your own table; drop one of them")
        if args.test is not None and args.test_fraction is not None:
            parser.error("argument --test-fraction: --test gives the test set; drop one of them")
        return
    for flag in TABLE_FLAGS:
        if getattr(args, flag) is not None:
            parser.error(f"argument --{flag.replace('_', '-')}: picks from a table; add --data PATH")


def read_table(args: argparse.Namespace, seed: int, progress=None):
    """--data's table as a Dataset (progress: the console's reading(), for reads that take a while)."""
    from ..data.datasets import Dataset

    return Dataset.from_tables(args.data, target=args.target, features=args.features, test=args.test,
                               test_fraction=args.test_fraction or TEST_FRACTION, regression=args.loss != "xent",
                               seed=seed, progress=progress)
