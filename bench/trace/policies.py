"""More leaf-only eviction policies for the trace simulation (bench/trace/sim.py).

Candidates measured against LRU and Belady's MIN on the conversation trace; each keeps the
rule of :mod:`kvtier.bench.trace.sim`: a block is useful only with its whole prefix, so only
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
- :func:`lirs_hit_rate`: LIRS (Jiang and Zhang, SIGMETRICS'02): blocks whose last two
  accesses were close (LIR) hold all but 1% of the cache and are never evicted while LIR;
  the rest (HIR) wait in a small FIFO Q of the other 1%. The recency stack S orders LIR,
  resident and evicted HIR blocks; an HIR block accessed again while still in S (its
  inter-reference recency below the oldest LIR's recency) becomes LIR, and the oldest LIR
  goes to Q. S is pruned from its bottom to a LIR block (amortized O(1)). Leaf-only: the
  victim is the first leaf of Q (a Q block with a resident child waits for it).

- :func:`reuse_hit_rate`: the host pool's ``reuse`` policy (:mod:`kvtier.daemon.pool.policies`),
  block for block: T1 (blocks seen once) and T2 (hit, or stored again while a ghost); one
  ghost FIFO of 4 x capacity ids, each with its block's last access tick; the victim is T1's
  coldest leaf unless T2's coldest leaf has been idle for more than the lifetime and is
  colder; the lifetime is the 0.95 quantile of the re-use distances (ticks from a block's
  last use to a hit on it, or to its return as a ghost), counted in powers of two and set
  each time the counts add up to as many as the cache holds blocks (the counts then
  halved), and four times the resident blocks before that. The clock here advances once a
  block touched; the pool's twice a page stored (allocation, commit), so its starting
  lifetime covers about half as many stored pages.

- :func:`reused_min_hit_rate`: a reference, not a policy: blocks seen once wait in an
  LRU list of a fixed share of the cache, blocks seen twice or more are kept by Belady's MIN
  (knowing their future) in the rest; per block, like :func:`min_hit_rate`. What a policy
  could reach that knows nothing of a block before its second use but everything after.

``python -m kvtier.bench.trace.policies [--trace FILE] [--blocks N,...]`` prints a Markdown
table: each candidate's hit rate and gap closed (LRU -> MIN) on the whole trace, its halves
and the synthetic workload.
"""

from __future__ import annotations

import functools
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.bench.trace.sim import arc_hit_rate, lru_hit_rate, min_hit_rate, workloads

__all__ = [
    "CANDIDATES",
    "lirs_hit_rate",
    "main",
    "reuse_hit_rate",
    "reused_min_hit_rate",
    "twoq_hit_rate",
    "wtinylfu_hit_rate",
]

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

    def victim(self, k: int) -> tuple[int, int]:
        """``(list, leaf)``: the coldest leaf of list ``k``, or of the other (of two) when
        ``k`` has none."""
        v = self.coldest(k)
        if v is None:
            k = 1 - k
            v = self.coldest(k)
        assert v is not None
        return k, v

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
            k, v = c.victim(0 if c.size[0] > a1_share else 1)
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


def lirs_hit_rate(chains: Chains, capacity: int, hir: float = 0.01) -> float:
    """Hit rate of leaf-only LIRS (see the module docstring); ``hir``: Q's share of the
    cache (LIRS's own: 1%)."""
    lir_cap = max(1, capacity - max(1, int(capacity * hir)))  # at least one LIR block
    stack: OrderedDict[int, None] = OrderedDict()  # S: bottom first
    q: OrderedDict[int, None] = OrderedDict()  # resident HIR: next victim first
    lir: set[int] = set()
    kids: dict[int, int] = {}  # resident block -> resident children
    parent: dict[int, int] = {}
    hits = total = 0

    def prune() -> None:
        while stack and next(iter(stack)) not in lir:
            stack.popitem(last=False)

    def demote() -> None:  # the bottom LIR block of S joins Q's hot end (while over the cap)
        prune()  # the bottom is a LIR block (resident) from here on
        if len(lir) <= lir_cap or not stack:
            return
        b, _ = stack.popitem(last=False)
        lir.discard(b)
        q[b] = None
        prune()

    def evict_one() -> None:
        v = next((b for b in q if kids[b] == 0), None)
        if v is None:  # every Q block has a resident child: the oldest LIR leaf goes
            v = next(b for b in stack if b in lir and kids[b] == 0)
            lir.discard(v)
            del stack[v]
            prune()
        else:
            del q[v]
        del kids[v]
        p = parent.pop(v, None)
        if p is not None and p in kids:
            kids[p] -= 1

    for chain in chains:
        total += len(chain)
        hits += _hits(chain, kids)
        for i, b in enumerate(chain):
            if b not in kids:
                kids[b] = 0
                if i:
                    parent[b] = chain[i - 1]
                    kids[chain[i - 1]] += 1
        new = {b for b in chain if b not in lir and b not in q}
        for b in reversed(chain):
            if b in lir:
                stack.move_to_end(b)
                prune()
            elif b in stack:  # an HIR block (resident or not) reused within S: LIR
                stack.move_to_end(b)
                q.pop(b, None)
                lir.add(b)
                demote()
            elif b in new and len(lir) < lir_cap:  # the cache is warming up
                lir.add(b)
                stack[b] = None
            else:
                stack[b] = None
                q.pop(b, None)
                q[b] = None
        while len(kids) > capacity:
            evict_one()
    return hits / total if total else 0.0


def reuse_hit_rate(
    chains: Chains, capacity: int, ghost: float = 4.0, quantile: float = 0.95
) -> float:
    """Hit rate of the pool's ``reuse`` policy (see the module docstring); ``ghost``: the
    ghost FIFO's length as a multiple of the capacity; ``quantile``: the re-use distances'
    quantile that is the lifetime."""
    c = _Lists(2)  # 0: T1, 1: T2
    ghosts: OrderedDict[int, int] = OrderedDict()  # id -> its block's last access tick
    glen = int(ghost * capacity)
    hist = [0] * 64
    state = {"life": -1, "cap": 0}

    def observe(d: int) -> None:
        if d <= 0:
            return
        hist[d.bit_length() - 1] += 1
        n = sum(hist)
        if state["cap"] <= 0 or n < state["cap"]:
            return
        target, acc = quantile * n, 0.0
        for b in range(64):
            if acc + hist[b] >= target:
                break
            acc += hist[b]
        state["life"] = int(2.0**b * (1.0 + (target - acc) / hist[b]))
        hist[:] = [h >> 1 for h in hist]

    hits = total = 0
    for chain in chains:
        total += len(chain)
        n = _hits(chain, c.where)
        hits += n
        lst = []
        for i, b in enumerate(chain):
            if b in c.where:
                if i < n:  # a hit is a use: into T2
                    observe(c.clock + 1 - c.pos[b])
                lst.append(1 if i < n else c.where[b])
                continue
            got = ghosts.pop(b, None)
            if got is not None:
                observe(c.clock - got)
            lst.append(0 if got is None else 1)
        c.insert(chain, lst)
        for b, k in zip(reversed(chain), reversed(lst), strict=True):
            c.touch(b, k)
        while len(c) > capacity:
            a, v2 = c.coldest(0), c.coldest(1)
            life = state["life"] if state["life"] >= 0 else 4 * len(c)
            old = v2 is not None and (
                a is None or (c.clock - c.pos[v2] > life and c.pos[v2] < c.pos[a])
            )
            v = v2 if old else a
            assert v is not None
            state["cap"] = len(c)
            ghosts[v] = c.pos[v]
            ghosts.move_to_end(v)
            c.evict(v)
            if len(ghosts) > glen:
                ghosts.popitem(last=False)
    return hits / total if total else 0.0


def reused_min_hit_rate(chains: Chains, capacity: int, first_share: float = 0.25) -> float:
    """Hit rate of the reference above: blocks seen once in an LRU list of
    ``first_share`` x capacity, blocks seen again kept by MIN in the rest."""
    never = len(chains)
    next_use: list[list[int]] = [[] for _ in chains]
    seen: dict[int, int] = {}
    for t in range(len(chains) - 1, -1, -1):
        next_use[t] = [seen.get(b, never) for b in chains[t]]
        for b in chains[t]:
            seen[b] = t
    first_cap = int(capacity * first_share)
    uses: dict[int, int] = {}
    once: OrderedDict[int, None] = OrderedDict()
    again: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []
    hits = total = 0
    for t, chain in enumerate(chains):
        total += len(chain)
        for b in chain:
            if b not in once and b not in again:
                break
            hits += 1
        for i in range(len(chain) - 1, -1, -1):
            b = chain[i]
            uses[b] = uses.get(b, 0) + 1
            if uses[b] == 1:
                once[b] = None
            else:
                once.pop(b, None)
                again[b] = next_use[t][i]
                heapq.heappush(heap, (-next_use[t][i], b))
        while len(once) > first_cap:
            once.popitem(last=False)
        while len(again) > capacity - first_cap:
            neg, b = heapq.heappop(heap)
            if again.get(b) == -neg:
                del again[b]
    return hits / total if total else 0.0


CANDIDATES: dict[str, Callable[[Chains, int], float]] = {
    "arc": arc_hit_rate,
    "arc ghost 4C": functools.partial(arc_hit_rate, ghost=4.0),
    "2q": twoq_hit_rate,
    "2q ghost 4C": functools.partial(twoq_hit_rate, ghost=4.0),
    "lirs": lirs_hit_rate,
    "reuse": reuse_hit_rate,
    "w-tinylfu": wtinylfu_hit_rate,
}
"""Each candidate's simulation: ``(chains, capacity) -> hit rate``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Print the candidates' hit rates and gap closed as a Markdown table."""
    sizes, work = workloads("python -m kvtier.bench.trace.policies", __doc__, argv)
    print("| workload | policy | " + " | ".join(str(s) for s in sizes) + " | gap closed |")
    print("|---|---|" + "---|" * len(sizes) + "---|")
    for name, ch in work.items():
        lru = [lru_hit_rate(ch, s) for s in sizes]
        opt = [min_hit_rate(ch, s) for s in sizes]
        for pol, r in (("lru", lru), ("min", opt)):
            print(f"| {name} | {pol} | " + " | ".join(f"{v:.3f}" for v in r) + " | |")
        for pol, sim in CANDIDATES.items():
            r = [sim(ch, s) for s in sizes]
            gaps = [
                f"{(v - lo) / (hi - lo):+.2f}" if hi - lo >= 0.01 else "n/a"
                for v, lo, hi in zip(r, lru, opt, strict=True)
            ]
            print(
                f"| {name} | {pol} | "
                + " | ".join(f"{v:.3f}" for v in r)
                + " | "
                + " ".join(gaps)
                + " |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
