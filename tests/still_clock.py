"""An asyncio event loop whose clock stands still until the test moves it.

``time()`` is what the loop's timers (``call_at``, ``call_later``, ``asyncio.sleep``,
``asyncio.wait`` and ``asyncio.timeout`` deadlines) read, so code under test that counts
from the loop's clock is driven by :attr:`StillClockLoop.now`: a deadline is checked by
setting the clock just before it and just after it, with no wall-clock waiting. I/O and
threads still wake the loop as usual. Never ``await asyncio.sleep(x)`` with ``x > 0`` on
it unless the test then moves the clock past it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["START", "StillClockLoop", "run", "turns"]

START = 1000.0
"""The clock's reading when a loop starts."""


class StillClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test sets :attr:`now`."""

    def __init__(self) -> None:
        super().__init__()
        self.now = START

    def time(self) -> float:
        """The test's clock."""
        return self.now


def run(test: Callable[[StillClockLoop], Awaitable[None]]) -> None:
    """Run ``test(loop)`` to its end on a new :class:`StillClockLoop`."""
    loop = StillClockLoop()
    try:
        loop.run_until_complete(test(loop))
    finally:
        loop.close()


async def turns(n: int = 50) -> None:
    """Let every ready task run ``n`` times over (the clock does not move)."""
    for _ in range(n):
        await asyncio.sleep(0)
