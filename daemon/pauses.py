"""The time kvtierd's event loop did not run, and deadlines that do not count it.

A daemon that is stopped (SIGSTOP, a frozen container, a debugger), starved of CPU or whose
loop is held reads none of its sockets meanwhile: what engines send waits unread. Once it
runs again, the timers that fell due run in the loop's first turns, before ZeroMQ's I/O
thread has handed over what arrived. A deadline that counted that time would end what a peer
did in time: a REGISTER's handover, a tensor-parallel round whose last rank asked, an L3
read already answered, a prefetch's budget, a lease whose heartbeats wait in the socket.

:data:`WATCH` measures it. Its tick (:meth:`PauseWatch.run`, started with the daemon's
loops) runs every :data:`TICK_S`; a gap since the last look longer than ``TICK_S +``
:data:`SLACK_S` is a pause. Whoever looks first after one (the tick, or a deadline through
:meth:`PauseWatch.catch_up`) records it, so the order in which due timers run does not
matter. A deadline then adds the pauses that fell within its span:
:class:`RunningTimer` (``call_later`` of running time), :func:`running_timeout`
(``asyncio.timeout`` of running time) and :meth:`PauseWatch.catch_up`'s total for a
deadline compared by hand. Until the tick runs, nothing is recorded (every pause is 0):
a component used without the daemon's loops keeps plain timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

__all__ = ["SLACK_S", "TICK_S", "WATCH", "PauseWatch", "RunningTimer", "running_timeout"]

TICK_S = 0.1
"""How often the watch looks when nothing else does."""

SLACK_S = 0.1
"""A gap this much longer than :data:`TICK_S` is a pause (shorter ones are the loop's
ordinary lateness, counted as running time)."""


class PauseWatch:
    """The total time the event loop did not run since its tick started.

    Attributes:
        paused: seconds of pauses recorded so far (only grows).
        pauses: how many were recorded.
    """

    def __init__(self) -> None:
        self.paused = 0.0
        self.pauses = 0
        self._last = 0.0
        self._ticking = 0
        self._listeners: list[Callable[[float], None]] = []

    def catch_up(self) -> float:
        """Record a pause that ended just now (if any, and if the tick runs); the total."""
        if self._ticking:
            now = time.monotonic()
            gap = now - self._last - TICK_S
            self._last = now
            if gap > SLACK_S:
                self.paused += gap
                self.pauses += 1
                for listener in list(self._listeners):
                    listener(gap)
        return self.paused

    def listen(self, listener: Callable[[float], None]) -> Callable[[], None]:
        """Call ``listener(seconds)`` for each pause recorded; returns the undo."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def run(self) -> None:
        """Look every :data:`TICK_S` until cancelled (owned by the daemon's task group)."""
        if not self._ticking:
            self._last = time.monotonic()
        self._ticking += 1
        try:
            while True:
                await asyncio.sleep(TICK_S)
                self.catch_up()
        finally:
            self._ticking -= 1


WATCH = PauseWatch()
"""The daemon's watch (one event loop per process)."""


class RunningTimer:
    """``loop.call_later(delay, callback, *args)`` that counts only the time the loop ran:
    a pause within its span moves it on by as much.

    Args:
        delay: seconds of running time.
        callback / args: called once, on the loop.
        watch: the pause watch (default :data:`WATCH`).
    """

    __slots__ = ("_args", "_callback", "_handle", "_loop", "_paused", "_watch")

    def __init__(
        self,
        delay: float,
        callback: Callable[..., object],
        *args: object,
        watch: PauseWatch = WATCH,
    ) -> None:
        self._watch = watch
        self._callback = callback
        self._args = args
        self._loop = asyncio.get_running_loop()
        self._paused = watch.catch_up()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        owed = self._watch.catch_up() - self._paused
        if owed > 0:
            self._paused += owed
            self._handle = self._loop.call_later(owed, self._fire)
            return
        self._handle = None
        self._callback(*self._args)

    def cancel(self) -> None:
        """Never call the callback (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def cancelled(self) -> bool:
        """Whether the callback will not be called (cancelled or already called)."""
        return self._handle is None


@contextlib.asynccontextmanager
async def running_timeout(seconds: float, watch: PauseWatch = WATCH) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)`` of running time: TimeoutError once the block has run
    ``seconds`` with the pauses within it not counted."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as tm:
        timer = RunningTimer(seconds, lambda: tm.reschedule(loop.time()), watch=watch)
        try:
            yield
        finally:
            timer.cancel()
