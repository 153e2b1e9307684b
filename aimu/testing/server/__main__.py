"""``python -m aimu.testing.server [--port N] [--delay S]``."""

import sys

from aimu.testing.server.command import main

sys.exit(main())
