"""`python -m rawgpu.launch`: start one host's ranks of a job (the command lives in cli/launch.py)."""

import sys

from .cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
