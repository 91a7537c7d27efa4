"""kvtierd's KV events publisher and replay socket facing abusive or unlucky
subscribers and replay requesters, and what a cache-aware router sees (docs/events.md).
Real kvtierd processes, real ZeroMQ sockets."""

from __future__ import annotations

import time

import pytest
import zmq
from kvtier.client.connection.events import EventSubscriber
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_kv_events import event_flags, published
from tests.integration.test_l3_tier import counters, wait_for

BIG = P.Geometry(num_layers=1, page_size=256, kv_heads=1, head_dim=8, dtype="float16")
"""8 KiB pages of 256 tokens: a BlockStored with token ids is about 1.3 KB per page."""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def subscriber_of(root) -> EventSubscriber:
    return EventSubscriber(f"ipc://{root}/ev.sock", replay=f"ipc://{root}/evr.sock")


@pytest.mark.timeout(300)
def test_replay_requesters_that_never_read_do_not_multiply_the_daemons_memory(
    daemon_factory, short_tmp
):
    """Queued replay answers share the replay buffer's bytes: 16 requesters that each ask
    once from 0 and never read their answer grow the daemon's memory by less than a few
    times what the replay buffer itself holds (~30 MB of batches here), never by a copy of
    the buffer per requester."""
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "64MiB")
    pool, conn = engine(d.runtime_dir, BIG, num_pages=200, model="big")
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        for c in range(120):  # 120 batches, a STORE of 200 pages with token ids each
            toks = tokens(200 * BIG.page_size, salt=c)
            eng = P.EngineBlocks(
                hashes=[c * 1000 + i for i in range(200)], token_ids=P.pack_tokens(toks.tolist())
            )
            before = published(d)
            assert conn.store(conn.page_keys(toks), list(range(200)), engine=eng).wait()
            wait_for(lambda n=before: published(d) > n, what="a batch")
        with subscriber_of(short_tmp) as sub:
            buffered = sub.replay(0)
        assert len(buffered) == published(d)
        buffer_bytes = sum(len(m.payload) for m in buffered)
        time.sleep(1.0)
        base = rss_bytes(d.pid)
        for _ in range(16):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(f"ipc://{short_tmp}/evr.sock")
            s.send_multipart([b"", E.replay_request(0)])  # and never reads
            socks.append(s)
        wait_for(lambda: counters(d)["kv_events_replays"] >= 17, what="16 more replays")
        time.sleep(2.0)
        grown = rss_bytes(d.pid) - base
        assert grown < 4 * buffer_bytes, (
            f"the daemon grew by {grown >> 20} MiB for 16 requesters that read nothing; its "
            f"replay buffer holds {buffer_bytes >> 20} MiB"
        )
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        conn.close()
        pool.close()


TINY = P.Geometry(num_layers=1, page_size=16, kv_heads=1, head_dim=16, dtype="float16")
"""1 KiB pages: thousands of them in a small engine pool."""


def many_batches(conn, n: int) -> list[bytes]:
    """With ``kv_events_max_batch = 1``: a STORE of every other key of a chain of ``n``
    pages, then one of the whole chain, whose ``n / 2`` new pages are as many one-page
    runs, a BlockStored and a batch each."""
    keys = conn.page_keys(tokens(n * TINY.page_size, salt=5))
    assert conn.store(keys[0::2], list(range(0, n, 2))).wait()
    assert conn.store(keys, list(range(n))).wait()
    return keys


@pytest.mark.timeout(180)
def test_a_requester_reading_its_replay_answer_gets_all_of_it_and_the_end_marker(
    daemon_factory, short_tmp
):
    """docs/events.md: a replay request is answered with each buffered batch from
    ``start_seq`` on, at most ``kv_events_replay_max`` (10,000 by default), then the end
    marker ``[b"", b"", -1, b""]``. A requester that reads its answer as it comes, on an
    idle daemon, gets every buffered batch (here about 6,000, under both the buffer and the
    replay bound) and the end marker, not a part of them and then silence (which a
    requester can only wait out, its replay timeout each time, before asking again)."""
    d = daemon_factory(*event_flags(short_tmp, "--kv-events-max-batch", "1"))
    pool, conn = engine(d.runtime_dir, TINY, num_pages=12000, model="t")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        many_batches(conn, 12000)
        total = wait_for(lambda: published(d) >= 6001 and published(d), what="6,001 batches")
        s.connect(f"ipc://{short_tmp}/evr.sock")
        s.send_multipart([b"", E.replay_request(0)])
        seqs: list[int] = []
        ended = False
        while s.poll(3000):  # reads as fast as it can
            _, _, seq, _ = s.recv_multipart()
            if seq == E.END_SEQ:
                ended = True
                break
            seqs.append(E.seq_of(seq))
        assert (len(seqs), ended) == (total, True), (
            f"{len(seqs)} of {total} batches, then {'the end marker' if ended else 'silence'}"
        )
    finally:
        s.close(linger=0)
        ctx.term()
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_a_chain_continued_without_engine_hashes_names_its_parent_as_announced(
    daemon_factory, short_tmp
):
    """docs/events.md: a block is named by the engine's own hash when its STORE carried
    it, otherwise by its page key, and a BlockStored names its parent. A chain stored in
    two STOREs, the first with the engine's hashes and the second (``parent_key`` = the
    first's last key) without: the second BlockStored's ``parent_block_hash`` must be the
    name the router was given for that parent block (the engine's hash 1003), so that the
    router's chain links up (as the announcement after a restart and L3's events do)."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, num_pages=8, model="c")
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=3))
        eng = P.EngineBlocks(hashes=[1000 + i for i in range(4)])
        assert conn.store(keys[:4], [0, 1, 2, 3], engine=eng).wait()
        assert conn.store(keys[4:], [4, 5, 6, 7], parent_key=keys[3]).wait()
        assert conn.lookup(keys).l2 == 8
        with subscriber_of(short_tmp) as sub:

            def both() -> list[E.BlockStored] | None:
                evs = [e for m in sub.replay(0) for e in m.batch.events]
                got = [e for e in evs if isinstance(e, E.BlockStored)]
                return got if len(got) >= 2 else None

            stored = wait_for(both, what="two BlockStored")
        assert [list(e.block_hashes) for e in stored] == [[1000, 1001, 1002, 1003], keys[4:]]
        assert stored[1].parent_block_hash == 1003, (
            f"parent named {stored[1].parent_block_hash!r}, a name the router was never given"
        )
    finally:
        conn.close()
        pool.close()
