"""KV events from a real kvtierd: what a STORE, an eviction, a FLUSH and an L3 write publish,
the engine's hashes in them, replay, and subscribers that misbehave (slow, vanished,
garbage on the replay socket). vLLM's own decoder reads the same stream in
tests/adapters/vllm/test_vllm_kv_events.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.events import EventMessage, EventSubscriber
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import SMALL, engine, tokens
from tests.integration.test_admin_cli import kvtier
from tests.integration.test_l3_tier import counters, flush, l3_flags, stats, wait_for
from tests.servers import RedisServer, serve_redis

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def event_flags(root: Path, *extra: str) -> list[str]:
    """kvtierd flags publishing on ipc:// sockets under ``root``."""
    return [
        "--kv-events-endpoint",
        f"ipc://{root}/ev.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{root}/evr.sock",
        *extra,
    ]


def subscriber(root: Path, **kw: object) -> EventSubscriber:
    """A subscriber that reads the stream from its start (sequence 0) and does not wait for
    its subscription to reach the daemon: what is sent before it gets there comes by replay
    (a first live batch past 0 is a gap; :func:`drain` asks for the rest)."""
    sub = EventSubscriber(f"ipc://{root}/ev.sock", replay=f"ipc://{root}/evr.sock", **kw)
    sub.next_seq = 0
    return sub


def events(msgs: list[EventMessage], kind: type, medium: str | None = None) -> list:
    return [
        e
        for m in msgs
        for e in m.batch.events
        if isinstance(e, kind) and (medium is None or getattr(e, "medium", None) == medium)
    ]


def hashes(evs: list) -> list:
    return [h for e in evs for h in e.block_hashes]


def drain(sub: EventSubscriber, timeout_s: float = 2.0) -> list[EventMessage]:
    """The batches from ``sub``'s next sequence number on, until none came for
    ``timeout_s``: as received, gaps filled by replay, then by replay those sent before its
    subscription reached the daemon that no batch received came after."""
    got = list(sub.iter(timeout_s))
    assert sub.next_seq is not None
    missed = sub.replay(sub.next_seq)
    if missed:
        sub.next_seq = missed[-1].seq + 1
    return got + missed


def published(d: DaemonProcess) -> int:
    """The batches ``d`` has published."""
    return counters(d)["kv_events_batches"]


def until_live(
    d: DaemonProcess, sub: EventSubscriber, publish: Callable[[], object], timeout_s: float = 30
) -> list[EventMessage]:
    """Call ``publish`` (it makes ``d`` publish a batch on ``sub``'s topic) until a batch
    reaches ``sub`` as sent, not by replay: its subscription is in place at the daemon then,
    however long it took to get there. After each call, once ``d`` has published, what is
    new is read (:func:`drain`). Returns the batches read; fails after ``timeout_s``."""
    got: list[EventMessage] = []
    deadline = time.monotonic() + timeout_s
    while all(m.replayed for m in got):
        assert time.monotonic() < deadline, "no batch reached the subscriber as sent"
        before = published(d)
        publish()
        wait_for(lambda n=before: published(d) > n, what="a batch published")
        got += drain(sub, 0.5)
    return got


def engine_blocks(n: int, base: int, page_size: int = SMALL.page_size) -> P.EngineBlocks:
    return P.EngineBlocks(
        hashes=[base + i for i in range(n)],
        parent=None,
        token_ids=P.pack_tokens(tokens(n * page_size).tolist()),
        lora_name="ad",
    )


def test_store_publishes_engine_hashes_and_keys_otherwise(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, model="m/x")
    sub = subscriber(short_tmp, topic=E.model_topic("m/x"))
    exact = subscriber(short_tmp, topic=E.namespace_topic("m/x", conn.ns_fingerprint))
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size))
        assert conn.store(keys[:4], list(range(4)), engine=engine_blocks(4, 1000)).wait()
        eng = P.EngineBlocks(hashes=[b"h%d" % i for i in range(4, 8)], parent=1003)
        assert conn.store(keys[4:], list(range(4, 8)), parent_key=keys[3], engine=eng).wait()
        other = conn.page_keys(tokens(2 * SMALL.page_size, salt=5))
        assert conn.store(other, [8, 9]).wait()  # no engine hashes: kvtier's keys
        msgs = drain(sub)
        stored = events(msgs, E.BlockStored, "CPU")
        assert [e.block_hashes for e in stored] == [
            [1000, 1001, 1002, 1003],
            [b"h4", b"h5", b"h6", b"h7"],
            other,
        ]
        first, second, third = stored
        assert first.parent_block_hash is None and first.lora_name == "ad"
        assert first.token_ids == [int(t) for t in tokens(4 * SMALL.page_size)]
        assert first.block_size == SMALL.page_size
        assert second.parent_block_hash == 1003 and second.token_ids == []
        assert third.parent_block_hash is None
        topic = E.namespace_topic("m/x", conn.ns_fingerprint)
        assert {m.topic for m in msgs} == {topic}
        assert [m.seq for m in drain(exact)] == [m.seq for m in msgs]
        assert counters(d)["kv_events_stored_blocks"] == 10
        # a page stored again is not announced again (it was skipped)
        assert conn.store(keys[:4], list(range(4)), engine=engine_blocks(4, 1000)).wait()
        assert events(drain(sub, 0.5), E.BlockStored) == []
        # the daemon took the 90-byte subscription: a STORE's batch reaches it as sent
        salts = itertools.count(100)

        def store_a_page() -> None:
            page = conn.page_keys(tokens(SMALL.page_size, salt=next(salts)))
            assert conn.store(page, [0]).wait()

        assert {m.topic for m in until_live(d, exact, store_a_page)} == {topic}
    finally:
        exact.close()
        sub.close()
        conn.close()
        pool.close()


def test_bad_engine_fields_are_refused_naming_field_and_value(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        bad = [
            (P.EngineBlocks(hashes=[1, 2]), "engine.hashes has 2 hashes for 4 keys"),
            (
                P.EngineBlocks(hashes=[1, 2, 3, 4], token_ids=b"\0" * 12),
                "engine.token_ids has 12 bytes",
            ),
            (P.EngineBlocks(hashes=[1, 2, 3, b"x" * 65]), "$.engine.hashes[3]"),
            (P.EngineBlocks(hashes=[1, 2, 3, b""]), "$.engine.hashes[3]"),
            (P.EngineBlocks(hashes=[1, 2, 3, 4], block_size=0), "$.engine.block_size"),
            (P.EngineBlocks(hashes=[1, 2, 3, 4], lora_name="a\0b"), "$.engine.lora_name"),
        ]
        for eng, what in bad:
            req = P.Store(
                req_id=7,
                session_id=conn.session_id,
                keys=keys,
                pages=[0, 1, 2, 3],
                slot=0,
                seq=1,
                engine=eng,
            )
            rep = conn._call(req)  # the session's own socket: the daemon checks the fields
            assert isinstance(rep, P.ErrorReply) and what in rep.message, (eng, rep)
            assert rep.code == P.ErrorCode.BAD_MESSAGE
        assert conn.lookup(keys).l2 == 0  # nothing was taken
        assert conn.store(keys, [0, 1, 2, 3], engine=P.EngineBlocks(hashes=[1, 2, 3, 4])).wait()
        assert conn.lookup(keys).l2 == 4  # and the daemon serves on
    finally:
        conn.close()
        pool.close()


def test_evictions_and_flush_are_removed_events_one_per_page(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool, conn = engine(d.runtime_dir, num_pages=200)
    sub = subscriber(short_tmp)
    try:
        engine_hash: dict[bytes, int] = {}
        for c in range(4):  # 800 pages through a pool of 512: an eviction storm
            keys = conn.page_keys(tokens(200 * SMALL.page_size, salt=c))
            eng = P.EngineBlocks(hashes=[c * 1000 + i for i in range(200)])
            engine_hash.update(zip(keys, eng.hashes))
            assert conn.store(keys, list(range(200)), engine=eng).wait()
        msgs = drain(sub)
        removed = hashes(events(msgs, E.BlockRemoved, "CPU"))
        evictions = stats(d)["pool"]["evictions"]
        assert evictions > 0 and len(removed) == evictions
        assert len(set(removed)) == len(removed)
        assert set(removed) <= set(engine_hash.values())  # named by the engine's hashes
        assert len(hashes(events(msgs, E.BlockStored))) == 800
        # FLUSH: every page still resident is removed, by its engine hash
        resident = set(engine_hash.values()) - set(removed)
        flush(d, "l2")
        gone = hashes(events(drain(sub), E.BlockRemoved, "CPU"))
        assert sorted(gone) == sorted(resident)
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_l3_writes_and_l3_flush(daemon_factory, short_tmp):
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir)
    sub = subscriber(short_tmp)
    try:
        keys = conn.page_keys(tokens(6 * SMALL.page_size))
        assert conn.store(keys, list(range(6)), engine=P.EngineBlocks(hashes=list(range(6)))).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 6, what="6 pages in L3")
        msgs = drain(sub)
        assert sorted(hashes(events(msgs, E.BlockStored, "FILE"))) == list(range(6))
        flush(d, "l2")
        assert sorted(hashes(events(drain(sub), E.BlockRemoved, "CPU"))) == list(range(6))
        # the counters agree with the stream: 6 stored in CPU and 6 in FILE, 6 removed
        c = counters(d)
        assert (c["kv_events_stored_blocks"], c["kv_events_removed_blocks"]) == (12, 6)
        conn.prefetch(keys)  # back from L3 into L2: stored in CPU again, same hashes
        assert conn.claim(keys, policy="wait_complete") == 6
        assert sorted(hashes(events(drain(sub), E.BlockStored, "CPU"))) == list(range(6))
        flush(d, "l3")
        after = drain(sub)
        assert isinstance(after[0].batch.events[0], E.AllBlocksCleared)
        assert sorted(hashes(events(after, E.BlockStored, "CPU"))) == list(range(6))
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_pages_the_l3_backend_evicts_are_removed_from_its_medium(daemon_factory, short_tmp):
    """A file store too small for what is written evicts for room: each page it drops is
    a BlockRemoved of medium FILE, by the engine's hash, and exactly the pages announced
    stored in FILE and not removed are still in L3."""
    extra = {"capacity": "1MiB", "segment_bytes": "512KiB"}
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", extra, prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir, num_pages=50)
    sub = subscriber(short_tmp)
    try:
        key_of: dict[int, bytes] = {}
        for c in range(4):  # 200 pages of 16 KiB into a 1 MiB store
            keys = conn.page_keys(tokens(50 * SMALL.page_size, salt=c))
            eng = P.EngineBlocks(hashes=[c * 1000 + i for i in range(50)])
            key_of.update(zip(eng.hashes, keys))
            assert conn.store(keys, list(range(50)), engine=eng).wait()
        settled = ("l3_write_written_pages", "l3_write_failed_pages", "l3_write_skipped_pages")
        wait_for(lambda: sum(counters(d)[k] for k in settled) >= 200, what="every L3 write settled")
        msgs = drain(sub)
        stored = hashes(events(msgs, E.BlockStored, "FILE"))
        removed = hashes(events(msgs, E.BlockRemoved, "FILE"))
        assert removed, "a 1 MiB store took 200 pages of 16 KiB without evicting"
        assert len(set(removed)) == len(removed)
        assert set(removed) <= set(stored)  # named by the engine's hashes, as stored
        flush(d, "l2")  # from here a page's lookup can only find it in L3
        in_l3 = {h for h in stored if conn.lookup([key_of[h]]).l3 == 1}
        assert in_l3 == set(stored) - set(removed)
    finally:
        sub.close()
        conn.close()
        pool.close()


@pytest.mark.parametrize("watch", [True, False], ids=["watch_drops", "not_watched"])
def test_pages_redis_expires_are_removed_from_its_medium(
    daemon_factory, short_tmp, redis_server, watch
):
    """With ``watch_drops``, pages the Redis server expires by itself (``ttl_s``) are
    BlockRemoved of medium REDIS, by the engine's hash; without it, nothing is said."""
    extra = {"url": redis_server.url, "ttl_s": 0.5, "watch_drops": watch}
    d = daemon_factory(*event_flags(short_tmp), *l3_flags("redis", extra, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    sub = subscriber(short_tmp)
    try:
        keys = conn.page_keys(tokens(6 * SMALL.page_size))
        eng = P.EngineBlocks(hashes=list(range(6)))
        assert conn.store(keys, list(range(6)), engine=eng).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 6, what="6 pages in L3")
        got: list[EventMessage] = []
        if watch:
            wait_for(
                lambda: (
                    got.extend(drain(sub, 0.5))
                    or len(hashes(events(got, E.BlockRemoved, "REDIS"))) >= 6
                ),
                what="6 pages expired and announced",
            )
            assert sorted(hashes(events(got, E.BlockRemoved, "REDIS"))) == eng.hashes
        else:
            flush(d, "l2")
            wait_for(lambda: conn.lookup(keys).l3 == 0, what="the pages expired")
            got = drain(sub, 1.0)
            assert hashes(events(got, E.BlockRemoved, "REDIS")) == []
        assert sorted(hashes(events(got, E.BlockStored, "REDIS"))) == eng.hashes
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_a_restarted_daemon_announces_what_it_adopted_by_engine_hashes(daemon_factory, short_tmp):
    """SIGTERM, restart on the same pool: the new stream starts with a BlockStored (CPU) of
    every page adopted, one per chain, named by the engines' hashes saved at the stop (a
    page stored without them, by its key); a SIGKILL'd daemon's successor uses what the last
    clean stop saved."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, num_pages=16)
    try:
        a = conn.page_keys(tokens(12 * SMALL.page_size, salt=1))
        b = conn.page_keys(tokens(4 * SMALL.page_size, salt=2))
        eng = P.EngineBlocks(hashes=[1000 + i for i in range(8)])
        assert conn.store(a[:8], list(range(8)), engine=eng).wait()
        # the chain goes on, by a STORE without hashes; and an unrelated chain
        assert conn.store(a[8:], list(range(4)), parent_key=a[7]).wait()
        assert conn.store(b, list(range(4))).wait()
        assert d.stop() == 0
        assert (short_tmp / "d0" / "state" / "kv-event-hashes.msgpack").exists()
        for restart in ("sigterm", "sigkill"):
            d = daemon_factory(*event_flags(short_tmp))
            with subscriber(short_tmp) as sub:
                got = wait_for(
                    lambda s=sub: events(s.replay(0), E.BlockStored, "CPU"), what="announce"
                )
            chains = sorted(((list(e.block_hashes), e.parent_block_hash) for e in got), key=repr)
            want = [([*eng.hashes, *a[8:]], None), (list(b), None)]
            assert chains == sorted(want, key=repr), restart
            d.kill()
    finally:
        conn.close()
        pool.close()


def test_a_restart_that_lost_l2_announces_the_pages_gone_once(daemon_factory, short_tmp):
    """SIGTERM, then a restart without the pool (``--cold-start``): the new stream names,
    by the engines' hashes and on the namespace's topic, a BlockRemoved (CPU) of every page
    the last daemon held in L2, so that a router replaying the new stream forgets them. The
    restart after it, which adopts the new (empty) pool, does not name them again."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, num_pages=16, model="m/lost")
    try:
        a = conn.page_keys(tokens(4 * SMALL.page_size, salt=31))
        b = conn.page_keys(tokens(3 * SMALL.page_size, salt=32))
        assert conn.store(
            a, list(range(4)), engine=P.EngineBlocks(hashes=[2000, 2001, 2002, 2003])
        ).wait()
        assert conn.store(
            b, list(range(3)), engine=P.EngineBlocks(hashes=[3000, 3001, 3002])
        ).wait()
        topic = E.namespace_topic("m/lost", conn.ns_fingerprint)
        assert d.stop() == 0

        d = daemon_factory(*event_flags(short_tmp), "--cold-start")
        with subscriber(short_tmp) as sub:
            got = wait_for(lambda s=sub: s.replay(0), what="the new stream")
        removed = events(got, E.BlockRemoved, "CPU")
        assert sorted(hashes(removed)) == [2000, 2001, 2002, 2003, 3000, 3001, 3002]
        assert {m.topic for m in got if events([m], E.BlockRemoved)} == {topic}
        assert events(got, E.BlockStored) == []  # the pool is new: nothing held
        assert d.stop() == 0

        d = daemon_factory(*event_flags(short_tmp))
        with subscriber(short_tmp) as sub:
            seen = drain(sub, 1.0)
        assert events(seen, E.BlockRemoved) == [], "the removal was announced again"
    finally:
        conn.close()
        pool.close()


def test_a_restart_that_lost_l2_does_not_name_again_what_had_left_it(daemon_factory, short_tmp):
    """Pages in L3 that had left L2 (dropped by ``kvtier flush --tier l2``: their removal from
    CPU was announced then) are not named as removed again by a restart without the pool;
    the pages L2 held are. Pages brought back into L2 from L3 count as held again."""
    flags = (
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=16)
    try:
        keys = conn.page_keys(tokens(6 * SMALL.page_size, salt=33))
        more = conn.page_keys(tokens(2 * SMALL.page_size, salt=34))
        assert conn.store(keys, list(range(6)), engine=P.EngineBlocks(hashes=list(range(6)))).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 6, what="6 pages in L3")
        flush(d, "l2")
        assert conn.store(more, [0, 1], engine=P.EngineBlocks(hashes=[100, 101])).wait()
        assert d.stop() == 0

        def restarted_removes() -> list:
            d = daemon_factory(*flags, "--cold-start")
            with subscriber(short_tmp) as sub:
                got = drain(sub, 1.0)
            return d, sorted(hashes(events(got, E.BlockRemoved, "CPU")))

        d, removed = restarted_removes()
        assert removed == [100, 101]
        conn.prefetch(keys)  # back from L3 into L2
        assert conn.claim(keys, policy="wait_complete") == 6
        assert d.stop() == 0
        d, removed = restarted_removes()
        assert removed == list(range(6))
    finally:
        conn.close()
        pool.close()


def test_a_damaged_hashes_file_is_ignored_and_named(daemon_factory, short_tmp):
    state = short_tmp / "d0" / "state"
    state.mkdir(parents=True)
    (state / "kv-event-hashes.msgpack").write_bytes(b"\x94\x01\x91\xc4\x01x\x90\x80")
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1]).wait()  # serving as usual
        assert "kv-event-hashes.msgpack" in d.log_tail()
        assert "1 keys but 0 hashes" in d.log_tail()
    finally:
        conn.close()
        pool.close()


def test_replay_recovers_what_a_late_subscriber_missed(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    salts = itertools.count(9)

    def store_a_chain() -> None:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=next(salts)))
        assert conn.store(keys, list(range(4))).wait()

    try:
        for c in range(3):
            keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=c))
            assert conn.store(keys, list(range(4))).wait()
        with subscriber(short_tmp) as late:
            msgs = list(late.iter(1.0, start_seq=0))
            n = len(msgs)  # stores that ended in one turn of the daemon's loop share a batch
            assert [m.seq for m in msgs] == list(range(n)) and all(m.replayed for m in msgs)
            assert len(events(msgs, E.BlockStored)) == 3
            assert len(hashes(events(msgs, E.BlockStored))) == 12
            # then it follows the stream as sent, from where the replay ended: STOREs until
            # one's batch reaches it so (one sent before its subscription reached the
            # daemon comes by replay), a batch each, no gap
            live = until_live(d, late, store_a_chain)
            assert [m.seq for m in live] == list(range(n, n + len(live)))
            assert len(hashes(events(live, E.BlockStored))) == 4 * len(live)
            assert not live[-1].replayed and late.gaps == 0
    finally:
        conn.close()
        pool.close()


def test_garbage_on_the_replay_socket_gets_nothing(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    ctx = zmq.Context()
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        assert conn.store(keys, list(range(4))).wait()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{short_tmp}/evr.sock")
        for frames in (
            [b"", b"abc"],
            [b"x", b"\0" * 8],
            [b""],
            [b"", b"\0" * 8, b"more"],
            [b"", b"\0" * 7],
            [b""] * 5000,
        ):
            s.send_multipart(frames)
        s.send_multipart([b"", b"\xff" * 1000])  # over the frame limit: dropped, disconnected
        assert not s.poll(500)  # not one answer
        c = counters(d)
        assert c["kv_events_replays_refused"] == 6 and c["kv_events_replays"] == 0
        with subscriber(short_tmp) as sub:  # a good request is still answered
            assert [m.seq for m in sub.replay(0)] == [0]
        assert conn.lookup(keys).l2 == 4
    finally:
        ctx.destroy(linger=0)
        conn.close()
        pool.close()


def test_replay_answers_at_most_replay_max(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp, "--kv-events-replay-max", "2"))
    pool, conn = engine(d.runtime_dir)
    try:
        for c in range(5):
            assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=c)), [c]).wait()
            time.sleep(0.1)  # a batch each (stores ending in one loop turn share one)
        total = counters(d)["kv_events_batches"]
        assert total >= 3
        ctx = zmq.Context()
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"ipc://{short_tmp}/evr.sock")

        def answer(start: int) -> list[int]:
            req.send_multipart((b"", E.replay_request(start)))
            got = []
            while req.poll(5000):
                _, _, seq, _ = req.recv_multipart()
                if seq == E.END_SEQ:
                    return got
                got.append(E.seq_of(seq))
            raise AssertionError("no end marker")

        try:
            assert answer(0) == [0, 1]
            assert answer(total - 2) == [total - 2, total - 1]
            assert answer(total) == []  # nothing past the end, but an answer
        finally:
            req.close(linger=0)
            ctx.term()
        with subscriber(short_tmp) as sub:  # the subscriber asks until it has them all
            assert [m.seq for m in sub.replay(0)] == list(range(total))
    finally:
        conn.close()
        pool.close()


_STALLED_SUBSCRIBER = """
import sys, time, zmq
s = zmq.Context().socket(zmq.SUB)
s.setsockopt(zmq.RCVHWM, 1)
s.setsockopt(zmq.RCVBUF, 4096)
s.setsockopt(zmq.SUBSCRIBE, b"")
s.connect(sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def test_slow_and_vanished_subscribers_cost_batches_not_service(daemon_factory, short_tmp):
    d = daemon_factory(
        *event_flags(short_tmp, "--kv-events-hwm", "2", "--kv-events-max-batch", "1")
    )
    pool, conn = engine(d.runtime_dir, num_pages=64, request_timeout_s=10.0)
    stalled = subprocess.Popen(
        [sys.executable, "-c", _STALLED_SUBSCRIBER, f"ipc://{short_tmp}/ev.sock"],
        stdout=subprocess.PIPE,
    )
    try:
        assert stalled.stdout is not None and stalled.stdout.readline() == b"ready\n"
        time.sleep(0.3)
        os.kill(stalled.pid, signal.SIGSTOP)  # connected, reading nothing: its buffers fill
        stored = 0
        for c in range(40):  # far more than its queue and socket buffers hold
            keys = conn.page_keys(tokens(64 * SMALL.page_size, salt=c))
            eng = P.EngineBlocks(
                hashes=[c * 100 + i for i in range(64)],
                token_ids=P.pack_tokens(tokens(64 * SMALL.page_size, c).tolist()),
            )
            assert conn.store(keys, list(range(64)), engine=eng).wait()
            stored += 64
        os.kill(stalled.pid, signal.SIGKILL)  # vanished mid-stream
        stalled.wait()
        time.sleep(0.3)
        with subscriber(short_tmp) as sub:  # replay recovers every batch
            got = sub.replay(0)
            assert [m.seq for m in got] == list(range(len(got)))
            assert len(hashes(events(got, E.BlockStored, "CPU"))) == stored
            keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=999))
            assert conn.store(keys, list(range(8))).wait()  # after the vanished one: served
            assert conn.lookup(keys).l2 == 8
            # its batch is in the buffer (published within kv_events_interval_s of the
            # STORE's end)
            later = wait_for(
                lambda: events(sub.replay(len(got)), E.BlockStored), what="the last batch"
            )
            assert [len(e.block_hashes) for e in later] == [8]
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.wait()
        assert stalled.stdout is not None
        stalled.stdout.close()
        conn.close()
        pool.close()


def test_events_are_off_by_default(daemon_factory, short_tmp):
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        assert not (short_tmp / "ev.sock").exists()
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1], engine=P.EngineBlocks(hashes=[1, 2])).wait()
        assert counters(d)["kv_events_stored_blocks"] == 0
    finally:
        conn.close()
        pool.close()


def test_kvtier_events_tails_the_stream_decoded(daemon_factory, short_tmp):
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, model="tail")
    try:
        keys = conn.page_keys(tokens(3 * SMALL.page_size))
        assert conn.store(keys, [0, 1, 2], engine=P.EngineBlocks(hashes=[5, 6, b"\x07"])).wait()
        flush(d, "l2")
        ep = ["--endpoint", f"ipc://{short_tmp}/ev.sock", "--replay", f"ipc://{short_tmp}/evr.sock"]
        out = kvtier("events", *ep, "--from", "0", "--json", "--timeout", "1")
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert [(r["type"], r["medium"]) for r in rows] == [
            ("BlockStored", "CPU"),
            ("BlockRemoved", "CPU"),
        ]
        assert rows[0]["block_hashes"] == [5, 6, "07"]
        assert sorted(map(str, rows[1]["block_hashes"])) == ["07", "5", "6"]
        assert rows[0]["topic"] == E.namespace_topic("tail", conn.ns_fingerprint)
        assert rows[0]["seq"] == 0 and rows[0]["replayed"] and rows[0]["block_size"] == 16
        text = kvtier("events", *ep, "--from", "0", "--count", "1", "--timeout", "1")
        assert text.returncode == 0 and "BlockStored" in text.stdout and "CPU" in text.stdout
        env = {
            "KVTIER_KV_EVENTS_ENDPOINT": f"ipc://{short_tmp}/ev.sock",
            "KVTIER_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{short_tmp}/evr.sock",
        }
        from_config = kvtier("events", "--from", "0", "--json", "--timeout", "1", env=env)
        assert len(from_config.stdout.splitlines()) == 2
        none = kvtier("events", "--timeout", "1")
        assert none.returncode == 2 and "no endpoint" in none.stderr
    finally:
        conn.close()
        pool.close()
