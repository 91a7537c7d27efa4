"""A STORE's slot allocation in C (:mod:`kvtier.daemon.pool.page_steps`) against the
page-by-page model (``tests/pool_model.py``).

Two pools get the same random operations: the host pool as the daemon runs it (every
allocation and commit in one C call) and one that allocates every key in Python. The
pools are small and hold two page classes, so allocations evict pages of their own class,
of the other (C's take_slot) and cut free extents (likewise); one owner has a quota
(take_slot decides its every slot). STOREs extend chains and branch off resident pages
(pages with several children, siblings evicted and aborted). After every operation both
must hold the same metadata columns, private arrays, indexes, evictable lists, counters
and eviction log, and have answered the same.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvtier.daemon.pool import page_steps
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError

from tests.pool_model import page_by_page
from tests.pool_model import observable as snapshot

KIB = 1024
EXTENT = 16 * KIB
NAMESPACES = (1, 2)
OWNERS = (10, 20, 30)  # 30 has a quota: take_slot decides its every slot


class Counting:
    """Stands in for the extension module, counting the calls that did the work."""

    def __init__(self, real: Any) -> None:
        self.real, self.runs, self.commits = real, 0, 0

    def run(self, *args: Any) -> Any:
        self.runs += 1
        return self.real.run(*args)

    def commit(self, *args: Any) -> Any:
        done = self.real.commit(*args)
        self.commits += done is not None
        return done

    def release(self, *args: Any) -> Any:
        return self.real.release(*args)


def pools(extents: int = 24) -> tuple[HostPool, HostPool]:
    out = (
        HostPool(extents * EXTENT, EXTENT, 4 * KIB),
        page_by_page(HostPool(extents * EXTENT, EXTENT, 4 * KIB)),
    )
    for p in out:
        assert p.register_class(4000) == 0  # 4 slots an extent
        assert p.register_class(8000) == 1  # 2 slots an extent
        p.set_quota(30, 40)
    return out


def key(rng: random.Random, chain: int, i: int) -> bytes:
    """A key of chain ``chain`` at position ``i``: 32 bytes mostly, sometimes shorter."""
    raw = f"c{chain}-{i}".encode()
    return raw if chain % 5 == 0 else raw.ljust(32, b".")


def run_ops(seed: int, ops: int = 400) -> tuple[int, int]:
    """Random operations on both pools, comparing after each; return how many allocations
    and commits C did."""
    rng = random.Random(seed)
    fast, ref = pools()
    counting = Counting(page_steps._alloc)
    page_steps._alloc = counting
    pending: list[tuple[list[int], bool]] = []  # WRITING slots left for later
    chains = 0
    try:
        for _ in range(ops):
            op = rng.random()
            if op < 0.7:  # a STORE
                if chains and rng.random() < 0.4:
                    chain = rng.randrange(chains)  # part of it may be resident
                else:
                    chain, chains = chains, chains + 1
                first = rng.randrange(0, 8)
                keys = [
                    key(rng, chain, first + i) for i in range(rng.choice((1, 3, 8, 12, 30, 60)))
                ]
                if rng.random() < 0.1 and len(keys) > 2:
                    keys[-1] = keys[0]  # a request that repeats a key
                parent = key(rng, chain, first - 1) if first and rng.random() < 0.7 else None
                ns, owner = rng.choice(NAMESPACES), rng.choice(OWNERS)
                if rng.random() < 0.25:  # a branch off any resident page: several children
                    t = fast._pages
                    resident = sorted(t.ready.get(ns, {})) + sorted(t._writing.get(ns, {}))
                    if resident:
                        parent = resident[rng.randrange(len(resident))]
                cid = 0 if rng.random() < 0.7 else 1
                got = [p.allocate(ns, owner, cid, keys, parent) for p in (fast, ref)]
                assert got[0] == got[1]
                slots = [s for _, s in got[0]]
                fate = rng.random()
                for p in (fast, ref):
                    if fate < 0.75:
                        p.commit(slots, [len(slots)] * len(slots))
                    elif fate < 0.85:
                        p.abort(slots)
                if fate >= 0.85:
                    pending.append((slots, rng.random() < 0.5))
            elif op < 0.8 and pending:  # settle an earlier STORE
                slots, ok = pending.pop(rng.randrange(len(pending)))
                for p in (fast, ref):
                    p.commit(slots) if ok else p.abort(slots)
            elif op < 0.9 and chains:  # a LOAD's pin, and its unpin later or never
                chain, ns = rng.randrange(chains), rng.choice(NAMESPACES)
                keys = [key(rng, chain, i) for i in range(40)]
                pinned = [p.pin(ns, keys) for p in (fast, ref)]
                assert pinned[0] == pinned[1]
                if rng.random() < 0.8:
                    for p in (fast, ref):
                        p.unpin(pinned[0])
            else:
                assert fast.drain_evicted() == ref.drain_evicted()
            assert snapshot(fast) == snapshot(ref)
    finally:
        page_steps._alloc = counting.real
    return counting.runs, counting.commits


@pytest.mark.parametrize("seed", range(6))
def test_allocations_in_c_match_page_by_page(seed: int) -> None:
    runs, commits = run_ops(seed)
    assert runs > 20 and commits > 20  # C did the work: not Python compared with itself


def test_a_key_over_32_bytes_is_refused_before_any_change() -> None:
    fast, ref = pools()
    keys = [b"k%02d" % i for i in range(20)] + [b"x" * 33]
    before = snapshot(fast)
    for p in (fast, ref):
        with pytest.raises(HostPoolError, match="at most 32 bytes"):
            p.allocate(1, 10, 0, keys)
    assert snapshot(fast) == before


def test_a_full_pool_evicts_in_c_and_keeps_counting() -> None:
    """Chains into a pool of one class fill it, then every STORE evicts cold pages; the
    evictions, their log and the per-owner lists agree with Python's, log overflow
    included."""
    fast, ref = pools(extents=8)
    for p in (fast, ref):
        p._pages.evictor.max_log = 50
    for chain in range(30):
        keys = [b"f%d-%d" % (chain, i) for i in range(16)]
        owner = OWNERS[chain % 2]
        got = [p.allocate(1, owner, 0, keys) for p in (fast, ref)]
        assert got[0] == got[1] and len(got[0]) == 16
        for p in (fast, ref):
            p.commit([s for _, s in got[0]])
        assert snapshot(fast) == snapshot(ref)
    assert fast._pages.evictor.evictions > 300 and fast._pages.evictor.unlogged > 0
    assert fast.drain_evicted() == ref.drain_evicted()


@pytest.mark.parametrize("bad", ["twice", "negative checksum", "not writing"])
def test_a_refused_commit_ends_as_page_by_page(bad: str) -> None:
    """What the Python path refuses, C leaves to it whole (a negative checksum, a slot not
    WRITING: nothing changes); a slot listed twice is committed up to it, then refused,
    as page by page."""
    fast, ref = pools()
    keys = [b"r%d" % i for i in range(12)]
    got = [p.allocate(1, 10, 0, keys) for p in (fast, ref)]
    slots = [s for _, s in got[0]]
    sums: list[int] | None = None
    if bad == "twice":
        slots = slots[:6] + [slots[2]] + slots[6:]
    elif bad == "negative checksum":
        sums = [1] * len(slots)
        sums[5] = -1
    else:
        slots[3] = slots[3] + 1000  # a FREE slot
    errors = []
    for p in (fast, ref):
        with pytest.raises(HostPoolError) as err:
            p.commit(slots, sums)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    assert snapshot(fast) == snapshot(ref)


def test_the_c_call_refuses_a_prev_outside_the_pool() -> None:
    """``_alloc.run`` checks the slot a STORE extends before reading its column, and
    changes nothing then."""
    fast, _ = pools()
    table = fast._pages
    runs, cls = table._steps, table.slots.classes[0]
    before = snapshot(fast)
    for prev in (-2, table.slots.n_slots):
        with pytest.raises(ValueError, match="outside the pool"):
            page_steps._alloc.run(
                runs._cols,
                [b"a", b"b"],
                prev,
                [0],
                1,
                10,
                0,
                cls.page_bytes,
                table._per_extent,
                {},
                {},
                {},
                table.keys,
                table.evictor.owned,
                table.evictor.lru.ends,
                table.evictor.lru.own_ends,
                [],
                runs._env(),
            )
    assert snapshot(fast) == before


@pytest.mark.parametrize("bad", ["twice", "free", "pinned", "outside"])
def test_a_refused_release_ends_as_page_by_page(bad: str) -> None:
    """An abort that lists a slot twice frees up to its second occurrence, then is refused,
    as page by page; a FREE, pinned or unknown slot is refused by the page table's release
    in C, named, and changes nothing."""
    fast, ref = pools()
    keys = [b"a%d" % i for i in range(10)]
    got = [p.allocate(1, 10, 0, keys) for p in (fast, ref)]
    assert got[0] == got[1]
    slots = [s for _, s in got[0]]
    if bad == "twice":
        errors = []
        for p in (fast, ref):
            with pytest.raises(HostPoolError) as err:
                p.abort(slots[:4] + [slots[1]] + slots[4:])
            errors.append(str(err.value))
        assert errors[0] == errors[1] and f"slot {slots[1]}" in errors[0]
        assert snapshot(fast) == snapshot(ref)
        return
    for p in (fast, ref):
        p.commit(slots)
    if bad == "pinned":
        for p in (fast, ref):
            p.pin(1, keys)
    if bad == "free":
        assert fast._pages.keys[slots[-1] + 1] is None  # the next slot of the extent: FREE
    victim = {"free": slots[-1] + 1, "pinned": slots[-1], "outside": fast.layout.n_slots}[bad]
    before = snapshot(fast)
    with pytest.raises(HostPoolError, match=f"slot {victim}"):
        fast._pages.release(victim)
    assert snapshot(fast) == before == snapshot(ref)


def test_an_owner_far_over_a_lowered_quota_evicts_at_most_the_budget_per_slot() -> None:
    """An owner whose quota was lowered far below its pages replaces at most ``budget`` of
    them for one new page; short of its quota then, the page is not stored (a shortfall),
    in C as page by page."""
    fast, ref = pools()
    keys = [b"q%d" % i for i in range(20)]
    for p in (fast, ref):
        got = p.allocate(1, 30, 0, keys)
        assert len(got) == 20
        p.commit([s for _, s in got])
        p.set_quota(30, 2)
    budget = fast._pages.evictor.budget
    assert budget < 20 - 2
    owned, tries = 20, 0
    while True:  # each try evicts at most `budget` of the owner's own pages
        tries += 1
        before = fast._pages.evictor.evictions
        got = [p.allocate(1, 30, 0, [b"new"]) for p in (fast, ref)]
        assert got[0] == got[1]
        assert snapshot(fast) == snapshot(ref)
        need = owned - 2 + 1  # down to one below the quota, then a page of its own
        if need > budget:
            assert got[0] == [] and fast._pages.evictor.evictions - before == budget
            owned -= budget
            continue
        assert len(got[0]) == 1 and fast._pages.evictor.evictions - before == need
        break
    assert tries == 3


def test_release_frees_an_evictable_page_and_refuses_a_parent() -> None:
    """The page table's release takes an evictable page off the evictable lists first, as
    page by page; a READY page with a resident child is refused and nothing changes."""
    fast, ref = pools()
    keys = [b"e%d" % i for i in range(6)]
    got = [p.allocate(1, 10, 0, keys) for p in (fast, ref)]
    for p in (fast, ref):
        p.commit([s for _, s in got[0]])
    tail, parent = got[0][-1][1], got[0][-2][1]
    for p in (fast, ref):
        p._pages.release(tail)
    assert snapshot(fast) == snapshot(ref)
    assert tail not in fast.evictable_slots() and parent in fast.evictable_slots()
    for p in (fast, ref):
        p._pages.release(parent)  # childless now
    assert snapshot(fast) == snapshot(ref)
    before = snapshot(fast)
    grand = got[0][-4][1]  # its child got[0][-3] is still resident
    for p in (fast, ref):
        with pytest.raises(HostPoolError, match=f"cannot release slot {grand}: it is READY"):
            p._pages.release(grand)
    assert snapshot(fast) == before == snapshot(ref)


def test_release_reads_every_slot_before_it_frees_one() -> None:
    """A slot id whose ``__index__`` empties the pool's key list runs before anything is
    freed; the call then refuses the pool as it stands (its key list no longer covers its
    slots), never reads past the list."""
    fast, _ = pools()
    got = fast.allocate(1, 10, 0, [b"x%d" % i for i in range(4)])
    table = fast._pages
    saved = list(table.keys)

    class Sneaky:
        def __index__(self) -> int:
            table.keys[:] = []
            return got[0][1]

    try:
        with pytest.raises(ValueError, match="do not agree"):
            table._steps.release([Sneaky()])  # type: ignore[list-item]
    finally:
        table.keys[:] = saved
    assert table.keys[got[0][1]] == b"x0"  # nothing freed


@pytest.mark.parametrize(
    ("parent", "cls", "keys"),
    [(None, 1, [b"big"]), (b"f23", 0, [b"n1", b"n2", b"n3"])],
)
def test_an_error_inside_the_policy_leaves_the_pool_as_page_by_page(
    parent: bytes | None, cls: int, keys: list[bytes]
) -> None:
    """When the policy's Python state raises in the middle of a slot's evictions (arc's
    ``evicted_page``), what was done stays done and is written back, in C as page by page:
    the lists, counters, clock and index agree with the model's (the page the STORE
    extends has no child from it), and the next STORE works."""
    fast, ref = (
        HostPool(6 * EXTENT, EXTENT, 4 * KIB, eviction_policy="arc"),
        page_by_page(HostPool(6 * EXTENT, EXTENT, 4 * KIB, eviction_policy="arc")),
    )
    for p in (fast, ref):
        assert p.register_class(4000) == 0 and p.register_class(8000) == 1
        for i in range(24):  # six extents of four pages: full, of 24 one-page chains
            got = p.allocate(1, 20, 0, [b"f%d" % i])
            assert len(got) == 1
            p.commit([s for _, s in got])
    for p in (fast, ref):
        split = p._pages.evictor.split
        real, calls = split.evicted_page, []

        def failing(*args, real=real, calls=calls):
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("policy failed")
            return real(*args)

        split.evicted_page = failing
        with pytest.raises(RuntimeError, match="policy failed"):
            p.allocate(1, 20, cls, keys, parent)  # evictions: a free extent, or slots
        del split.evicted_page
    assert snapshot(fast) == snapshot(ref)
    got = [p.allocate(1, 20, cls, keys[-1:], parent) for p in (fast, ref)]
    assert got[0] == got[1] and len(got[0]) == 1
    assert snapshot(fast) == snapshot(ref)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_an_error_inside_the_allocation_keeps_the_clock_of_the_pages_it_wrote(
    fail_at: int,
) -> None:
    """When the policy's Python code raises part way through a STORE's allocation, the
    pages already written keep their access stamps and the table's clock has counted them
    (a later page never gets an older stamp)."""
    pool = HostPool(4 * EXTENT, EXTENT, 4 * KIB, eviction_policy="arc")
    cls = pool.register_class(4000)
    table = pool._pages
    split = table.evictor.split
    assert split is not None
    calls = [0]
    real = split.admit

    def admit(s: int, ns: int, k: bytes, clock: int) -> None:
        calls[0] += 1
        if calls[0] == fail_at + 1:
            raise RuntimeError("the policy failed")
        real(s, ns, k, clock)

    split.admit = admit  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the policy failed"):
        pool.allocate(1, 10, cls, [b"k%d" % i for i in range(6)])
    stamps = [table.meta.stamp[s] for s in range(table.n_slots) if table.meta.state[s]]
    assert len(stamps) == fail_at + 1 and table._clock == max(stamps)
    split.admit = real  # type: ignore[method-assign]
    ((_, s),) = pool.allocate(1, 10, cls, [b"later"])
    assert table.meta.stamp[s] == max(stamps) + 1


def test_an_error_while_a_slot_is_taken_drops_the_child_reference_it_took() -> None:
    """A STORE extending a READY page shields it (a child reference) while its slot is
    taken; when the policy raises then, the page gets no child and is evictable again."""
    pool = HostPool(4 * EXTENT, EXTENT, 4 * KIB, eviction_policy="arc")
    cls = pool.register_class(4000)
    keys = [b"k%d" % i for i in range(pool.n_slots)]
    pool.commit([s for _, s in pool.allocate(1, 10, cls, keys)])  # full: the next evicts
    tail = pool._pages.ready[1][keys[-1]]
    assert tail in pool.evictable_slots()
    split = pool._pages.evictor.split
    assert split is not None

    def victim_list(resident: int) -> int:
        raise RuntimeError("the policy failed")

    split.victim_list = victim_list  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the policy failed"):
        pool.allocate(1, 10, cls, [b"next"], keys[-1])
    assert pool._pages.kids.count[tail] == 0 and tail in pool.evictable_slots()


def test_a_new_page_size_past_the_bound_takes_an_idle_class():
    """Past ``max_classes``, a new page size takes over the id of a class that holds no
    page and no open session's size; a class holding pages, or named in ``in_use``, keeps
    its size and the new one is refused. The new class allocates, commits and reads back
    like any other."""
    pool = HostPool(8 * EXTENT, EXTENT, 4 * KIB)
    a = pool.register_class(4000, max_classes=2)
    b = pool.register_class(8000, max_classes=2)
    ns = pool.namespace_id(b"n" * 32)
    owner = pool.owner_id("t")
    held = pool.allocate(ns, owner, a, [b"a0", b"a1"])
    gone = pool.allocate(ns, owner, b, [b"b0", b"b1", b"b2"])
    pool.commit([s for _, s in held])
    with pytest.raises(HostPoolError, match="page size past the 2"):
        pool.register_class(12000, max_classes=2)  # a holds pages, b's are WRITING
    pool.abort([s for _, s in gone])
    with pytest.raises(HostPoolError, match="page size past the 2"):
        pool.register_class(12000, max_classes=2, in_use=[b])  # an open session's size
    c = pool.register_class(12000, max_classes=2, in_use=[a])
    assert c == b
    assert pool.register_class(12000, max_classes=2) == c  # the same size, the same id
    assert pool.class_stride(c) >= 12000
    new = pool.allocate(ns, owner, c, [b"c0", b"c1"])
    assert len(new) == 2
    pool.commit([s for _, s in new])
    assert pool.lookup(ns, [b"a0", b"a1"]) == 2 and pool.lookup(ns, [b"c0", b"c1"]) == 2
    stats = {k.page_bytes: k for k in pool.stats().classes}
    assert 8000 not in stats and stats[12000].pages_ready == stats[4000].pages_ready == 2
    with pytest.raises(HostPoolError, match="page size past the 2"):
        pool.register_class(8000, max_classes=2)  # both hold pages now


def test_a_page_stored_before_its_prefix_rejoins_its_chain() -> None:
    """A resident page without a parent (stored before its prefix was back) is linked under
    the page of the key before it when a STORE names both: that prefix page is then not
    evictable while its extension is resident, as in any chain. A request that would make a
    page its own ancestor links nothing."""
    fast, ref = pools()
    keys = [b"o%d" % i for i in range(6)]
    tail = [p.allocate(1, 10, 0, keys[3:]) for p in (fast, ref)]  # no parent resident
    for p in (fast, ref):
        p.commit([s for _, s in tail[0]])
    whole = [p.allocate(1, 10, 0, keys) for p in (fast, ref)]
    assert whole[0] == whole[1] and [i for i, _ in whole[0]] == [0, 1, 2]
    for p in (fast, ref):
        p.commit([s for _, s in whole[0]])
    assert snapshot(fast) == snapshot(ref)
    prefix_end, tail_head = whole[0][-1][1], tail[0][0][1]
    evictable = fast.evictable_slots()
    assert prefix_end not in evictable, "the prefix's last page is evictable under its tail"
    assert tail[0][-1][1] in evictable  # the chain shrinks from its tail
    for p in (fast, ref):
        p._pages.release(tail[0][-1][1])
        p._pages.release(tail[0][-2][1])
        p._pages.release(tail_head)
    assert prefix_end in fast.evictable_slots() and snapshot(fast) == snapshot(ref)

    loop = [b"l0", b"l1"]
    made = [p.allocate(2, 10, 0, loop) for p in (fast, ref)]  # l0 <- l1
    for p in (fast, ref):
        p.commit([s for _, s in made[0]])
    before = snapshot(fast)
    again = [p.allocate(2, 10, 0, [loop[1], loop[0]]) for p in (fast, ref)]
    assert again[0] == again[1] == []
    assert snapshot(fast) == before == snapshot(ref)
