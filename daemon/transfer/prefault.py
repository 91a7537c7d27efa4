"""Build the daemon's page tables over an engine's mapped memory before the copies need them.

The daemon maps an engine's KV memory (a memfd the engine handed over) once, at REGISTER.
Its page tables start empty: the first copy into or out of each 4 KiB page takes a page
fault, which costs more than the copy itself: a memcpy into a fresh mapping of resident
shared memory is several times slower than the same memcpy again, and so is a LOAD into
pages the daemon has not touched before. Which pages a load lands in is the engine's choice (vLLM hands out free
blocks in its own order), so without this the same LOAD is fast or slow by chance.

:class:`Prefaulter` builds those page tables right after the session opens, on the
daemon's :class:`PrefaultQueue` threads (users take turns, a step each),
with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14), which faults pages in without
touching their bytes. It populates **only the pages the engine has already allocated**
(``mincore``): populating a hole of a memfd would allocate memory, charged to the daemon,
and an engine may hand over a huge sparse file. A page the engine allocates later is
faulted in by the copy that first reaches it.

The work goes in ``STEP`` bytes at a time, each step under a lock; :meth:`Prefaulter.stop`
sets the stop flag and takes that lock, so once it returns no thread touches the mapping
any more and the memory may be unmapped. An engine that shrinks its memory meanwhile only
ends the thread early (``madvise`` fails with ``EFAULT`` where a fault would SIGBUS).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict, deque

import numpy as np

__all__ = [
    "DROP_STEP",
    "MADV_DONTNEED",
    "MADV_POPULATE_WRITE",
    "PAGE",
    "STEP",
    "PrefaultQueue",
    "Prefaulter",
    "drop_page_tables",
    "populate_resident",
]

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


MADV_DONTNEED = 4
"""``madvise`` advice: drop the range's page tables (a shared mapping's bytes stay in its
file; touching them again faults them back in)."""
DROP_STEP = 16 << 20
"""Bytes :func:`drop_page_tables` empties per ``madvise``."""


def drop_page_tables(address: int, size: int, step: int = DROP_STEP) -> int:
    """Empty this process's page tables over the shared mapping ``[address, address + size)``,
    ``step`` bytes per ``madvise(MADV_DONTNEED)``; the bytes stay in the mapped file.

    An ``munmap`` of a mapping whose page tables are built holds the process's memory map
    (its ``mmap_lock``) for as long as it takes to tear them down, in proportion to the
    pages mapped; every other thread that maps or unmaps anything meanwhile (an allocation
    of the event loop) waits for it. Emptied a step at a time first, the mapping is then
    unmapped at once, and no thread waits for more than a step.

    Args:
        address: page-aligned start of a shared mapping of this process.
        size: its bytes.
        step: bytes per call (a multiple of :data:`PAGE`).

    Returns:
        The bytes emptied (less than ``size`` when the kernel refused a step: the rest is
        left to the unmap).
    """
    done = 0
    while done < size:
        n = min(step, size - done)
        if _libc.madvise(address + done, n, MADV_DONTNEED) != 0:
            break
        done += n
    return done


class Prefaulter:
    """Populates the page tables of some mapped ranges (see the module docstring), one
    :data:`STEP` at a time: on a :class:`PrefaultQueue`'s threads, taking turns with other
    users' memory, or on a thread of its own (:meth:`start`).

    Args:
        ranges: ``(address, size)`` of each mapping to populate (they must stay mapped
            until :meth:`stop` has returned).
        label: names the memory in the log.
    """

    __slots__ = (
        "_at",
        "_lock",
        "_ranges",
        "_started",
        "_stop",
        "_thread",
        "complete",
        "label",
        "populated",
    )

    def __init__(self, ranges: list[tuple[int, int]], label: str) -> None:
        self._ranges = [(a, n) for a, n in ranges if n >= PAGE]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._at = (0, 0)  # (range index, offset in it) of the next step
        self._started = 0.0
        self.label = label
        self.populated = 0
        """Bytes populated so far."""
        self.complete = True
        """False once the kernel refused a range (the rest of that range is skipped)."""

    @property
    def pending(self) -> bool:
        """Whether steps are left (not stopped, ranges not all done)."""
        return not self._stop.is_set() and self._at[0] < len(self._ranges)

    def step(self) -> bool:
        """Populate the next :data:`STEP` bytes; return whether steps are left."""
        with self._lock:
            if not self.pending:
                return False
            if not self._started:
                self._started = time.perf_counter()
            i, off = self._at
            address, size = self._ranges[i]
            n, ok = populate_resident(address + off, min(STEP, size - off))
            self.populated += n
            off += STEP
            if not ok:
                self.complete = False
            if not ok or off >= size - size % PAGE:
                i, off = i + 1, 0
            self._at = (i, off)
            more = self.pending
        if not more and not self._stop.is_set():
            log.debug(
                "%s: %d MiB of page tables built in %.3f s%s",
                self.label,
                self.populated >> 20,
                time.perf_counter() - self._started,
                "" if self.complete else " (stopped early: the kernel refused a range)",
            )
        return more

    def start(self) -> None:
        """Run the steps on a thread of its own (at most once; nothing to do starts nothing)."""
        if self._thread is None and self.pending:
            self._thread = threading.Thread(target=self._run, name="kvtier-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while self.step():
            pass

    def stop(self) -> None:
        """Stop; when this returns no thread touches the mappings any more (one may still
        be finishing, outside them)."""
        self._stop.set()
        with self._lock:
            pass

    @property
    def running(self) -> bool:
        """True while its own thread runs."""
        return self._thread is not None and self._thread.is_alive()


class PrefaultQueue:
    """A fixed set of threads that run :class:`Prefaulter` steps, users taking turns.

    Each user (uid) has a queue of prefaulters; a thread takes one step of the first
    prefaulter of the user whose turn it is, then that user goes to the back of the line.
    So the prefault work of one user's sessions (a client may register many) delays
    another user's by one step per thread at most, and the CPU it takes is bounded by the
    thread count, whatever is registered.

    Args:
        threads: worker threads (started by :meth:`start`).
    """

    def __init__(self, threads: int) -> None:
        self._cond = threading.Condition()
        self._users: OrderedDict[int, deque[Prefaulter]] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._count = threads
        self._closed = False

    def start(self) -> None:
        """Start the threads (at daemon start: a thread that cannot start fails the start,
        never a REGISTER)."""
        for i in range(self._count):
            t = threading.Thread(target=self._work, name=f"kvtier-prefault-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, job: Prefaulter, user: int) -> None:
        """Queue ``job``'s steps for ``user``'s turns (nothing to do queues nothing)."""
        if not job.pending:
            return
        with self._cond:
            if self._closed:
                return
            self._users.setdefault(user, deque()).append(job)
            self._cond.notify()

    def queued(self) -> dict[int, int]:
        """Prefaulters with steps left, per user (those being stepped now not counted)."""
        with self._cond:
            return {u: len(q) for u, q in self._users.items()}

    def close(self) -> None:
        """Stop the threads after the step each is taking (queued prefaulters are dropped:
        their owners stop them before they unmap)."""
        with self._cond:
            self._closed = True
            self._users.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
        self._threads = []

    def _next(self) -> tuple[int, Prefaulter] | None:
        with self._cond:
            while not self._users and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            user, q = self._users.popitem(last=False)
            job = q.popleft()
            if q:
                self._users[user] = q  # back of the line
            return user, job

    def _work(self) -> None:
        while (got := self._next()) is not None:
            user, job = got
            try:
                more = job.step()
            except Exception:  # one job's failure ends that job, never the queue
                log.exception("%s: prefault failed", job.label)
                more = False
            if more:
                with self._cond:
                    if not self._closed:
                        self._users.setdefault(user, deque()).append(job)
                        self._cond.notify()
