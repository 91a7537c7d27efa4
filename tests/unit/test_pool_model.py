"""The host pool against its page-by-page model, op for op (hypothesis state machines).

Two pools get every operation: the host pool as the daemon runs it (allocate, commit, pin
and unpin in C, ``daemon/pool/native``) and one whose page table does them page by page in
Python (``tests/pool_model.py``). After every step everything observable must agree: the
answers (slots, errors, lookups), the metadata columns, the private arrays, indexes,
evictable lists, counters, the eviction log and, under ``arc``, T1/T2, the target and the
ghost lists. The pools are small (evictions from the first stores), hold three page
classes (evictions of other classes, extents cut and given back), owners get quotas that
change (an owner at its quota evicts from its own list), and evictions may require L3.
STOREs extend chains and also branch off resident pages, so pages have several children
and first, middle and last siblings leave (released, evicted, aborted, orphaned). The
machines run derandomized: a fixed seed, the same sequences every run.
"""

from __future__ import annotations

from typing import Any, cast

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError

from tests.pool_model import ResidentChildren, observable, page_by_page

KIB = 1024
EXTENT = 16 * KIB
CLASS_BYTES = (4000, 5000, 12000)  # 4, 3 and 1 slots an extent
NAMESPACES = (1, 2)
OWNERS = (10, 20, 30)


def key(chain: int, i: int) -> bytes:
    """Key ``i`` of chain ``chain`` (32 bytes, some shorter)."""
    raw = f"c{chain}-{i}".encode()
    return raw if chain % 4 == 3 else raw.ljust(32, b".")


class PoolVersusModel(RuleBasedStateMachine):
    """Random STOREs (chains and branches), LOADs, aborts, releases, flushes, quotas and L3
    marks on both pools."""

    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.pools = [
            HostPool(6 * EXTENT, EXTENT, 4 * KIB, eviction_policy=self.POLICY),
            page_by_page(HostPool(6 * EXTENT, EXTENT, 4 * KIB, eviction_policy=self.POLICY)),
        ]
        for p in self.pools:
            assert [p.register_class(b) for b in CLASS_BYTES] == [0, 1, 2]
            p.set_quota(30, 6)
        self.pending: list[list[int]] = []  # WRITING slots of STOREs not settled
        self.held: list[list[int]] = []  # pinned slots of LOADs not ended

    def both(self, op: str, *args: Any) -> Any:
        """``op`` on both pools: the same answer (or the same error)."""
        got = []
        for p in self.pools:
            try:
                got.append(("ok", getattr(p, op)(*args)))
            except HostPoolError as err:  # PageStateError too
                got.append(("error", str(err)))
        assert got[0] == got[1], op
        return got[0][1] if got[0][0] == "ok" else None

    @rule(
        chain=st.integers(0, 11),
        first=st.integers(0, 4),
        n=st.sampled_from((1, 2, 5, 9)),
        ns=st.sampled_from(NAMESPACES),
        owner=st.sampled_from(OWNERS),
        cid=st.integers(0, 2),
        parent=st.booleans(),
        fate=st.sampled_from(("commit", "abort", "later", "sums")),
    )
    def store(
        self, chain: int, first: int, n: int, ns: int, owner: int, cid: int, parent: bool, fate: str
    ) -> None:
        keys = [key(chain, first + i) for i in range(n)]
        up = key(chain, first - 1) if parent and first else None
        got = self.both("allocate", ns, owner, cid, keys, up)
        slots = [s for _, s in got]
        if fate == "commit":
            self.both("commit", slots)
        elif fate == "sums":
            self.both("commit", slots, [(s * 7919) & 0xFFFF for s in slots])
        elif fate == "abort":
            self.both("abort", slots)
        elif slots:
            self.pending.append(slots)

    @rule(
        pick=st.integers(0, 999),
        twigs=st.lists(
            st.tuples(
                st.integers(0, 15),
                st.sampled_from((1, 1, 3)),
                st.sampled_from(("commit", "abort", "later")),
            ),
            min_size=2,
            max_size=4,
        ),
        onto=st.sampled_from(("any", "writing", "writing, then aborted")),
        ns=st.sampled_from(NAMESPACES),
        owner=st.sampled_from(OWNERS),
        cid=st.integers(0, 2),
    )
    def branch(
        self,
        pick: int,
        twigs: list[tuple[int, int, str]],
        onto: str,
        ns: int,
        owner: int,
        cid: int,
    ) -> None:
        """STOREs that branch off one resident page, named by ``parent_key``: each twig is
        a new chain under it, so the page gets several children (each linked ahead of its
        siblings), and this rule's aborts and the releases, evictions, settles and flushes
        of the others take first, middle and last siblings off their lists. The page is
        READY or WRITING (``onto`` "writing": WRITING, of a pending STORE, a new one if
        there is none; "then aborted": that STORE is aborted after the twigs, which
        orphans them all). A twig's keys may be resident already (under another parent):
        the STORE goes on from there."""
        t = self.pools[0]._pages
        if onto != "any" and not t._writing.get(ns):  # a pending STORE to branch off
            got = self.both("allocate", ns, owner, cid, [key(99, pick % 8)])
            if got:
                self.pending.append([s for _, s in got])
        ready, writing = sorted(t.ready.get(ns, {})), sorted(t._writing.get(ns, {}))
        under = writing if onto != "any" and writing else ready + writing
        if not under:
            return
        up = under[pick % len(under)]
        for twig, n, fate in twigs:
            got = self.both("allocate", ns, owner, cid, [key(100 + twig, i) for i in range(n)], up)
            slots = [s for _, s in got]
            if fate == "commit":
                self.both("commit", slots)
            elif fate == "abort":
                self.both("abort", slots)
            elif slots:
                self.pending.append(slots)
        s = t._writing.get(ns, {}).get(up)
        if onto == "writing, then aborted" and s is not None:
            for i, slots in enumerate(self.pending):
                if s in slots:
                    self.both("abort", self.pending.pop(i))
                    break

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 99), ok=st.booleans())
    def settle(self, i: int, ok: bool) -> None:
        slots = self.pending.pop(i % len(self.pending))
        self.both("commit" if ok else "abort", slots)

    @rule(
        chain=st.integers(0, 11),
        n=st.integers(1, 8),
        ns=st.sampled_from(NAMESPACES),
        used=st.booleans(),
    )
    def load(self, chain: int, n: int, ns: int, used: bool) -> None:
        keys = [key(chain, i) for i in range(n)]
        self.both("lookup", ns, keys)
        slots = self.both("pin", ns, keys, used)
        if slots:
            self.held.append(slots)

    @rule(
        picks=st.lists(st.integers(0, 999), min_size=2, max_size=8), ns=st.sampled_from(NAMESPACES)
    )
    def load_any(self, picks: list[int], ns: int) -> None:
        """A LOAD of READY pages from many chains: several childless pages in one run."""
        ready = sorted(k for k, _ in self.pools[0].ready_pages(ns))
        if ready:
            slots = self.both("pin", ns, [ready[i % len(ready)] for i in picks])
            if slots:
                self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99), bad=st.sampled_from(("no", "no", "twice", "outside")))
    def unload(self, i: int, bad: str) -> None:
        slots = self.held.pop(i % len(self.held))
        if bad == "twice" and self.both("unpin", slots + slots[:1]) is None:
            self.held.append(slots)  # refused before any change
        elif bad == "outside":
            self.both("unpin", slots + [-1])
            self.held.append(slots)
        else:
            self.both("unpin", slots)

    @rule(chain=st.integers(0, 11), ns=st.sampled_from(NAMESPACES), touch=st.booleans())
    def write_back(self, chain: int, ns: int, touch: bool) -> None:
        """A write to L3: pinned (touched or not, as the writer pins), marked, unpinned."""
        keys = [key(chain, i) for i in range(6)]
        slots = self.both("pin", ns, keys, False, touch)
        self.both("mark_in_l3", slots)
        self.both("unpin", slots)

    @rule(on=st.booleans())
    def requires_l3(self, on: bool) -> None:
        for p in self.pools:
            p.evict_requires_l3 = on

    @rule(owner=st.sampled_from(OWNERS), limit=st.sampled_from((None, 0, 2, 3, 8)))
    def quota(self, owner: int, limit: int | None) -> None:
        """Any owner's quota set or lifted: an owner at it evicts from its own list."""
        self.both("set_quota", owner, limit)

    @rule(ns=st.sampled_from((None, *NAMESPACES)), owner=st.sampled_from((None, *OWNERS)))
    def flush(self, ns: int | None, owner: int | None) -> None:
        self.both("flush", ns, owner)

    @rule(pick=st.integers(0, 9999))
    def release(self, pick: int) -> None:
        """The page table's release of any slot: an evictable or WRITING page is freed (a
        pending STORE's page too: its commit is then refused alike), any other refused."""
        self.release_slot(pick % self.pools[0].n_slots)

    @rule(pick=st.integers(0, 999))
    def release_sibling(self, pick: int) -> None:
        """The same of a page with siblings (the first, a middle or the last child of a
        page that has several): one leaves its parent's child list."""
        model = cast(ResidentChildren, self.pools[1]._pages.kids)  # the oracle's child lists
        siblings = sorted(c for kids in model.of.values() if len(kids) > 1 for c in kids)
        if siblings:
            self.release_slot(siblings[pick % len(siblings)])

    def release_slot(self, s: int) -> None:
        got = []
        for p in self.pools:
            try:
                p._pages.release(s)
                got.append("freed")
            except HostPoolError as err:  # PageStateError too
                got.append(str(err))
        assert got[0] == got[1]

    @rule()
    def drain(self) -> None:
        self.both("drain_evicted")

    @invariant()
    def alike(self) -> None:
        assert observable(self.pools[0]) == observable(self.pools[1])

    @invariant()
    def lists_hold_exactly_the_evictable_pages(self) -> None:
        """The rule itself, which both pools could break alike: a page is on the
        evictable lists, once, exactly when it is READY, unpinned and childless."""
        pool = self.pools[0]
        listed = pool.evictable_slots()
        assert len(listed) == len(set(listed))
        evictable = {s for s in range(pool.n_slots) if pool.describe(s).evictable}
        assert set(listed) == evictable
        for owner in OWNERS:
            assert set(pool.evictable_slots(owner)) == {
                s for s in evictable if pool.describe(s).owner == owner
            }


class ArcVersusModel(PoolVersusModel):
    """The same under the ``arc`` eviction policy."""

    POLICY = "arc"


class ReuseVersusModel(PoolVersusModel):
    """The same under the ``reuse`` eviction policy."""

    POLICY = "reuse"


MODEL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)

TestPoolVersusModel = PoolVersusModel.TestCase
TestPoolVersusModel.settings = MODEL_SETTINGS
TestArcVersusModel = ArcVersusModel.TestCase
TestArcVersusModel.settings = MODEL_SETTINGS
TestReuseVersusModel = ReuseVersusModel.TestCase
TestReuseVersusModel.settings = MODEL_SETTINGS
