"""aimu: agent runs on asyncio that can be stopped at any moment and picked up again.

The public async surface is ``from aimu import aio``. Importing ``aimu`` loads nothing
heavy; provider SDKs are imported only when a client for them is made.
"""

import logging

__version__ = "0.1.0"
__all__ = ["__version__"]

# aimu logs under "aimu" (retries, stops, store repair, tool failures; contents only at
# DEBUG, secrets never) and leaves where records go to the application.
logging.getLogger("aimu").addHandler(logging.NullHandler())
