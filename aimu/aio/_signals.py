"""Signal handlers installed for a while, then put back: the one place aimu does it.

``signal.signal``, not ``loop.add_signal_handler``: removing a loop handler would drop
one the loop had before (Ctrl+C would then do nothing), and the handler it replaced is
needed to pass later signals on. A handler runs between two bytecodes of the main
thread: it should queue work on the loop (``call_soon_threadsafe``) and touch nothing.
"""

from __future__ import annotations

import signal
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

__all__ = ["Handler", "SignalHandlers"]

Handler: TypeAlias = Callable[[int, types.FrameType | None], Any]


class SignalHandlers:
    """``handler`` installed for ``signals`` until :meth:`restore` (also a context
    manager). ``ValueError`` off the main thread, where Python cannot install one."""

    __slots__ = ("handler", "previous")

    def __init__(self, handler: Handler, signals: Iterable[int] = (signal.SIGINT,)) -> None:
        self.handler = handler
        self.previous: dict[int, Any] = {}
        try:
            for number in signals:
                self.previous[number] = signal.signal(number, handler)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put back each handler replaced, where ours is still the one installed (a
        handler installed outside Python reads as None: the default is the closest)."""
        for number, previous in self.previous.items():
            if signal.getsignal(number) is self.handler:
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)

    def pass_on(self, number: int, frame: types.FrameType | None) -> None:
        """Give signal ``number`` to the handler that was there before ours."""
        previous = self.previous.get(number)
        if callable(previous):
            previous(number, frame)
        elif previous != signal.SIG_IGN and number == signal.SIGINT:
            signal.default_int_handler(number, frame)

    def __enter__(self) -> SignalHandlers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()
