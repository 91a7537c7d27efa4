"""A closed session's engine memory, unmapped off the event loop.

When a session ends (UNREGISTER, its engine's death, an expired lease) the daemon unmaps the
engine's memory and closes its descriptors. ``munmap`` takes time in proportion to the pages
the mapping holds, and the daemon builds the page tables of every page the engine has
allocated (:mod:`~kvtier.daemon.transfer.prefault`): for an engine of many GiB the unmap
takes long enough that, on the event loop, every other engine's requests would wait for it
whenever one engine leaves. :class:`Unmaps` does it on a thread of its own instead, one
memory after another, first emptying the mapping's page tables a step at a time
(:func:`~kvtier.daemon.transfer.prefault.drop_page_tables`): a whole ``munmap`` would hold
the process's memory map for its whole length, and the event loop waits for that too
whenever it maps or unmaps memory of its own.

The session's bounds (:mod:`~kvtier.daemon.service.quotas`) are released when it ends, so
the memory waiting to be unmapped is bounded apart: once more than ``cap()`` bytes wait, a
closing memory is unmapped at once, on the caller's thread, as it would be without a
thread. A memory closed after :meth:`Unmaps.shutdown` is unmapped at once too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

__all__ = ["Closable", "Unmaps"]

log = logging.getLogger("kvtier.daemon")


class Closable(Protocol):
    """Engine memory as :class:`Unmaps` sees it (its ``mapped_bytes``, where it has them,
    count against the cap)."""

    def close(self) -> None:
        """Unmap it and close its descriptors."""
        ...


class Unmaps:
    """Closes engine memories on a ``kvtier-unmap`` thread (see the module docstring).

    Args:
        cap: the most bytes that may wait to be unmapped (read at each :meth:`close`).
        initializer: run first on the thread (e.g. to lower its CPU priority).
    """

    def __init__(
        self, cap: Callable[[], int], initializer: Callable[[], object] | None = None
    ) -> None:
        self._cap = cap
        self._initializer = initializer
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.pending_bytes = 0
        """Bytes queued and not unmapped yet."""
        self.queued = 0
        """Memories handed to the thread so far."""
        self.inline = 0
        """Memories unmapped at once, over the cap or after :meth:`shutdown`."""

    def close(self, memory: Closable) -> None:
        """Unmap ``memory`` on the thread, or at once when more than the cap would wait or
        after :meth:`shutdown`. Nothing may use ``memory`` afterwards."""
        nbytes = max(0, int(getattr(memory, "mapped_bytes", 0)))
        with self._lock:
            queue = not self._closed and self.pending_bytes + nbytes <= self._cap()
            if queue:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        1, thread_name_prefix="kvtier-unmap", initializer=self._initializer
                    )
                self.pending_bytes += nbytes
                self.queued += 1
                pool = self._pool
            else:
                self.inline += 1
        if not queue:
            _close(memory)
            return
        pool.submit(self._run, memory, nbytes)

    def _run(self, memory: Closable, nbytes: int) -> None:
        try:
            _close(memory)
        finally:
            with self._lock:
                self.pending_bytes -= nbytes

    def shutdown(self) -> None:
        """Wait until every queued memory is unmapped; later ones are unmapped at once.
        Blocks: the daemon calls it off the event loop when it stops."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _close(memory: Closable) -> None:
    try:
        drop = getattr(memory, "drop_page_tables", None)
        if drop is not None:  # a step at a time: the loop's own mappings never wait long
            drop()
        memory.close()
    except Exception:  # close boundary: the daemon keeps serving the other sessions
        log.exception("unmapping a closed session's engine memory failed")
