"""The L2 host pool under memory pressure together with L3 (the file store).

Small pools (2 MiB: 64 pages of 32 KiB in 2 extents), chains restored from L3 into L2,
prefetches into a pool full of WRITING pages, tenant quotas during prefetch, and eviction
policies switched across restarts.
"""

from __future__ import annotations

import json

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import (
    REPO,
    counters,
    flush,
    l3_flags,
    slow_flags,
    stats,
    wait_for,
    wait_written,
)

TOKEN_A = "tok-a-5f1e9c"
ADMIN = "adm-4c2d1e"


def small_pool(*more: str) -> list[str]:
    """A 2 MiB pool of two 1 MiB extents: 64 pages of SMALL's 32 KiB."""
    return ["--hicache-size", "2MiB", "--extent-size", "1MiB", *more]


def resident(conn, keys: list[bytes]) -> int:
    """How many of ``keys`` are READY in L2, each looked up on its own."""
    return sum(conn.lookup([k]).l2 for k in keys)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_chain_restored_from_l3_shrinks_from_its_tail(daemon_factory, policy):
    """Eviction takes only pages with no resident child (docs/architecture.md, "The host
    pool"; docs/configuration.md, "Eviction"): a cached prefix shrinks from its tail, and
    whenever L2 holds pages of a chain they are its leading run (LOOKUP's L2 run), never a
    tail cut off from its head.

    Here the tail comes first: an engine stores pages 4..7 naming page 3 as their parent
    (``parent_key``) while page 3 is only in L3; a PREFETCH then brings pages 0..3 back, and
    the whole chain is in L2 (LOOKUP: 8). The STORE that names page 3 and page 4 together
    links them, so under pressure page 7 goes first, never page 3."""
    d = daemon_factory(
        *l3_flags("file", prefetch_threshold="0", eviction_policy=policy), *small_pool()
    )
    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=3))
        for p in range(8):
            fill_page(pool, p, seed=p + 1)
        expected = [page_bytes(pool, p) for p in range(8)]
        h = conn.store(keys, list(range(8)))
        assert h.wait() and h.count == 8
        wait_written(d, 8)
        flush(d, "l2")  # the chain left L2 (it is in L3)
        # the engine stores the pages after page 3, naming it as their parent
        h = conn.store(keys[4:], list(range(4, 8)), parent_key=keys[3])
        assert h.wait() and h.count == 4
        assert (conn.lookup(keys).l2, conn.lookup(keys[4:]).l2) == (0, 4)
        conn.prefetch(keys)
        assert conn.claim(keys, policy="wait_complete") == 8
        h = conn.load(keys, list(range(32, 40)))
        assert h.wait() and h.count == 8
        assert [page_bytes(pool, p) for p in range(32, 40)] == expected
        h = conn.load(keys[4:], list(range(40, 44)))  # the tail is used again
        assert h.wait() and h.count == 4
        # pressure: one-page chains until L2 loses a page of the chain
        for i in range(200):
            k = conn.page_keys(tokens(SMALL.page_size, salt=1000 + i))
            fill_page(pool, 10, seed=5000 + i)
            h = conn.store(k, [10])
            assert h.wait()
            if resident(conn, keys) < 8:
                break
        else:
            pytest.fail("200 one-page stores into a 64-page pool evicted nothing of the chain")
        run, held = conn.lookup(keys).l2, resident(conn, keys)
        assert held == run, (
            f"L2 holds {held} pages of the chain but its leading run is {run}: a page with a "
            f"resident child was evicted (tail resident: {conn.lookup(keys[4:]).l2} of 4)"
        )
    finally:
        conn.close()
        pool.close()


def admin_stats(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
        return admin.stats()


def admin_flush_l2(d) -> None:
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
        rep = admin.call(P.Flush(req_id=0, tier="l2", admin_token=ADMIN))
    assert isinstance(rep, P.FlushReply), rep


@pytest.mark.timeout(90)
def test_a_tenant_quota_holds_during_a_prefetch_longer_than_it(daemon_factory):
    """(docs/configuration.md, Tenants: ``quota_pages`` is "the most L2 pages the
    tenant may hold") a PREFETCH from L3 of a 12-page chain by a tenant whose quota is 6
    fills at most 6 pages, the leading ones, loadable byte for byte, and every started page
    ends as completed, cancelled or failed."""
    ten = json.dumps({"a": {"token": TOKEN_A, "quota_pages": 6}})
    d = daemon_factory(
        *l3_flags("file", prefetch_threshold="0", eviction_policy="lru"),
        "--tenants",
        ten,
        "--admin-token",
        ADMIN,
    )
    pool, conn = engine(d.runtime_dir, num_pages=64, tenant="a", token=TOKEN_A)
    try:
        keys = conn.page_keys(tokens(12 * SMALL.page_size, salt=3))
        for p in range(12):
            fill_page(pool, p, seed=p + 1)
        expected = [page_bytes(pool, p) for p in range(12)]
        h = conn.store(keys[:6], list(range(6)))
        assert h.wait() and h.count == 6
        wait_for(lambda: admin_stats(d)["counters"]["l3_write_written_pages"] >= 6)
        admin_flush_l2(d)
        h = conn.store(keys[6:], list(range(6, 12)), parent_key=keys[5])
        assert h.wait() and h.count == 6
        wait_for(lambda: admin_stats(d)["counters"]["l3_write_written_pages"] >= 12)
        admin_flush_l2(d)
        assert (conn.lookup(keys).l2, conn.lookup(keys).l3) == (0, 12)
        assert conn.prefetch(keys) <= 6
        got = conn.claim(keys, policy="wait_complete")
        assert got == 6
        s = admin_stats(d)
        assert s["pool"]["pages_ready"] + s["pool"]["pages_writing"] <= 6
        h = conn.load(keys[:got], list(range(32, 32 + got)))
        assert h.wait() and h.count == got
        assert [page_bytes(pool, p) for p in range(32, 32 + got)] == expected[:got]
        c = s["counters"]
        assert c["l3_prefetch_started_pages"] == (
            c["l3_prefetch_completed_pages"]
            + c["l3_prefetch_cancelled_pages"]
            + c["l3_prefetch_failed_pages"]
        )
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_prefetches_into_a_pool_full_of_writing_pages_stay_exact(daemon_factory, short_tmp):
    """(docs/architecture.md, PREFETCH and CLAIM; docs/metrics.md) two engines
    prefetch from a slow L3 more pages than a 64-page pool holds; the second fills only what
    is left (it never waits for nor takes the first one's WRITING slots), the claims answer
    runs that load byte for byte, and every started page ends once (started = completed +
    cancelled + failed)."""
    d = daemon_factory(
        *slow_flags(short_tmp, 0.4, eviction_policy="lru"),
        *small_pool(),
        env={"PYTHONPATH": REPO},
    )
    pool, conn = engine(d.runtime_dir, num_pages=64)
    pool_b, conn_b = engine(d.runtime_dir, num_pages=64)
    try:

        def chain(n, salt, c, p):
            keys = c.page_keys(tokens(n * SMALL.page_size, salt=salt))
            for i in range(n):
                fill_page(p, i, seed=salt * 100 + i)
            exp = [page_bytes(p, i) for i in range(n)]
            h = c.store(keys, list(range(n)))
            assert h.wait() and h.count == n
            return keys, exp

        ka, ea = chain(40, 1, conn, pool)
        wait_written(d, 40)
        kc, ec = chain(30, 3, conn, pool)
        wait_written(d, 70)
        flush(d, "l2")
        chain(20, 2, conn_b, pool_b)
        wait_written(d, 90)  # written: no longer pinned by their write, so evictable
        assert conn.prefetch(ka) == 40
        assert conn_b.prefetch(kc) == 24  # what the 40 WRITING slots leave
        ca = conn.claim(ka, policy="wait_complete")
        cc = conn_b.claim(kc, policy="wait_complete")
        assert (ca, cc) == (40, 24)
        h = conn.load(ka[:ca], list(range(ca)))
        assert h.wait() and h.count == ca
        assert [page_bytes(pool, i) for i in range(ca)] == ea[:ca]
        h = conn_b.load(kc[:cc], list(range(cc)))
        assert h.wait() and h.count == cc
        assert [page_bytes(pool_b, i) for i in range(cc)] == ec[:cc]
        wait_for(lambda: stats(d)["l3"]["prefetching"] == 0)
        c = counters(d)
        assert c["l3_prefetch_started_pages"] == (
            c["l3_prefetch_completed_pages"]
            + c["l3_prefetch_cancelled_pages"]
            + c["l3_prefetch_failed_pages"]
        )
    finally:
        for cn in (conn, conn_b):
            cn.close()
        for p in (pool, pool_b):
            p.close()


@pytest.mark.timeout(120)
def test_switching_eviction_policies_across_restarts_keeps_pages_exact(daemon_factory, short_tmp):
    """(docs/configuration.md, Eviction: "A restart keeps the pages, their recency,
    which were used again") a pool adopted under another ``eviction_policy`` (reuse → arc →
    lru → reuse) keeps every page, evicts under pressure without error, and every page LOOKUP
    finds loads byte for byte."""
    state = str(short_tmp / "state")
    chains: list[tuple[list[bytes], list[bytes]]] = []
    salt = 0
    for pol in ["reuse", "arc", "lru", "reuse"]:
        d = daemon_factory(
            *l3_flags("file", prefetch_threshold="0", eviction_policy=pol, state_dir=state),
            *small_pool(),
        )
        pool, conn = engine(d.runtime_dir, num_pages=64)
        try:
            if chains:
                assert stats(d)["adopt"]["pages_adopted"] == 64
            for keys, exp in chains:
                n = conn.lookup(keys).l2
                if n:
                    h = conn.load(keys[:n], list(range(40, 40 + n)))
                    assert h.wait() and h.count == n
                    assert [page_bytes(pool, 40 + i) for i in range(n)] == exp[:n], pol
            for i in range(12):
                salt += 1
                keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=salt))
                for p in range(8):
                    fill_page(pool, p, seed=salt * 100 + p)
                exp = [page_bytes(pool, p) for p in range(8)]
                h = conn.store(keys, list(range(8)))
                assert h.wait()
                chains.append((keys, exp))
                if i % 3 == 0 and len(chains) > 2:
                    k2 = chains[-3][0]
                    n = conn.lookup(k2).l2
                    if n:
                        h = conn.load(k2[:n], list(range(40, 40 + n)))
                        assert h.wait()
            assert stats(d)["pool"]["evictions"] > 0
        finally:
            conn.close()
            pool.close()
        d.stop()
