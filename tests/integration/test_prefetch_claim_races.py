"""PREFETCH and CLAIM (L3 -> L2 fills an engine starts at LOOKUP time and claims
before it loads), through real kvtierd processes whose L3 is the file store, slowed on
purpose (``slow_flags``: every L3 read takes ``delay_s``, one read at a time)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines import engine
from tests.integration.test_l3_tier import (
    counters,
    load_and_compare,
    read_batch,
    slow_daemon,  # noqa: F401  (fixture)
    stats,
    store_pages,
    stored_then_evicted,
    wait_for,
)


def settled(d) -> dict[str, Any]:
    """The daemon's counters once no fill runs any more."""
    wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, what="fills to end")
    return counters(d)


def balanced(c: dict[str, Any]) -> bool:
    return c["l3_prefetch_started_pages"] == (
        c["l3_prefetch_completed_pages"]
        + c["l3_prefetch_cancelled_pages"]
        + c["l3_prefetch_failed_pages"]
    )


@pytest.mark.timeout(90)
def test_prefetch_again_after_a_best_effort_claim_brings_every_page(slow_daemon):  # noqa: F811
    """A ``best_effort`` CLAIM ends a prefetch while its first read (32 pages) is still in
    flight: those pages are given up once the read returns. The same chain prefetched again
    meanwhile (the request was rescheduled) promises no page it will not hand over: its
    ``wait_complete`` CLAIM gets every page its PREFETCH said was coming, and nothing is left
    WRITING. Once the given-up read has returned, a prefetch of the chain brings all 64 pages,
    byte-exact."""
    d = slow_daemon(0.5)
    pool, conn, keys, expected = stored_then_evicted(d, 64)
    try:
        assert read_batch(64, 1) == 32
        assert conn.prefetch(keys) == 64
        assert conn.claim(keys, policy="best_effort") == 0  # the first read is in flight
        coming = conn.prefetch_coming(keys)
        got = conn.claim(keys, policy="wait_complete")
        assert got == coming, f"wait_complete claimed {got} of the {coming} pages coming"
        wait_for(lambda: stats(d)["pool"]["pages_writing"] == 0, what="the given-up read")
        assert conn.prefetch_coming(keys) == 64
        assert conn.claim(keys, policy="wait_complete") == 64
        c = settled(d)
        assert c["l3_prefetch_failed_pages"] == 0 and balanced(c), c  # no read failed
        assert stats(d)["pool"]["pages_writing"] == 0
        load_and_compare(pool, conn, keys, expected, first_page=0)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_wait_complete_claim_of_a_short_prefix_waits_only_for_its_own_pages(
    slow_daemon,  # noqa: F811
):
    """Engine A prefetches a 256-page chain (four reads of 64 pages, one at a time). Engine
    B prefetches the first 16 pages of it: they are all in A's first read, so B's prefetch
    starts nothing and waits for A's reads. B's ``wait_complete`` CLAIM must end once its
    16 pages are READY (its prefetch is complete then: "wait_complete waits for the whole
    prefetch"; the ``timeout`` deadline is also documented as "for the tokens it fetches"),
    not when A's 240 other pages are read."""
    d = slow_daemon(0.6)
    pool, conn, keys, expected = stored_then_evicted(d, 256)
    pool_b, conn_b = engine(d.runtime_dir)
    try:
        assert read_batch(256, 1) == 64
        assert conn.prefetch(keys) == 256
        assert conn_b.prefetch(keys[:16], request_id="b") == 0  # A's first read brings them
        got = conn_b.claim(keys[:16], policy="wait_complete", request_id="b")
        done_when_b_returned = counters(d)["l3_prefetch_completed_pages"]
        assert got == 16
        load_and_compare(pool_b, conn_b, keys[:16], expected[:16], first_page=0)
        assert done_when_b_returned < 256, (
            "B's claim of 16 pages waited until all 256 pages of A's prefetch were read"
        )
    finally:
        for c in (conn, conn_b):
            c.close()
        for p in (pool, pool_b):
            p.close()


@pytest.mark.timeout(90)
def test_closing_the_starters_session_leaves_another_engines_claim_whole(
    slow_daemon,  # noqa: F811
):
    """Engine A's prefetch is being read when A's session closes; engine B,
    whose prefetch waits for A's reads under its own request id, still claims every page it
    was promised, byte-exact; afterwards no slot stays WRITING and every started page ended
    exactly once (started = completed + cancelled + failed)."""
    d = slow_daemon(0.5)
    pool, conn, keys, expected = stored_then_evicted(d, 64)
    pool_b, conn_b = engine(d.runtime_dir)
    try:
        assert conn.prefetch(keys) == 64
        assert conn_b.prefetch_coming(keys[:40], request_id="b") == 40
        conn.close()  # A's session ends: its prefetch is given up, B's still waits for it
        assert conn_b.claim(keys[:40], policy="wait_complete", request_id="b") == 40
        load_and_compare(pool_b, conn_b, keys[:40], expected[:40], first_page=0)
        c = settled(d)
        assert balanced(c) and c["l3_prefetch_failed_pages"] == 0, c
        assert stats(d)["pool"]["pages_writing"] == 0
    finally:
        conn_b.close()
        pool.close()
        pool_b.close()


@pytest.mark.timeout(60)
def test_prefetch_without_l3_tells_what_l2_holds(daemon_factory):
    """With no L3 a PREFETCH starts no read, and its reply still says what is coming: the
    leading run L2 holds, as it says with an L3."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 8)
        assert conn.prefetch(keys) == 0
        assert conn.prefetch_coming(keys) == 8
        assert conn.prefetch_coming(keys, skip=3) == 5
        assert conn.claim(keys) == 8
    finally:
        conn.close()
        pool.close()
