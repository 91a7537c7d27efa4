"""The cache manager's loads and HiCache's write policies against a real kvtierd.

What L2 holds is asked of the daemon (LOOKUP and STATS), never of the manager, under keys
derived from the spec (tests/key_chain.py), not by the client's own key code. Page contents
are derived from the page key, so a page that was stored late (after its device page was
reused) shows up as wrong bytes.
"""

from __future__ import annotations

import pytest
from kvtier.client.cache.manager import CacheManager, MatchResult
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.engine.allocator import PageAllocator

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.key_chain import spec_fingerprint, spec_page_keys

P = SMALL.page_size


def keys_of(conn: Connection, toks) -> list[bytes]:
    """The page keys of ``toks`` in ``conn``'s namespace, per the spec."""
    assert conn.ns_fingerprint == spec_fingerprint(SMALL, model_id="m")
    return spec_page_keys(conn.ns_fingerprint, toks, P)


def seed_of(key: bytes) -> int:
    return int.from_bytes(key[:3], "little") + 1


def expected(pool, keys: list[bytes], busy: list[int]) -> list[bytes]:
    """The bytes pages with ``keys`` must hold, built in a page not in ``busy``."""
    scratch = next(p for p in range(pool.num_pages - 1, -1, -1) if p not in busy)
    out = []
    for key in keys:
        fill_page(pool, scratch, seed_of(key))
        out.append(page_bytes(pool, scratch))
    return out


def request(cm: CacheManager, pool, toks, extra_pages: int = 1) -> MatchResult:
    """One engine request: match, alloc, load, 'compute' the rest, insert, release, free."""
    m = cm.match(toks)
    n_full = len(toks) // P
    l1 = len(m.l1_pages)
    new = cm.alloc(n_full - l1 + extra_pages)
    ld = cm.load(m, new[: m.l2_pages])
    assert ld.finish()
    table = m.l1_pages + new
    for i in range(l1 + ld.pages, n_full):  # computed pages get the key's pattern
        fill_page(pool, table[i], seed_of(m.keys[i]))
    dups = cm.insert(m, table[:n_full])
    taken = set(table[l1:n_full]).difference(dups)
    cm.release(m)
    cm.free(p for p in new if p not in taken)
    return m


def stats(endpoint) -> dict:
    with AdminClient(endpoint) as admin:
        return admin.stats()["counters"]


@pytest.fixture
def make(daemon):
    """``make(num_pages, **client_config)`` -> (pool, conn, allocator, manager); closed at the end."""
    made = []

    def build(num_pages: int = 64, **cfg):
        pool, conn = engine(daemon.runtime_dir, SMALL, num_pages=num_pages, **cfg)
        alloc = PageAllocator(num_pages)
        cm = CacheManager(alloc, conn)
        made.append((pool, conn, cm))
        return pool, conn, alloc, cm

    yield build
    for pool, conn, cm in made:
        cm.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_write_through_stores_on_first_insert(make, daemon):
    pool, conn, _, cm = make(hicache_write_policy="write_through")
    toks = tokens(5 * P + 3).tolist()
    m = request(cm, pool, toks)
    keys = keys_of(conn, toks)
    assert conn.lookup(keys).l2 == 5
    assert stats(daemon.endpoint)["store_pages"] == 5
    assert (cm.counters.stores_issued, cm.counters.pages_stored, cm.pending_stores) == (1, 5, 0)
    # the stored bytes are the pages' own (the device pages were not reused before the store)
    dst = cm.alloc(5)
    h = conn.load(keys, dst)
    assert h.count == 5 and h.wait()
    assert [page_bytes(pool, p) for p in dst] == expected(pool, m.keys, dst)
    # a second request stores nothing new
    request(cm, pool, toks)
    assert stats(daemon.endpoint)["store_pages"] == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threshold", [2, 3])
def test_write_through_selective_stores_pages_used_threshold_times(make, daemon, threshold):
    pool, conn, _, cm = make(
        hicache_write_policy="write_through_selective", write_through_threshold=threshold
    )
    a = tokens(5 * P + 3).tolist()
    keys = keys_of(conn, a)
    for _ in range(threshold - 1):
        request(cm, pool, a)
        assert conn.lookup(keys).l2 == 0
    assert stats(daemon.endpoint)["store_pages"] == 0
    # another prompt sharing A's first two pages: only those reach the threshold
    b = a[: 2 * P] + tokens(3 * P + 5, salt=7).tolist()
    request(cm, pool, b)
    assert conn.lookup(keys).l2 == 2
    assert conn.lookup(keys_of(conn, b)).l2 == 2
    request(cm, pool, a)
    assert conn.lookup(keys).l2 == 5
    assert stats(daemon.endpoint)["store_pages"] == 5


@pytest.mark.timeout(60)
def test_write_back_stores_only_evicted_pages_before_reusing_them(make, daemon):
    pool, conn, alloc, cm = make(num_pages=12, hicache_write_policy="write_back")
    a = tokens(5 * P + 3).tolist()
    keys_a = keys_of(conn, a)
    m = request(cm, pool, a)  # 5 pages stay in L1
    assert conn.lookup(keys_a).l2 == 0 and stats(daemon.endpoint)["store_pages"] == 0
    # B needs 9 pages, 7 are free: A's two tail pages are evicted, stored, then reused by B
    b = tokens(8 * P + 3, salt=3).tolist()
    request(cm, pool, b)
    assert cm.counters.evicted_pages == 2 and cm.counters.written_back_pages == 2
    assert stats(daemon.endpoint)["store_pages"] == 2
    assert conn.lookup(keys_a).l2 == 0  # A's head is still only in L1
    assert conn.lookup(keys_a[3:]).l2 == 2
    # a cold L1: everything goes to L2 first, chained, so A is whole again
    cm.flush_l1()
    assert conn.lookup(keys_a).l2 == 5
    assert conn.lookup(keys_of(conn, b)).l2 == 8
    assert alloc.free_count == 12
    dst = cm.alloc(5)
    h = conn.load(keys_a, dst)
    assert h.count == 5 and h.wait()
    # the evicted pages were overwritten by B after the store: L2 must hold A's bytes
    assert [page_bytes(pool, p) for p in dst] == expected(pool, m.keys[:5], dst)


@pytest.mark.timeout(60)
def test_match_continues_the_chain_after_l1_and_loads_from_l2(make, daemon):
    pool, conn, alloc, cm = make(num_pages=16, hicache_write_policy="write_through")
    a = tokens(6 * P + 5).tolist()
    request(cm, pool, a, extra_pages=0)
    # make L1 keep only A's first 3 pages: take pages until 3 of A's are evicted
    hold = cm.alloc(alloc.free_count + 3)
    cm.free(hold)
    longer = a + tokens(40, salt=5).tolist()
    m = cm.match(longer)
    assert len(m.l1_pages) == 3 and m.l2_pages == 3
    assert m.keys == keys_of(conn, longer)
    new = cm.alloc(3)
    ld = cm.load(m, new)
    assert ld.pages == 3
    for layer in range(SMALL.num_layers):
        assert ld.wait_layer(layer)
    assert ld.finish()
    got = [page_bytes(pool, p) for p in new]
    assert got == expected(pool, m.keys[3:6], new + m.l1_pages)
    cm.release(m)
    cm.free(new)
    assert cm.counters.loaded_tokens == 3 * P
    # a new manager (a restarted engine) finds the same pages from the namespace seed
    fresh = CacheManager(PageAllocator(16), conn)
    m2 = fresh.match(longer)
    assert (len(m2.l1_pages), m2.l2_pages) == (0, 6)
    fresh.release(m2)


@pytest.mark.timeout(60)
def test_daemon_gone_means_misses_and_dropped_stores(make, daemon):
    pool, _, _, cm = make(request_timeout_s=0.5, hicache_write_policy="write_through")
    a = tokens(4 * P + 1).tolist()
    daemon.kill()
    m = request(cm, pool, a)
    assert m.l2_pages == 0
    assert cm.counters.pages_stored == 0 and cm.counters.store_dropped_pages == 4
    # L1 keeps working without the daemon
    m2 = cm.match(a)
    assert len(m2.l1_pages) == 4
    cm.release(m2)
