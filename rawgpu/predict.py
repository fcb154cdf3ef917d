"""`python -m rawgpu.predict`: predict with a checkpoint (the command lives in cli/predict.py)."""

import sys

from .cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
