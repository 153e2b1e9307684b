"""``python -m aimu chat``: the same as the ``aimu`` command."""

import sys

from aimu.cli import main

if __name__ == "__main__":
    sys.exit(main())
