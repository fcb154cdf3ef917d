"""`python -m rawgpu`: the package's commands, each a module of its own (`python -m rawgpu.COMMAND --help`)."""

from __future__ import annotations

import sys

from . import __version__

COMMANDS = {
    "train": "train an MLP on MNIST-like data, one CUDA graph launch per step (--gpus N: several GPUs)",
    "evaluate": "test loss, accuracy and confusion matrix of a saved checkpoint",
    "predict": "the class of each image (IDX, .npy or PNG) by a saved checkpoint",
    "compile": "fill the kernel cache ahead of a run, no GPU needed",
    "sweep": "train many models of one architecture at once: a grid of settings times seeds",
    "launch": "start one host's ranks of a job on several hosts (as torchrun does)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"rawgpu {__version__}: a minimal GPU training runtime that talks to the NVIDIA driver directly",
             "", "usage: python -m rawgpu.COMMAND [options]   (or the console script rawgpu-COMMAND)", "",
             "commands:"]
    lines += [f"  {name:{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "python -m rawgpu.COMMAND --help describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"rawgpu {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    hint = f"; run python -m rawgpu.{argv[0]}" if argv[0] in COMMANDS else ""
    print(f"{usage()}\n\nrawgpu: error: unknown argument {argv[0]!r}{hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
