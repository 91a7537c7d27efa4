"""What a client learns of losses it did not see happen, through real kvtierd processes
(and a real redis-server where Redis is the subject).

- a subscriber that read a daemon's stream by replay (``iter(start_seq=0)``, what a router
  that comes late does) must still see a restarted daemon's new stream;
- after a Redis restart the backend's ``watch_drops`` must keep announcing what the new
  server expires;
- under write_back, L1 pages whose L2 copy was lost while they stayed on the device must be
  backed up again when L1 evicts them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from kvtier.client.connection.events import EventMessage, EventSubscriber
from kvtier.engine.engine import ReferenceEngine
from kvtier.engine.model import ModelConfig, TinyLlama
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, tokens
from tests.integration.test_kv_events import drain, event_flags, events, hashes, published
from tests.integration.test_l3_tier import counters, flush, l3_flags, wait_for
from tests.servers import RedisServer, serve_redis

pytestmark = pytest.mark.timeout(120)

PAGE = 16


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


# ---------------------------------------------------------------------------- subscriber
def test_a_subscriber_that_replayed_from_zero_follows_a_restarted_daemons_new_stream(
    daemon_factory, short_tmp
):
    """``EventSubscriber.iter(timeout, start_seq=0)`` (docs: "replay from this sequence
    number first ... then follow the stream") reads a quiet daemon's 8 batches by replay.
    The daemon restarts and starts a new stream at 0: its batches carry sequence numbers the
    old replay brought, but other contents, and the subscriber must read them as the new
    stream they are, not drop them as batches it already had."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    sub: EventSubscriber | None = None
    try:
        for c in range(8):  # eight batches, a STORE each
            before = published(d)
            assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=700 + c)), [0]).wait()
            wait_for(lambda n=before: published(d) > n, what="a batch")
        n_old = published(d)
        conn.close()
        pool.close()
        sub = EventSubscriber(f"ipc://{short_tmp}/ev.sock", replay=f"ipc://{short_tmp}/evr.sock")
        old = list(sub.iter(0.5, start_seq=0))  # the stream so far, by replay
        assert [m.seq for m in old] == list(range(n_old))
        assert d.stop() == 0

        d2 = daemon_factory(*event_flags(short_tmp))
        pool, conn = engine(d2.runtime_dir)
        got: list[EventMessage] = []
        for c in range(3):
            assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=800 + c)), [0]).wait()
            got += list(sub.iter(0.5))
        new = conn.page_keys(tokens(2 * SMALL.page_size, salt=999))
        assert conn.store(new, [0, 1]).wait()
        got += list(sub.iter(1.0))
        assert published(d2) < n_old  # the new stream is still below the old position
        stored = hashes(events(got, E.BlockStored, "CPU"))
        assert set(new) <= set(stored), (
            f"the subscriber read {[m.seq for m in got]} of the new stream "
            f"({published(d2)} batches published), restarts={sub.restarts}"
        )
        assert sub.restarts == 1
    finally:
        if sub is not None:
            sub.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- redis
def test_pages_a_restarted_redis_expires_are_still_announced_with_watch_drops(
    daemon_factory, short_tmp, redis_server
):
    """With ``watch_drops`` the backend turns on the server's keyspace notifications
    (``CONFIG SET notify-keyspace-events``). A restarted Redis starts with its own
    configuration: the backend turns them on again, so every page the new server expires is
    still announced (a router would otherwise keep it for ever)."""
    extra = {"url": redis_server.url, "ttl_s": 1.0, "watch_drops": True}
    d = daemon_factory(*event_flags(short_tmp), *l3_flags("redis", extra, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    sub = EventSubscriber(f"ipc://{short_tmp}/ev.sock", replay=f"ipc://{short_tmp}/evr.sock")
    sub.next_seq = 0
    try:
        redis_server.restart()
        wait_for(
            lambda: counters(d)["kv_events_cleared"] >= 1,
            timeout=30,
            what="the daemon noticing the restarted Redis",
        )
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=31))
        eng = P.EngineBlocks(hashes=[9000 + i for i in range(4)])
        written = counters(d)["l3_write_written_pages"]
        assert conn.store(keys, list(range(4)), engine=eng).wait()
        wait_for(
            lambda: counters(d)["l3_write_written_pages"] >= written + 4,
            what="4 pages written to the new Redis",
        )
        got: list[EventMessage] = []
        try:
            wait_for(
                lambda: (
                    got.extend(drain(sub, 0.3))
                    or set(eng.hashes) <= set(hashes(events(got, E.BlockRemoved, "REDIS")))
                ),
                timeout=12,
                what="the 4 pages the new server expired announced",
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}: BlockRemoved(REDIS) seen: {hashes(events(got, E.BlockRemoved, 'REDIS'))}"
            ) from None
    finally:
        sub.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- write_back
@pytest.fixture
def tiny() -> TinyLlama:
    return TinyLlama(ModelConfig.tiny())


def test_write_back_backs_up_l1_pages_whose_l2_copy_was_lost_while_on_the_device(
    daemon_factory, tiny
):
    """A prefix that stays hot in L1 is never looked up past the L1 hit, and its L2 copy is
    exactly what L2's own recency evicts first (L1 hits never touch it). When L1 finally
    evicts it, write_back must find out that L2 lost it and store it again: the prefix must
    never end up in no tier."""
    d = daemon_factory()
    on = ReferenceEngine(
        mode="on",
        page_size=PAGE,
        num_pages=64,
        client_config=client_config(d.runtime_dir, hicache_write_policy="write_back"),
        model=tiny,
    )
    try:
        assert on.cache is not None
        p = np.random.default_rng(23).integers(0, tiny.cfg.vocab_size, 6 * PAGE + 3).tolist()
        full_pages = 6 * PAGE
        on.generate(p, 2)
        assert on.flush_l1() == 6  # written back
        loaded = on.generate(p, 2)
        assert loaded.cached_l2 == full_pages  # back in L1, recorded as held by L2 too
        assert flush(d, "l2").l2_pages == 6  # L2 loses them (as its eviction would)
        hot = on.generate(p, 2)
        assert hot.cached_l1 == full_pages  # an L1 hit: nothing asked of the daemon
        on.flush_l1()
        assert on.cache.stored_prefix_tokens(p) == full_pages, "the evicted prefix is in no tier"
    finally:
        on.close()
