"""Eviction policy of the host pool: which READY page gives up its slot, and when.

Pure and synchronous, like the rest of the pool. The evictable pages are the recency
lists of :class:`~kvtier.daemon.pool.links.RecencyLists` (a page is on them while it is
READY, unpinned and childless); the page table keeps them in step, this module only
reads them to choose victims, and frees each victim through the page table.

Policy, LRU and tail first:

- A page with a resident child is never evicted, so a chain goes tail to head.
  Touching a chain ``k0..kn`` (commit, pin) stamps it in reverse, so its tail is the
  colder end. A page that becomes evictable (its last child left, its last pin
  dropped) goes to the cold end if it is not more recent than the current cold end,
  else to the hot end.
- A slot of class ``c`` comes from, in order: the free list of ``c``; a fresh slot of
  the extent ``c`` is cutting; a free extent; eviction from the cold end of the global
  list, any class (a victim of ``c`` frees a slot of ``c``; one of another class frees
  its slot and, when that empties its extent, the extent is free for ``c``), at most
  ``EVICT_FACTOR`` x the largest slots-per-extent victims; then the coldest page of
  ``c`` itself (bounded scan). Otherwise the allocation fails (a shortfall).
- An owner at its quota evicts only its own pages, coldest first, same bounds.

Policies ``arc`` and ``reuse`` (:mod:`~kvtier.daemon.pool.policies`): the global list is
two, T1 (pages stored once) and T2 (pages used again); the victim is the cold end of the
one the policy's adaptive target names (the other when it has none within the scan).
Owner quotas still evict from the owner's single recency list.

Write-back hook: with :attr:`Evictor.requires_l3` set (the pool's
``evict_requires_l3``), eviction skips pages not marked in L3 (within the bounded
scan), so no slot is reused before its page reached L3. A write-back task pins cold
pages, copies them to L3, marks them in L3 and unpins them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from kvtier.daemon.pool.policies import POLICIES, SplitState, split_state
from kvtier.daemon.pool.layout import NIL
from kvtier.daemon.pool.links import RecencyLists
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.records import EvictedPage, HostPoolError
from kvtier.daemon.pool.slots import SlotAllocator

__all__ = ["EVICT_FACTOR", "MIN_SCAN", "Evictor"]

EVICT_FACTOR = 2
"""Victims per slot allocation: at most EVICT_FACTOR x the largest slots-per-extent."""

MIN_SCAN = 256
"""Lower bound of the scan length when a victim must match a filter."""


class Evictor:
    """Chooses victims for slot allocations and evicts them (see the module docstring).

    Owns the evictable lists, the per-owner page counts and quotas, and the eviction log.
    A victim is freed through ``release``, which must take a READY page that is off the
    evictable lists and return its slot to ``slots``.

    Args:
        slots: the pool's slot allocator (new slots come from it; the global evictable
            list shares its link pair).
        meta: the pool's mapped metadata (stamp, in-L3, namespace and owner columns).
        keys: the pool's key of each slot (None: FREE), for the eviction log.
        release: frees a victim (the page table's release; its second argument keeps the
            slot taken instead of giving it back to the allocator).
        max_log: evictions kept for :meth:`drain`; more are counted only.
        quota: ``owner -> max resident pages`` (kept by reference; see :meth:`set_quota`).
        requires_l3: initial :attr:`requires_l3`.
        policy: ``"lru"``, ``"arc"`` or ``"reuse"`` (see the module docstring).

    Attributes:
        lru: the evictable pages, cold end first (global and per owner).
        policy: the eviction policy.
        split: the two-list policy's state (None under ``lru``).
        owned: resident (READY + WRITING) pages per owner, kept by the page table.
        quota: the quotas.
        requires_l3: evict only pages marked in L3 (the write-back hook).
        evictions / unlogged: evictions since construction, and those left out of the log.
        log: the evictions logged since the last :meth:`drain` (at most ``max_log``).
    """

    def __init__(
        self,
        slots: SlotAllocator,
        meta: PoolMeta,
        keys: list[bytes | None],
        release: Callable[[int, bool], None],
        *,
        max_log: int,
        quota: dict[int, int],
        requires_l3: bool,
        policy: str = "lru",
    ) -> None:
        if policy not in POLICIES:
            raise HostPoolError(f"eviction_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.split: SplitState | None = split_state(policy, len(slots.prev), meta.flags)
        self.lru = RecencyLists(
            slots.prev, slots.next, meta.stamp, None if self.split is None else self.split.tier
        )
        self.owned: dict[int, int] = {}
        self.quota = quota
        self.requires_l3 = requires_l3
        self.max_log = max_log
        self.evictions = self.unlogged = 0
        self.log: list[EvictedPage] = []
        self._budget = 1
        self._scan_limit = MIN_SCAN
        self._slots = slots
        self._ext_class, self._per_extent = slots.ext_class, slots.per_extent
        self._in_l3, self._ns, self._owner = meta.in_l3, meta.ns, meta.owner
        self._keys = keys
        self._release = release

    def fit_class(self, slots_per_extent: int) -> None:
        """Raise the victim budget and scan limit for a class that cuts
        ``slots_per_extent`` slots from an extent (they only grow)."""
        self._budget = max(self._budget, EVICT_FACTOR * slots_per_extent)
        self._scan_limit = max(MIN_SCAN, self._budget)

    def set_quota(self, owner: int, max_pages: int | None) -> None:
        """Limit the resident pages of ``owner`` (None lifts the limit).

        Raises:
            HostPoolError: ``max_pages`` is negative.
        """
        if max_pages is None:
            self.quota.pop(owner, None)
        elif max_pages < 0:
            raise HostPoolError(f"max_pages must be >= 0 or None, got {max_pages}")
        else:
            self.quota[owner] = max_pages

    def by_reason(self) -> dict[str, int]:
        """Evictions by the list the victim came from (see :class:`HostPoolStats`)."""
        if self.split is None:
            return {"lru": self.evictions}
        return {"t1": self.split.evicted[0], "t2": self.split.evicted[1]}

    def drain(self) -> list[EvictedPage]:
        """Return the evictions logged since the last drain and clear the log."""
        out, self.log = self.log, []
        return out

    def take_slot(self, cid: int, owner: int) -> int:
        """Return a slot of class ``cid`` for ``owner``, evicting if needed, or NIL.

        Args:
            cid: a registered class id.
            owner: the tenant the page is charged to (its quota applies).

        Returns:
            A free slot id (not yet written), or NIL: a shortfall.
        """
        quota = self.quota.get(owner)
        scope: int | None = None  # whose pages may be evicted; None: anyone's
        if quota is not None and self.owned.get(owner, 0) >= quota:
            scope, budget = owner, self._budget
            while self.owned.get(owner, 0) >= quota:  # replace own pages first
                v = self.coldest(owner, NIL)
                if v == NIL or budget == 0:
                    return NIL
                self.evict(v)
                budget -= 1
        s = self._slots.take(cid)
        return s if s != NIL else self._reclaim(cid, scope)

    def _reclaim(self, cid: int, owner: int | None) -> int:
        """Evict (anyone's, or only ``owner``'s pages) until a slot of ``cid`` frees.

        Called when ``cid`` has no free slot, no extent being cut and no free extent is
        left, so a victim of ``cid`` frees exactly the slot a take would hand out next:
        that slot is kept for the caller instead of going through the free list."""
        budget = self._budget
        ext_class, per_extent = self._ext_class, self._per_extent
        while budget > 0:
            v = self.coldest(owner, NIL)
            if v == NIL:
                break
            if ext_class[v // per_extent] == cid:
                self.evict(v, keep=True)
                return v
            self.evict(v)
            budget -= 1
            s = self._slots.take(cid)
            if s != NIL:
                return s
        v = self.coldest(owner, cid)  # fall back to the class's own pages
        if v == NIL:
            return NIL
        self.evict(v, keep=True)
        return v

    def coldest(self, owner: int | None, cid: int) -> int:
        """Return the coldest page eviction may take from the global (or ``owner``'s)
        list, of class ``cid`` unless NIL; NIL if none within the scan limit."""
        split = self.split
        if split is None or owner is not None:
            return self._scan(self.lru.start(owner), cid)
        second = split.victim_list(sum(self.owned.values())) == 1
        s = self._scan(self.lru.start(None, second), cid)
        return s if s != NIL else self._scan(self.lru.start(None, not second), cid)

    def _scan(self, start: tuple[int, array[int]], cid: int) -> int:
        """The first page from ``start`` (a list's cold end and its next links) on,
        within the scan limit, that eviction may take (NIL: none)."""
        s, nxt = start
        need_l3 = self.requires_l3
        steps = self._scan_limit
        while s != NIL and steps > 0:
            if (not need_l3 or self._in_l3[s]) and (
                cid == NIL or self._ext_class[s // self._per_extent] == cid
            ):
                return s
            s = nxt[s]
            steps -= 1
        return NIL

    def evict(self, s: int, keep: bool = False) -> None:
        """Evict the evictable page ``s``: log it, take it off the lists, free it (with
        ``keep``, its slot stays taken, for the allocation that evicted it)."""
        self.evictions += 1
        if len(self.log) < self.max_log:
            key = self._keys[s]
            assert key is not None
            self.log.append(EvictedPage(key, self._ns[s], s, bool(self._in_l3[s])))
        else:
            self.unlogged += 1
        if self.split is not None:
            key = self._keys[s]
            assert key is not None
            self.split.evicted_page(s, self._ns[s], key, sum(self.owned.values()))
        self.lru.dequeue(s, self._owner[s])
        self._release(s, keep)
