"""`python -m rawgpu.train`: train an MLP on MNIST (the training loop lands with the kernels; see README)."""

from __future__ import annotations

import argparse
import sys

from .errors import RawgpuError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rawgpu.train", description=__doc__)
    p.add_argument("--hidden", type=int, default=256, help="hidden layer width (default 256)")
    p.add_argument("--data-dir", default=None, help="directory with the four MNIST IDX files (gz or raw)")
    p.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hidden <= 0:
        build_parser().error(f"--hidden must be a positive integer, got {args.hidden}")
    try:
        from .data import load_mnist
        from .driver import Device

        device = Device(args.device)
        data = load_mnist(args.data_dir)
    except RawgpuError as exc:
        print(f"rawgpu: error: {exc}", file=sys.stderr)
        return 1
    print(f"rawgpu: found {device.name} ({device.arch}, {device.sm_count} SMs); "
          f"MNIST loaded from {data.source} ({len(data.train_labels)} train, {len(data.test_labels)} test).")
    print("rawgpu: error: training is not implemented yet (the GEMM and training-step kernels come next).",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
