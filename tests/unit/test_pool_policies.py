"""Exact tests of the host pool's two-list eviction policies, ``arc`` and ``reuse`` (no mocks).

Geometry: align 4 KiB, extents of 16 KiB, one class of 4000 B pages (4 slots an extent).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kvtier.daemon.pool.host_pool import HostPool, HostPoolError, PageState
from kvtier.daemon.pool.policies import FLOOR, GHOST_FACTOR, SHADOW, ArcState, ReuseState

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


def test_reuse_ghost_hit_grows_its_lists_target() -> None:
    pool, cls = pool_of(2, "reuse")  # 8 pages
    for key in (b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"):
        store(pool, cls, [key])  # chains of one page each
    load(pool, [b"a"])
    load(pool, [b"b"])  # a, b in T2
    store(pool, cls, [b"i"])  # the first eviction: T1's target is the share T1 filled, 6 of
    split = pool._pages.evictor.split  # 8 pages, and T1 holds that many: its coldest, c
    assert isinstance(split, ReuseState) and split.share == 0.75
    load(pool, [b"d"])  # d into T2: T1 = {e .. i}, 5 pages, under its target
    store(pool, cls, [b"c"])  # so T2's coldest goes, a; c, a T1 ghost no T1 eviction deep,
    # is within T2's shadow (SHADOW x 0.25 x 8 pages): into T2, T1's target grows
    assert split.t2 == 3
    assert split.share == pytest.approx(min(0.75 + 1.0 / (SHADOW * 8 * 0.25), 1.0 - FLOOR))
    store(pool, cls, [b"j"])  # T1 = {e .. i}, 5 pages, under 0.99 x 8: T2's coldest, b
    assert evicted(pool) == [b"c", b"a", b"b"]
    assert pool.stats().evictions_by_reason == {"t1": 1, "t2": 2}
    assert pool.stats().eviction_split == {  # c returned; a and b are ghosts
        "t2_pages": 2,
        "t1_target_ratio": split.share,
        "ghosts": 2,
    }


def test_reuse_adapts_by_ghost_depth_and_bounds_its_memory() -> None:
    st = ReuseState(8)
    ns = 3
    st.t2 = 95  # the first eviction, T1 holding 5 of 100 pages: its target, 0.05
    assert st.victim_list(100) == 0 and st.share == pytest.approx(0.05)
    start = st.share
    st.t2 = 0
    for i in range(500):  # T1 evictions with 100 pages resident
        st.evicted_page(0, ns, b"k%d" % i, 100)
    assert st.ghosts == GHOST_FACTOR * 100
    assert st.evicted == [500, 0] and st.capacity == 100
    st.admit(0, ns, b"k99")  # forgotten: the oldest of the 500
    assert st.tier[0] == 0 and st.t2 == 0
    region = SHADOW * 100 * (1.0 - start)  # T2's shadow: 23.75 evictions
    st.admit(1, ns, b"k450")  # left T1 49 evictions ago: beyond the shadow, no change
    assert st.tier[1] == 1 and st.t2 == 1 and st.share == start
    st.admit(2, ns, b"k490")  # 9 evictions ago: within it
    assert st.tier[2] == 1 and st.share == pytest.approx(start + 1.0 / region)
    st.admit(3, ns, b"k490")  # a ghost counts once
    st.admit(4, 99, b"k491")  # another namespace's key is not this one's ghost
    assert st.tier[3] == st.tier[4] == 0 and st.t2 == 2
    st.tier[5] = 1
    st.t2 += 1
    share = st.share
    st.evicted_page(5, ns, b"t2", 1000)  # a T2 eviction, back at once: T1's target shrinks
    st.released(5)
    st.admit(5, ns, b"t2")
    assert st.share == pytest.approx(share - 1.0 / (SHADOW * 1000 * share))
    st.tier[6] = 1
    st.t2 += 1
    for i in range(1000):  # T2's evictions keep coming back: T1's target stops at FLOOR
        st.evicted_page(6, ns, b"w%d" % i, 100)
        st.released(6)
        st.admit(6, ns, b"w%d" % i)
    assert st.share == pytest.approx(FLOOR)
    assert st.victim_list(100) == (0 if 100 - st.t2 > FLOOR * 100 else 1)


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
            assert FLOOR <= arc.share <= 1.0 - FLOOR
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
    """The split survives a restart (the flags column's USED_AGAIN bit); the targets and the
    ghosts, private memory, start afresh."""
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
    assert split.p == 0.0 if isinstance(split, ArcState) else split.share == 1.0 - FLOOR
    assert (split.ghosts == 0) if isinstance(split, ReuseState) else not any(split.ghosts)
    assert again.evictable_slots()[-1] == x  # T1 (y, then b), then T2
    assert again.evictable_slots(OWNER)[0] == x  # by last access alone: x is the coldest
    store(again, cls, [b"c"])
    assert evicted(again) == [b"y"]  # T1's coldest, not x (the coldest of all)
    assert again.stats().eviction_policy == policy


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
