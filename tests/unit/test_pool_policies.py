"""Exact tests of the host pool's two-list eviction policies, ``arc`` and ``reuse`` (no mocks).

Geometry: align 4 KiB, extents of 16 KiB, one class of 4000 B pages (4 slots an extent).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError, PageState
import numpy as np
from kvtier.daemon.pool.policies import GHOST_FACTOR, LIFE_QUANTILE, ArcState, ReuseState

from tests.pool_model import page_by_page

KIB = 1024
EXTENT = 16 * KIB
NS, OWNER = 1, 10


def pool_of(extents: int, policy: str = "arc", model: bool = False) -> tuple[HostPool, int]:
    """A pool of ``extents`` extents (``model``: with the page-by-page table)."""
    pool = HostPool(extents * EXTENT, EXTENT, 4 * KIB, eviction_policy=policy)
    if model:
        page_by_page(pool)
    return pool, pool.register_class(4000)


def store(pool: HostPool, cls: int, keys: list[bytes]) -> list[int]:
    slots = [s for _, s in pool.allocate(NS, OWNER, cls, keys)]
    pool.commit(slots)
    return slots


def load(pool: HostPool, keys: list[bytes]) -> list[int]:
    """Pin and unpin the leading READY run of ``keys`` as a LOAD does."""
    slots = pool.pin(NS, keys, used=True)
    if slots:
        pool.unpin(slots)
    return slots


def evicted(pool: HostPool) -> list[bytes]:
    return [e.key for e in pool.drain_evicted()]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(HostPoolError, match=r"eviction_policy.*'mru'"):
        HostPool(EXTENT, EXTENT, 4 * KIB, eviction_policy="mru")


@pytest.mark.parametrize(
    ("policy", "order"), [("lru", [b"x"]), ("arc", [b"y", b"z"]), ("reuse", [b"y", b"z"])]
)
def test_reused_page_outlives_newer_pages_stored_once(policy: str, order: list[bytes]) -> None:
    pool, cls = pool_of(1, policy)
    store(pool, cls, [b"x"])
    load(pool, [b"x"])  # x is used again: T2
    for key in (b"y", b"z", b"w"):
        store(pool, cls, [key])  # T1, all more recent than x
    store(pool, cls, [b"v"])  # full: lru takes x, arc T1's coldest (p = 0)
    store(pool, cls, [b"y"])  # lru: still resident; arc, reuse: a ghost, into T2
    assert evicted(pool) == order
    stats = pool.stats()
    assert stats.eviction_policy == policy
    assert stats.evictions_by_reason == ({"lru": 1} if policy == "lru" else {"t1": 2, "t2": 0})
    assert (stats.eviction_split == {}) == (policy == "lru")


def test_ghost_hit_in_t2_shrinks_t1_target() -> None:
    pool, cls = pool_of(1)
    store(pool, cls, [b"a"])
    store(pool, cls, [b"b"])
    load(pool, [b"a"])
    load(pool, [b"b"])  # a, b in T2
    store(pool, cls, [b"c"])
    store(pool, cls, [b"d"])
    store(pool, cls, [b"e"])  # T1 holds c, d (2 > p = 0): c goes to B1
    store(pool, cls, [b"c"])  # B1 hit: p = 1, c to T2; T1 = {d, e} > 1: d goes
    store(pool, cls, [b"d"])  # B1 hit: p = 2, d to T2; T1 = {e} <= 2: T2's coldest, a
    store(pool, cls, [b"a"])  # B2 hit: p = 2 - max(|B1| / |B2|, 1) = 1; T1 = {} : b (T2)
    assert evicted(pool) == [b"c", b"d", b"a", b"b"]
    assert pool.stats().evictions_by_reason == {"t1": 2, "t2": 2}


def stamps(pool: HostPool, keys: list[bytes]) -> list[int]:
    """The access ticks of the resident pages ``keys``."""
    slots = pool._lookups.run_slots(NS, keys)
    return [int(pool._pages.meta.array("stamp")[s]) for s in slots]


def test_reuse_keeps_a_reused_page_for_its_lifetime_then_lets_it_go() -> None:
    pool, cls = pool_of(1, "reuse")  # 4 pages
    store(pool, cls, [b"a"])  # a store takes two ticks (allocation, commit)
    store(pool, cls, [b"b"])
    load(pool, [b"a"])  # a: T2, last used at tick 5
    store(pool, cls, [b"c"])
    store(pool, cls, [b"d"])  # full; clock 9
    split = pool._pages.evictor.split
    assert isinstance(split, ReuseState) and split.life == -1  # no estimate yet:
    assert split.lifetime(4) == 16  # four times the resident pages
    assert stamps(pool, [b"a"]) == [5]
    for key in (b"e", b"f", b"g"):  # a is colder than every page of T1 but within its
        store(pool, cls, [key])  # lifetime: T1's coldest go, b, c, d
    assert evicted(pool) == [b"b", b"c", b"d"]
    # each eviction is decided at the clock before the new page's tick: 15 for h
    for key in (b"h", b"i", b"j", b"k"):  # a idle 10, 12, 14, 16 ticks: <= 16, T1's go
        store(pool, cls, [key])
    store(pool, cls, [b"l"])  # idle 18 > 16, and a (5) is colder than T1's coldest: a
    assert evicted(pool) == [b"e", b"f", b"g", b"h", b"a"]
    assert pool.stats().evictions_by_reason == {"t1": 7, "t2": 1}
    assert pool.stats().eviction_split == {"t2_pages": 0, "lifetime_ratio": 4.0, "ghosts": 8}


def test_reuse_sets_its_lifetime_from_a_quantile_of_the_reuse_distances() -> None:
    st = ReuseState(8)
    assert st.pick(10, 5, 100, 10) == 1  # life 4 x 10 = 40: idle 95 ticks, colder: T2's
    assert st.pick(10, 5, 45, 10) == 0  # idle 40: within the lifetime
    assert st.pick(3, 5, 100, 10) == 0  # T1's is colder
    assert st.pick(None, 5, 6, 10) == 1 and st.pick(3, None, 100, 10) == 0
    st.evicted_page(0, 1, b"x", 3, 100)  # an eviction with 100 pages resident: capacity 100
    assert st.capacity == 100 and st.life == -1
    stamp = np.zeros(8, dtype=np.int64)
    stamp[1], stamp[2] = 9000, 5000
    for _ in range(59):  # 59 uses 1,000 ticks after the last, 40 uses 5,000 after
        st.using([1], memoryview(stamp), 10000)
    for _ in range(40):
        st.using([2], memoryview(stamp), 10000)
    assert st.life == -1  # 99 distances: fewer than the pool holds pages
    st.admit(3, 1, b"x", 1003)  # x's page, last used at tick 3, comes back: distance 1000
    assert st.tier[3] == 1 and st.t2 == 1
    # 100 distances: 60 in [512, 1024), 40 in [4096, 8192); the quantile's rank, 95 of
    # them, falls in the second, 35 of its 40 in: linearly, 4096 x (1 + 35 / 40)
    assert LIFE_QUANTILE == 0.95 and st.life == int(4096 * (1 + (95.0 - 60) / 40))
    hist = st.core.histogram()  # the counts halved once the estimate is made
    assert hist[9] == 30 and hist[12] == 20 and sum(hist) == 50
    assert st.lifetime(1) == st.life
    life = st.life
    assert st.pick(10**6, 10**6 - life - 1, 10**6, 100) == 1
    assert st.pick(10**6, 10**6 - life, 10**6, 100) == 0
    st.admit(4, 1, b"x", 2000)  # a ghost counts once
    assert st.tier[4] == 0
    with pytest.raises(ValueError, match="slot 8 is outside"):
        st.using([1, 8], memoryview(stamp), 10**6)
    assert sum(st.core.histogram()) == 50  # nothing counted


def test_reuse_bounds_its_ghosts() -> None:
    st = ReuseState(8)
    for i in range(500):  # T1 evictions with 100 pages resident
        st.evicted_page(0, 3, b"k%d" % i, i, 100)
    assert st.ghosts == GHOST_FACTOR * 100
    assert st.evicted == [500, 0] and st.capacity == 100
    st.admit(0, 3, b"k99", 600)  # forgotten: the oldest of the 500
    assert st.tier[0] == 0 and st.t2 == 0
    st.admit(1, 99, b"k450", 600)  # another namespace's key is not this one's ghost
    assert st.tier[1] == 0
    st.admit(2, 3, b"k450", 600)
    assert st.tier[2] == 1 and st.t2 == 1 and st.ghosts == GHOST_FACTOR * 100 - 1
    assert sum(st.core.histogram()) == 1  # 600 - 450 = 150 ticks


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_chain_goes_tail_first_and_parent_keeps_its_list(policy: str) -> None:
    pool, cls = pool_of(2, policy)
    store(pool, cls, [b"a0", b"a1", b"a2"])
    load(pool, [b"a0", b"a1"])  # a0, a1 in T2; a2 (their child) stays in T1
    store(pool, cls, [b"b0", b"b1", b"b2", b"b3", b"b4"])
    store(pool, cls, [b"c0"])  # full (8): T1 over p = 0, its coldest evictable is a2
    assert evicted(pool) == [b"a2"]
    assert pool.lookup(NS, [b"a0", b"a1", b"a2"]) == 2
    a1 = pool._lookups.run_slots(NS, [b"a0", b"a1"])[1]
    assert t2_list(pool) == [a1]  # a1 lost its only child: evictable again, in T2


def t2_list(pool: HostPool) -> list[int]:
    out = []
    s, nxt = pool._pages.evictor.lru.start(None, second=True)
    while s != -1:
        out.append(s)
        s = nxt[s]
    return out


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_write_back_pin_is_not_a_use(policy: str) -> None:
    pool, cls = pool_of(1, policy)
    (s,) = store(pool, cls, [b"x"])
    pool.unpin(pool.pin(NS, [b"x"]))  # a pin that is not a LOAD (L3 write)
    arc = pool._pages.evictor.split
    assert arc is not None and arc.tier[s] == 0 and arc.t2 == 0
    load(pool, [b"x"])
    assert arc.tier[s] == 1 and arc.t2 == 1


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_flush_drops_both_lists(policy: str) -> None:
    pool, cls = pool_of(1, policy)
    store(pool, cls, [b"x", b"y"])
    store(pool, cls, [b"z"])
    load(pool, [b"z"])
    assert pool.flush() == 3
    assert len(pool.evictable_slots()) == 0 and pool._pages.evictor.split is not None
    assert pool._pages.evictor.split.t2 == 0


def _long_runs(native: bool, policy: str) -> tuple[list[bytes], list[int]]:
    """Long chains stored, loaded and evicted; in C or by the page-by-page model."""
    pool, cls = pool_of(8, policy, model=not native)  # 32 pages
    out: list[bytes] = []
    for r in range(12):
        keys = [f"c{r % 5}-{i}".encode() for i in range(10 + r % 3)]
        load(pool, keys)
        store(pool, cls, keys)
        out += evicted(pool)
    return out, pool.evictable_slots()


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_c_and_the_page_by_page_model_evict_alike(policy: str) -> None:
    assert _long_runs(True, policy) == _long_runs(False, policy)


class ArcModel(RuleBasedStateMachine):
    """Random stores and loads of short chains over a small pool, under arc."""

    policy = "arc"

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.cls = pool_of(2, self.policy)  # 8 pages

    @rule(c=st.integers(0, 5), n=st.integers(1, 4))
    def request(self, c: int, n: int) -> None:
        keys = [f"{c}-{i}".encode() for i in range(n)]
        load(self.pool, keys)
        store(self.pool, self.cls, keys)

    @invariant()
    def lists_hold_exactly_the_evictable_pages(self) -> None:
        pool = self.pool
        arc = pool._pages.evictor.split
        assert arc is not None
        listed = pool.evictable_slots()
        assert len(listed) == len(set(listed))
        resident = [s for s in range(pool.n_slots) if pool.describe(s).state != PageState.FREE]
        evictable = [s for s in resident if pool.describe(s).evictable]
        assert sorted(listed) == sorted(evictable)
        assert arc.t2 == sum(arc.tier[s] for s in resident)
        assert all(arc.tier[s] == 0 for s in range(pool.n_slots) if s not in resident)
        assert arc.capacity <= pool.n_slots
        if isinstance(arc, ArcState):
            assert 0.0 <= arc.p <= arc.capacity
            assert all(len(g) <= arc.capacity for g in arc.ghosts)
        else:
            assert isinstance(arc, ReuseState)
            assert arc.life == -1 or arc.life >= 1
            assert arc.ghosts <= GHOST_FACTOR * arc.capacity
        for s in resident:  # no chain is cut: a resident page's parent is resident
            parent = pool.describe(s).parent
            assert parent == -1 or pool.describe(parent).state != PageState.FREE


class ReuseModel(ArcModel):
    """The same, under reuse."""

    policy = "reuse"


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestArcModel = ArcModel.TestCase
TestArcModel.settings = _SETTINGS
TestReuseModel = ReuseModel.TestCase
TestReuseModel.settings = _SETTINGS


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_adoption_keeps_pages_recency_and_the_split(policy: str) -> None:
    """The split survives a restart (the flags column's USED_AGAIN bit); the target, the
    lifetime and the ghosts, private memory, start afresh."""
    meta = bytearray(pool_of(1, policy)[0].layout.meta_bytes)
    pool = HostPool(EXTENT, EXTENT, 4 * KIB, eviction_policy=policy, meta=meta)
    cls = pool.register_class(4000)
    (x,) = store(pool, cls, [b"x"])
    load(pool, [b"x"])  # x: T2
    (y,) = store(pool, cls, [b"y"])  # y: T1, and more recent than x
    store(pool, cls, [b"a", b"b"])  # the pool's 4 slots are full
    pool.close()
    again = HostPool(EXTENT, EXTENT, 4 * KIB, eviction_policy=policy, meta=meta, classes=[4000])
    res = again.adopted
    assert res is not None and res.adopted and res.pages_adopted == 4
    split = again._pages.evictor.split
    assert split is not None and split.t2 == 1 and split.tier[x] == 1 and not split.tier[y]
    assert split.p == 0.0 if isinstance(split, ArcState) else split.life == -1
    assert (split.ghosts == 0) if isinstance(split, ReuseState) else not any(split.ghosts)
    assert again.evictable_slots()[-1] == x  # T1 (y, then b), then T2
    assert again.evictable_slots(OWNER)[0] == x  # by last access alone: x is the coldest
    store(again, cls, [b"c"])
    assert evicted(again) == [b"y"]  # T1's coldest, not x (the coldest of all)
    assert again.stats().eviction_policy == policy


def test_reuse_keeps_its_lifetime_through_a_restart() -> None:
    """The lifetime is written to the pool file as it is estimated and taken back by the
    pool that adopts the file; a value out of range there, or a formatted file, gives none."""
    import struct

    from kvtier.daemon.pool.layout import POLICY_OFFSET

    meta = bytearray(pool_of(1, "reuse")[0].layout.meta_bytes)
    pool = HostPool(EXTENT, EXTENT, 4 * KIB, eviction_policy="reuse", meta=meta)
    cls = pool.register_class(4000)
    for key in (b"a", b"b", b"c", b"d", b"e"):  # 4 slots: e evicts a, capacity 4
        store(pool, cls, [key])
    for key in (b"b", b"c", b"d", b"e"):  # 4 re-uses: as many as the pool holds pages
        load(pool, [key])
    split = pool._pages.evictor.split
    assert isinstance(split, ReuseState) and split.life > 0
    life = split.life
    assert struct.unpack_from("<q", meta, POLICY_OFFSET)[0] == life
    pool.close()

    def adopted(cold: bool = False) -> ReuseState:
        again = HostPool(
            EXTENT,
            EXTENT,
            4 * KIB,
            eviction_policy="reuse",
            meta=meta,
            classes=[4000],
            cold_start=cold,
        )
        st = again._pages.evictor.split
        again.close()
        assert isinstance(st, ReuseState)
        return st

    assert adopted().life == life
    struct.pack_into("<q", meta, POLICY_OFFSET, -5)  # not a lifetime: ignored
    assert adopted().life == -1
    struct.pack_into("<q", meta, POLICY_OFFSET, life)
    assert adopted(cold=True).life == -1  # a formatted pool starts afresh
    assert struct.unpack_from("<q", meta, POLICY_OFFSET)[0] == 0


def test_the_saved_lifetime_has_its_own_bytes_in_the_header_region() -> None:
    from kvtier.daemon.pool.layout import HEADER_BYTES, HEADER_REGION, POLICY_OFFSET
    from kvtier.daemon.pool.poolfile import OWNER_TAG_MAGIC, OWNER_TAG_MAX, OWNER_TAG_OFFSET

    tag_end = OWNER_TAG_OFFSET + len(OWNER_TAG_MAGIC) + 2 + OWNER_TAG_MAX  # magic, length
    assert HEADER_BYTES <= OWNER_TAG_OFFSET and tag_end <= POLICY_OFFSET
    assert POLICY_OFFSET + 8 <= HEADER_REGION


def test_reuse_core_survives_stamps_from_a_corrupt_file() -> None:
    """Stamps adopted from a file may be anything: the ghosts keep their bound and no
    distance or comparison overflows."""
    st = ReuseState(8)
    for i, stamp in enumerate([2**63 - 1, -(2**63), 2**62, -1] * 50):
        st.evicted_page(0, 1, b"k%d" % i, stamp, 2)
        assert st.ghosts <= GHOST_FACTOR * 2
    st.admit(0, 1, b"k199", -(2**63))  # a distance below zero: not counted
    st.admit(1, 1, b"k198", 2**63 - 1)  # 2^63 - 1 - 2^61: counted
    assert sum(st.core.histogram()) == 1
    assert st.pick(2**63 - 1, -(2**63), 2**63 - 1, 2) == 1  # idle "forever": T2's
    assert st.pick(-(2**63), 2**63 - 1, -(2**63), 2) == 0
    stamp = np.array([2**63 - 1, -(2**63)], dtype=np.int64)
    st.using([0, 1], memoryview(stamp), -(2**63))  # no overflow, nothing counted
    assert st.life == -1
    st.using([0, 1], memoryview(stamp), 2**63 - 1)  # the second saturates: counted, and
    assert 2**62 < st.life <= 9 * 10**18  # with 2 distances (2 pages resident): an estimate


def test_config_selects_the_policy() -> None:
    from kvtier.config import DaemonConfig
    from kvtier.config.errors import ConfigError
    from kvtier.config.loader import load_config

    cfg = load_config(
        DaemonConfig, env={"KVTIER_EVICTION_POLICY": "arc", "KVTIER_HICACHE_SIZE": "64MiB"}
    )
    assert cfg.eviction_policy == "arc"
    assert HostPool.from_config(cfg).stats().eviction_policy == "arc"
    default = load_config(DaemonConfig, env={"KVTIER_HICACHE_SIZE": "64MiB"})
    assert default.eviction_policy == "reuse"  # the daemon's default
    assert HostPool.from_config(default).stats().eviction_policy == "reuse"
    with pytest.raises(ConfigError, match=r"eviction_policy.*'mru'"):
        load_config(DaemonConfig, env={}, cli={"eviction_policy": "mru"})


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_write_back_walks_both_lists_from_their_cold_ends_in_turn(policy: str) -> None:
    """Write-back writes the pages ``iter_evictable`` yields first: the cold ends of T1 and
    T2 in turn, so the policy's choice between the two cold ends finds a page in L3 at
    each (T2's cold page does not wait, unwritten, while T1's are written and evicted)."""
    pool, cls = pool_of(2, policy)
    store(pool, cls, [b"old"])
    load(pool, [b"old"])  # T2, and the coldest page
    store(pool, cls, [b"t1-a"])
    store(pool, cls, [b"t1-b"])
    order = [pool.describe(s).key for s in pool.iter_evictable()]
    assert order == [b"t1-a", b"old", b"t1-b"]
    assert [pool.describe(s).key for s in pool.evictable_slots()] == [b"t1-a", b"t1-b", b"old"]
