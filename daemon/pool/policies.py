"""The host pool's two-list eviction policies: ``arc`` and ``reuse``.

Both split the evictable pages into two recency lists (the pool's intrusive lists,
:class:`~kvtier.daemon.pool.links.RecencyLists`: the first global list and the second, by
a page's ``tier`` byte) and take each victim from the cold end of one of them; ``lru`` has
one list and no state here. The lists hold only evictable pages (no resident children),
so chains stay whole for every policy.

- T1 holds pages stored once and not used since; T2 pages used again: pinned by a LOAD,
  or stored again soon after their eviction (their key is a ghost: a key of a recent
  eviction, remembered without its page).
- ``arc``: ARC (Megiddo and Modha, FAST'03). Each list leaves its evictions' keys in its
  own ghost list (B1, B2), each at most as long as the pool holds pages; a store of a key
  found in B1 means T1 was too small (its target ``p`` grows by ``max(|B2| / |B1|, 1)``),
  one found in B2 that T2 was (``p`` shrinks by ``max(|B1| / |B2|, 1)``).
- ``reuse``: one ghost FIFO of ``GHOST_FACTOR`` x the resident pages, each key with the
  list it left and that list's eviction count then. A ghost hit counts only when the key
  left its list recently: fewer than ``SHADOW`` x (the other list's target) evictions of
  that list ago, so the returning key would still have been resident had its list been
  that much larger. Each such hit moves ``1 / (SHADOW x the other list's share)`` of the
  pool from the other list's target to its own, so each list grows in proportion to the
  hits it would gain per page it takes. The targets start, at the pool's first eviction, as
  the split the pool filled with (T1's share of the resident pages then), so a pool that
  filled with pages stored once does not start by evicting them in a rush; neither target
  drops below ``FLOOR``. Remembering keys four times past the pool is what
  lets a page that comes back after a long gap (the next turn of a conversation, minutes
  later) be recognised as reused. The state is C's (``_alloc.Reuse``,
  ``daemon/pool/native/_reuse.h``), which the pool's C code runs itself: the ghosts are
  a ring of 16-byte entries indexed by a table of 16-byte entries, at most half full, so a
  ghost costs at most about 130 bytes of private memory (about 500 a page of the pool)
  against a page's kilobytes to megabytes.

In both, the victim comes from T1 while T1 holds more pages than its target (under
``reuse``, at least as many), else from T2 (from the other when that list has no
evictable page within the scan).

Pure and synchronous. What a restart keeps: the pages, their recency (the stamp column)
and the T1/T2 split (a page in T2 is marked :data:`~kvtier.daemon.pool.layout.USED_AGAIN`
in the flags column: by the commit that makes it READY, or by the LOAD that uses it); what
it loses: the targets (back to their start) and the ghosts (private memory).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvtier.daemon.pool.layout import USED_AGAIN
from kvtier.daemon.pool.native import _alloc, _pins

__all__ = ["POLICIES", "ArcState", "ReuseState", "SplitState", "split_state"]

POLICIES = ("lru", "arc", "reuse")
"""The host pool's eviction policies (``eviction_policy``)."""


class SplitState:
    """T1/T2 membership of each slot, and what both policies keep and answer.

    Args:
        n_slots: slot ids of the pool.
        flags: the pool's flags column, where a page used again is marked
            :data:`~kvtier.daemon.pool.layout.USED_AGAIN` (the page table's commit marks
            a page admitted to T2), so an adopted pool keeps the split; None: not kept.

    Attributes:
        tier: per slot, 1 when the page is in T2 (0: T1, or no page).
        t2: resident pages in T2.
        capacity: the resident pages at the last eviction (the pool was full then).
        evicted: evictions from T1 and from T2 (the metrics' eviction reasons).
    """

    t2: int
    capacity: int
    evicted: list[int]

    def __init__(self, n_slots: int, flags: memoryview | None = None) -> None:
        self.tier = bytearray(n_slots)
        self._flags = flags

    def admit(self, s: int, ns: int, key: bytes) -> None:
        """A new page ``s`` was allocated for ``key``: T2 when its key is a ghost."""
        raise NotImplementedError

    def reused(self, slots: Iterable[int]) -> None:
        """The pages ``slots`` (off the evictable lists: pinned) were used: into T2 (and
        marked :data:`~kvtier.daemon.pool.layout.USED_AGAIN`), in one C call.

        Raises:
            ValueError: a slot outside the pool (nothing changed).
        """
        run = slots if type(slots) is list else list(slots)
        self.t2 += _pins.mark_used(self.tier, self._flags, run, USED_AGAIN)

    def victim_list(self, resident: int) -> int:
        """Which list the next victim comes from (0: T1, 1: T2), ``resident`` pages in
        all."""
        raise NotImplementedError

    def evicted_page(self, s: int, ns: int, key: bytes, resident: int) -> None:
        """Record the eviction of ``s`` (still resident: ``resident`` pages)."""
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        """``t2_pages``, ``t1_target_ratio`` (T1's target over the resident pages at the
        last eviction) and ``ghosts``: :attr:`HostPoolStats.eviction_split`."""
        raise NotImplementedError

    def released(self, s: int) -> None:
        """The page ``s`` left the pool (evicted, flushed or aborted)."""
        if self.tier[s]:
            self.tier[s] = 0
            self.t2 -= 1


class ArcState(SplitState):
    """ARC's state: the target ``p`` and the ghost lists (see the module docstring).

    Attributes:
        p: the target size of T1, in pages (at most :attr:`capacity`).
        ghosts: B1 and B2: ``hash((namespace, key)) -> None``, oldest first (private to
            the process, so Python's hash is enough).
    """

    def __init__(self, n_slots: int, flags: memoryview | None = None) -> None:
        super().__init__(n_slots, flags)
        self.t2 = self.capacity = 0
        self.evicted = [0, 0]
        self.p = 0.0
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(),
            OrderedDict(),
        )

    def admit(self, s: int, ns: int, key: bytes) -> None:
        if self._returning(hash((ns, key))):
            self.tier[s] = 1
            self.t2 += 1

    def _returning(self, g: int) -> bool:
        """Whether ``g`` is a ghost of B1 or B2 (dropping it, adapting ``p``)."""
        b1, b2 = self.ghosts
        if g in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[g]
        elif g in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[g]
        else:
            return False
        return True

    def victim_list(self, resident: int) -> int:
        return 0 if resident - self.t2 > self.p else 1

    def summary(self) -> dict[str, float]:
        share = self.p / self.capacity if self.capacity else 0.0
        return {"t2_pages": self.t2, "t1_target_ratio": share, "ghosts": sum(map(len, self.ghosts))}

    def evicted_page(self, s: int, ns: int, key: bytes, resident: int) -> None:
        k = self.tier[s]
        self.evicted[k] += 1
        self.capacity = resident
        ghost = self.ghosts[k]
        g = hash((ns, key))
        ghost[g] = None
        while len(ghost) > resident:
            ghost.popitem(last=False)


GHOST_FACTOR = 4
"""``reuse``: ghosts kept, as a multiple of the resident pages."""

SHADOW = 0.25
"""``reuse``: a ghost hit adapts the split when its key left its list within this share
of the other list's target, in that list's evictions."""

FLOOR = 0.01
"""``reuse``: the least share of the pool either target keeps."""


class ReuseState(SplitState):
    """The ``reuse`` policy's state (see the module docstring), kept by its C core
    (``_alloc.Reuse``, ``daemon/pool/native/_reuse.h``), which the pool's C code runs
    itself; these methods take the same steps one call at a time (the page-by-page model
    of ``tests/pool_model.py`` calls them).

    Attributes:
        core: the targets, counts and ghosts.
    """

    def __init__(self, n_slots: int, flags: memoryview | None = None) -> None:
        self.core = _alloc.Reuse(GHOST_FACTOR, SHADOW, FLOOR)
        super().__init__(n_slots, flags)

    @property
    def t2(self) -> int:
        """Resident pages in T2."""
        return self.core.t2

    @t2.setter
    def t2(self, n: int) -> None:
        self.core.t2 = n

    @property
    def capacity(self) -> int:
        """The resident pages at the last eviction."""
        return self.core.capacity

    @capacity.setter
    def capacity(self, n: int) -> None:
        raise AttributeError("capacity is the core's: set by its evictions")

    @property
    def evicted(self) -> list[int]:
        """Evictions from T1 and from T2 (a copy)."""
        return self.core.evicted

    @evicted.setter
    def evicted(self, counts: list[int]) -> None:
        raise AttributeError("evicted is the core's: counted by its evictions")

    @property
    def share(self) -> float:
        """T1's target, a share of the resident pages (T2's: ``1 - share``)."""
        return self.core.share

    @property
    def ghosts(self) -> int:
        """Ghosts remembered (at most ``GHOST_FACTOR`` x :attr:`capacity`)."""
        return self.core.ghosts

    def admit(self, s: int, ns: int, key: bytes) -> None:
        if self.core.returning(ns, key):
            self.tier[s] = 1
            self.core.t2 += 1

    def victim_list(self, resident: int) -> int:
        return self.core.victim_list(resident)

    def summary(self) -> dict[str, float]:
        core = self.core
        return {"t2_pages": core.t2, "t1_target_ratio": core.share, "ghosts": core.ghosts}

    def evicted_page(self, s: int, ns: int, key: bytes, resident: int) -> None:
        self.core.record_eviction(self.tier[s], ns, key, resident)


def split_state(policy: str, n_slots: int, flags: memoryview | None = None) -> SplitState | None:
    """The state of ``policy`` over ``n_slots`` slots, marking pages used again in
    ``flags`` (None for ``lru``)."""
    if policy == "arc":
        return ArcState(n_slots, flags)
    if policy == "reuse":
        return ReuseState(n_slots, flags)
    return None
