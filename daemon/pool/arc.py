"""The ``arc`` eviction policy's state: ARC (Megiddo and Modha, FAST'03) over chains.

ARC splits the resident pages into T1 (stored once, not used since) and T2 (used again
after they were stored: pinned by a LOAD, or stored again soon after an eviction), each
evicted in recency order, and adapts ``p``, the size T1 aims at, to the workload:

- a page evicted from T1 (T2) leaves its key in the ghost list B1 (B2), which keeps the
  keys of as many evictions as the pool holds pages; a store of a key found in B1 means
  T1 was too small (``p`` grows by ``max(|B2| / |B1|, 1)``), one found in B2 that T2 was
  (``p`` shrinks by ``max(|B1| / |B2|, 1)``); either way the page goes to T2;
- a victim comes from T1 while T1 holds more than ``p`` pages, else from T2 (from the
  other when that list has no evictable page).

No constant is tuned: ``p`` starts at 0 and learns. Chains stay whole because the lists
hold only evictable pages (no resident children), as for ``lru``: the pool's intrusive
lists (:class:`~kvtier.daemon.pool.links.RecencyLists`) keep T1 on their first global
list and T2 on their second, and the victim is the cold end of one of them.

Pure and synchronous. What a restart keeps: the pages and their recency (the stamp
column); what it loses: the T1/T2 split (adopted pages start in T1), ``p`` and the ghost
lists (private memory, about 100 bytes a ghost: up to two per page the pool holds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["POLICIES", "ArcState"]

POLICIES = ("lru", "arc")
"""The host pool's eviction policies (``eviction_policy``)."""


class ArcState:
    """T1/T2 membership of each slot, the target ``p`` and the ghost lists.

    Args:
        n_slots: slot ids of the pool.

    Attributes:
        tier: per slot, 1 when the page is in T2 (0: T1, or no page).
        t2: resident pages in T2.
        p: the target size of T1, in pages (at most :attr:`capacity`).
        capacity: the resident pages at the last eviction (the pool was full then).
        ghosts: B1 and B2: ``hash((namespace, key)) -> None``, oldest first (private to
            the process, so Python's hash is enough).
        evicted: evictions from T1 and from T2 (the metrics' eviction reasons).
    """

    def __init__(self, n_slots: int) -> None:
        self.tier = bytearray(n_slots)
        self.t2 = 0
        self.p = 0.0
        self.capacity = 0
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self.evicted = [0, 0]

    def admit(self, s: int, ns: int, key: bytes) -> None:
        """A new page ``s`` was allocated for ``key``: to T2 when its key is a ghost
        (adapting ``p``), else T1."""
        b1, b2 = self.ghosts
        g = hash((ns, key))
        if g in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[g]
        elif g in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[g]
        else:
            return
        self.tier[s] = 1
        self.t2 += 1

    def reused(self, slots: Iterable[int]) -> None:
        """The pages ``slots`` (off the evictable lists: pinned) were used: into T2."""
        tier = self.tier
        for s in slots:
            if not tier[s]:
                tier[s] = 1
                self.t2 += 1

    def victim_list(self, resident: int) -> int:
        """Which list the next victim comes from (0: T1, 1: T2), ``resident`` pages in
        all."""
        return 0 if resident - self.t2 > self.p else 1

    def evicted_page(self, s: int, ns: int, key: bytes, resident: int) -> None:
        """Record the eviction of ``s`` (still resident: ``resident`` pages) in its
        ghost list, which keeps at most ``resident`` keys."""
        k = self.tier[s]
        self.evicted[k] += 1
        self.capacity = resident
        ghost = self.ghosts[k]
        ghost[hash((ns, key))] = None
        while len(ghost) > resident:
            ghost.popitem(last=False)

    def released(self, s: int) -> None:
        """The page ``s`` left the pool (evicted, flushed or aborted)."""
        if self.tier[s]:
            self.tier[s] = 0
            self.t2 -= 1
