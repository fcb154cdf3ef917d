import sys

from .sources import main

try:
    sys.exit(main())
except BrokenPipeError:  # the reader (head, less) stopped early: not an error
    sys.stderr.close()
    sys.exit(0)
