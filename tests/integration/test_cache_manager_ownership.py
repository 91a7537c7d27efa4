"""The engine-side cache manager's device pages against a real kvtierd: a failed load's
quarantined pages are freed once, loads leave write-back STOREs their slots, and a load
never writes into the L1 hit's pages."""

from __future__ import annotations

import time

import pytest
import torch
from kvtier.client.cache.manager import CacheManager
from kvtier.engine.allocator import PageAllocator
from kvtier.ipc import protocol as P

from tests.engines import engine, tokens

BIG = P.Geometry(num_layers=8, page_size=16, kv_heads=8, head_dim=128, dtype="float32")
"""1 MiB pages: a 64-page LOAD takes long enough to be caught running."""

FLAGS = ("--hicache-size", "512MiB", "--lease-s", "30")


def _fill(pool, pages, salt: int = 0) -> None:
    for p in pages:
        for b, buf in enumerate(pool.k + pool.v):
            buf[p].view(-1).view(torch.int32).fill_(p * 1000 + b + 1 + salt)


@pytest.mark.timeout(120)
def test_a_drained_quarantine_is_not_freed_again_by_the_requests_free(daemon_factory):
    """The daemon ends a failed load whose pages the manager quarantined, and another
    request's alloc() drains the quarantine before the failed request ends (release, then
    free of every page it was given): those pages are freed once, by that free(), never
    handed to the other request as well (two requests writing their KV into one page)."""
    d = daemon_factory(*FLAGS)
    n = 64
    toks = tokens(n * BIG.page_size + 1, salt=3).tolist()
    spool, sconn = engine(d.runtime_dir, BIG, num_pages=n)
    pool, conn = engine(d.runtime_dir, BIG, num_pages=3 * n + 8, load_timeout_s=1e-6)
    try:
        _fill(spool, range(n))
        keys = sconn.page_keys(toks)[:n]
        assert sconn.store(keys, list(range(n))).wait()
        alloc = PageAllocator(3 * n + 8)
        cm = CacheManager(alloc, conn)
        for _ in range(20):  # until a load is caught running when its wait gives up
            ma = cm.match(toks)
            assert ma.l2_pages == n
            pages_a = cm.alloc(n + 1)
            ld = cm.load(ma, pages_a[:n])
            assert ld.pages == n
            if not ld.wait_layer(BIG.num_layers - 1) and ld.quarantined:
                break
            cm.release(ma)
            cm.free(pages_a)
        else:
            pytest.skip("no load was still running when its wait timed out")
        deadline = time.monotonic() + 10
        while ld.copying() and time.monotonic() < deadline:  # the daemon ends it (RELEASE)
            time.sleep(0.01)
        assert not ld.copying()
        # another request allocates meanwhile, which drains the quarantine
        pages_b = cm.alloc(n)
        assert not ld.quarantined
        # the failed request ends as documented: release, then free what it was given
        cm.release(ma)
        cm.free(pages_a)
        taken = sorted(set(pages_b) & set(cm.alloc(alloc.free_count)))
        assert not taken, f"pages {taken} of a live request were handed out again"
    finally:
        conn.close()
        pool.close()
        sconn.close()
        spool.close()


@pytest.mark.timeout(120)
def test_write_back_is_not_dropped_while_a_batch_of_loads_is_in_flight(daemon):
    """Under write_back an L1 page L2 lacks is stored when L1 evicts it (the only copy
    kvtier makes of it). With a batch of requests' loads in flight (matched, loading, not
    yet finished), loads keep to their half of the completion slots (a load past it is a
    miss), so the eviction's write-back STORE finds a slot and the evicted pages reach
    L2."""
    from tests.engines import SMALL

    size = SMALL.page_size
    batch = 64  # the session's completion slots
    pool, conn = engine(
        daemon.runtime_dir, SMALL, num_pages=3 + batch, hicache_write_policy="write_back"
    )
    alloc = PageAllocator(3 + batch)
    cm = CacheManager(alloc, conn)
    matches = []
    try:
        z = tokens(3 * size + 1, salt=11).tolist()  # a conversation whose 3 pages L1 holds
        m = cm.match(z)
        pz = cm.alloc(4)
        cm.insert(m, pz[:3])
        cm.release(m)
        cm.free(pz[3:])
        z_keys = m.keys[:3]
        assert conn.lookup(z_keys).l2 == 0  # write_back: not stored yet
        y = tokens(size + 1, salt=12).tolist()  # a system prompt L2 holds
        spare = alloc.alloc(1)
        assert conn.store(conn.page_keys(y), spare).wait()
        alloc.free(spare)
        loaded = 0
        for _ in range(batch):  # a batch of requests, each loading the prompt from L2
            my = cm.match(y)
            assert my.l2_pages == 1
            loaded += cm.load(my, cm.alloc(1)).pages  # past the room for loads: a miss
            matches.append(my)
        assert loaded >= batch // 2
        # the next request needs the pages L1 holds for z: evicted, written back first
        m2 = cm.match(tokens(3 * size + 1, salt=13).tolist())
        got = cm.alloc(3)
        assert set(got) == set(pz[:3])
        assert conn.lookup(z_keys).l2 == 3, (
            f"the evicted pages were not written back "
            f"(store_dropped_pages={cm.counters.store_dropped_pages}, "
            f"written_back_pages={cm.counters.written_back_pages})"
        )
        cm.release(m2)
        cm.free(got)
    finally:
        for my in matches:
            cm.release(my)
        cm.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_load_refuses_device_pages_of_the_l1_hit(daemon):
    """load() into the L1 hit's own pages (an engine that passes its page table,
    ``m.l1_pages + new``, instead of the new pages) is refused: the L2 run's KV would be
    copied over locked L1 pages that every request sharing that prefix reads."""
    from kvtier.config import KvtierError

    from tests.engines import SMALL, fill_page, page_bytes

    size = SMALL.page_size
    x = tokens(4 * size + 1, salt=21).tolist()
    pool1, conn1 = engine(daemon.runtime_dir, SMALL, num_pages=16)
    pool2, conn2 = engine(daemon.runtime_dir, SMALL, num_pages=16)
    cm1 = CacheManager(PageAllocator(16), conn1)
    cm2 = CacheManager(PageAllocator(16), conn2)
    try:
        m = cm1.match(x)  # engine 1 computes all 4 pages: stored to L2 (write_through)
        p1 = cm1.alloc(4)
        for i, p in enumerate(p1):
            fill_page(pool1, p, 100 + i)
        cm1.insert(m, p1)
        cm1.release(m)
        m = cm2.match(x[: 2 * size + 1])  # engine 2 holds the first 2 in L1
        p2 = cm2.alloc(2)
        for i, p in enumerate(p2):
            fill_page(pool2, p, 100 + i)
        cm2.insert(m, p2)
        cm2.release(m)
        before = [page_bytes(pool2, p) for p in p2]
        m = cm2.match(x)
        assert (m.l1_pages, m.l2_pages) == (p2, 2)
        try:
            with pytest.raises(KvtierError):
                cm2.load(m, m.l1_pages)
        finally:
            if m.load is not None:
                m.load.finish()
            after = [page_bytes(pool2, p) for p in p2]
            cm2.release(m)
        assert after == before, "the L1 hit's pages were overwritten"
    finally:
        cm1.close()
        cm2.close()
        conn1.close()
        conn2.close()
        pool1.close()
        pool2.close()
