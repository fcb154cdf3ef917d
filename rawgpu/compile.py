"""`python -m rawgpu.compile`: fill the kernel cache ahead of a run (the command lives in cli/compile.py)."""

import sys

from .cli.compile import main

if __name__ == "__main__":
    sys.exit(main())
