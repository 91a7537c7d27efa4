"""The L2 eviction policies (``eviction_policy = reuse | lru | arc``) and their
metrics, through real kvtierd processes, as an operator uses them (docs/configuration.md,
"Eviction"; docs/metrics.md; docs/architecture.md, "The host pool")."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_metrics import scrape, value
from tests.servers import free_port

POLICIES = ["lru", "arc", "reuse"]
POOL_PAGES = 64


def small_pool(*more: str) -> list[str]:
    """A 2 MiB pool of two 1 MiB extents: 64 pages of SMALL's 32 KiB."""
    return ["--hicache-size", "2MiB", "--extent-size", "1MiB", *more]


def stats(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()


def chain(conn, n: int, salt: int) -> list[bytes]:
    return conn.page_keys(tokens(n * SMALL.page_size, salt=salt))


# ------------------------------------------------------------------ ghosts (arc)


@pytest.mark.timeout(120)
def test_arc_remembers_at_most_as_many_evicted_keys_as_the_pool_holds_pages(daemon_factory):
    """docs/metrics.md, ``kvtier_l2_eviction_ghosts``: under ``arc`` the keys of recent
    evictions remembered are "at most the pool's pages" (four times that under ``reuse``).
    A 64-page pool first churned with chains stored once (evicted from T1), then with chains
    stored and loaded (evicted from T2), never reports more than 64 ghosts, in STATS or on
    the Prometheus endpoint."""
    port = free_port()
    d = daemon_factory("--eviction-policy", "arc", "--metrics-port", str(port), *small_pool())
    pool, conn = engine(d.runtime_dir, num_pages=64)
    seen = []
    try:
        for i in range(40):  # stored once: T1 victims
            assert conn.store(chain(conn, 8, salt=i), list(range(8))).wait()
        seen.append(stats(d)["pool"]["eviction_split"]["ghosts"])
        for i in range(40, 80):  # stored, then loaded: T2 victims
            keys = chain(conn, 8, salt=i)
            assert conn.store(keys, list(range(8))).wait()
            h = conn.load(keys, list(range(8, 16)))
            assert h.count == 8 and h.wait()
        split = stats(d)["pool"]["eviction_split"]
        seen.append(split["ghosts"])
        gauge = value(scrape(port), "kvtier_l2_eviction_ghosts", policy="arc")
        assert max(seen) <= POOL_PAGES and gauge <= POOL_PAGES, (
            f"arc remembers {seen} evicted keys (gauge {gauge}) in a {POOL_PAGES}-page pool"
        )
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ chain rule


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", POLICIES)
def test_no_resident_page_without_its_parent_with_chains_sharing_a_prefix(daemon_factory, policy):
    """docs/configuration.md, Eviction: a page with a resident child is never evicted (a
    cached prefix shrinks from its tail), under every policy. Twelve 10-page chains sharing
    a 4-page prefix, half of them loaded again (T2 under ``arc`` and ``reuse``), stored into
    a 64-page pool: after every step, no page of any chain is resident while its parent is
    not."""
    d = daemon_factory("--eviction-policy", policy, *small_pool())
    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        prefix = tokens(4 * SMALL.page_size, salt=1)
        chains: list[list[bytes]] = []
        for i in range(12):
            keys = conn.page_keys(np.concatenate([prefix, tokens(6 * SMALL.page_size, 100 + i)]))
            assert conn.store(keys, list(range(10))).wait()
            chains.append(keys)
            if i % 2 == 0:
                n = conn.lookup(keys).l2
                if n:
                    assert conn.load(keys[:n], list(range(20, 20 + n))).wait()
            for c, keys_c in enumerate(chains):
                r = [conn.lookup([k]).l2 for k in keys_c]
                orphans = [j for j in range(1, len(r)) if r[j] and not r[j - 1]]
                assert not orphans, f"step {i}, chain {c}: pages {orphans} without parent {r}"
        assert stats(d)["pool"]["evictions"] > 0
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ metrics add up


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_counts_and_window_hit_rate_match_what_was_done(daemon_factory, policy):
    """docs/metrics.md: ``kvtier_evictions_by_reason_total`` (by policy and reason) adds up
    to ``kvtier_evictions_total`` and STATS' ``pool.evictions``; the last minute's
    ``kvtier_l2_page_hit_ratio_window`` (STATS ``window``) is the page keys found in L2
    over the page keys looked up, by the LOOKUPs done (some hitting, some missing: chains
    never stored); ``kvtier_l2_t2_pages`` never exceeds the READY pages, and is 0 once a FLUSH
    emptied L2."""
    port = free_port()
    d = daemon_factory("--eviction-policy", policy, "--metrics-port", str(port), *small_pool())
    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        looked = hits = 0
        done: list[list[bytes]] = []
        for i in range(20):
            keys = chain(conn, 8, salt=i)
            assert conn.store(keys, list(range(8))).wait()
            done.append(keys)
            never = chain(conn, 8, salt=10_000 + i)  # never stored: 8 misses
            for c in [never, *done[-3:]]:
                r = conn.lookup(c)
                looked += len(c)
                hits += r.l2
                if r.l2:
                    assert conn.load(c[: r.l2], list(range(8, 8 + r.l2))).wait()
        assert 0 < hits < looked
        s = stats(d)
        p = s["pool"]
        assert p["evictions"] > 0
        assert sum(p["evictions_by_reason"].values()) == p["evictions"], p
        assert (s["window"]["lookup_keys"], s["window"]["lookup_hit_keys"]) == (looked, hits)
        m = scrape(port)
        by = {
            dict(labels)["reason"]: v
            for (name, labels), v in m.items()
            if name == "kvtier_evictions_by_reason_total"
        }
        assert set(by) == ({"lru"} if policy == "lru" else {"t1", "t2"})
        assert value(m, "kvtier_evictions_total") == sum(by.values()) == p["evictions"]
        assert value(m, "kvtier_l2_page_hit_ratio_window", seconds="60") == pytest.approx(
            hits / looked
        )
        if policy != "lru":
            assert 0 <= value(m, "kvtier_l2_t2_pages", policy=policy) <= p["pages_ready"]
            with AdminClient(d.endpoint, timeout_s=10.0) as admin:
                assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
            p = stats(d)["pool"]
            assert p["pages_ready"] == 0 and p["eviction_split"]["t2_pages"] == 0, p
    finally:
        conn.close()
        pool.close()
