"""The pins of the host pool's pages: a count per page, set and dropped a run at a time in C.

A LOAD pins the pages it reads (a pinned page is never evicted) and unpins them when its
copy ends; a LOAD of a 128K-token context pins 8,192 pages. :class:`Pins` keeps the count
of each page and the number of pinned pages, and does both steps in one call of
``daemon/pool/native/_pins.c`` for any number of pages: the per-page steps in the
page-by-page order (a slot listed twice is pinned twice), and the moves of the pages that
leave the evictable lists (pinned, and childless) or enter them (unpinned, and childless).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
from kvtier.daemon.pool.links import RecencyLists, filled
from kvtier.daemon.pool.native import _pins
from kvtier.daemon.pool.records import PageState

__all__ = ["Pins"]

_READY = int(PageState.READY)


class Pins:
    """The pin count of each page of a pool, and how many pages are pinned.

    Args:
        n_slots: slot ids of the pool.
        stamp / state / owner: the pool's last-access, state and owner columns.
        children: each page's resident children (:attr:`ChildLists.count`).
        lru: the evictable lists (a page is on them while READY, unpinned, childless).

    Attributes:
        count: pins per slot (``array('i')``).
        pinned: pages with at least one pin.
    """

    def __init__(
        self,
        n_slots: int,
        stamp: memoryview,
        state: memoryview,
        owner: memoryview,
        children: array[int],
        lru: RecencyLists,
    ) -> None:
        self.count = filled("i", 0, n_slots)
        self.pinned = 0
        self._stamp, self._state = stamp, state
        self._children, self._lru = children, lru
        self._links = (lru.prev, lru.next, lru.oprev, lru.onext, stamp, owner)

    def _recount(self) -> None:
        """Count the pinned pages again (after an error left a run half done)."""
        self.pinned = int(np.count_nonzero(np.frombuffer(self.count, dtype=np.int32)))

    def _lists(self) -> tuple[object, ...]:
        """The evictable lists as ``_pins`` takes them (their ends as they are now)."""
        lru = self._lru
        tiers = (None, None) if lru.tier is None else (lru.ends2, lru.tier)
        return (*self._links, lru.ends, lru.own_ends, *tiers)

    def pin(self, slots: list[int], clock: int) -> int:
        """Pin the READY ``slots`` and touch them, the last first (access stamps
        ``clock + 1`` onwards; a negative ``clock``: no stamp changes); the pages pinned
        for the first time leave the evictable lists. Returns the new clock."""
        try:
            clock, newly = _pins.pin(
                self.count, self._stamp, self._children, slots, clock, self._lists()
            )
        except BaseException:  # a corrupt list stopped it after the counts changed
            self._recount()
            raise
        self.pinned += newly
        return clock

    def unpin(self, slots: Sequence[int]) -> bool:
        """Drop one pin of each of ``slots``; the pages left unpinned and childless enter
        the evictable lists, in ``slots`` order. False, having changed nothing, when a slot
        is outside the pool, not READY, not pinned, or listed more often than pinned."""
        try:
            unpinned = _pins.unpin(
                self.count,
                self._state,
                self._children,
                slots if type(slots) is list else list(slots),
                _READY,
                self._lists(),
            )
        except ValueError:  # a slot outside the pool: refused before any change
            return False
        except BaseException:  # a corrupt list stopped it after the counts changed
            self._recount()
            raise
        if unpinned is None:
            return False
        self.pinned -= unpinned
        return True
