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
  own ghost list (B1, B2): the two together, and T1 with B1, at most as long as the pool
  holds pages (ARC's directory). A store of a key found in B1 means T1 was too small
  (its target ``p`` grows by ``max(|B2| / |B1|, 1)``),
  one found in B2 that T2 was (``p`` shrinks by ``max(|B1| / |B2|, 1)``).
- ``reuse``: a page used again is worth more than one stored once, for a while. The
  victim is the coldest page of T1, unless T2's coldest page has not been used for more
  than the *lifetime* and is colder than it (or T1 has no evictable page). The lifetime is
  the ``LIFE_QUANTILE`` quantile of the *re-use distances*: the ticks of the pool's access
  clock (which advances as pages are stored and loaded) between a page's last use and its
  next one, counted when a LOAD pins a resident page and when a STORE brings back the key
  of a page evicted lately (a *ghost*: one FIFO of ``GHOST_FACTOR`` x the resident pages,
  each key with the list it left and its page's last access tick). The distances are
  counted in powers of two; each time the counts add up to as many as the pool holds
  pages, the lifetime is set from them (the quantile found in its power of two, linearly
  between its bounds) and every count is halved, so it follows the traffic. Before the
  first estimate the lifetime is four times the resident pages. This is the rule of the
  Multi-Queue policy (Zhou, Philbin and Li, USENIX ATC'01, for second-level caches, whose
  re-use distances are long) on two queues: a page whose reuse was seen keeps its place
  for as long as nearly every reuse takes, and no longer, so neither list needs a target
  size. Remembering keys four times past the pool is what lets a page that comes back
  after a long gap (the next turn of a conversation, minutes later) be recognised as
  reused. The state is C's (``_alloc.Reuse``, ``daemon/pool/native/_reuse.h``), which the
  pool's C code runs itself: the ghosts are a ring of 16-byte entries indexed by a table
  of 16-byte entries, at most half full, so a ghost costs at most about 130 bytes of
  private memory (about 500 a page of the pool) against a page's kilobytes to megabytes.

Under ``arc`` the victim comes from T1 while T1 holds more pages than its target, else from
T2 (from the other when that list has no evictable page within the scan).

Pure and synchronous. What a restart keeps: the pages, their recency (the stamp column),
the T1/T2 split (a page in T2 is marked :data:`~kvtier.daemon.pool.layout.USED_AGAIN` in
the flags column: by the commit that makes it READY, or by the LOAD that uses it) and
``reuse``'s lifetime (the pool file's :data:`~kvtier.daemon.pool.layout.POLICY_OFFSET`,
written when it changes); what it loses: ``arc``'s target (back to its start), the
re-use distances counted since the last estimate and the ghosts (private memory).
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

    def admit(self, s: int, ns: int, key: bytes, clock: int) -> None:
        """A new page ``s`` was allocated for ``key`` at access tick ``clock``: T2 when its
        key is a ghost."""
        raise NotImplementedError

    def save(self) -> None:
        """Write what a restart keeps of the policy's private state (``reuse``: its
        lifetime) into the pool file; nothing here."""

    def using(self, slots: list[int], stamp: memoryview, clock: int) -> None:
        """The resident pages ``slots`` are about to be used (a LOAD pins them) at access
        tick ``clock``; ``stamp`` is the pool's stamp column (their last use). Nothing
        here; ``reuse`` counts their re-use distances."""

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

    def evicted_page(self, s: int, ns: int, key: bytes, stamp: int, resident: int) -> None:
        """Record the eviction of ``s``, last used at tick ``stamp`` (still resident:
        ``resident`` pages)."""
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        """:attr:`HostPoolStats.eviction_split`: ``t2_pages``, ``ghosts``, and ``arc``'s
        ``t1_target_ratio`` (T1's target over the resident pages at the last eviction) or
        ``reuse``'s ``lifetime_ratio`` (the lifetime over them)."""
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

    def admit(self, s: int, ns: int, key: bytes, clock: int) -> None:
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

    def evicted_page(self, s: int, ns: int, key: bytes, stamp: int, resident: int) -> None:
        k = self.tier[s]
        self.evicted[k] += 1
        self.capacity = resident
        b1, b2 = self.ghosts
        self.ghosts[k][hash((ns, key))] = None
        # ARC's directory: T1 + B1 at most c, and B1 + B2 at most c (the pages resident)
        t1 = resident - self.t2
        while b1 and t1 + len(b1) > resident:
            b1.popitem(last=False)
        while len(b1) + len(b2) > resident:
            from_b1 = b1 and (t1 + len(b1) > resident or not b2)
            (b1 if from_b1 else b2).popitem(last=False)


GHOST_FACTOR = 4
"""``reuse``: ghosts kept, as a multiple of the resident pages."""

MAX_LIFE = 9 * 10**18
"""``reuse``: the longest lifetime, in access ticks (the core's bound)."""

LIFE_QUANTILE = 0.95
"""``reuse``: the lifetime is this quantile of the re-use distances: a page seen reused
keeps its place as long as 19 in 20 reuses take, then goes as an old page does."""


class ReuseState(SplitState):
    """The ``reuse`` policy's state (see the module docstring), kept by its C core
    (``_alloc.Reuse``, ``daemon/pool/native/_reuse.h``), which the pool's C code runs
    itself; these methods take the same steps one call at a time (the page-by-page model
    of ``tests/pool_model.py`` calls them).

    Attributes:
        core: the lifetime, the re-use distances, the counts and the ghosts.
    """

    def __init__(
        self, n_slots: int, flags: memoryview | None = None, saved: memoryview | None = None
    ) -> None:
        self.core = _alloc.Reuse(GHOST_FACTOR, LIFE_QUANTILE)
        super().__init__(n_slots, flags)
        self._saved = saved
        self._life = -1
        if saved is not None and 0 < saved[0] <= MAX_LIFE:  # a lifetime measured before
            self.core.restore(saved[0])  # a restart (anything else in the file: ignored)
            self._life = saved[0]

    def save(self) -> None:
        """Write the lifetime where a restart finds it (when it changed)."""
        life = self.core.life
        if life != self._life and self._saved is not None:
            self._saved[0] = max(life, 0)
            self._life = life

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
    def life(self) -> int:
        """The lifetime estimated from the re-use distances, in access ticks (-1: none
        yet; :meth:`lifetime` gives the one in use)."""
        return self.core.life

    def lifetime(self, resident: int) -> int:
        """The lifetime in use with ``resident`` pages resident."""
        return self.core.lifetime(resident)

    @property
    def ghosts(self) -> int:
        """Ghosts remembered (at most ``GHOST_FACTOR`` x :attr:`capacity`)."""
        return self.core.ghosts

    def admit(self, s: int, ns: int, key: bytes, clock: int) -> None:
        if self.core.returning(ns, key, clock):
            self.tier[s] = 1
            self.core.t2 += 1

    def using(self, slots: list[int], stamp: memoryview, clock: int) -> None:
        self.core.used(stamp, slots, clock)

    def pick(self, stamp1: int | None, stamp2: int | None, clock: int, resident: int) -> int:
        """The list the next victim comes from (0: T1, 1: T2), given the stamps of each
        list's coldest evictable page (None: it has none), the access clock and the
        resident pages."""
        return self.core.pick(stamp1, stamp2, clock, resident)

    def summary(self) -> dict[str, float]:
        core = self.core
        out: dict[str, float] = {"t2_pages": core.t2, "ghosts": core.ghosts}
        cap = core.capacity  # resident pages at the last eviction (0: none since the start)
        if cap:
            out["lifetime_ratio"] = core.lifetime(cap) / cap
        elif core.life < 0:  # the starting rule: 4 x the resident pages
            out["lifetime_ratio"] = 4.0
        return out

    def evicted_page(self, s: int, ns: int, key: bytes, stamp: int, resident: int) -> None:
        self.core.record_eviction(self.tier[s], ns, key, stamp, resident)


def split_state(
    policy: str,
    n_slots: int,
    flags: memoryview | None = None,
    saved: memoryview | None = None,
) -> SplitState | None:
    """The state of ``policy`` over ``n_slots`` slots, marking pages used again in
    ``flags``, ``reuse`` keeping its lifetime in ``saved`` (one int64: the pool file's;
    None for ``lru``)."""
    if policy == "arc":
        return ArcState(n_slots, flags)
    if policy == "reuse":
        return ReuseState(n_slots, flags, saved)
    return None
