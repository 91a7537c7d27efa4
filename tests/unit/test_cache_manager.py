"""The cache manager's pure L1 paths: match, lock, insert, release and eviction, no daemon.

A manager without a connection (``conn=None``) keys pages from the seed it is given; what it
does with L2 (loads, write policies) is tested against a real kvtierd in
tests/integration/test_cache_manager_l2.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvtier.client.cache.manager import CacheManager, DevicePoolExhausted
from kvtier.config import ClientConfig
from kvtier.engine.allocator import PageAllocator, PageAllocatorError

from tests.engines import SMALL, tokens
from tests.key_chain import spec_page_keys

P = SMALL.page_size


@pytest.mark.timeout(30)
def test_l1_only_match_locks_and_keeps_the_last_token():
    alloc = PageAllocator(8)
    seed = bytes(range(32))
    cm = CacheManager(alloc, None, page_size=P, key_seed=seed)
    toks = tokens(4 * P).tolist()
    m = cm.match(toks)
    assert (m.l1_pages, m.l2_pages) == ([], 0)
    assert m.keys == spec_page_keys(seed, toks, P)
    pages = cm.alloc(4)
    assert cm.insert(m, pages) == []
    cm.release(m)
    # a page-aligned prompt hits all but its last page: the last token is always computed
    m2 = cm.match(toks)
    assert m2.l1_pages == pages[:3] and m2.keys == m.keys
    assert cm.tree.evictable_page_count == 1  # the hit is locked
    cm.release(m2)
    assert cm.tree.evictable_page_count == 4
    m3 = cm.match(toks + [1, 2, 3])
    assert m3.l1_pages == pages
    cm.release(m3)
    assert cm.counters.l1_hit_tokens == 7 * P


@pytest.mark.timeout(30)
def test_alloc_evicts_unlocked_pages_and_refuses_locked_ones():
    alloc = PageAllocator(8)
    cm = CacheManager(alloc, None, page_size=P)
    toks = tokens(6 * P + 1).tolist()
    m = cm.match(toks)
    pages = cm.alloc(6)
    cm.insert(m, pages)  # the request's lock now covers all 6 pages
    with pytest.raises(DevicePoolExhausted):
        cm.alloc(4)
    cm.release(m)
    got = cm.alloc(4)
    assert set(got) == {6, 7} | set(pages[4:])  # the two tail pages were evicted
    assert cm.counters.evicted_pages == 2
    assert cm.match(toks).l1_pages == pages[:4]
    with pytest.raises(PageAllocatorError):
        alloc.free([got[0], got[0]])


class _H:
    """A transfer that ended at once (the fake L2 below copies nothing)."""

    def __init__(self, n: int) -> None:
        self.count = self.writing = n

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return True

    def copying(self) -> bool:
        return False


class _L2:
    """Stands in for a kvtierd connection (an L2 as a set of keys): which pages the
    manager stores, and with which chain parent."""

    store_room = (64, 64)
    load_room = (64, 64)

    def __init__(self, policy: str) -> None:
        self.geometry = SimpleNamespace(page_size=4)
        self.config = ClientConfig(hicache_write_policy=policy)
        self.ns_fingerprint = bytes(32)
        self.epoch = 1
        self.held: set[bytes] = set()
        self.stores: list[tuple[list[bytes], bytes | None]] = []

    def lookup(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return SimpleNamespace(l2=n, l3=0)

    def store(self, keys, pages, parent_key=None):
        self.stores.append((list(keys), parent_key))
        self.held.update(keys)
        return _H(len(keys))

    def load(self, keys, pages):
        return _H(min(len(keys), len(pages)))

    def daemon_alive(self) -> bool:
        return True


def test_write_back_stores_pages_l2_lost_with_their_chain_parents() -> None:
    """Under write_back, pages loaded back from L2 and then lost there (evicted by the daemon)
    are stored again when L1 evicts them, as one chain run with its parent: kvtierd's
    eviction never takes a page with a resident child, which it knows by the parents."""
    l2 = _L2("write_back")
    cm = CacheManager(PageAllocator(8), l2)
    toks = list(range(1, 14))  # three full pages of 4 tokens
    m = cm.match(toks)
    cm.insert(m, cm.alloc(3))
    cm.release(m)
    cm.flush_l1()  # written back
    m = cm.match([*toks, 99])
    pages = cm.alloc(3)
    cm.load(m, pages).finish()
    cm.insert(m, m.l1_pages + pages)
    cm.release(m)
    keys = m.keys
    l2.held.clear()  # the daemon evicted them while L1 held them
    l2.stores.clear()
    cm.flush_l1()
    stored = {k: parent for ks, parent in l2.stores for k in [ks[0]]}
    assert sorted(k for ks, _ in l2.stores for k in ks) == sorted(keys[:3])
    for ks, parent in l2.stores:  # each run's parent is the page before it in the chain
        first = keys.index(ks[0])
        assert parent == (keys[first - 1] if first else None), (first, stored)
        assert ks == keys[first : first + len(ks)]


class _FailedLoad(_H):
    """A LOAD whose wait failed; ``still`` says whether the daemon is still copying it."""

    def __init__(self, n: int, still: list[bool]) -> None:
        super().__init__(n)
        self.still = still

    def wait(self, timeout: float | None = None) -> bool:
        return False

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return False

    def copying(self) -> bool:
        return self.still[0]


@pytest.mark.parametrize("copying", [False, True])
def test_a_failed_loads_pages_are_held_exactly_while_kvtierd_may_write_them(copying) -> None:
    """A failed LOAD's pages are quarantined only while kvtierd may still write them (its
    transfer not ended): none when it has ended (or never writes the engine's pages, as in
    the engine copy mode); else until it ends, however long that takes."""
    l2 = _L2("write_through")
    cm = CacheManager(PageAllocator(8), l2)
    toks = list(range(1, 14))
    m = cm.match(toks)
    cm.insert(m, cm.alloc(3))
    cm.release(m)
    cm.flush_l1()
    still = [copying]
    l2.load = lambda keys, pages: _FailedLoad(min(len(keys), len(pages)), still)  # type: ignore[method-assign]
    m = cm.match([*toks, 99])
    pages = cm.alloc(3)
    load = cm.load(m, pages)
    assert not load.wait_layer(0)
    cm.release(m)
    cm.free(pages)
    assert cm.quarantined_pages == (3 if copying else 0)
    still[0] = False  # the daemon ended it: the next allocation takes the pages back
    cm.free(cm.alloc(1))
    assert cm.quarantined_pages == 0


def test_loads_a_request_dropped_unsettled_do_not_hold_the_room_for_loads() -> None:
    """Under write_back, loads in flight keep to the link's room for loads. A request that
    drops its match without finishing the load (an engine error path that never calls
    release) does not keep counting against that room: after such drops, loads are still
    served instead of every one becoming a miss."""
    import gc

    l2 = _L2("write_back")
    l2.load_room = (2, 64)
    cm = CacheManager(PageAllocator(64), l2)
    toks = list(range(1, 14))  # three full pages of 4 tokens
    m = cm.match(toks)
    cm.insert(m, cm.alloc(3))
    cm.release(m)
    cm.flush_l1()  # written back: L2 holds them, L1 not
    for _ in range(4):
        m = cm.match([*toks, 99])
        assert cm.load(m, cm.alloc(3)).pages == 3
        del m  # dropped unsettled, never released
        gc.collect()
    m = cm.match([*toks, 99])
    ld = cm.load(m, cm.alloc(3))
    assert ld.pages == 3
    assert ld.finish()
    cm.release(m)
