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
whenever it maps or unmaps memory of its own. The thread runs at nice :data:`UNMAP_NICE`:
unmapping and closing an engine's memory is kernel work that grows with its size (the last
close of a memfd frees its pages), and a thread that wakes up on the same CPU (the event
loop, an engine answering its own request) would otherwise wait for the end of the unmap
thread's time slice, even with another CPU idle. The unmap is never urgent: what waits
counts against the address-space bound (below), not against anyone's latency.

A closing memory's prefault is stopped at once, on the caller's thread (it waits for one
step at most): no thread builds page tables the unmap would then empty. What waits to be
unmapped still counts against the daemon's address-space bound: the caller's ``room()``
says how many bytes may wait, and a memory that would exceed it is unmapped at once, on the
caller's thread, as it would be without a thread; so is one closed after
:meth:`Unmaps.shutdown`. A memory that maps nothing (a control-only session's) is closed at
once and not counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvtier.daemon.transfer.cpu_priority import lower_this_thread

__all__ = ["UNMAP_NICE", "Closable", "Unmaps"]

log = logging.getLogger("kvtier.daemon")

UNMAP_NICE = 19
"""The unmap thread's nice value."""


class Closable(Protocol):
    """Engine memory as :class:`Unmaps` sees it. Its ``mapped_bytes`` (where it has them)
    count while it waits; ``stop_prefault`` and ``drop_page_tables`` (where it has them) run
    first."""

    def close(self) -> None:
        """Unmap it and close its descriptors."""
        ...


class Unmaps:
    """Closes engine memories on a ``kvtier-unmap`` thread (see the module docstring).

    Args:
        room: the most bytes that may wait to be unmapped now (read at each :meth:`close`).
    """

    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.pending_bytes = 0
        """Bytes queued and not unmapped yet."""
        self.queued = 0
        """Memories handed to the thread so far."""
        self.unmapped = 0
        """Memories the thread has unmapped (closed) so far."""
        self.inline = 0
        """Memories unmapped at once: no room for them to wait, or after :meth:`shutdown`."""

    def close(self, memory: Closable) -> None:
        """Stop ``memory``'s prefault, then unmap it on the thread, or at once when it would
        exceed the room or after :meth:`shutdown`. Nothing may use ``memory`` afterwards."""
        nbytes = max(0, int(getattr(memory, "mapped_bytes", 0)))
        if nbytes == 0:  # nothing mapped: nothing to wait for
            _close(memory)
            return
        stop = getattr(memory, "stop_prefault", None)
        if stop is not None:
            stop()
        with self._lock:
            queue = not self._closed and self.pending_bytes + nbytes <= self._room()
            if queue:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        1, thread_name_prefix="kvtier-unmap", initializer=_lowest_priority
                    )
                self._pool.submit(self._run, memory, nbytes)
                self.pending_bytes += nbytes
                self.queued += 1
            else:
                self.inline += 1
        if not queue:
            _close(memory)

    def _run(self, memory: Closable, nbytes: int) -> None:
        try:
            _close(memory)
        finally:
            with self._lock:
                self.pending_bytes -= nbytes
                self.unmapped += 1

    def shutdown(self) -> None:
        """Wait until every queued memory is unmapped; later ones are unmapped at once.
        Blocks: the daemon calls it off the event loop when it stops."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _lowest_priority() -> None:
    """The unmap thread's nice value: UNMAP_NICE."""
    lower_this_thread(UNMAP_NICE)


def _close(memory: Closable) -> None:
    try:
        drop = getattr(memory, "drop_page_tables", None)
        try:
            if drop is not None:  # a step at a time: the loop's own mappings never wait long
                drop()
        finally:
            memory.close()
    except Exception:  # close boundary: the daemon keeps serving the other sessions
        log.exception("unmapping a closed session's engine memory failed")
