"""Run the ``file`` backend's batches in worker threads, and let ``close`` wait for them.

A batch is one worker-thread hop. Closing must not pull file descriptors from under a
batch in flight, and a batch that starts after ``close`` must not touch them at all: the
gate counts the batches in flight, refuses new ones once closed (they answer their
``default``, a miss), and :meth:`WorkerGate.close` returns when the last one has finished.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["WorkerGate"]

_T = TypeVar("_T")


class WorkerGate:
    """Counts batches in worker threads; closes once, after they finish."""

    __slots__ = ("_busy", "_closed", "_cond")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (read without the lock: a plain flag)."""
        return self._closed

    async def run(self, fn: Callable[..., _T], default: _T, *args: Any) -> _T:
        """Run ``fn(*args)`` in a worker thread; ``default`` once the gate is closed.

        A cancelled caller's worker still finishes its batch (``asyncio.to_thread``), and
        :meth:`close` waits for it.
        """

        def guarded() -> _T:
            with self._cond:
                if self._closed:
                    return default
                self._busy += 1
            try:
                return fn(*args)
            finally:
                with self._cond:
                    self._busy -= 1
                    if not self._busy:
                        self._cond.notify_all()

        return await asyncio.to_thread(guarded)

    def close(self) -> None:
        """Refuse new batches and block until those in flight have finished (run it in a
        worker thread, not on the event loop)."""
        with self._cond:
            self._closed = True
            while self._busy:
                self._cond.wait()
