"""One process of ``aimu serve --workers N``: ``aimu serve`` with the options it was given."""

from __future__ import annotations

import os
import sys
import threading

from aimu.serve.command import run_serve
from aimu.serve.fleet import exit_with_parent, worker_options

if __name__ == "__main__":
    given = worker_options()
    if given is None:
        sys.exit("aimu serve: this module runs as a child of aimu serve --workers")
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    sys.exit(run_serve(given))
