"""The copy threads, with region copies that never take the GIL.

:class:`FairExecutor <kvtier.daemon.transfer.fair_pool.FairExecutor>` runs every copy as a
Python callable: the thread takes the GIL to pick it up, again after the copy to set its
future and to hand its end to the event loop, and each of those hand-overs wakes a thread
and moves the GIL between it and the loop. With two CPUs and several engines that is a
large part of the daemon's CPU per GB beyond the copy itself.

:class:`CopyThreads` keeps the same turns between users (one queue per uid, the next free
thread takes the oldest job of the user whose turn it is) in C
(``kvtier.kernels._guarded.CopyPool``), and runs a transfer whose regions are one native
table (:meth:`submit_copy`) entirely there: the thread copies, announces each layer in the
session's completion block (waking the engine's futex for a LOAD), and adds the copy to a
list of ended ones whose eventfd (:attr:`fd`) the event loop reads (:meth:`reap`). A copy
split in parts (``bounds``) runs each part so on its own thread, the parts sharing a gate
that announces a layer once every part has copied it. Other copies (a CUDA session, regions
copied one by one, a STORE that checksums its pages, one shared with the event loop) are
Python callables (:meth:`submit_for`), run by the same threads in the same turns.

Its threads are all started with it, at daemon start, as :class:`FairExecutor`'s are.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
from kvtier.daemon.transfer.fair_pool import run_work, start_threads
from kvtier.kernels import guarded_copy, native

__all__ = ["CopyThreads", "Ended"]

log = logging.getLogger("kvtier.daemon")

_Work = tuple[Future, Callable[..., Any], tuple[Any, ...]]

Ended = tuple[int, int, int]
"""A region copy's end, as :meth:`CopyThreads.reap` gives it: (job id, status, pages):
status 0 DONE (pages: every page), 1 SHORT (a page of engine memory was gone: pages is its
index in the request), 2 CANCELLED."""

DONE, SHORT, CANCELLED = 0, 1, 2


class CopyThreads:
    """A fixed pool of threads running region copies in C and callables in Python, users
    taking turns.

    Args:
        threads: how many threads (all started here).
        name: thread name prefix.
        initializer: run by each thread before its first job (e.g. its CPU priority).

    Raises:
        RuntimeError: the ``_guarded`` extension is not built (:func:`available`).
    """

    def __init__(
        self,
        threads: int,
        name: str = "kvtier-copy",
        initializer: Callable[[], object] | None = None,
    ) -> None:
        native = guarded_copy.native_module()
        if native is None:
            raise RuntimeError("the native copy threads need kvtier.kernels._guarded")
        self._pool = native.CopyPool()
        self._initializer = initializer
        self._calls: dict[int, _Work] = {}
        self._ids = itertools.count(1)  # the callables'
        self._copy_lock = threading.Lock()
        self._next_copy = 1  # the region copies' (a part each; a copy's parts consecutive)
        self._threads: list[threading.Thread] = []
        start_threads(self._threads, threads, name, self._work, self.shutdown)

    @staticmethod
    def available() -> bool:
        """Whether native copy threads can run here: the extension is built, and neither
        ``copy_threads`` nor ``region_copy`` is turned off (:mod:`kvtier.kernels.native`)."""
        return (
            guarded_copy.strided()
            and native.enabled("copy_threads")
            and guarded_copy.native_module() is not None
        )

    @property
    def fd(self) -> int:
        """A descriptor that becomes readable when region copies have ended (:meth:`reap`)."""
        return int(self._pool.fd)

    def submit_copy(
        self,
        user: int,
        host: int,
        host_nbytes: int,
        offsets: np.ndarray,
        page_ids: np.ndarray,
        table: np.ndarray,
        groups: np.ndarray,
        to_host: bool,
        stream: bool,
        yield_bytes: int,
        layers_addr: int,
        wake_addr: int,
        num_layers: int,
        bounds: np.ndarray | None = None,
    ) -> list[int]:
        """Queue a region copy in ``user``'s turn; its job ids (:meth:`reap`, :meth:`cancel`):
        one, or one per part.

        The arguments are :func:`~kvtier.kernels.guarded_copy.copy_regions`'s, plus
        ``groups``: int64 rows (first row, end row, layers done after them) covering the
        table in order; ``layers_addr``: the int64 where each group's layers are announced
        (0: nowhere); ``wake_addr``: the 32-bit wake counter bumped, and woken, with each
        announcement (0: no wake-up); ``num_layers``: announced once every row is copied;
        ``bounds``: int64 part starts and the end (``[0, ..., len(page_ids)]``) to copy the
        pages in parts on several threads at once, a layer announced once every part has
        copied it (None: one part). Every row, index and bound is checked here: ValueError
        names a bad one, and nothing is queued. The addresses must stay mapped until every
        part is reaped.

        Raises:
            ValueError: a bad row, index, group or count.
            RuntimeError: after :meth:`shutdown`.
        """
        parts = 1 if bounds is None else max(1, len(bounds) - 1)
        with self._copy_lock:
            first = self._next_copy
            self._next_copy += parts
        self._pool.submit_copy(
            first,
            user,
            host,
            host_nbytes,
            offsets,
            page_ids,
            table,
            groups,
            to_host,
            stream,
            yield_bytes,
            layers_addr,
            wake_addr,
            num_layers,
            *(() if bounds is None else (bounds,)),
        )
        return list(range(first, first + parts))

    def reap(self) -> list[Ended]:
        """The region copies that ended since the last call (read once :attr:`fd` is
        readable; an empty list when it was woken for copies an earlier call took)."""
        return self._pool.reap()

    def ended(self) -> int:
        """Region copies that have ended and wait for :meth:`reap`."""
        return self._pool.ended()

    def cancel(self, job: int) -> bool:
        """Stop region copy ``job`` before its next group of rows (it ends CANCELLED, or
        DONE when it was past its last); whether it was queued or running."""
        return bool(self._pool.cancel(job))

    def submit_for(self, user: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a copy thread in ``user``'s turn; its future.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        fut: Future = Future()
        job = next(self._ids)
        self._calls[job] = (fut, fn, args)
        try:
            self._pool.submit_call(job, user)
        except BaseException:
            del self._calls[job]
            raise
        return fut

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` with no user's turn (user -1)."""
        return self.submit_for(-1, fn, *args)

    def queued(self) -> dict[int, int]:
        """Jobs waiting for a thread, per user."""
        return self._pool.queued()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Take no more work; the threads end once the queue is empty (``cancel_futures``:
        empty it now: queued region copies end CANCELLED, queued callables' futures are
        cancelled), joined when ``wait``."""
        for job in self._pool.shutdown(cancel_futures):
            work = self._calls.pop(job, None)
            if work is not None:
                work[0].cancel()
        if wait:
            for t in self._threads:
                t.join()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._pool.serve()) is not None:
            work = self._calls.pop(job, None)
            if work is not None:
                run_work(work)
