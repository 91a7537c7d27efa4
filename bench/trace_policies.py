"""More leaf-only eviction policies for the trace simulation (bench/trace_sim.py).

Candidates measured against LRU and Belady's MIN on the conversation trace; each keeps the
rule of :mod:`kvtier.bench.trace_sim`: a block is useful only with its whole prefix, so only
leaves (blocks without a resident child) are evicted, and a request touches its chain tail
first (the tail is the colder end). Each policy is a few LRU lists of leaves; a victim is the
cold end of one list, so each maps onto the host pool's intrusive lists with O(1) work per
page. The simulation keeps each list as a heap of (position, block) with stale entries
skipped, which orders victims exactly as such a list would.

- :func:`twoq_hit_rate`: 2Q (Johnson and Shasha, VLDB'94): new blocks enter A1 (a quarter
  of the cache, evicted first while over its share); a block evicted from A1 is remembered
  in the ghost A1out (ids only, ``ghost`` x capacity of them, FIFO); a block that comes
  back while in A1out enters Am, the main LRU list.
- :func:`wtinylfu_hit_rate`: W-TinyLFU (Einziger et al., TOS'17): a 1% LRU window, then a
  segmented LRU (probation, protected 80%); a block leaving the window enters probation
  only if it was seen more often than probation's victim (frequencies: 4-bit counters
  halved every 10 x capacity accesses, counted exactly here where a count-min sketch would
  approximate them).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["twoq_hit_rate", "wtinylfu_hit_rate"]

Chains = Sequence[Sequence[int]]


class _Lists:
    """Resident blocks, each in one of ``n`` LRU lists that hold its leaves."""

    def __init__(self, n: int) -> None:
        self.where: dict[int, int] = {}  # block -> its list
        self.pos: dict[int, int] = {}  # block -> position (larger: hotter)
        self.kids: dict[int, int] = {}
        self.parent: dict[int, int] = {}
        self.size = [0] * n
        self.heaps: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.clock = 0

    def __len__(self) -> int:
        return len(self.where)

    def insert(self, chain: Sequence[int], lst: Sequence[int]) -> None:
        """Make every block of ``chain`` resident (missing ones into list ``lst[i]``)."""
        for i, b in enumerate(chain):
            if b in self.where:
                continue
            self.kids[b] = 0
            if i:
                self.parent[b] = chain[i - 1]
                self.kids[chain[i - 1]] += 1
            self.where[b] = lst[i]
            self.size[lst[i]] += 1
            self.pos[b] = 0

    def touch(self, b: int, k: int) -> None:
        """Move ``b`` to the hot end of list ``k``."""
        self.size[self.where[b]] -= 1
        self.where[b] = k
        self.size[k] += 1
        self.clock += 1
        self.pos[b] = self.clock
        if self.kids[b] == 0:
            heapq.heappush(self.heaps[k], (self.clock, b))

    def coldest(self, k: int) -> int | None:
        """The leaf at the cold end of list ``k`` (None: no leaf there)."""
        hp = self.heaps[k]
        while hp:
            p, b = hp[0]
            if self.pos.get(b) == p and self.where[b] == k and self.kids[b] == 0:
                return b
            heapq.heappop(hp)
        return None

    def evict(self, b: int) -> None:
        """Drop leaf ``b``; its parent, if now a leaf, rejoins its list at its position."""
        self.size[self.where.pop(b)] -= 1
        del self.pos[b], self.kids[b]
        p = self.parent.pop(b, None)
        if p is not None and p in self.where:
            self.kids[p] -= 1
            if self.kids[p] == 0:
                heapq.heappush(self.heaps[self.where[p]], (self.pos[p], p))


def _hits(chain: Sequence[int], resident: dict[int, int]) -> int:
    n = 0
    for b in chain:
        if b not in resident:
            break
        n += 1
    return n


def twoq_hit_rate(chains: Chains, capacity: int, ghost: float = 1.0) -> float:
    """Hit rate of leaf-only 2Q (see the module docstring); ``ghost``: A1out's size
    as a multiple of the capacity."""
    c = _Lists(2)  # 0: A1, 1: Am
    a1out: OrderedDict[int, None] = OrderedDict()
    a1_share, glen = max(1, capacity // 4), int(ghost * capacity)
    hits = total = 0
    for chain in chains:
        total += len(chain)
        hits += _hits(chain, c.where)
        lst = [1 if b in a1out else 0 for b in chain]
        for b in chain:
            a1out.pop(b, None)
        c.insert(chain, lst)
        for b in reversed(chain):
            c.touch(b, c.where[b])
        while len(c) > capacity:
            k = 0 if c.size[0] > a1_share else 1
            v = c.coldest(k)
            if v is None:
                k = 1 - k
                v = c.coldest(k)
            assert v is not None
            c.evict(v)
            if k == 0:
                a1out[v] = None
                if len(a1out) > glen:
                    a1out.popitem(last=False)
    return hits / total if total else 0.0


def wtinylfu_hit_rate(chains: Chains, capacity: int) -> float:
    """Hit rate of leaf-only W-TinyLFU (see the module docstring)."""
    c = _Lists(3)  # 0: window, 1: probation, 2: protected
    window = max(1, capacity // 100)
    main = capacity - window
    protected = main * 4 // 5
    freq: dict[int, int] = {}
    seen = 0
    hits = total = 0
    for chain in chains:
        total += len(chain)
        n = _hits(chain, c.where)
        hits += n
        for b in chain:
            freq[b] = min(15, freq.get(b, 0) + 1)
            seen += 1
            if seen >= 10 * capacity:
                seen = 0
                freq = {k: v >> 1 for k, v in freq.items() if v > 1}
        c.insert(chain, [0] * len(chain))
        for i in range(len(chain) - 1, -1, -1):
            b = chain[i]
            c.touch(b, 2 if i < n and c.where[b] else c.where[b])
        while c.size[2] > protected and (v := c.coldest(2)) is not None:
            c.touch(v, 1)
        while len(c) > capacity:
            cand = c.coldest(0) if c.size[0] > window else None
            if cand is None:
                v = c.coldest(1)
                v = c.coldest(2) if v is None else v
                v = c.coldest(0) if v is None else v
                assert v is not None
                c.evict(v)
                continue
            if c.size[1] + c.size[2] < main:
                c.touch(cand, 1)
                continue
            vic = c.coldest(1)
            vic = c.coldest(2) if vic is None else vic
            if vic is not None and freq.get(cand, 0) <= freq.get(vic, 0):
                c.evict(cand)
            else:
                if vic is not None:
                    c.evict(vic)
                c.touch(cand, 1)
    return hits / total if total else 0.0
