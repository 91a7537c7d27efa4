"""Pin and unpin in C (:class:`kvtier.daemon.pool.pins.Pins`) against the page-by-page
model (``tests/pool_model.py``).

Two pools get the same operations: the host pool as the daemon runs it (every pin and unpin
in one C call) and one that pins and unpins page by page. After every operation both must
hold the same pins, access stamps, pinned-page count and evictable lists, answer with the
same slots or the same error, and evict the same pages later.
"""

from __future__ import annotations

import itertools
import random
from array import array

import numpy as np
import pytest
from kvtier.daemon.pool import pins as pins_mod
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError
from kvtier.daemon.pool.links import link_in_order
from kvtier.daemon.pool.native import _pins

from tests.pool_model import page_by_page

KIB = 1024
EXTENT = 16 * KIB
NS = 1
OWNERS = (10, 20)


def pools(extents: int = 96) -> tuple[HostPool, HostPool]:
    out = (
        HostPool(extents * EXTENT, EXTENT, 4 * KIB),
        page_by_page(HostPool(extents * EXTENT, EXTENT, 4 * KIB)),
    )
    for p in out:
        assert p.register_class(4000) == 0
    return out


def snapshot(p: HostPool) -> tuple:
    return (
        np.frombuffer(p._pages.pins.count, dtype=np.int32).tolist(),
        p._pages.meta.array("stamp").tolist(),
        p.stats().pages_pinned,
        p.evictable_slots(),
        [p.evictable_slots(o) for o in OWNERS],
        p._pages._clock,
    )


def both(bulk: HostPool, ref: HostPool, op: str, *args: object) -> object:
    """Run ``op`` on both pools; they must answer alike and end alike."""
    got = []
    for p in (bulk, ref):
        try:
            got.append(("ok", getattr(p, op)(*args)))
        except HostPoolError as err:  # PageStateError too
            got.append(("error", str(err)))
    assert got[0] == got[1], op
    assert snapshot(bulk) == snapshot(ref), op
    return got[0][1]


def test_long_runs_pin_and_unpin_as_page_by_page() -> None:
    bulk, ref = pools()
    rng = random.Random(5)
    chains: list[list[bytes]] = []
    held: list[list[int]] = []
    for step in range(300):
        roll = rng.random()
        if roll < 0.3 or not chains:  # a new chain, sometimes extending another
            n = rng.choice((3, 8, 40, 64, 100, 150))
            parent = rng.choice(chains)[-1] if chains and rng.random() < 0.3 else None
            keys = [f"c{step}-{i}".encode() for i in range(n)]
            owner = rng.choice(OWNERS)
            slots = both(bulk, ref, "allocate", NS, owner, 0, keys, parent)
            both(bulk, ref, "commit", [s for _, s in slots])
            chains.append(keys)
        elif roll < 0.4:  # pages of no chain: each its own, each evictable, pinned at once
            keys = [f"s{step}-{i}".encode() for i in range(rng.choice((8, 64, 80)))]
            for key in keys:
                got = both(bulk, ref, "allocate", NS, rng.choice(OWNERS), 0, [key], None)
                both(bulk, ref, "commit", [s for _, s in got])
            slots = both(bulk, ref, "pin", NS, keys)
            if slots:
                held.append(slots)
        elif roll < 0.65:  # pin a prefix of a chain, now and then with a key twice
            keys = rng.choice(chains)
            keys = keys[: rng.randint(1, len(keys))]
            if len(keys) > 2 and rng.random() < 0.15:
                keys = keys + [keys[1]]
            slots = both(bulk, ref, "pin", NS, keys)
            if slots:
                held.append(slots)
        elif held:  # unpin what a pin returned, or a list the pool must refuse
            slots = held.pop(rng.randrange(len(held)))
            bad = rng.random()
            if bad < 0.1:
                if isinstance(both(bulk, ref, "unpin", slots + slots), str):
                    held.append(slots)  # more often than pinned: refused before any change
            elif bad < 0.15:
                both(bulk, ref, "unpin", slots + [bulk.n_slots])
                held.append(slots)
            else:
                both(bulk, ref, "unpin", slots)
    for slots in held:
        both(bulk, ref, "unpin", slots)
    assert bulk.stats().pages_pinned == 0
    # the same pages go first when the pool fills up
    for i in range(4):
        keys = [f"fill{i}-{j}".encode() for j in range(128)]
        got = both(bulk, ref, "allocate", NS, OWNERS[0], 0, keys, None)
        both(bulk, ref, "commit", [s for _, s in got])
    assert [e.key for e in bulk.drain_evicted()] == [e.key for e in ref.drain_evicted()]


@pytest.mark.parametrize("n", [1, 2, 8, 300])
def test_every_run_is_pinned_in_one_c_call(n: int) -> None:
    """Pin and unpin go to C whatever the number of pages: one call each."""
    pool, _ = pools()
    keys = [f"k{i}".encode() for i in range(n)]
    slots = [s for _, s in pool.allocate(NS, OWNERS[0], 0, keys)]
    pool.commit(slots)
    calls: list[str] = []
    real_pin, real_unpin = _pins.pin, _pins.unpin

    def pin(*args: object) -> object:
        calls.append("pin")
        return real_pin(*args)

    def unpin(*args: object) -> object:
        calls.append("unpin")
        return real_unpin(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pins_mod._pins, "pin", pin)
        mp.setattr(pins_mod._pins, "unpin", unpin)
        assert pool.pin(NS, keys) == slots
        assert pool.stats().pages_pinned == n and pool.evictable_slots() == []
        pool.unpin(slots)
    assert calls == ["pin", "unpin"]
    assert pool.stats().pages_pinned == 0


@pytest.mark.parametrize("bad", ["twice", "free", "unpinned", "negative"])
def test_a_refused_bulk_unpin_changes_nothing_and_names_the_slot(bad: str) -> None:
    bulk, ref = pools()
    keys = [f"k{i}".encode() for i in range(64 + 8)]
    for p in (bulk, ref):
        p.commit([s for _, s in p.allocate(NS, OWNERS[0], 0, keys)])
    slots = both(bulk, ref, "pin", NS, keys[:64])
    assert isinstance(slots, list)
    other = both(bulk, ref, "lookup", NS, keys)  # all READY
    assert other == len(keys)
    extra = {
        "twice": slots[3],
        "free": bulk.n_slots - 1,
        "unpinned": bulk._pages.ready[NS][keys[-1]],
        "negative": -1,
    }[bad]
    before = snapshot(bulk)
    for p in (bulk, ref):
        with pytest.raises(HostPoolError) as err:
            p.unpin(slots + [extra])
        assert str(extra) in str(err.value)
    if bad != "twice":  # checked before any change on both paths
        assert snapshot(bulk) == before
    both(bulk, ref, "unpin", slots)


def lists_of(stamp: array[int], owner: array[int], on: list[int]) -> tuple[object, ...]:
    """``_pins``'s ``lists`` for a pool of ``len(stamp)`` slots, the pages ``on`` linked
    into the global list and their owners' in that order (cold end first)."""
    n = len(stamp)
    links = [array("i", [-1] * n) for _ in range(4)]
    ends = link_in_order(links[0], links[1], np.array(on, dtype=np.int64))
    own_ends: dict[int, list[int]] = {}
    for o in sorted({owner[s] for s in on}):
        mine = np.array([s for s in on if owner[s] == o], dtype=np.int64)
        own_ends[o] = link_in_order(links[2], links[3], mine)
    return (*links, stamp, owner, ends, own_ends, None, None)


def walk(lists: tuple[object, ...]) -> list[int]:
    """The global list's slots, cold end first (checked against its hot end)."""
    prev, nxt, ends = lists[0], lists[1], lists[6]
    assert isinstance(prev, array) and isinstance(nxt, array) and isinstance(ends, list)
    out, s = [], ends[0]
    while s != -1:
        out.append(s)
        s = nxt[s]
    assert (out[-1] if out else -1) == ends[1]
    assert all(prev[b] == a for a, b in itertools.pairwise(out))
    return out


def test_the_c_pins_check_every_slot_before_any_change() -> None:
    """``daemon/pool/native/_pins.c`` called directly: a slot outside the columns (however
    large) or columns of different sizes are a ValueError, an item that is not an int a
    TypeError; an unpin of a slot not pinned, not READY or listed more often than pinned is
    refused (None); none of these changes a pin, a stamp or a list. The pages pinned first
    and childless leave the evictable lists; those unpinned and childless enter them, at the
    hot end when more recent than the cold end."""
    n = 8
    pins, kids, stamp = array("i", [0] * n), array("i", [0] * n), array("q", range(n))
    owner = array("q", [7, 7, 9, 7, 9, 7, 7, 7])
    lists = lists_of(stamp, owner, list(range(n)))
    state = array("b", [1] * n)  # READY
    ready = 1
    assert _pins.pin(pins, stamp, kids, [1, 2, 2], 10, lists) == (13, 2)
    assert list(pins) == [0, 1, 2, 0, 0, 0, 0, 0] and list(stamp)[:3] == [0, 13, 12]
    assert walk(lists) == [0, 3, 4, 5, 6, 7]
    assert lists[7] == {7: [0, 7], 9: [4, 4]}
    before = (list(pins), list(stamp), walk(lists))
    for bad in ([1, 8], [-1], [2, 1 << 40], [1 << 70]):
        with pytest.raises(ValueError, match="outside the 8 slots"):
            _pins.pin(pins, stamp, kids, bad, 0, lists)
        with pytest.raises(ValueError, match="outside the 8 slots"):
            _pins.unpin(pins, state, kids, bad, ready, lists)
    with pytest.raises(ValueError, match="do not agree"):
        _pins.pin(pins, array("q", [0] * (n - 1)), kids, [1], 0, lists)
    with pytest.raises(TypeError):
        _pins.pin(pins, stamp, kids, [1, "2"], 0, lists)
    with pytest.raises(TypeError):
        _pins.pin(pins, stamp, kids, (1, 2), 0, lists)  # a list only
    with pytest.raises(TypeError, match="lists"):
        _pins.pin(pins, stamp, kids, [1], 0, lists[:-1])
    with pytest.raises(RuntimeError, match="shorter than the pool"):
        _pins.pin(pins, stamp, kids, [1], 0, (array("i", [-1] * (n - 1)), *lists[1:]))
    with pytest.raises(ValueError, match="do not agree"):
        _pins.unpin(pins, array("b", [1] * (n + 1)), kids, [1], ready, lists)
    assert _pins.unpin(pins, state, kids, [1, 3], ready, lists) is None  # 3: not pinned
    assert _pins.unpin(pins, state, kids, [1, 2, 1], ready, lists) is None  # 1 twice
    state[2] = 0
    assert _pins.unpin(pins, state, kids, [2], ready, lists) is None  # not READY
    assert (list(pins), list(stamp), walk(lists)) == before
    state[2] = ready
    kids[2] = 1  # slot 2 has a resident child: it never enters the evictable lists
    assert _pins.unpin(pins, state, kids, [2, 1, 2], ready, lists) == 2
    assert list(pins) == [0] * n
    assert walk(lists) == [0, 3, 4, 5, 6, 7, 1]  # stamp 13: the hot end
    assert lists[7] == {7: [0, 1], 9: [4, 4]}


@pytest.mark.parametrize("bad", ["ends", "link"])
def test_a_corrupt_evictable_list_is_an_error_not_a_stray_write(bad: str) -> None:
    """List ends or links naming no slot of the pool stop the move with a RuntimeError
    (never a write outside the columns); the pin counts are counted again by ``Pins``."""
    n = 8
    pins, kids, stamp = array("i", [0] * n), array("i", [0] * n), array("q", range(n))
    owner = array("q", [7] * n)
    lists = lists_of(stamp, owner, list(range(n)))
    if bad == "ends":
        lists[6][:] = [1 << 30, 1 << 30]  # type: ignore[index]
    else:
        lists[1][3] = 1 << 20  # type: ignore[index]  # slot 3's next
    with pytest.raises(RuntimeError, match="not slots of the pool"):
        _pins.pin(pins, stamp, kids, [3], 0, lists)


def test_mark_used_puts_each_slot_in_t2_once_and_sets_its_flag() -> None:
    tier, flags = bytearray(8), bytearray([0, 1, 0, 0, 0, 0, 2, 0])
    assert _pins.mark_used(tier, memoryview(flags), [6, 1, 6, 3], 4) == 3  # 6 listed twice
    assert list(tier) == [0, 1, 0, 1, 0, 0, 1, 0]
    assert list(flags) == [0, 5, 0, 4, 0, 0, 6, 0]  # other bits kept
    assert _pins.mark_used(tier, None, [1, 2], 4) == 1  # 1 was in T2 already
    assert list(tier) == [0, 1, 1, 1, 0, 0, 1, 0] and list(flags)[2] == 0


@pytest.mark.parametrize("bad", [8, -1, 1 << 70])
def test_mark_used_checks_every_slot_before_any_change(bad: int) -> None:
    tier, flags = bytearray(8), bytearray(8)
    with pytest.raises(ValueError, match="outside the pool"):
        _pins.mark_used(tier, memoryview(flags), [0, 1, bad], 4)
    assert tier == bytearray(8) and flags == bytearray(8)
    with pytest.raises(ValueError, match=r"slot 1180591620717411303424 is outside"):
        _pins.mark_used(tier, None, [1 << 70], 4)  # named as given
    with pytest.raises(ValueError, match="columns of bytes"):
        _pins.mark_used(np.zeros(8, np.int32), None, [1], 4)
    short = bytearray(4)  # the flags column bounds the slots too
    with pytest.raises(ValueError, match=r"slot 5 is outside the pool \[0, 4\)"):
        _pins.mark_used(tier, memoryview(short), [5], 4)


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_a_load_moves_its_pages_to_t2_once(policy: str) -> None:
    from kvtier.daemon.pool.layout import USED_AGAIN
    from kvtier.daemon.pool.policies import split_state

    flags = bytearray(16)
    split = split_state(policy, 16, memoryview(flags))
    assert split is not None
    split.reused([3, 4, 4])
    split.reused(iter([4, 5]))  # any iterable of slots
    assert split.t2 == 3 and [i for i, t in enumerate(split.tier) if t] == [3, 4, 5]
    assert [i for i, f in enumerate(flags) if f & USED_AGAIN] == [3, 4, 5]
    split.released(4)
    assert split.t2 == 2


def test_a_slot_whose_index_empties_the_list_is_refused_not_read_past() -> None:
    class Shrinks:
        def __init__(self, run: list[object]) -> None:
            self.run = run

        def __index__(self) -> int:
            self.run.clear()
            return 1

    for call in (
        lambda run: _pins.mark_used(bytearray(8), None, run, 4),
        lambda run: _pins.pin(
            bytearray(32),
            bytearray(64),
            bytearray(32),
            run,
            0,
            lists_of(array("q", [0] * 8), array("q", [0] * 8), []),
        ),
    ):
        run: list[object] = [None, 1, 1, 1]
        run[0] = Shrinks(run)
        with pytest.raises(ValueError, match="slots changed while being read"):
            call(run)


def test_a_pin_stopped_by_a_corrupt_list_leaves_the_pinned_count_true() -> None:
    """A pin that a corrupt evictable list stops after the counts changed raises, and the
    number of pinned pages the pool reports is the number with a pin."""
    pool, _ = pools()
    keys = [f"k{i}".encode() for i in range(4)]
    pool.commit([s for _, s in pool.allocate(NS, OWNERS[0], 0, keys)])
    lru = pool._pages.evictor.lru
    lru.next[lru.ends[0]] = 1 << 20  # the cold end's next names no slot
    with pytest.raises(RuntimeError, match="not slots of the pool"):
        pool.pin(NS, keys)
    count = np.frombuffer(pool._pages.pins.count, dtype=np.int32)
    assert pool.stats().pages_pinned == int(np.count_nonzero(count)) > 0
