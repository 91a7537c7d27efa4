"""The cache manager's HiCache policies (write and prefetch) against real kvtierd processes.

What a user of :mod:`kvtier.client.cache` is promised (README, docs/configuration.md
"Engines", the manager's docstrings, and SGLang's own HiCache semantics, which kvtier
models): a prefetch started at the match is claimed at the load as the prefetch policy says
(``wait_complete``: every page coming; ``timeout``: until the computed deadline;
``best_effort``: no wait), pages reach L2 when the write policy says, and every output is
exact. Each test here names what it expects in its docstring.
"""

from __future__ import annotations

import time

import pytest
from kvtier.client.cache.manager import CacheManager
from kvtier.engine.allocator import PageAllocator

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import REPO, flush, slow_flags, wait_written

P = SMALL.page_size


def put_in_l3_only(d, pool, conn, toks: list[int], n: int, chunk: int = 20) -> list[bytes]:
    """Store the ``n`` full pages of ``toks`` chunk by chunk (each chunk written to L3, then
    L2 flushed, so that a pool smaller than the run can hold it); return their keys. At the
    end L3 holds the whole chain and L2 none of it."""
    keys = conn.page_keys(toks[: n * P])
    for p in range(n):
        fill_page(pool, p, 5000 + p)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        h = conn.store(keys[a:b], list(range(a, b)), parent_key=keys[a - 1] if a else None)
        assert h.count == b - a and h.wait()
        wait_written(d, b)
        flush(d, "l2")
    r = conn.lookup(keys)
    assert (r.l2, r.l3) == (0, n)
    return keys


# ---------------------------------------------------------------------------- prefetch policy


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_claim_waits_for_the_pages_coming_when_l2_cannot_take_the_whole_l3_run(
    daemon_factory, short_tmp, policy
):
    """``CacheManager.match`` starts a prefetch of the L3 run and reports in
    ``match.l3_coming`` the pages on their way to L2; ``load`` then claims the prefetch "as
    the client's hicache_storage_prefetch_policy says". Under ``wait_complete`` (and under
    ``timeout`` with a deadline far beyond the reads) the claim waits for those pages and
    the load takes them all (SGLang: wait_complete never terminates a prefetch early), also
    when L2 can take only part of the L3 run (``l3_coming`` below ``l3_pages``: a long
    context, a small or busy pool)."""
    n = 100
    d = daemon_factory(
        *slow_flags(short_tmp, 0.3),
        "--hicache-size",
        "2MiB",
        "--extent-size",
        "512KiB",
        "--prefetch-timeout-base",
        "60",
        env={"PYTHONPATH": REPO},
    )
    pool, conn = engine(
        d.runtime_dir,
        num_pages=2 * n + 8,
        hicache_storage_prefetch_policy=policy,
        prefetch_threshold=0,
    )
    cm = CacheManager(PageAllocator(2 * n + 8), conn)
    try:
        toks = tokens(n * P + 1).tolist()
        put_in_l3_only(d, pool, conn, toks, n)
        expected = [page_bytes(pool, p) for p in range(n)]
        m = cm.match(toks)
        assert (len(m.l1_pages), m.l2_pages, m.l3_pages) == (0, 0, n)
        coming = m.l3_coming
        assert 0 < coming < n, f"the 64-page L2 must take part of the run, got {coming}"
        new = cm.alloc(n + 1)
        ld = cm.load(m, new[:coming])
        assert ld.finish()
        got = ld.pages
        cm.release(m)
        # what the load took is exact, whatever it was
        assert [page_bytes(pool, p) for p in new[:got]] == expected[:got]
        assert got == coming, (
            f"{policy}: the load took {got} of the {coming} pages the prefetch was bringing"
        )
    finally:
        cm.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- guards (pass)


@pytest.mark.timeout(90)
def test_a_daemon_killed_mid_prefetch_makes_the_load_a_prompt_miss(daemon_factory, short_tmp):
    """A kvtierd that dies between the match (prefetch started, L3 slow) and the load: the
    claim must answer a miss at once (the process is gone), not wait for the policy's
    deadline, and the load takes nothing (the engine recomputes; never a page from a dead
    prefetch)."""
    n = 40
    d = daemon_factory(*slow_flags(short_tmp, 0.5), env={"PYTHONPATH": REPO})
    pool, conn = engine(
        d.runtime_dir,
        num_pages=2 * n + 8,
        hicache_storage_prefetch_policy="wait_complete",
        prefetch_threshold=0,
    )
    cm = CacheManager(PageAllocator(2 * n + 8), conn)
    try:
        toks = tokens(n * P + 1, salt=3).tolist()
        put_in_l3_only(d, pool, conn, toks, n)
        m = cm.match(toks)
        assert m.l3_pages == n and m.l3_coming == n
        d.kill()
        new = cm.alloc(n + 1)
        t0 = time.monotonic()
        ld = cm.load(m, new[: m.l3_coming])
        assert ld.pages == 0 and ld.finish()
        assert time.monotonic() - t0 < 10.0  # far below claim_timeout_s (35 s)
        cm.release(m)
        cm.free(new)
    finally:
        cm.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threshold", [1, 10**9])
def test_write_through_selective_threshold_edges(daemon, threshold):
    """``write_through_threshold`` 1 behaves as write_through (a page is stored by the insert
    that computed it); a huge one never stores, not even at eviction from L1 (SGLang's
    selective write-through drops an evicted node that was never backed up)."""
    pool, conn = engine(
        daemon.runtime_dir,
        num_pages=16,
        hicache_write_policy="write_through_selective",
        write_through_threshold=threshold,
    )
    cm = CacheManager(PageAllocator(16), conn)
    try:
        toks = tokens(5 * P + 3, salt=11).tolist()
        m = cm.match(toks)
        new = cm.alloc(6)
        for i, page in enumerate(new[:5]):
            fill_page(pool, page, 77 + i)
        cm.insert(m, new[:5])
        cm.release(m)
        cm.free(new[5:])
        keys = conn.page_keys(toks[: 5 * P])
        assert conn.lookup(keys).l2 == (5 if threshold == 1 else 0)
        cm.flush_l1()
        assert conn.lookup(keys).l2 == (5 if threshold == 1 else 0)
        assert cm.counters.written_back_pages == 0
    finally:
        cm.close()
        conn.close()
        pool.close()
