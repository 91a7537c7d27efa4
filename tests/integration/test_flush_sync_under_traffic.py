"""Operator requests (FLUSH, SYNC) issued while engines store, load and prefetch, against
real kvtierd processes (and a real redis-server): what an operator is told, and what
LOOKUP sees afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_l3_tier import REPO, l3_flags, slow_flags, stats, wait_for
from tests.servers import RedisServer, serve_redis


def slow_daemon(daemon_factory, short_tmp: Path, delay_s=0.0, put_delay_s=0.0, **more: str):
    """A daemon whose L3 reads take ``delay_s`` and writes ``put_delay_s`` seconds each."""
    flags = slow_flags(short_tmp, delay_s, put_delay_s, **more)
    return daemon_factory(*flags, env={"PYTHONPATH": REPO})


def admin_call(d, msg: P.Request, wait_s: float = 30.0) -> P.Reply:
    with AdminClient(d.endpoint, timeout_s=wait_s) as admin:
        return admin.call(msg, wait_s=wait_s)


def store(conn, pool, keys: list[bytes], first_page: int = 0, seed: int = 0, parent=None) -> None:
    n = len(keys)
    for p in range(n):
        fill_page(pool, first_page + p, seed=seed + p)
    kw = {} if parent is None else {"parent_key": parent}
    h = conn.store(keys, list(range(first_page, first_page + n)), **kw)
    assert h.count == n and h.wait(), f"store of {n} pages: count {h.count}"


# ---------------------------------------------------------------------------- FLUSH
@pytest.mark.timeout(90)
def test_flush_all_while_pages_are_written_to_l3_leaves_none_of_them(daemon_factory, short_tmp):
    """A FLUSH of every tier that returns while write-through is still copying freshly
    stored pages to L3 leaves none of them behind: afterwards LOOKUP finds them neither in
    L2 nor (once the writes in flight have ended) in L3, and the FLUSH reply counts every
    L2 page it removed."""
    put_delay = 3.0
    d = slow_daemon(
        daemon_factory, short_tmp, put_delay_s=put_delay, hicache_write_policy="write_through"
    )
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=3))
        store(conn, pool, keys)
        # the writer has taken the pages (queued for L3, being written)
        wait_for(lambda: stats(d)["l3"]["write_queue"] == 8, what="pages queued for L3")
        rep = admin_call(d, P.Flush(req_id=0, tier="all"))
        assert isinstance(rep, P.FlushReply), rep
        after = conn.lookup(keys)
        time.sleep(put_delay + 1.0)  # the writes in flight end
        wait_for(lambda: stats(d)["l3"]["write_queue"] == 0, what="the writes to end")
        later = conn.lookup(keys)
        # what L3 holds, with L2 out of the way (LOOKUP asks L3 only after the L2 run)
        assert isinstance(admin_call(d, P.Flush(req_id=0, tier="l2")), P.FlushReply)
        in_l3 = conn.lookup(keys).l3
        assert (rep.l2_pages, after.l2, later.l2, in_l3) == (8, 0, 0, 0), (
            f"FLUSH tier=all said {rep.l2_pages} L2 pages dropped; right after it LOOKUP "
            f"found {after.l2} in L2; once the L3 writes ended: {later.l2} in L2, "
            f"{in_l3} in L3"
        )
    finally:
        conn.close()
        pool.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


@pytest.mark.timeout(90)
def test_flush_that_cannot_reach_l3_is_not_reported_as_done(daemon_factory, redis_server):
    """A FLUSH of L3 made while the L3 store does not answer (a Redis stalled for a few
    seconds) is never answered as a success while the store keeps the pages: its reply says
    why L3 was not flushed in full (``l3_error``), and LOOKUP finds in L3 what is still
    there once the store answers again."""
    extra = {"url": redis_server.url, "timeout_s": 1.0}
    d = daemon_factory(*l3_flags("redis", extra, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=11))
        store(conn, pool, keys)
        synced = admin_call(d, P.Sync(req_id=0, timeout_s=20.0))
        assert isinstance(synced, P.SyncReply) and synced.left == synced.failed == 0, synced
        redis_server.pause()
        try:
            rep = admin_call(d, P.Flush(req_id=0, tier="all"))
        finally:
            redis_server.resume()
        wait_for(lambda: stats(d)["l3"]["healthy"], what="L3 healthy again")
        left = conn.lookup(keys)
        assert isinstance(rep, P.FlushReply) and rep.l2_pages == 4, rep
        assert rep.l3_error and rep.l3_pages == 0, (
            f"FLUSH tier=all answered {rep} while Redis did not answer; afterwards LOOKUP "
            f"finds {left.l2} pages in L2 and {left.l3} in L3"
        )
        assert (left.l2, left.l3) == (0, 4)
        again = admin_call(d, P.Flush(req_id=0, tier="l3"))
        assert isinstance(again, P.FlushReply) and (again.l3_pages, again.l3_error) == (4, "")
        assert conn.lookup(keys).l3 == 0
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- SYNC
@pytest.mark.timeout(90)
def test_sync_backs_up_a_chain_whose_next_pages_are_being_prefetched(daemon_factory, short_tmp):
    """SYNC writes every L2 page not in L3 to L3, also the pages of a chain that an engine
    is extending at that moment (here: the chain's later pages are being prefetched from
    L3 into L2): its reply counts them, and once it returns with nothing left or failed,
    the whole chain can come back from L3 after L2 is dropped."""
    delay = 4.0
    d = slow_daemon(daemon_factory, short_tmp, delay_s=delay, hicache_write_policy="write_back")
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(12 * SMALL.page_size, salt=21))
        head, tail = keys[:8], keys[8:]
        # the chain's last 4 pages are in L3 only
        store(conn, pool, tail, first_page=8, seed=8, parent=head[-1])
        first = admin_call(d, P.Sync(req_id=0, timeout_s=20.0))
        assert isinstance(first, P.SyncReply) and first.written == 4, first
        assert admin_call(d, P.Flush(req_id=0, tier="l2")).l2_pages == 4
        # its first 8 pages in L2 only (write-back writes nothing before L2 fills)
        store(conn, pool, head)
        assert conn.lookup(keys).l2 == 8
        assert conn.prefetch(keys) == 4  # the last 4 come from L3, slowly
        rep = admin_call(d, P.Sync(req_id=0, timeout_s=20.0))
        assert isinstance(rep, P.SyncReply), rep
        wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, timeout=30, what="the prefetch")
        assert admin_call(d, P.Flush(req_id=0, tier="l2")).l2_pages >= 8
        back = conn.lookup(keys)
        assert (rep.pages, rep.written, rep.left, rep.failed, back.l3) == (8, 8, 0, 0, 12), (
            f"SYNC during the prefetch answered {rep}; after it and a flush of L2, LOOKUP "
            f"finds {back.l3} of the chain's 12 pages in L3"
        )
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_flush_all_during_a_prefetch_leaves_no_prefetched_page(daemon_factory, short_tmp):
    """A FLUSH of every tier while an engine's prefetch is half-way through reading a
    chain from L3 leaves nothing of that chain: right after the FLUSH returns, and once
    the reads in flight have ended, LOOKUP finds none of its pages in L2 or L3."""
    from kvtier.daemon.tier.prefetch import read_batch

    delay, n = 2.0, 128
    d = slow_daemon(
        daemon_factory,
        short_tmp,
        delay_s=delay,
        hicache_write_policy="write_through",
    )
    pool, conn = engine(d.runtime_dir, num_pages=n + 8)
    try:
        keys = conn.page_keys(tokens(n * SMALL.page_size, salt=31))
        store(conn, pool, keys)
        synced = admin_call(d, P.Sync(req_id=0, timeout_s=20.0))
        assert isinstance(synced, P.SyncReply) and synced.left == synced.failed == 0, synced
        assert admin_call(d, P.Flush(req_id=0, tier="l2")).l2_pages == n
        batch = read_batch(n, 1)
        assert batch < n
        assert conn.prefetch(keys) == n
        # the first batch has been read into L2, the next read is in flight
        wait_for(lambda: stats(d)["pool"]["pages_ready"] >= batch, what="the first batch")
        rep = admin_call(d, P.Flush(req_id=0, tier="all"))
        assert isinstance(rep, P.FlushReply), rep
        right_after = conn.lookup(keys)
        wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, timeout=30, what="reads to end")
        later = conn.lookup(keys)
        assert (right_after.l2, right_after.l3, later.l2, later.l3) == (0, 0, 0, 0), (
            f"FLUSH tier=all during a prefetch answered {rep}; right after it LOOKUP found "
            f"{right_after.l2} pages in L2 and {right_after.l3} in L3, once the reads ended "
            f"{later.l2} in L2 and {later.l3} in L3"
        )
    finally:
        conn.close()
        pool.close()
