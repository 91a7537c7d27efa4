"""The L2 eviction policies (``eviction_policy``) through real kvtierd processes: which page
a full pool gives up, as docs/configuration.md ("Eviction") and docs/architecture.md ("The
host pool") promise it: recency is what engines do, never the daemon's own writes to L3."""

from __future__ import annotations

import random
import threading

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import REPO, counters, l3_flags, slow_flags, wait_for


def small_pool(*more: str) -> list[str]:
    """A 2 MiB pool of two 1 MiB extents: 64 pages of SMALL's 32 KiB."""
    return ["--hicache-size", "2MiB", "--extent-size", "1MiB", *more]


def resident(conn, keys: list[bytes]) -> int:
    """How many of ``keys`` are READY in L2, each looked up on its own."""
    return sum(conn.lookup([k]).l2 for k in keys)


def _stats(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()


def written(d) -> int:
    """Pages the L3 writer has written or found already in L3."""
    c = counters(d)
    return c["l3_write_written_pages"] + c["l3_write_skipped_pages"]


@pytest.mark.timeout(120)
def test_lru_victim_is_the_page_the_engines_used_least_recently_not_the_last_written_to_l3(
    daemon_factory, short_tmp
):
    """Under ``eviction_policy = "lru"`` "the victim is the least recently used such page"
    (docs/architecture.md): recency is what the engines do (STOREs and LOADs). The daemon's
    own write-through of a page to L3 is not a use by anyone: a chain A that an engine
    LOADed after storing chain B stays, and B (used less recently) is evicted first, however
    late the L3 writer got to B."""
    d = daemon_factory(
        *slow_flags(short_tmp, 0.0, put_delay_s=3.0, eviction_policy="lru"),
        *small_pool(),
        env={"PYTHONPATH": REPO},
    )
    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        chain = lambda n, salt: conn.page_keys(tokens(n * SMALL.page_size, salt=salt))  # noqa: E731
        a = chain(4, 1)
        assert conn.store(a, [0, 1, 2, 3]).wait()
        wait_for(lambda: written(d) >= 4, what="A in L3")
        # four one-page chains keep the L3 writer's four batches busy for 3 s
        fillers = [chain(1, 10 + i) for i in range(4)]
        for f in fillers:
            assert conn.store(f, [4]).wait()
        b = chain(4, 2)
        assert conn.store(b, [5, 6, 7, 8]).wait()  # B: stored, its L3 write still queued
        h = conn.load(a, [9, 10, 11, 12])  # A used again, after B's store
        assert h.count == 4 and h.wait()
        wait_for(lambda: written(d) >= 12, timeout=30, what="F and B in L3")
        g = chain(52, 3)  # fills the pool: 4 + 4 + 4 + 52 = 64 pages
        assert conn.store(g, list(range(12, 64))).wait()
        wait_for(lambda: written(d) >= 64, timeout=30, what="G in L3")
        assert resident(conn, a) == 4 and resident(conn, b) == 4
        h8 = chain(8, 4)  # 8 victims: the four fillers, then the least recently used chain
        assert conn.store(h8, list(range(8))).wait()
        assert [resident(conn, f) for f in fillers] == [0, 0, 0, 0]
        assert (resident(conn, a), resident(conn, b)) == (4, 0), (
            "A (loaded after B was stored) was evicted before B"
        )
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["lru", "arc", "reuse"])
def test_a_restart_keeps_the_recency_of_the_pages(daemon_factory, short_tmp, policy):
    """Docs: "A restart keeps the pages, their recency" (configuration.md, Eviction), with
    the default L3 (the file store, write-through): of two chains stored once, A first
    and B after it, A is the older; after a stop and a start on the same pool (the new
    daemon checks its adopted pages against L3 on its own), the first victims of a full pool
    are A's pages, as they would have been without the restart, and B stays."""
    flags = [*l3_flags("file", prefetch_threshold="0", eviction_policy=policy), *small_pool()]
    flags += ["--state-dir", str(short_tmp / "state")]
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=64)
    chain = lambda n, salt: conn.page_keys(tokens(n * SMALL.page_size, salt=salt))  # noqa: E731
    a, b = chain(4, 1), chain(4, 2)
    try:
        assert conn.store(a, [0, 1, 2, 3]).wait()
        wait_for(lambda: written(d) >= 4, what="A in L3")
        assert conn.store(b, [4, 5, 6, 7]).wait()
        wait_for(lambda: written(d) >= 8, what="B in L3")
    finally:
        conn.close()
        pool.close()
    d.stop()
    d = daemon_factory(*flags)
    assert _stats(d)["adopt"]["pages_adopted"] == 8
    wait_for(lambda: written(d) >= 8, what="the adopted pages checked against L3")
    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        g = chain(56, 3)  # fills the pool: 4 + 4 + 56 = 64 pages
        assert conn.store(g, list(range(56))).wait()
        wait_for(lambda: written(d) >= 64, timeout=30, what="G in L3")
        assert resident(conn, a) == 4 and resident(conn, b) == 4
        h4 = chain(4, 4)  # 4 victims: the least recently used pages, A's
        assert conn.store(h4, [0, 1, 2, 3]).wait()
        assert (resident(conn, a), resident(conn, b)) == (0, 4), (
            "after the restart B (stored last) was evicted before A"
        )
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------- several engines, full pool


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["lru", "arc", "reuse"])
def test_engines_storing_and_loading_shared_chains_into_a_full_pool_get_their_bytes(
    daemon_factory, policy
):
    """Three engines of one model store and load overlapping chains (shared prefixes) into
    a pool far too small for them, STOREs and LOADs sliced so that they interleave. With
    every policy each LOAD brings back exactly the bytes stored under its keys, nothing
    hangs, and once they are done no page is left pinned or WRITING and the pool's counts
    add up."""
    d = daemon_factory("--eviction-policy", policy, "--slice-pages", "3", *small_pool())
    errors: list[str] = []
    n_pages = 24

    def seed_of(c: int, i: int) -> int:
        return 7919 * c + i + 1

    def worker(w: int) -> None:
        rnd = random.Random(w)
        pool, conn = engine(d.runtime_dir, num_pages=2 * n_pages, load_timeout_s=30.0)
        try:
            for _ in range(40):
                c, n = rnd.randrange(8), rnd.randint(4, n_pages)
                keys = conn.page_keys(tokens(n * SMALL.page_size, salt=c))
                # the chain's tokens are c's, so page i of chain c always holds the same bytes
                for i in range(n):
                    fill_page(pool, i, seed=seed_of(c, i))
                h = conn.store(keys, list(range(n)))
                if not h.wait():
                    errors.append(f"engine {w}: store failed")
                dst = list(range(n_pages, n_pages + n))
                lh = conn.load(keys, dst)
                if lh.count and not lh.wait():  # its pages were pinned: it cannot fail
                    errors.append(f"engine {w}: load of {lh.count} pages failed")
                    continue
                for i in range(lh.count):
                    fill_page(pool, i, seed=seed_of(c, i))
                    if page_bytes(pool, dst[i]) != page_bytes(pool, i):
                        errors.append(f"engine {w}: chain {c} page {i} has other bytes")
        except Exception as err:
            errors.append(f"engine {w}: {err!r}")
        finally:
            conn.close()
            pool.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert not any(t.is_alive() for t in threads), "an engine hung"
    assert errors == []
    s = _stats(d)["pool"]
    assert s["pages_writing"] == 0 and s["pages_pinned"] == 0, s
    assert s["pages_ready"] <= 64
    assert sum(s["evictions_by_reason"].values()) == s["evictions"], s
