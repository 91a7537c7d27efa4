"""Pin and unpin of page runs in one C call, or in numpy: one pass instead of a Python
iteration per page.

A LOAD of a 128K-token context pins 8,192 pages and unpins them when the copy ends. Page
by page in Python that takes milliseconds, a noticeable share of the copy itself. These
functions do the same work on whole columns. They change the pins and access stamps and
count the newly (un)pinned pages exactly as :meth:`~kvtier.daemon.pool.pages.PageTable.pin`
and :meth:`~kvtier.daemon.pool.pages.PageTable.unpin` do page by page, and move the few
pages that enter or leave the evictable lists (a chain's childless pages, usually its last)
one by one, in the same order.

Where the C extension is built (``kvtier.daemon.pool.native._pins``), it does the per-page steps in
the page-by-page order, from :data:`NATIVE_PAGES` pages on: numpy's fixed cost per call
outweighs the work for short runs, more so once a copy has flushed the caches. Otherwise
numpy does, from
:data:`BULK_PAGES` pages on.

What they leave to the page-by-page path, which they tell by returning False before any
change: for unpin, a slot that is out of range, not READY or not pinned, or listed more
often than pinned (that path names it in its error); and, in numpy, a run that names a slot
twice (only a request that repeats a key makes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
from kvtier.daemon.pool.records import PageState

from kvtier.daemon.pool.native import _pins

if TYPE_CHECKING:
    from kvtier.daemon.pool.pages import PageTable

__all__ = ["BULK_PAGES", "NATIVE", "NATIVE_PAGES", "pin_run", "run_pages", "unpin_run"]

_READY = int(PageState.READY)

NATIVE = _pins is not None
"""Whether runs are pinned in C (``daemon/pool/native/_pins.c``); else in numpy. The tests run both."""
BULK_PAGES = 64
"""Without the C extension, runs of at least this many pages are pinned and unpinned in
numpy; shorter ones page by page (cheaper below it: the numpy views and passes have a fixed
cost of a few microseconds)."""
NATIVE_PAGES = 8
"""With it, runs of at least this many pages are pinned and unpinned in C."""


def run_pages() -> int:
    """The shortest run :func:`pin_run` and :func:`unpin_run` take."""
    return NATIVE_PAGES if _pins is not None else BULK_PAGES


def _distinct(slots: np.ndarray) -> bool:
    """Whether ``slots`` names no slot twice (a sort: tens of microseconds for 8,192)."""
    ordered = np.sort(slots)
    return bool((ordered[1:] != ordered[:-1]).all())


def _childless(table: PageTable, slots: np.ndarray) -> list[int]:
    """Those of ``slots`` without resident children (the evictable lists hold only such
    pages), in ``slots`` order."""
    if not len(slots):
        return []
    children = np.frombuffer(table._children, dtype=np.int32)
    try:
        return cast("list[int]", slots[children[slots] == 0].tolist())
    finally:
        del children


def pin_run(table: PageTable, slots: list[int]) -> bool:
    """Pin ``slots`` (READY, found by the caller's lookup) and touch them, the last first,
    as :meth:`PageTable.pin` does; return False, having changed nothing, when a slot is
    listed twice (numpy only)."""
    if _pins is not None:
        table._clock, newly, childless = _pins.pin(
            table._pins, table._stamp, table._children, slots, table._clock
        )
        table._n_pinned += newly
        owner, lru = table._owner, table._lru
        for s in childless:  # off the evictable lists
            lru.dequeue(s, owner[s])
        return True
    order = np.array(slots[::-1], dtype=np.int64)  # touch order: the chain's tail first
    if not _distinct(order):
        return False
    pins = np.frombuffer(table._pins, dtype=np.int32)
    stamp = table._meta.array("stamp")
    try:
        before = pins[order]
        pins[order] = before + 1
        clock = table._clock
        stamp[order] = np.arange(clock + 1, clock + 1 + len(order), dtype=np.int64)
        table._clock = clock + len(order)
        first = order[before == 0]
        table._n_pinned += len(first)
        owner, lru = table._owner, table._lru
        for s in _childless(table, first):  # off the evictable lists
            lru.dequeue(s, owner[s])
        return True
    finally:
        del pins, stamp


def unpin_run(table: PageTable, slots: Sequence[int]) -> bool:
    """Drop one pin of each of ``slots``, as :meth:`PageTable.unpin` does (the pages left
    unpinned and childless become evictable, in ``slots`` order); return False, having
    changed nothing, when a slot is out of range, not READY, not pinned or (numpy only)
    listed twice."""
    if _pins is not None:
        try:
            done = _pins.unpin(
                table._pins,
                table._state,
                table._children,
                slots if type(slots) is list else list(slots),
                _READY,
            )
        except ValueError:  # a slot outside the pool: the page-by-page path names it
            return False
        if done is None:
            return False
        table._n_pinned -= done[0]
        owner, lru = table._owner, table._lru
        for s in done[1]:  # onto the evictable lists
            lru.enqueue(s, owner[s])
        return True
    at = np.array(slots, dtype=np.int64)
    if at.min() < 0 or at.max() >= table.n_slots:
        return False
    pins = np.frombuffer(table._pins, dtype=np.int32)
    state = table._meta.array("state")
    try:
        before = pins[at]
        if not ((before > 0).all() and (state[at] == int(PageState.READY)).all() and _distinct(at)):
            return False
        pins[at] = before - 1
        last = at[before == 1]
        table._n_pinned -= len(last)
        owner, lru = table._owner, table._lru
        for s in _childless(table, last):  # onto the evictable lists
            lru.enqueue(s, owner[s])
        return True
    finally:
        del pins, state
