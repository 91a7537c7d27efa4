"""A long request's page-table steps in slices (:mod:`kvtier.daemon.service.slices`), on a
real host pool, stopped at every slice boundary: what another request (a LOOKUP, a LOAD's
pin, an eviction by another STORE) would find there.

Each step takes the event loop's turn as an argument; here that turn runs a check (and may
act on the pool) instead of yielding, so every boundary is visited, in order, every time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.service import slices
from kvtier.ipc.packed import PackedKeyList

KIB = 1024
EXTENT = 64 * KIB
PAGE = 1 * KIB
NS, OWNER = 1, 7
SIZE = 4  # pages per slice
CHAIN = 18  # five slices, the last one short


def chain(name: str, n: int = CHAIN) -> list[bytes]:
    return [f"{name}-{i:04d}".encode().ljust(32, b".") for i in range(n)]


def pool(extents: int = 4) -> tuple[HostPool, int]:
    p = HostPool(extents * EXTENT, EXTENT, PAGE)
    return p, p.register_class(PAGE)


def run(coro):  # a coroutine in, its result out
    return asyncio.run(coro)


def at_each(check: Callable[[], None]) -> Callable[[], asyncio.Future[None]]:
    """A turn that runs ``check`` at the boundary and yields once."""

    async def step() -> None:
        check()
        await asyncio.sleep(0)

    return step  # type: ignore[return-value]


def noop(_wanted: int, _got: int) -> None:
    return None


def test_a_sliced_commit_is_seen_all_at_once_never_half():
    p, cid = pool()
    keys = chain("a")
    slots = [s for _, s in p.allocate(NS, OWNER, cid, keys)]
    seen: list[int] = []
    pins: list[int] = []

    def look() -> None:
        seen.append(p.lookup(NS, keys))
        got = p.pin(NS, keys)  # what a LOAD would pin here
        pins.append(len(got))
        p.unpin(got)

    run(slices.commit(p, slots, None, SIZE, at_each(look)))
    assert len(seen) == (CHAIN + SIZE - 1) // SIZE - 1  # every boundary was visited
    assert seen == [0] * len(seen)  # the head turns READY last
    assert pins == [0] * len(pins)
    assert p.lookup(NS, keys) == CHAIN
    assert p.stats().pages_writing == 0


def test_a_sliced_commit_over_a_stored_prefix_shows_the_prefix_until_the_end():
    p, cid = pool()
    keys = chain("b")
    head = [s for _, s in p.allocate(NS, OWNER, cid, keys[:5])]
    p.commit(head)
    rest = [s for _, s in p.allocate(NS, OWNER, cid, keys)]
    assert len(rest) == CHAIN - 5
    seen: list[int] = []
    run(slices.commit(p, rest, None, SIZE, at_each(lambda: seen.append(p.lookup(NS, keys)))))
    assert seen and set(seen) == {5}
    assert p.lookup(NS, keys) == CHAIN


def test_a_sliced_allocation_links_its_slices_and_stays_invisible():
    p, cid = pool()
    keys = chain("c")
    seen: list[int] = []
    got = run(
        slices.allocate(
            p,
            NS,
            OWNER,
            cid,
            keys,
            None,
            SIZE,
            lambda: False,
            noop,
            at_each(lambda: seen.append(p.lookup(NS, keys))),
        )
    )
    assert got is not None and got.count == CHAIN and got.indexes == list(range(CHAIN))
    assert seen == [0] * ((CHAIN + SIZE - 1) // SIZE - 1)
    # one chain: each page's parent is the page before it, across slice boundaries too
    parents = [p.chain_link(s)[2] for s in got.slots]
    assert parents[1:] == got.slots[:-1]
    offsets = [int(o) for part in got.offsets for o in part]
    assert offsets == [p.slot_offset(s) for s in got.slots]


def test_a_packed_chain_is_allocated_as_its_list_would_be():
    keys = chain("p")
    results = []
    for given in (keys, PackedKeyList(b"".join(keys))):
        p, cid = pool()
        got = run(
            slices.allocate(
                p, NS, OWNER, cid, given, None, SIZE, lambda: False, noop, at_each(lambda: None)
            )
        )
        assert got is not None and got.count == CHAIN
        assert got.keys == keys  # as bytes objects, every slice's
        assert all(type(k) is bytes for k in got.keys)
        results.append(([p.chain_link(s)[2] for s in got.slots], got.indexes))
        assert p.resident_run(NS, keys) == CHAIN
    assert results[0] == results[1]


def test_a_short_allocation_keeps_the_keys_of_the_slices_it_went_through():
    p, cid = pool(extents=1)  # 64 pages
    keys = chain("q")
    present = [s for _, s in p.allocate(NS, OWNER, cid, keys[:SIZE])]
    p.commit(present)
    got = run(
        slices.allocate(
            p,
            NS,
            OWNER,
            cid,
            PackedKeyList(b"".join(keys)),
            None,
            SIZE,
            lambda: False,
            noop,
            at_each(lambda: p.flush(NS)),
        )
    )
    assert got is not None and got.count == SIZE and got.keys == keys[:SIZE]


def test_a_second_store_of_the_same_chain_between_slices_shares_it():
    p, cid = pool()
    keys = chain("d")
    other: list[list[tuple[int, int]]] = []

    def second_store() -> None:
        if not other:  # at the first boundary: the whole chain, as another engine would
            other.append(p.allocate(NS, OWNER, cid, keys))

    got = run(
        slices.allocate(
            p, NS, OWNER, cid, keys, None, SIZE, lambda: False, noop, at_each(second_store)
        )
    )
    assert got is not None
    mine, theirs = got.slots, [s for _, s in other[0]]
    assert len(mine) == SIZE and len(theirs) == CHAIN - SIZE  # each page allocated once
    assert got.count == CHAIN  # the rest is being stored by the other
    run(slices.commit(p, theirs, None, SIZE, at_each(lambda: None)))
    assert p.lookup(NS, keys) == 0  # this store's head is still WRITING
    run(slices.commit(p, mine, None, SIZE, at_each(lambda: None)))
    assert p.lookup(NS, keys) == CHAIN


def test_a_cancelled_allocation_leaves_no_writing_page():
    p, cid = pool()
    keys = chain("e")
    boundaries = [0]

    def cancelled() -> bool:
        boundaries[0] += 1
        return boundaries[0] == 3  # at the third boundary: the session went away

    got = run(
        slices.allocate(p, NS, OWNER, cid, keys, None, SIZE, cancelled, noop, at_each(lambda: None))
    )
    assert got is None
    st = p.stats()
    assert st.pages_writing == 0 and st.pages_ready == 0
    assert p.resident_run(NS, keys) == 0
    # the slots went back: the whole pool can be allocated again
    again = p.allocate(NS, OWNER, cid, chain("f", p.n_slots))
    assert len(again) == p.stats().capacity_bytes // PAGE


def test_an_allocation_stops_where_the_page_ending_a_slice_was_evicted():
    p, cid = pool(extents=1)  # 64 pages
    keys = chain("g")
    present = [s for _, s in p.allocate(NS, OWNER, cid, keys[:SIZE])]
    p.commit(present)  # the first slice is stored already: READY, the last childless

    def evict_it() -> None:
        p.flush(NS)  # another store's eviction of the evictable pages, as it happens

    got = run(
        slices.allocate(p, NS, OWNER, cid, keys, None, SIZE, lambda: False, noop, at_each(evict_it))
    )
    assert got is not None and got.slots == [] and got.count == SIZE
    assert p.stats().pages_writing == 0


def test_a_sliced_pin_holds_its_run_and_a_cancelled_one_lets_go():
    p, cid = pool()
    keys = chain("h")
    p.commit([s for _, s in p.allocate(NS, OWNER, cid, keys)])
    pinned: list[int] = []
    got = run(
        slices.pin(
            p, NS, keys, SIZE, lambda: False, at_each(lambda: pinned.append(p.stats().pages_pinned))
        )
    )
    assert got is not None and len(got) == CHAIN
    assert pinned == [SIZE * i for i in range(1, len(pinned) + 1)]
    run(slices.unpin(p, got, SIZE, at_each(lambda: None)))
    assert p.stats().pages_pinned == 0
    stop = run(slices.pin(p, NS, keys, SIZE, lambda: True, at_each(lambda: None)))
    assert stop is None and p.stats().pages_pinned == 0


def test_a_sliced_pin_ends_where_the_tail_was_evicted():
    p, cid = pool()
    keys = chain("i")
    p.commit([s for _, s in p.allocate(NS, OWNER, cid, keys)])
    got = run(slices.pin(p, NS, keys, SIZE, lambda: False, at_each(lambda: p.flush(NS))))
    assert got is not None and len(got) == SIZE  # the unpinned rest was flushed
    run(slices.unpin(p, got, SIZE))
    assert p.stats().pages_pinned == 0


def test_a_sliced_abort_frees_every_slot():
    p, cid = pool()
    keys = chain("j")
    slots = [s for _, s in p.allocate(NS, OWNER, cid, keys)]
    writing: list[int] = []
    run(slices.abort(p, slots, SIZE, at_each(lambda: writing.append(p.stats().pages_writing))))
    assert writing == sorted(writing, reverse=True) and writing[0] < CHAIN
    assert p.stats().pages_writing == 0 and p.resident_run(NS, keys) == 0


def test_the_turn_between_slices_offers_the_cpu_before_the_loop_goes_on(monkeypatch):
    """Each turn yields the thread's CPU (an engine thread waiting for that core runs now,
    not at the scheduler's tick) and then gives the event loop its turn: a callback queued
    before the turn has run when it returns."""
    offered: list[int] = []
    monkeypatch.setattr(slices.os, "sched_yield", lambda: offered.append(1))
    ran: list[int] = []

    async def main() -> None:
        asyncio.get_running_loop().call_soon(ran.append, 1)
        await slices.turn()
        assert ran == [1] and offered == [1]
        p, cls = pool()
        got = await slices.allocate(p, NS, OWNER, cls, chain("y"), None, SIZE, lambda: False, noop)
        assert got is not None and len(got.slots) == CHAIN
        assert len(offered) == 1 + (CHAIN - 1) // SIZE  # one per turn between two slices

    run(main())
