"""A cache-aware router's view of kvtierd's KV event stream (docs/events.md), read with real
ZeroMQ SUB / DEALER sockets: after reading the events up to sequence N, the router's picture
of which blocks the node holds (per topic and medium) must be the daemon's real contents, and
no subscriber (slow, hostile) may take that away from the others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_kv_events import (
    _STALLED_SUBSCRIBER,
    event_flags,
    events,
    hashes,
    published,
    subscriber,
    until_live,
)
from tests.integration.test_l3_tier import counters, l3_flags, wait_for


def _replay_answer(root, start_frame: bytes, timeout_s: float = 3.0) -> list[int] | None:
    """One raw replay request ``[b"", start_frame]`` on a fresh DEALER: the sequence numbers
    answered, or None when no end marker came within ``timeout_s``."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{root}/evr.sock")
        s.send_multipart([b"", start_frame])
        got: list[int] = []
        while s.poll(int(timeout_s * 1000)):
            _, _, seq, _ = s.recv_multipart()
            if seq == E.END_SEQ:
                return got
            got.append(E.seq_of(seq))
        return None
    finally:
        s.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------- slow subscribers


@pytest.mark.timeout(120)
def test_one_stalled_subscriber_does_not_starve_a_healthy_router(daemon_factory, short_tmp):
    """docs/events.md, "Subscribers cannot hurt the daemon": a subscriber whose queue is full
    misses batches for itself alone. A healthy router that reads everything at once keeps
    receiving live batches while another subscriber is stalled (connected, reading nothing,
    its queue and socket buffers long full)."""
    d = daemon_factory(
        *event_flags(short_tmp, "--kv-events-hwm", "2", "--kv-events-max-batch", "1")
    )
    pool, conn = engine(d.runtime_dir, num_pages=64, request_timeout_s=10.0)
    healthy = subscriber(short_tmp)
    stalled = subprocess.Popen(
        [sys.executable, "-c", _STALLED_SUBSCRIBER, f"ipc://{short_tmp}/ev.sock"],
        stdout=subprocess.PIPE,
    )
    salt = iter(range(10_000, 20_000))

    def store_a_page() -> None:
        assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=next(salt))), [0]).wait()

    try:
        until_live(d, healthy, store_a_page)  # the healthy router's subscription is in place
        assert stalled.stdout is not None and stalled.stdout.readline() == b"ready\n"
        time.sleep(0.3)
        os.kill(stalled.pid, signal.SIGSTOP)  # connected, reading nothing
        for c in range(40):  # far more than the stalled queue and its socket buffers hold
            keys = conn.page_keys(tokens(64 * SMALL.page_size, salt=c))
            eng = P.EngineBlocks(
                hashes=[c * 100 + i for i in range(64)],
                token_ids=P.pack_tokens(tokens(64 * SMALL.page_size, c).tolist()),
            )
            assert conn.store(keys, list(range(64)), engine=eng).wait()
            while healthy.recv(0.05) is not None:  # the healthy router keeps up
                pass
        live = []
        for _ in range(5):  # five more batches, the healthy router reading all the while
            before = published(d)
            store_a_page()
            wait_for(lambda n=before: published(d) > n, what="a batch published")
            while (m := healthy.recv(0.5)) is not None:
                live.append(m.seq)
        assert live, "the healthy router received no live batch after another subscriber stalled"
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.wait()
        assert stalled.stdout is not None
        stalled.stdout.close()
        healthy.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- hostile replay
@pytest.mark.timeout(60)
def test_a_replay_request_near_the_top_of_the_sequence_space_breaks_no_replay(
    daemon_factory, short_tmp
):
    """A replay request is ``[b"", start_seq (8 bytes)]``; any 8-byte start is well formed,
    and the answer is the buffered batches from it on (none, for a start past the end),
    then the end marker. A request from 2**63 - 1 must get an empty answer, and every
    router's later requests must still be answered."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1]).wait()
        wait_for(lambda: published(d) >= 1, what="a batch")
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(f"ipc://{short_tmp}/evr.sock")
            s.send_multipart([b"", (2**63 - 1).to_bytes(8, "big")])
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            answers: list[list[int]] = []
            got: list[int] = []
            while len(answers) < 2 and s.poll(3000):
                _, _, seq, _ = s.recv_multipart()
                if seq == E.END_SEQ:
                    answers.append(got)
                    got = []
                else:
                    got.append(E.seq_of(seq))
        finally:
            s.close(linger=0)
            ctx.term()
        later = _replay_answer(short_tmp, E.replay_request(0))  # a router connecting now
        assert (answers, later) == ([[], [0]], [0]), (
            f"answers: {answers}, then to a new router: {later} (None: no answer); "
            f"the log: {d.log_tail()[-500:]}"
        )
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_a_replay_from_past_2_63_answers_no_batch_below_its_start(daemon_factory, short_tmp):
    """docs/events.md: the replay answer is "each buffered batch from start_seq on", and
    ``kvtier events --from`` takes 0 to 2**64 - 1 (an unsigned start). A start of 2**63 or
    more is past every batch: the answer must hold none."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    try:
        assert conn.store(conn.page_keys(tokens(2 * SMALL.page_size)), [0, 1]).wait()
        wait_for(lambda: published(d) >= 1, what="a batch")
        assert _replay_answer(short_tmp, E.replay_request(5)) == []  # past the end: nothing
        for start in (2**63, 2**64 - 1):
            got = _replay_answer(short_tmp, start.to_bytes(8, "big"))
            assert got == [], f"a replay from {start} answered batches {got}"
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- restarts
@pytest.mark.timeout(90)
def test_after_a_crash_a_new_namespaces_adopted_pages_are_announced_on_its_models_topic(
    daemon_factory, short_tmp
):
    """docs/events.md: a restarted kvtierd starts its new stream with a BlockStored (CPU)
    per chain of the L2 pages it adopted, "on the same topics"; after a crash, pages stored
    since the last clean stop are "named by their keys" (only their names fall back). A
    router subscribed to its model's topic prefix gets the announcement, with the
    namespace's block size, also for a namespace first named since the last clean stop."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, model="m/x")
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=7))
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        topic = E.namespace_topic("m/x", conn.ns_fingerprint)
    finally:
        conn.close()
        pool.close()
    d.kill()  # a crash: no clean stop has ever saved this namespace's model id
    d = daemon_factory(*event_flags(short_tmp))
    with subscriber(short_tmp) as every, subscriber(short_tmp, topic=E.model_topic("m/x")) as model:
        announced = wait_for(
            lambda: every.replay(0) or None, what="the announcement of the adopted pages"
        )
        seen = {(m.topic, e.block_size) for m in announced for e in m.batch.events}
        assert hashes(events(announced, E.BlockStored, "CPU")) == keys  # named by their keys
        got = model.replay(0)
        assert {m.topic for m in got} == {topic}, f"announced on {seen}, not on {topic}"
        assert [e.block_size for e in events(got, E.BlockStored)] == [SMALL.page_size]


@pytest.mark.timeout(120)
def test_after_a_restart_pages_back_from_l3_keep_their_engine_hashes(daemon_factory, short_tmp):
    """docs/events.md: a page is named by the engine's block hash
    when its STORE carried it, and the hashes survive a clean restart ("named as before the restart"); pages a
    prefetch brings back from L3 are a BlockStored (CPU). A page stored with engine hashes,
    written to L3, kept over a clean restart, evicted from L2 and prefetched back must be
    announced by the same engine hashes, or the router cannot match the prefix any more
    (the adopted pool's in-L3 marks are cleared at start: the eviction must not forget the
    hashes of pages L3 still holds)."""
    flags = [
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
        "--hicache-size",
        "8MiB",
        "--extent-size",
        "4MiB",
    ]
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=200)
    a = conn.page_keys(tokens(8 * SMALL.page_size, salt=77))
    eng = P.EngineBlocks(hashes=[700 + i for i in range(8)])
    try:
        assert conn.store(a, list(range(8)), engine=eng).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 8, what="8 pages in L3")
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir, num_pages=200)
    sub = subscriber(short_tmp)
    try:
        first = wait_for(lambda: events(sub.replay(0), E.BlockStored, "CPU"), what="announce")
        assert hashes(first) == eng.hashes  # adopted, by the saved engine hashes
        sub.next_seq = None
        for c in range(4):  # 800 pages through a pool of 512: the adopted chain is evicted
            keys = conn.page_keys(tokens(200 * SMALL.page_size, salt=c))
            assert conn.store(keys, list(range(200))).wait()
        assert conn.lookup(a).l2 == 0 and conn.lookup(a).l3 == 8
        conn.prefetch(a)
        assert conn.claim(a, policy="wait_complete") == 8
        wait_for(lambda: conn.lookup(a).l2 == 8, what="the chain back in L2")
        names = set(a) | set(eng.hashes)

        def announced_back() -> list[int | bytes] | None:
            """The chain's names in the BlockStored (CPU) after the eviction that named
            them removed (None until it is published)."""
            msgs = sub.replay(0)
            removal = [
                i
                for i, m in enumerate(msgs)
                for e in m.batch.events
                if isinstance(e, E.BlockRemoved) and set(eng.hashes) & set(e.block_hashes)
            ]
            if not removal:
                return None
            back = events(msgs[max(removal) :], E.BlockStored, "CPU")
            got = [h for e in back for h in e.block_hashes if h in names]
            return got or None

        again = wait_for(announced_back, what="the prefetched pages announced")
        removed = hashes(events(sub.replay(0), E.BlockRemoved, "CPU"))
        assert set(eng.hashes) <= set(removed)  # the eviction named them right
        assert again == eng.hashes, (
            "the prefetched pages were announced by "
            + ("kvtier's page keys" if set(again) <= set(a) else repr(again))
            + f", not by the engine hashes {eng.hashes}"
        )
    finally:
        sub.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- topics
@pytest.mark.timeout(60)
def test_a_models_topic_prefix_does_not_match_another_models_events(daemon_factory, short_tmp):
    """docs/events.md: a router subscribes to its model's topic prefix (``kvtier/<model
    id>/``, the model id's ``/`` escaped) and gets the events of every namespace of its model
    and of no other: the router of model ``org`` gets nothing of model ``org/llama`` (model
    ids with ``/`` are the usual Hugging Face ids)."""
    d = daemon_factory(*event_flags(short_tmp))
    pool_a, conn_a = engine(d.runtime_dir, model="org")
    pool_b, conn_b = engine(d.runtime_dir, model="org/llama")
    try:
        mine = conn_a.page_keys(tokens(2 * SMALL.page_size, salt=1))
        other = conn_b.page_keys(tokens(3 * SMALL.page_size, salt=2))
        assert conn_a.store(mine, [0, 1], engine=P.EngineBlocks(hashes=[1, 2])).wait()
        assert conn_b.store(other, [0, 1, 2], engine=P.EngineBlocks(hashes=[7, 8, 9])).wait()
        wait_for(lambda: published(d) >= 1 and counters(d)["kv_events_stored_blocks"] >= 5)
        time.sleep(0.1)
        with subscriber(short_tmp, topic=E.model_topic("org")) as router:
            got = router.replay(0)
        topics = {m.topic for m in got}
        assert hashes(events(got, E.BlockStored, "CPU")) == [1, 2], (
            f"the router of model 'org' received the topics {sorted(topics)}"
        )
    finally:
        conn_b.close()
        pool_b.close()
        conn_a.close()
        pool_a.close()
