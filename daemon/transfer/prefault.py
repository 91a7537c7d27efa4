"""Build the daemon's page tables over an engine's mapped memory before the copies need them.

The daemon maps an engine's KV memory (a memfd the engine handed over) once, at REGISTER.
Its page tables start empty: the first copy into or out of each 4 KiB page takes a page
fault, which costs more than the copy itself: a memcpy into a fresh mapping of resident
shared memory is several times slower than the same memcpy again, and so is a LOAD into
pages the daemon has not touched before. Which pages a load lands in is the engine's choice (vLLM hands out free
blocks in its own order), so without this the same LOAD is fast or slow by chance.

:class:`Prefaulter` builds those page tables on a thread right after the session opens,
with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14), which faults pages in without
touching their bytes. It populates **only the pages the engine has already allocated**
(``mincore``): populating a hole of a memfd would allocate memory, charged to the daemon,
and an engine may hand over a huge sparse file. A page the engine allocates later is
faulted in by the copy that first reaches it.

The thread works in ``STEP`` bytes at a time, each step under a lock; :meth:`stop` sets
the stop flag and takes that lock, so once it returns the thread touches the mapping no
more and the memory may be unmapped. An engine that shrinks its memory meanwhile only
ends the thread early (``madvise`` fails with ``EFAULT`` where a fault would SIGBUS).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np

__all__ = ["MADV_POPULATE_WRITE", "PAGE", "STEP", "Prefaulter", "populate_resident"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14): fault the range in, writable, without touching it."""
PAGE = 4096
"""The page size ``mincore`` reports in."""
STEP = 16 << 20
"""Bytes one step looks at (one ``mincore``, then one ``madvise`` per resident run)."""


def populate_resident(address: int, size: int) -> tuple[int, bool]:
    """Fault in, writable, the pages of ``[address, address + size)`` that are resident.

    Args:
        address: page-aligned start of a shared mapping of this process.
        size: bytes (a multiple of :data:`PAGE` is looked at; a tail is left alone).

    Returns:
        (bytes populated, True when every resident run was populated; False when the
        kernel refused one: no ``MADV_POPULATE_WRITE``, or the file shrank).
    """
    pages = size // PAGE
    if pages <= 0:
        return 0, True
    vec = np.zeros(pages, dtype=np.uint8)
    if _libc.mincore(address, pages * PAGE, vec.ctypes.data) != 0:
        return 0, False
    resident = (vec & 1).astype(np.int8)
    edges = np.diff(np.concatenate(([0], resident, [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    done = 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if _libc.madvise(address + s * PAGE, (e - s) * PAGE, MADV_POPULATE_WRITE) != 0:
            return done, False
        done += (e - s) * PAGE
    return done, True


class Prefaulter:
    """Populates the page tables of some mapped ranges on a thread (see the module docstring).

    Args:
        ranges: ``(address, size)`` of each mapping to populate (they must stay mapped
            until :meth:`stop` has returned).
        label: names the memory in the log.
    """

    __slots__ = ("_lock", "_ranges", "_stop", "_thread", "label", "populated")

    def __init__(self, ranges: list[tuple[int, int]], label: str) -> None:
        self._ranges = [(a, n) for a, n in ranges if n >= PAGE]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.label = label
        self.populated = 0
        """Bytes populated so far."""

    def start(self) -> None:
        """Start the thread (at most once; nothing to do starts nothing)."""
        if self._thread is None and self._ranges and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="kvtier-prefault",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        complete = True
        for address, size in self._ranges:
            for off in range(0, size - size % PAGE, STEP):
                with self._lock:
                    if self._stop.is_set():
                        return
                    n, ok = populate_resident(address + off, min(STEP, size - off))
                    self.populated += n
                if not ok:
                    complete = False
                    break
        log.debug("%s: %d MiB of page tables built in %.3f s%s", self.label,
                  self.populated >> 20, time.perf_counter() - t0,
                  "" if complete else " (stopped early: the kernel refused a range)")

    def stop(self) -> None:
        """Stop the thread; when this returns it touches the mappings no more (it may still
        be finishing, outside them)."""
        self._stop.set()
        with self._lock:
            pass

    @property
    def running(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()
