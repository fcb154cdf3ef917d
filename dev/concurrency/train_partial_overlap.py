"""Experiment: `python -m rawgpu.train` with programmatic dependent launch taken off some kernels only.

    python dev/concurrency/train_partial_overlap.py --plain gather,head -- --hidden 256 --seed 3

Every launch whose kernel name contains one of the `--plain` words is launched ordinarily (it starts only when
the kernel before it has ended); the rest overlap as the product launches them. With many.py, this finds which
kernel's early start matters when several processes share the GPU. Not part of the product (dev/README.md).
"""

from __future__ import annotations

import argparse
import sys

from rawgpu.runtime import driver
from rawgpu.cli import train


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", required=True, help="comma-separated parts of kernel names to launch ordinarily")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    words = [w for w in args.plain.split(",") if w]
    overlapping = driver.Launch.overlapping

    def selective(launch: driver.Launch) -> driver.Launch:
        return launch if any(w in launch.kernel.name for w in words) else overlapping(launch)

    driver.Launch.overlapping = selective
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
