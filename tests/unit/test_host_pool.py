"""Exact tests of the host pool's slot allocator and L2 index (no mocks).

Geometry used throughout: align 4 KiB, extents of 16 KiB, so every extent reserves
4 slot ids (extent e owns ids 4e..4e+3). Class "small" (4000 B pages) has a 4 KiB
stride and 4 slots per extent; class "big" (5000 B pages) an 8 KiB stride and 2 slots.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.config.errors import KvtierError
from kvtier.daemon.pool.host_pool import (
    NIL,
    EvictedPage,
    HostPool,
    HostPoolError,
    PageState,
    PageStateError,
)

RUN_PAGES = 8  # a STORE of several pages (C allocates any number)

KIB = 1024
EXTENT = 16 * KIB
NS, NS2 = 1, 2
A, B = 10, 20  # owners


def k(name: str) -> bytes:
    return name.encode()


def chain(prefix: str, n: int) -> list[bytes]:
    return [k(f"{prefix}{i}") for i in range(n)]


def pool_of(extents: int, **kw: int) -> HostPool:
    return HostPool(extents * EXTENT + 1000, EXTENT, 4 * KIB, **kw)  # the 1000 B are unused


def store(
    pool: HostPool,
    keys: list[bytes],
    cls: int,
    ns: int = NS,
    owner: int = A,
    parent: bytes | None = None,
) -> list[int]:
    """Allocate and commit ``keys``; return the new slots."""
    slots = [s for _, s in pool.allocate(ns, owner, cls, keys, parent)]
    pool.commit(slots)
    return slots


def evicted_keys(pool: HostPool) -> list[bytes]:
    return [e.key for e in pool.drain_evicted()]


# ----------------------------------------------------------------- geometry


def test_geometry_and_class_registration() -> None:
    pool = pool_of(3)
    assert (pool.n_extents, pool.n_slots) == (3, 12)
    small = pool.register_class(4000)
    big = pool.register_class(5000)
    assert (small, big) == (0, 1)
    assert pool.register_class(4000) == small
    assert (pool.class_stride(small), pool.class_stride(big)) == (4096, 8192)
    assert pool.register_class(EXTENT) == 2
    with pytest.raises(HostPoolError, match="exceeds extent_bytes"):
        pool.register_class(EXTENT + 1)
    with pytest.raises(HostPoolError, match="positive"):
        pool.register_class(0)
    with pytest.raises(HostPoolError, match="unknown page class 7"):
        pool.allocate(NS, A, 7, [k("x")])
    with pytest.raises(HostPoolError, match="power of two"):
        HostPool(EXTENT, EXTENT, 3000)
    with pytest.raises(HostPoolError, match="holds no"):
        HostPool(EXTENT - 1, EXTENT)
    assert issubclass(PageStateError, KvtierError)


def test_min_page_bytes_bounds_metadata_and_caps_small_classes() -> None:
    pool = HostPool(2 * EXTENT, EXTENT, 4 * KIB, min_page_bytes=8 * KIB)
    assert pool.n_slots == 4  # 2 ids per extent instead of 4
    small = pool.register_class(4000)  # would fit 4 per extent; capped at 2
    got = [s for _, s in pool.allocate(NS, A, small, chain("s", 5))]
    assert got == [0, 1, 2, 3]
    assert [pool.slot_offset(s) for s in got] == [0, 4096, EXTENT, EXTENT + 4096]


def test_consecutive_allocations_are_contiguous() -> None:
    pool = pool_of(3)
    small = pool.register_class(4000)
    first = pool.allocate(NS, A, small, chain("a", 3))
    second = pool.allocate(NS, A, small, chain("b", 3))
    assert first == [(0, 0), (1, 1), (2, 2)]
    assert second == [(0, 3), (1, 4), (2, 5)]  # slot 4 opens extent 1
    slots = [s for _, s in first + second]
    assert [pool.slot_offset(s) for s in slots] == [i * 4096 for i in range(6)]
    with pytest.raises(HostPoolError, match="not allocated"):
        pool.slot_offset(8)  # extent 2 is still free
    with pytest.raises(HostPoolError, match="out of range"):
        pool.slot_offset(12)


def test_two_classes_share_the_budget_and_an_emptied_extent_changes_class() -> None:
    pool = pool_of(2)
    small, big = pool.register_class(4000), pool.register_class(5000)
    a = [s for _, s in pool.allocate(NS, A, small, chain("a", 4))]
    b = [s for _, s in pool.allocate(NS, A, big, chain("b", 2))]
    assert (a, b) == ([0, 1, 2, 3], [4, 5])
    assert [pool.slot_offset(s) for s in b] == [EXTENT, EXTENT + 8192]
    assert pool.allocate(NS, A, big, [k("b2")]) == []  # full, all WRITING
    st0 = pool.stats()
    assert (st0.extents_free, st0.used_bytes) == (0, 4 * 4096 + 2 * 8192)
    assert st0.used_bytes <= st0.capacity_bytes
    pool.abort(a)
    assert pool.stats().extents_free == 1
    assert pool.allocate(NS, A, big, [k("b2"), k("b3"), k("b4")]) == [(0, 0), (1, 1)]
    assert [pool.slot_offset(s) for s in (0, 1)] == [0, 8192]
    cls_stats = pool.stats().classes
    assert [(c.extents, c.pages_writing) for c in cls_stats] == [(0, 0), (2, 4)]


def test_eviction_reclaims_an_extent_of_another_class() -> None:
    pool = pool_of(2)
    small, big = pool.register_class(4000), pool.register_class(5000)
    store(pool, chain("a", 4), small)  # extent 0
    store(pool, chain("b", 2), big)  # extent 1, warmer
    got = pool.allocate(NS, A, big, [k("n")])
    assert got == [(0, 0)]  # extent 0 emptied and recut for the big class
    assert evicted_keys(pool) == [k("a3"), k("a2"), k("a1"), k("a0")]
    assert pool.lookup(NS, chain("b", 2)) == 2
    assert [c.extents for c in pool.stats().classes] == [0, 2]


def test_eviction_budget_then_falls_back_to_own_class() -> None:
    pool = pool_of(4)
    small, big = pool.register_class(4000), pool.register_class(5000)
    for e in range(3):  # 3 small extents, each kept alive by one pinned page
        keys = [k(f"p{e}")] + [k(f"s{e}{i}") for i in range(3)]
        store(pool, keys[:1], small)
        store(pool, keys[1:], small)
        pool.pin(NS, keys[:1])
    b = store(pool, chain("b", 2), big)  # warmest
    assert pool.allocate(NS, A, big, [k("n")]) == [(0, b[1])]
    # budget = 2 x 4 slots: eight small victims reclaim nothing, then the big tail goes
    ev = evicted_keys(pool)
    assert ev[:8] == [k(n) for n in ("s02", "s01", "s00", "s12", "s11", "s10", "s22", "s21")]
    assert ev[8:] == [k("b1")]
    assert pool.lookup(NS, [k("s20")]) == 1


# ------------------------------------------------------------- index, states


def test_lookup_stops_at_first_missing_or_writing_key() -> None:
    pool = pool_of(2)
    small = pool.register_class(4000)
    keys = chain("a", 4)
    slots = [s for _, s in pool.allocate(NS, A, small, keys)]
    assert pool.lookup(NS, keys) == 0  # all WRITING
    pool.commit([slots[0], slots[1], slots[3]])
    assert pool.lookup(NS, keys) == 2  # a2 still WRITING
    assert pool.lookup(NS, [keys[0], k("zz"), keys[1]]) == 1
    assert pool.pin(NS, keys) == slots[:2]
    assert pool.lookup(NS, []) == 0
    assert pool.resident_run(NS, keys + [k("zz"), keys[0]]) == 4  # WRITING counts here
    assert pool.resident_run(NS2, keys) == 0


def test_allocate_skips_present_keys_and_links_parents() -> None:
    pool = pool_of(2)
    small = pool.register_class(4000)
    store(pool, chain("a", 2), small)  # slots 0, 1
    got = pool.allocate(NS, A, small, chain("a", 4))
    assert got == [(2, 2), (3, 3)]
    assert pool.describe(2).parent == 1 and pool.describe(1).children == 1
    more = pool.allocate(NS, A, small, [k("a4")], parent_key=k("a3"))
    assert more == [(0, 4)] and pool.describe(4).parent == 3
    orphan = pool.allocate(NS, A, small, [k("x")], parent_key=k("nope"))
    assert pool.describe(orphan[0][1]).parent == NIL


def test_writing_pages_are_invisible_and_not_evictable() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    pool.allocate(NS, A, small, chain("w", 4))
    assert pool.lookup(NS, chain("w", 4)) == 0
    assert pool.pin(NS, chain("w", 4)) == []
    assert pool.evictable_slots() == []
    assert pool.allocate(NS, A, small, [k("n")]) == []
    assert pool.stats().evictions == 0


def test_detached_writing_pages_let_another_store_write_their_keys() -> None:
    """A cancelled STORE's WRITING pages are detached: their keys leave the index at once,
    so another STORE of the same keys allocates pages of its own; aborting the detached
    pages later frees them and leaves the new pages' index entries alone."""
    pool = pool_of(2)
    small = pool.register_class(4000)
    keys = chain("d", 3)
    old = [s for _, s in pool.allocate(NS, A, small, keys)]
    assert pool.allocate(NS, B, small, keys) == []  # being written: skipped
    pool.detach(old)
    pool.detach(old)  # twice: nothing more happens
    new = [s for _, s in pool.allocate(NS, B, small, keys)]
    assert len(new) == 3 and not set(new) & set(old)
    pool.abort(old)
    assert all(pool.describe(s).state is PageState.FREE for s in old)
    assert pool.lookup(NS, keys) == 0  # the new pages are still WRITING
    pool.commit(new)
    assert pool.lookup(NS, keys) == 3 and pool.pin(NS, keys) == new


def test_abort_frees_slots_and_parent_becomes_evictable() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    slots = [s for _, s in pool.allocate(NS, A, small, chain("a", 3))]
    pool.commit(slots[:1])
    assert pool.evictable_slots() == []  # a0 has a resident child
    pool.abort(slots[1:])
    assert pool.lookup(NS, chain("a", 3)) == 1
    assert pool.describe(slots[1]).state is PageState.FREE
    assert pool.describe(slots[0]).children == 0
    assert pool.evictable_slots() == [slots[0]]
    assert pool.allocate(NS, A, small, [k("a1"), k("a2")]) == [(0, 1), (1, 2)]


def test_abort_of_a_parent_orphans_children_from_other_batches() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    ((_, p),) = pool.allocate(NS, A, small, [k("a0")])
    assert pool.allocate(NS, A, small, [k("a0"), k("a1")]) == [(1, 1)]
    pool.commit([1])
    assert pool.describe(p).children == 1
    pool.abort([p])
    assert pool.describe(1).parent == NIL and pool.describe(1).state is PageState.READY
    assert pool.lookup(NS, [k("a0"), k("a1")]) == 0
    assert pool.allocate(NS, A, small, [k("a0"), k("a1")]) == [(0, 0)]


def test_wrong_transitions_raise_and_change_nothing() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    w = [s for _, s in pool.allocate(NS, A, small, chain("a", 2))]
    pool.commit([w[0]])
    with pytest.raises(PageStateError, match="cannot commit slot 0: it is READY, not WRITING"):
        pool.commit([w[1], w[0]])
    assert pool.describe(w[1]).state is PageState.WRITING  # validated before any change
    with pytest.raises(PageStateError, match="cannot abort slot 0: it is READY"):
        pool.abort([w[0], w[1]])
    assert pool.describe(w[1]).state is PageState.WRITING
    with pytest.raises(PageStateError, match="cannot commit slot 3: it is FREE"):
        pool.commit([3])
    with pytest.raises(PageStateError, match="cannot unpin slot 0: it is READY with no pins"):
        pool.unpin([w[0]])
    with pytest.raises(PageStateError, match="cannot unpin slot 1: it is WRITING"):
        pool.unpin([w[1]])
    with pytest.raises(PageStateError, match="cannot commit slot 1: it is READY"):
        pool.commit([w[1], w[1]])  # a duplicate fails at its second occurrence
    with pytest.raises(PageStateError, match="FREE"):
        pool.mark_in_l3([3])
    with pytest.raises(HostPoolError, match="slot 99 out of range"):
        pool.abort([99])
    with pytest.raises(HostPoolError, match=">= 0"):
        pool.set_quota(A, -1)


def test_namespace_isolation() -> None:
    pool = pool_of(2)
    small = pool.register_class(4000)
    slots = store(pool, chain("a", 2), small, ns=NS)
    assert pool.lookup(NS2, chain("a", 2)) == 0
    assert pool.pin(NS2, chain("a", 2)) == []
    # the same key in another namespace is another page: NS2 gets its own slots, so a
    # store reveals nothing about what NS holds, and NS's pages are untouched
    own = pool.allocate(NS2, A, small, [k("a0"), k("z")])
    assert [i for i, _ in own] == [0, 1] and not set(slots) & {s for _, s in own}
    assert pool.resident_run(NS2, [k("a0"), k("z")]) == 2
    pool.commit([s for _, s in own])
    assert pool.lookup(NS2, [k("a0"), k("a1")]) == 1
    got = pool.allocate(NS2, A, small, [k("b0")], parent_key=k("a1"))
    assert pool.describe(got[0][1]).parent == NIL  # no link across namespaces
    assert pool.describe(slots[0]).ns_id == NS and pool.lookup(NS, chain("a", 2)) == 2
    pool.abort([s for _, s in got])
    pool.flush(ns_id=NS2)
    assert pool.lookup(NS, chain("a", 2)) == 2


# ------------------------------------------------------------------ eviction


def test_lru_evicts_chains_tail_to_head() -> None:
    pool = pool_of(2)  # 8 small slots
    small = pool.register_class(4000)
    x = store(pool, chain("x", 3), small)
    y = store(pool, chain("y", 3), small)
    store(pool, chain("z", 2), small)
    stamps = [pool.describe(s).last_access for s in x]
    assert stamps[2] < stamps[1] < stamps[0]  # commit touches the tail first
    assert pool.evictable_slots() == [x[2], y[2], 7]
    got = pool.allocate(NS, A, small, chain("w", 4))
    assert evicted_keys(pool) == [k("x2"), k("x1"), k("x0"), k("y2")]
    assert [s for _, s in got] == [x[2], x[1], x[0], y[2]]
    assert pool.lookup(NS, chain("y", 3)) == 2


def test_touch_makes_a_chain_hot_and_keeps_its_tail_colder() -> None:
    pool = pool_of(2)
    small = pool.register_class(4000)
    x = store(pool, chain("x", 3), small)
    y = store(pool, chain("y", 3), small)
    pool.unpin(pool.pin(NS, chain("x", 3)))  # x is now more recent than y
    stamps = [pool.describe(s).last_access for s in x]
    assert stamps[2] < stamps[1] < stamps[0]
    assert pool.evictable_slots() == [y[2], x[2]]
    pool.allocate(NS, A, small, chain("w", 5))
    assert evicted_keys(pool) == [k("y2"), k("y1"), k("y0")]


def test_a_parent_is_never_evicted_while_a_child_is_resident() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    a = store(pool, chain("a", 3), small)
    store(pool, [k("b")], small)
    assert pool.pin(NS, [k("a2")]) == [a[2]]  # pin only the tail
    got = pool.allocate(NS, A, small, [k("n0"), k("n1")])
    assert got == [(0, 3)] and evicted_keys(pool) == [k("b")]  # a0, a1 stay
    pool.unpin([a[2]])
    pool.allocate(NS, A, small, [k("n1")])
    assert evicted_keys(pool) == [k("a2")]


def test_parent_placement_when_its_last_child_leaves() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    (_, a0), (_, a1) = pool.allocate(NS, A, small, [k("a0"), k("a1")])
    pool.commit([a0])  # oldest, but has a child
    p = store(pool, [k("p")], small)[0]
    pool.commit([a1])
    q = store(pool, [k("q")], small)[0]
    assert pool.evictable_slots() == [p, a1, q]
    pool.pin(NS, [k("p")])
    pool.allocate(NS, A, small, [k("n")])  # evicts a1; a0 is older than q: cold end
    assert evicted_keys(pool) == [k("a1")]
    assert pool.evictable_slots() == [a0, q]
    pool.unpin([p])  # p was touched after q: hot end
    assert pool.evictable_slots() == [a0, q, p]

    pool2 = pool_of(1)
    small = pool2.register_class(4000)
    (_, b0), (_, b1) = pool2.allocate(NS, A, small, [k("b0"), k("b1")])
    pool2.commit([b1])
    r = store(pool2, [k("r")], small)[0]
    pool2.commit([b0])  # b0 is more recent than r
    store(pool2, [k("t")], small)
    pool2.allocate(NS, A, small, [k("n")])
    assert evicted_keys(pool2) == [k("b1")]
    assert pool2.evictable_slots() == [r, b0, 3]  # b0: after r, before t, by its last use


def test_a_parent_passes_over_at_most_the_walk_of_recent_pages() -> None:
    """A parent that becomes evictable goes where its last access puts it among the 17 most
    recent pages of its list (``RECENCY_WALK`` + 1); older than those, it goes before the
    17th (not further back: the walk is bounded)."""
    pool = pool_of(6)  # 24 slots
    small = pool.register_class(4000)
    (_, a0), (_, a1) = pool.allocate(NS, A, small, [k("a0"), k("a1")])
    pool.commit([a1])  # the oldest evictable page; its parent a0 is not evictable yet
    y = store(pool, [k("y")], small)[0]
    pool.commit([a0])
    xs = [store(pool, [k(f"x{i}")], small)[0] for i in range(21)]  # the pool is full
    assert pool.evictable_slots() == [a1, y, *xs]
    pool.allocate(NS, A, small, [k("n")])  # evicts a1: a0 is evictable, more recent than y
    assert evicted_keys(pool) == [k("a1")]
    assert pool.evictable_slots() == [y, *xs[:4], a0, *xs[4:]]  # x20 .. x4 looked at


def test_pins_block_eviction_and_full_pool_is_a_shortfall() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    keys = chain("a", 4)
    store(pool, keys[:2], small)
    store(pool, keys[2:3], small)
    store(pool, keys[3:], small)
    pinned = pool.pin(NS, keys[:3]) + pool.pin(NS, keys[3:])
    assert pool.stats().pages_pinned == 4
    assert pool.allocate(NS, A, small, [k("n0"), k("n1")]) == []
    pool.unpin([pinned[3]])
    assert pool.allocate(NS, A, small, [k("a0"), k("n0"), k("n1")]) == [(1, 3)]
    assert evicted_keys(pool) == [k("a3")]
    assert pool.describe(3).parent == 0  # parented by the present a0


def test_a_pinned_page_is_never_evicted_and_is_evictable_again_after_unpin() -> None:
    """Full pool, the coldest page pinned: allocation evicts the other three in LRU
    order, then falls short rather than take the pinned one; once unpinned it is the
    coldest evictable page and the next allocation takes exactly its slot."""
    pool = pool_of(1)  # one extent: slots 0..3
    small = pool.register_class(4000)
    a, b, c, d = (store(pool, [k(n)], small)[0] for n in "abcd")  # independent pages
    assert (a, b, c, d) == (0, 1, 2, 3)
    assert pool.evictable_slots() == [a, b, c, d]  # cold end first
    assert pool.pin(NS, [k("a")]) == [a]

    got = pool.allocate(NS, A, small, chain("n", 4))
    assert got == [(0, b), (1, c), (2, d)]  # n3 finds nothing evictable: a shortfall
    assert pool.drain_evicted() == [
        EvictedPage(k("b"), NS, b, False),
        EvictedPage(k("c"), NS, c, False),
        EvictedPage(k("d"), NS, d, False),
    ]
    info = pool.describe(a)
    assert (info.state, info.key, info.pins, info.evictable) == (PageState.READY, k("a"), 1, False)
    assert pool.lookup(NS, [k("a")]) == 1
    pool.commit([b, c, d])  # the chain n0 <- n1 <- n2: only its tail n2 is evictable
    assert pool.evictable_slots() == [d]
    assert pool.allocate(NS, A, small, [k("x")]) == [(0, d)]
    assert evicted_keys(pool) == [k("n2")]
    assert pool.evictable_slots() == [c]  # n1 lost its child; a is still pinned
    assert pool.describe(a).pins == 1 and pool.lookup(NS, [k("a")]) == 1

    pool.unpin([a])  # touched by its pin before the n pages: it goes to the cold end
    assert pool.describe(a).evictable and pool.evictable_slots() == [a, c]
    assert pool.stats().pages_pinned == 0
    pool.commit([d])  # x
    assert pool.allocate(NS, A, small, [k("y")]) == [(0, a)]
    assert evicted_keys(pool) == [k("a")]
    assert pool.lookup(NS, [k("a")]) == 0


def test_a_pinned_parent_stays_off_the_lru_when_its_last_child_leaves() -> None:
    """A pinned page whose last resident child leaves (aborted, flushed, evicted, or a
    child reference dropped by a shortfall) is still pinned: it must not become evictable,
    and pressure must never take it."""
    pool = pool_of(1)  # one extent: slots 0..3
    small = pool.register_class(4000)
    (p,) = store(pool, [k("p")], small)
    assert pool.pin(NS, [k("p")]) == [p]

    def still_pinned_and_off_the_lists() -> None:
        info = pool.describe(p)
        assert (info.state, info.pins, info.children, info.evictable) == (
            PageState.READY,
            1,
            0,
            False,
        )
        assert p not in pool.evictable_slots() and p not in pool.evictable_slots(A)

    ((_, c),) = pool.allocate(NS, A, small, [k("p"), k("c")])  # c extends p
    assert pool.describe(p).children == 1
    pool.abort([c])  # the child leaves unfilled
    still_pinned_and_off_the_lists()

    (c,) = store(pool, [k("c")], small, parent=k("p"))
    assert pool.evictable_slots() == [c]
    assert pool.flush(NS) == 1  # the child goes; its pinned parent stays
    assert pool.lookup(NS, [k("p"), k("c")]) == 1
    still_pinned_and_off_the_lists()

    (c,) = store(pool, [k("c")], small, parent=k("p"))
    x, y = (store(pool, [k(n)], small)[0] for n in "xy")  # the pool is full
    assert pool.evictable_slots() == [c, x, y]
    got = pool.allocate(NS, A, small, chain("n", 4))  # evicts c, x, y; never p
    assert got == [(0, c), (1, x), (2, y)]
    assert evicted_keys(pool) == [k("c"), k("x"), k("y")]
    still_pinned_and_off_the_lists()
    pool.abort([s for _, s in got])

    pool.set_quota(A, 1)  # p is A's only page: the child finds no slot, its reference drops
    assert pool.allocate(NS, A, small, [k("p"), k("d")]) == []
    still_pinned_and_off_the_lists()
    pool.set_quota(A, None)

    pool.unpin([p])  # now it is evictable
    assert pool.describe(p).evictable and pool.evictable_slots() == [p]


def test_a_pinned_parent_stays_off_the_lru_when_a_long_store_evicts_its_child() -> None:
    """As above, for one allocation of many keys (C's allocation loop), whose evictions drop
    the pinned parent's last child."""
    pool = pool_of(3)  # 12 slots
    small = pool.register_class(4000)
    (p,) = store(pool, [k("p")], small)
    (c,) = store(pool, [k("c")], small, parent=k("p"))
    store(pool, chain("o", 10), small)
    assert pool.pin(NS, [k("p")]) == [p]
    assert pool.evictable_slots()[0] == c  # the coldest: stored before the others
    got = pool.allocate(NS, A, small, chain("n", RUN_PAGES))
    assert len(got) == RUN_PAGES and evicted_keys(pool)[0] == k("c")
    info = pool.describe(p)
    assert (info.pins, info.children, info.evictable) == (1, 0, False)
    assert p not in pool.evictable_slots()
    pool.commit([s for _, s in got])
    got2 = pool.allocate(NS, A, small, chain("m", 12))  # everything unpinned goes; p stays
    assert p not in [s for _, s in got2] and pool.lookup(NS, [k("p")]) == 1
    assert k("p") not in evicted_keys(pool)


def test_evict_requires_l3_skips_pages_not_in_l3() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    slots = store(pool, [k("a"), k("b")], small) + store(pool, [k("c"), k("d")], small)
    pool.evict_requires_l3 = True
    assert pool.allocate(NS, A, small, [k("n")]) == []
    pool.mark_in_l3([slots[3]])
    assert pool.allocate(NS, A, small, [k("n")]) == [(0, slots[3])]
    assert pool.drain_evicted() == [EvictedPage(k("d"), NS, slots[3], True)]
    assert pool.drain_evicted() == []


def test_pages_whose_l3_copy_is_gone_are_no_longer_evicted_under_evict_requires_l3() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    slots = store(pool, [k("a"), k("b")], small) + store(pool, [k("c"), k("d")], small)
    pool.evict_requires_l3 = True
    pool.mark_in_l3(slots)
    assert pool.clear_in_l3(NS, [k("d"), k("zz")]) == 1  # a key of no page is skipped
    assert pool.clear_in_l3(NS + 1) == 0  # another namespace holds nothing here
    assert [pool.describe(s).in_l3 for s in slots] == [True, True, True, False]
    assert pool.allocate(NS, A, small, [k("n")]) == [(0, slots[1])]  # d stays: in no tier
    assert pool.clear_in_l3(NS) == 2 and pool.clear_in_l3(NS) == 0  # a and c (b left L2)
    assert not pool.describe(slots[2]).in_l3
    assert pool.allocate(NS, A, small, [k("m")]) == []


def test_eviction_log_is_bounded() -> None:
    pool = pool_of(1, max_evicted_log=1)
    small = pool.register_class(4000)
    store(pool, chain("a", 4), small)
    pool.allocate(NS, A, small, chain("n", 3))
    assert evicted_keys(pool) == [k("a3")]
    st0 = pool.stats()
    assert (st0.evictions, st0.evicted_unlogged) == (3, 2)


# -------------------------------------------------------------------- quotas


def test_quota_owner_evicts_only_its_own_pages() -> None:
    pool = pool_of(2)
    small = pool.register_class(4000)
    store(pool, chain("b", 4), small, owner=B)  # B's pages are the coldest
    store(pool, chain("a", 3), small, owner=A)
    pool.set_quota(A, 3)
    got = pool.allocate(NS, A, small, chain("n", 2))
    assert got == [(0, 6), (1, 5)]  # A's own slots, not the free slot 7
    assert evicted_keys(pool) == [k("a2"), k("a1")]
    assert pool.lookup(NS, chain("b", 4)) == 4
    assert (pool.owned_pages(A), pool.owned_pages(B)) == (3, 4)
    assert pool.evictable_slots(owner=B) == [3]

    pool.pin(NS, [k("a0")])  # A has nothing evictable left (n0, n1 are WRITING)
    assert pool.allocate(NS, A, small, [k("m")]) == []  # even though slot 7 is free
    assert pool.lookup(NS, chain("b", 4)) == 4
    pool.set_quota(A, None)  # unlimited again: the free slot, then B's cold pages
    assert pool.allocate(NS, A, small, [k("m0")]) == [(0, 7)]
    assert pool.allocate(NS, A, small, [k("m1")]) == [(0, 3)]
    assert evicted_keys(pool) == [k("b3")]


def test_quota_owner_needing_another_class_still_evicts_only_its_own() -> None:
    pool = pool_of(2)
    small, big = pool.register_class(4000), pool.register_class(5000)
    store(pool, chain("b", 2), small, owner=B)  # coldest of all
    store(pool, chain("a", 2), small, owner=A)
    x = store(pool, chain("x", 2), big, owner=A)
    pool.set_quota(A, 4)
    assert pool.allocate(NS, A, big, [k("n")]) == [(0, x[1])]
    # a1 and a0 free small slots (extent 0 keeps B's pages), so A's own big x1 goes
    assert evicted_keys(pool) == [k("a1"), k("a0"), k("x1")]
    assert pool.lookup(NS, chain("b", 2)) == 2


def test_zero_quota_blocks_allocation() -> None:
    pool = pool_of(1)
    small = pool.register_class(4000)
    pool.set_quota(B, 0)
    assert pool.allocate(NS, B, small, [k("x")]) == []
    assert pool.allocate(NS, A, small, [k("x")]) == [(0, 0)]


# ---------------------------------------------------------------- flush, stats


def test_flush_by_namespace_and_owner() -> None:
    pool = pool_of(3)
    small = pool.register_class(4000)
    store(pool, chain("a", 3), small, ns=NS, owner=A)
    store(pool, chain("b", 2), small, ns=NS, owner=B)
    store(pool, chain("c", 2), small, ns=NS2, owner=B)
    pool.pin(NS, [k("b1")])
    pool.allocate(NS, A, small, [k("w")])
    assert pool.flush(ns_id=NS2) == 2
    assert pool.lookup(NS2, chain("c", 2)) == 0
    assert pool.flush(owner=B) == 0  # b1 is pinned and b0 is its parent
    assert pool.flush(ns_id=NS) == 3  # the a chain, tail to head
    assert pool.lookup(NS, chain("b", 2)) == 2
    st0 = pool.stats()
    assert (st0.pages_ready, st0.pages_writing, st0.pages_pinned, st0.evictions) == (2, 1, 1, 0)
    assert pool.drain_evicted() == []


def test_stats_counts() -> None:
    pool = pool_of(3)
    small, big = pool.register_class(4000), pool.register_class(5000)
    store(pool, chain("a", 2), small)
    pool.allocate(NS, A, big, [k("b")])
    s = pool.stats()
    assert (s.capacity_bytes, s.extents_total, s.extents_free) == (3 * EXTENT + 1000, 3, 1)
    assert (s.pages_ready, s.pages_writing, s.used_bytes) == (2, 1, 2 * 4096 + 8192)
    assert [(c.page_bytes, c.stride, c.slots_per_extent) for c in s.classes] == [
        (4000, 4096, 4),
        (5000, 8192, 2),
    ]


# ------------------------------------------------------- random op sequences


CLASS_BYTES = (4000, 5000, 12000)


class PoolMachine(RuleBasedStateMachine):
    """Random operations against a small pool; the model holds only what the caller
    would know (its slots, states, pins, intended parents) and checks the pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.make_pool()
        self.cls = [self.pool.register_class(b) for b in CLASS_BYTES]
        self.live: dict[int, tuple[bytes, int]] = {}  # slot -> (key, ns)
        self.ready: set[int] = set()
        self.pins: dict[int, int] = {}
        self.parent_key: dict[int, int | None] = {}  # slot -> the slot of its parent page
        self.detached: set[int] = set()  # WRITING pages of a cancelled STORE: aborted later

    def make_pool(self) -> HostPool:
        """The pool under test (a subclass may back it with persistent metadata)."""
        return pool_of(3)

    def commit(self, slots: list[int]) -> None:
        """Commit ``slots`` (a subclass may fill their payloads and pass checksums)."""
        self.pool.commit(slots)

    def _forget(self, slot: int, aborted: bool = False) -> None:
        self.live.pop(slot)
        self.ready.discard(slot)
        self.detached.discard(slot)
        self.parent_key.pop(slot)
        if aborted:  # only an aborted page may leave while pages extending it stay
            for child, parent in self.parent_key.items():
                if parent == slot:
                    self.parent_key[child] = None

    def _absorb_evictions(self) -> None:
        for ev in self.pool.drain_evicted():
            assert ev.slot in self.ready and self.pins.get(ev.slot, 0) == 0
            assert self.live[ev.slot] == (ev.key, ev.ns_id)
            self._forget(ev.slot)

    @rule(
        ns=st.sampled_from([NS, NS2]),
        owner=st.sampled_from([A, B]),
        cls=st.integers(0, 2),
        chain_id=st.integers(0, 3),
        start=st.integers(0, 4),
        n=st.integers(1, 5),
        with_parent=st.booleans(),
    )
    def allocate(self, ns, owner, cls, chain_id, start, n, with_parent) -> None:
        keys = [k(f"c{chain_id}.{i}") for i in range(start, start + n)]
        pk = k(f"c{chain_id}.{start - 1}") if with_parent and start > 0 else None
        # (key, ns): a key is a page only within its namespace; a detached page is none
        before = {v: s for s, v in self.live.items() if s not in self.detached}
        got = self.pool.allocate(ns, owner, self.cls[cls], keys, pk)
        self._absorb_evictions()  # may include later keys of this very call
        resident = {v for s, v in self.live.items() if s not in self.detached}
        idx = [i for i, _ in got]
        assert idx == sorted(set(idx))
        assert len({s for _, s in got}) == len(got)
        new = dict(got)
        for i, s in got:
            assert s not in self.live and (keys[i], ns) not in resident  # never double-allocated
        for i, key in enumerate(keys):  # in key order, as the pool walks them
            if i > 0:  # the page of the key before: allocated here, or resident before
                parent = new.get(i - 1, before.get((keys[i - 1], ns)))
            else:
                parent = before.get((pk, ns)) if pk is not None else None
            if i in new:
                self.live[new[i]] = (key, ns)
                self.parent_key[new[i]] = parent
                continue
            present = before.get((key, ns))
            if present is None:
                break  # a shortfall: the pool stops at this key
            if present in self.live and self.parent_key.get(present) is None:
                self._adopt(present, parent)

    def _adopt(self, s: int, parent: int | None) -> None:
        """A present page without a parent is linked under the page of the key before it in
        a STORE, unless that page is itself or below it."""
        x = parent
        while x is not None:
            if x == s:
                return
            x = self.parent_key.get(x)
        self.parent_key[s] = parent

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), owner=st.sampled_from([A, B]), cls=st.integers(0, 2), n=st.integers(1, 3))
    def extend_ready(self, data, owner, cls, n) -> None:
        """Allocate pages extending a READY page (a random chain rarely meets one): parents
        with children, pinned or not, that the other rules then take away."""
        key, ns = self.live[data.draw(st.sampled_from(sorted(self.ready)))]
        chain_id, start = map(int, key.decode()[1:].split("."))
        self.allocate(ns, owner, cls, chain_id, start + 1, n, True)

    @precondition(lambda self: len(self.live) > len(self.ready) + len(self.detached))
    @rule(data=st.data())
    def detach(self, data) -> None:
        """A STORE cancelled: its WRITING pages leave the index (aborted later, never
        committed); the same keys may be allocated again meanwhile."""
        writing = sorted(set(self.live) - self.ready - self.detached)
        chosen = data.draw(st.lists(st.sampled_from(writing), unique=True, min_size=1, max_size=4))
        self.pool.detach(chosen)
        self.detached.update(chosen)
        for s in chosen:  # a detached page's children no longer find it by its key
            assert self.pool.describe(s).state is PageState.WRITING

    @precondition(lambda self: self.detached)
    @rule(data=st.data())
    def abort_detached(self, data) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.detached)), unique=True, min_size=1)
        )
        self.pool.abort(chosen)
        for s in chosen:
            self._forget(s, aborted=True)

    @precondition(lambda self: len(self.live) > len(self.ready) + len(self.detached))
    @rule(data=st.data())
    def commit_or_abort(self, data) -> None:
        writing = sorted(set(self.live) - self.ready - self.detached)
        chosen = data.draw(st.lists(st.sampled_from(writing), unique=True, min_size=1, max_size=4))
        if not data.draw(st.booleans()):  # False, hypothesis's simplest draw, commits
            self.commit(chosen)
            self.ready.update(chosen)
        else:
            self.pool.abort(chosen)
            for s in chosen:
                self._forget(s, aborted=True)

    @rule(ns=st.sampled_from([NS, NS2]), chain_id=st.integers(0, 3), start=st.integers(0, 4))
    def pin(self, ns, chain_id, start) -> None:
        self._pin(ns, chain_id, start)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def pin_ready(self, data) -> None:
        """Pin from a READY page on (a random key rarely names a resident page)."""
        key, ns = self.live[data.draw(st.sampled_from(sorted(self.ready)))]
        chain_id, start = map(int, key.decode()[1:].split("."))
        self._pin(ns, chain_id, start)

    def _pin(self, ns: int, chain_id: int, start: int) -> None:
        keys = [k(f"c{chain_id}.{i}") for i in range(start, start + 4)]
        expect = 0
        by_key = {(key, kns): s for s, (key, kns) in self.live.items()}
        for key in keys:
            hit = by_key.get((key, ns))
            if hit is None or hit not in self.ready:
                break
            expect += 1
        assert self.pool.lookup(ns, keys) == expect
        for s in self.pool.pin(ns, keys):
            self.pins[s] = self.pins.get(s, 0) + 1

    @rule(data=st.data())
    def unpin(self, data) -> None:
        held = sorted(s for s, n in self.pins.items() if n)
        if held:
            s = data.draw(st.sampled_from(held))
            self.pool.unpin([s])
            self.pins[s] -= 1

    @rule(ns=st.sampled_from([None, NS, NS2]), owner=st.sampled_from([None, A, B]))
    def flush(self, ns, owner) -> None:
        n = self.pool.flush(ns_id=ns, owner=owner)
        gone = [s for s in self.live if self.pool.describe(s).state is PageState.FREE]
        assert len(gone) == n
        for s in gone:
            assert s in self.ready and self.pins.get(s, 0) == 0
            assert ns is None or self.live[s][1] == ns
            assert owner is None or self.pool.describe(s).owner == owner  # stale but kept
            self._forget(s)
        for s in self.live:  # nothing matching is left evictable
            d = self.pool.describe(s)
            assert not (d.evictable and (ns is None or d.ns_id == ns) and owner in (None, d.owner))

    @rule(owner=st.sampled_from([A, B]), quota=st.one_of(st.none(), st.integers(0, 6)))
    def set_quota(self, owner, quota) -> None:
        self.pool.set_quota(owner, quota)

    @rule(data=st.data(), flag=st.booleans())
    def l3(self, data, flag) -> None:
        self.pool.evict_requires_l3 = flag
        if self.live:
            self.pool.mark_in_l3(data.draw(st.lists(st.sampled_from(sorted(self.live)))))

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        infos = [pool.describe(s) for s in range(pool.n_slots)]
        live = [d for d in infos if d.state is not PageState.FREE]
        assert {d.slot for d in live} == set(self.live)
        indexed = [d for d in live if d.slot not in self.detached]
        assert len({(d.key, d.ns_id) for d in indexed}) == len(indexed)
        spans = []
        for d in live:
            assert (d.key, d.ns_id) == self.live[d.slot]
            assert (d.state is PageState.READY) == (d.slot in self.ready)
            assert d.pins == self.pins.get(d.slot, 0)
            if d.slot not in self.detached:  # a detached page's key may name another page
                assert pool.lookup(d.ns_id, [d.key]) == (d.state is PageState.READY)
            spans.append((d.offset, d.offset + pool.class_stride(d.class_id)))
            children = [c for c in live if c.parent == d.slot]
            assert d.children == len(children)
            want = self.parent_key[d.slot]  # tail first: a linked parent is still there
            assert d.parent == (NIL if want is None else want)
        if live:  # every slot at once (one C call over the offsets column) agrees, extents reused
            many = [d.slot for d in live] * 17
            assert pool.slot_offsets(many).tolist() == [d.offset for d in live] * 17
        spans.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(spans))
        assert all(lo >= 0 and hi <= pool.n_extents * EXTENT for lo, hi in spans)
        evictable = [d.slot for d in live if d.evictable]
        order = pool.evictable_slots()
        assert sorted(order) == sorted(evictable)
        assert sorted(pool.evictable_slots(A) + pool.evictable_slots(B)) == sorted(order)
        s = pool.stats()
        assert s.used_bytes == sum(hi - lo for lo, hi in spans) <= s.capacity_bytes
        assert s.pages_pinned == sum(1 for d in live if d.pins)
        assert sum(c.extents for c in s.classes) + s.extents_free == pool.n_extents
        for c in s.classes:
            mine = [d for d in live if d.class_id == c.class_id]
            assert c.pages_ready + c.pages_writing == len(mine)
            assert len({d.slot // 4 for d in mine}) <= c.extents


# Derandomized (tests/conftest.py): every run replays the same 200 examples of up to 40
# steps, so a verdict never depends on an earlier run's example database. The budget is
# sized by planting bugs: a pinned parent put back on the evictable list when its last
# child leaves is found by this seed and by random ones at this budget (runs of 20 steps
# missed it for some seeds). A passing run takes seconds. Bounded so that a failing run, shrinking
# included, ends well within the test's timeout. No explain phase (it traces every line of
# every replay), and one bug reported: a second one (such as pytest-timeout's exception,
# which hypothesis catches as a failure) would be shrunk as well. No per-example deadline:
# a verdict is about the pool's state, never about how long a step took on a loaded
# machine. Shared with test_pool_persistence.
MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)

TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = MACHINE_SETTINGS
