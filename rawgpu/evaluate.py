"""`python -m rawgpu.evaluate`: evaluate a checkpoint (the command lives in cli/evaluate.py)."""

import sys

from .cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
