"""`python -m rawgpu.sweep`: train many models at once (the command lives in cli/sweep.py)."""

import sys

from .cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
