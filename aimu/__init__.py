"""aimu: agent runs on asyncio that can be stopped at any moment and picked up again.

The public async surface is ``from aimu import aio``. Importing ``aimu`` loads nothing
heavy; provider SDKs are imported only when a client for them is made.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
