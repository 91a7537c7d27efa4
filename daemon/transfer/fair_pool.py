"""The copy threads, serving users in turn.

A plain thread pool runs copies in the order they were submitted, so one user's engines,
submitting many long copies (an engine that declares 8,192 tiny regions makes each of its
copies slow), could keep the threads busy while another user's copies wait behind all of
them. :class:`FairExecutor` keeps one queue per user (uid) instead and hands the next free
thread the oldest copy of the user whose turn it is, then sends that user to the back of
the line: a user's copies wait behind at most one copy of each other user per thread.

Its threads are all started with it, at daemon start: no request ever starts a thread
(a thread that could not start, for want of memory, would fail a request that has no
part in the shortage).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["FairExecutor", "run_work", "start_threads"]

log = logging.getLogger("kvtier.daemon")

_Work = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class FairExecutor:
    """A fixed pool of threads running callables, users taking turns.

    Args:
        threads: how many threads (all started here).
        name: thread name prefix.
        initializer: run by each thread before its first callable (e.g. its CPU priority).
    """

    def __init__(
        self,
        threads: int,
        name: str = "kvtier-copy",
        initializer: Callable[[], object] | None = None,
    ) -> None:
        self._initializer = initializer
        self._cond = threading.Condition()
        self._users: OrderedDict[int, deque[_Work]] = OrderedDict()
        self._shutdown = False
        self._threads: list[threading.Thread] = []
        start_threads(self._threads, threads, name, self._work, self.shutdown)

    def submit_for(self, user: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in ``user``'s turn; its future.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        fut: Future = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("the copy threads have shut down")
            self._users.setdefault(user, deque()).append((fut, fn, args))
            self._cond.notify()
        return fut

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` with no user's turn (user -1)."""
        return self.submit_for(-1, fn, *args)

    def queued(self) -> dict[int, int]:
        """Callables waiting for a thread, per user."""
        with self._cond:
            return {u: len(q) for u, q in self._users.items()}

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Take no more work; the threads end once the queue is empty (``cancel_futures``:
        empty it now, cancelling what waits), joined when ``wait``."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for q in self._users.values():
                    for fut, _, _ in q:
                        fut.cancel()
                self._users.clear()
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()

    def _next(self) -> _Work | None:
        with self._cond:
            while not self._users:
                if self._shutdown:
                    return None
                self._cond.wait()
            user, q = self._users.popitem(last=False)
            work = q.popleft()
            if q:
                self._users[user] = q  # back of the line
            return work

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (work := self._next()) is not None:
            run_work(work)


def start_threads(
    into: list[threading.Thread],
    count: int,
    name: str,
    target: Callable[[], None],
    shutdown: Callable[..., None],
) -> None:
    """Start ``count`` daemon threads running ``target``, named ``name_0``, ``name_1``...,
    into ``into``; when one cannot start, ``shutdown(wait=False)`` and raise."""
    try:
        for i in range(count):
            t = threading.Thread(target=target, name=f"{name}_{i}", daemon=True)
            t.start()
            into.append(t)
    except BaseException:
        shutdown(wait=False)
        raise


def run_work(work: _Work) -> None:
    """Run one queued callable on this thread and set its future (unless cancelled)."""
    fut, fn, args = work
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as err:
        fut.set_exception(err)
    else:
        fut.set_result(result)
