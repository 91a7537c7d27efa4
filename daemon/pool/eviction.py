"""Eviction policy of the host pool: which READY page gives up its slot, and when.

Pure and synchronous, like the rest of the pool. The evictable pages are the recency
lists of :class:`~kvtier.daemon.pool.links.RecencyLists` (a page is on them while it is
READY, unpinned and childless); the page table keeps them in step. :class:`Evictor`
holds the policy's settings and state; the steps below run in C, within a STORE's
allocation (``daemon/pool/native/_alloc.c``, its ``take_slot``), each victim freed as the
page table frees a page. ``tests/pool_model.py`` holds the same steps page by page in
Python, the model the C code is held to.

Policy, LRU and tail first:

- A page with a resident child is never evicted, so a chain goes tail to head.
  Touching a chain ``k0..kn`` (commit, pin) stamps it in reverse, so its tail is the
  colder end. A page that becomes evictable (its last child left, its last pin
  dropped) goes to the cold end if it is not more recent than the current cold end,
  else where its last access puts it among the 17 most recent pages (before all 17 when
  it is older than they are: the walk is bounded).
- A slot of class ``c`` comes from, in order: the free list of ``c``; a fresh slot of
  the extent ``c`` is cutting; a free extent; eviction from the cold end of the global
  list, any class (a victim of ``c`` frees a slot of ``c``; one of another class frees
  its slot and, when that empties its extent, the extent is free for ``c``), at most
  ``EVICT_FACTOR`` x the largest slots-per-extent victims; then the coldest page of
  ``c`` itself (bounded scan). Otherwise the allocation fails (a shortfall).
- An owner at its quota evicts only its own pages, coldest first, same bounds.

Policies ``arc`` and ``reuse`` (:mod:`~kvtier.daemon.pool.policies`): the global list is
two, T1 (pages stored once) and T2 (pages used again); the victim is the cold end of the
one the policy names (``arc``: by its adaptive target, the other when it has none within
the scan; ``reuse``: by the two cold ends' last accesses and its lifetime).
Owner quotas still evict from the owner's single recency list.

Write-back hook: with :attr:`Evictor.requires_l3` set (the pool's
``evict_requires_l3``), eviction skips pages not marked in L3 (within the bounded
scan), so no slot is reused before its page reached L3. A write-back task pins cold
pages, copies them to L3, marks them in L3 and unpins them.
"""

from __future__ import annotations

from kvtier.daemon.pool.policies import POLICIES, SplitState, split_state
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
    """The eviction policy's settings and state (see the module docstring).

    Owns the evictable lists, the per-owner page counts and quotas, the victim budget and
    scan limit, and the eviction log. The steps that choose and evict victims run in C
    (``daemon/pool/native/_alloc.c``'s ``take_slot``, for every slot a STORE allocates),
    over this state, through
    :class:`~kvtier.daemon.pool.page_steps.PageSteps`.

    Args:
        slots: the pool's slot allocator (the global evictable list shares its link pair).
        meta: the pool's mapped metadata (the stamp column orders the lists; the flags
            column records T2 under a two-list policy).
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
        budget: victims one slot allocation may evict (:data:`EVICT_FACTOR` x the largest
            slots-per-extent of a registered class).
        scan_limit: pages a victim scan looks at from a list's cold end when the victim
            must match a filter (in L3, of a class).
        evictions / unlogged: evictions since construction, and those left out of the log.
        log: the evictions logged since the last :meth:`drain` (at most ``max_log``).
    """

    def __init__(
        self,
        slots: SlotAllocator,
        meta: PoolMeta,
        *,
        max_log: int,
        quota: dict[int, int],
        requires_l3: bool,
        policy: str = "lru",
    ) -> None:
        if policy not in POLICIES:
            raise HostPoolError(f"eviction_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.split: SplitState | None = split_state(
            policy, len(slots.prev), meta.flags, meta.policy_state
        )
        self.lru = RecencyLists(
            slots.prev, slots.next, None if self.split is None else self.split.tier
        )
        self.owned: dict[int, int] = {}
        self.quota = quota
        self.requires_l3 = requires_l3
        self.max_log = max_log
        self.evictions = self.unlogged = 0
        self.log: list[EvictedPage] = []
        self.budget = 1
        self.scan_limit = MIN_SCAN

    def fit_class(self, slots_per_extent: int) -> None:
        """Raise the victim budget and scan limit for a class that cuts
        ``slots_per_extent`` slots from an extent (they only grow)."""
        self.budget = max(self.budget, EVICT_FACTOR * slots_per_extent)
        self.scan_limit = max(MIN_SCAN, self.budget)

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
