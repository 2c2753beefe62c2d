"""``python -m leapfrog``: the ``leapfrog`` console command (same parser, same exit codes)."""

import sys

from leapfrog.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
