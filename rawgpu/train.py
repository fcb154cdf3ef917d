"""`python -m rawgpu.train`: train an MLP (the command lives in cli/train.py)."""

import sys

from .cli.train import main

if __name__ == "__main__":
    sys.exit(main())
