"""A router that follows kvtierd's KV events ends up with exactly what the node holds.

Each test replays the stream into :class:`Router`, a model of a cache-aware router's index
(vLLM's semantics: a ``BlockStored`` is a chain whose first block extends
``parent_block_hash``; ``BlockRemoved`` forgets blocks; ``AllBlocksCleared`` forgets a
topic), and compares it with what the daemon holds, tier by tier, parents included. Other
tests hold the reference subscriber (``kvtier.client.connection.events``) to what a router
needs from it: recovering every missed batch and following a restarted daemon.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.events import EventMessage, EventSubscriber
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_kv_events import (
    drain,
    event_flags,
    events,
    hashes,
    published,
    subscriber,
)
from tests.integration.test_l3_tier import counters, flush, l3_flags, stats, wait_for

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- the router
@dataclass
class Router:
    """A router's index built from the stream: per topic and medium, block -> parent."""

    blocks: dict[str, dict[str, dict[object, object]]] = field(default_factory=dict)
    removed_unknown: list[object] = field(default_factory=list)

    def apply(self, msgs: Iterable[EventMessage]) -> Router:
        for m in msgs:
            media = self.blocks.setdefault(m.topic, {})
            for ev in m.batch.events:
                if isinstance(ev, E.BlockStored):
                    held = media.setdefault(ev.medium, {})
                    parent = ev.parent_block_hash
                    for h in ev.block_hashes:
                        held[h] = parent
                        parent = h
                elif isinstance(ev, E.BlockRemoved):
                    held = media.setdefault(ev.medium, {})
                    for h in ev.block_hashes:
                        if held.pop(h, KeyError) is KeyError:
                            self.removed_unknown.append(h)
                elif isinstance(ev, E.AllBlocksCleared):
                    media.clear()
        return self

    def held(self, medium: str, topic: str | None = None) -> dict[object, object]:
        """block -> parent in ``medium`` (of one topic, or of every topic together)."""
        out: dict[object, object] = {}
        for t, media in self.blocks.items():
            if topic is None or t == topic:
                out.update(media.get(medium, {}))
        return out


def chain_parents(hs: list[object], parent: object = None) -> dict[object, object]:
    """block -> parent of a chain ``hs`` extending ``parent``."""
    out = {}
    for h in hs:
        out[h] = parent
        parent = h
    return out


def blocks(n: int, base: int, parent: int | None = None) -> P.EngineBlocks:
    return P.EngineBlocks(hashes=[base + i for i in range(n)], parent=parent)


# ---------------------------------------------------------------------------- L2 evictions
TINY = P.Geometry(num_layers=1, page_size=16, kv_heads=1, head_dim=32, dtype="float32")
"""4 KiB pages: the most slots an extent holds."""
WIDE = P.Geometry(num_layers=1, page_size=16, kv_heads=1, head_dim=64, dtype="float32")
"""8 KiB pages: another page class."""


def test_a_router_sees_every_eviction_of_one_allocation_that_empties_a_large_extent(
    daemon_factory, short_tmp
):
    """One extent of 66,560 slots full of 4 KiB pages; a STORE of one 8 KiB page (another
    class) must empty the extent, so that one allocation evicts all 66,000 pages, more than
    65,536. Every one of them is a BlockRemoved (none only counted in ``evicted_unlogged``):
    a router must not keep pages the node no longer holds."""
    extent = 66560 * 4096  # a multiple of 4 KiB that holds more than 65,536 4-KiB pages
    d = daemon_factory(
        *event_flags(short_tmp),
        "--extent-size",
        str(extent),
        "--hicache-size",
        str(extent + (16 << 20)),
    )
    n, per_store = 66000, 8250
    pool_a, conn_a = engine(d.runtime_dir, TINY, num_pages=per_store, model="tiny")
    pool_b, conn_b = engine(d.runtime_dir, WIDE, num_pages=4, model="wide")
    sub = subscriber(short_tmp)
    try:
        keys = conn_a.page_keys(tokens(n * TINY.page_size, salt=1))
        parent = None
        for a in range(0, n, per_store):  # one chain, in STOREs of 8,250 pages
            part = keys[a : a + per_store]
            assert conn_a.store(part, list(range(len(part))), parent_key=parent).wait()
            parent = part[-1]
        assert stats(d)["pool"]["evictions"] == 0
        wide = conn_b.page_keys(tokens(WIDE.page_size, salt=2))
        assert conn_b.store(wide, [0]).wait()  # needs the extent: every tiny page goes
        assert conn_a.lookup(keys[:1]).l2 == 0
        pool_stats = stats(d)["pool"]
        assert pool_stats["evictions"] == n
        router = Router().apply(drain(sub))
        assert len(router.held("CPU")) == 1, (
            f"{len(router.held('CPU')) - 1} evicted pages are still held by the router "
            f"(evicted_unlogged = {pool_stats['evicted_unlogged']})"
        )
        assert set(router.held("CPU")) == set(wide)
    finally:
        sub.close()
        conn_b.close()
        pool_b.close()
        conn_a.close()
        pool_a.close()


# ---------------------------------------------------------------------------- L3 parents
def test_l3_block_stored_of_a_continued_chain_names_its_parent(daemon_factory, short_tmp):
    """A chain stored in two STOREs (the second extends the first by ``parent_key``) is
    written to L3 in two batches. Its FILE BlockStored events say, as its CPU ones do, that
    page 4 follows page 3 (``parent_block_hash``), so a router matching a prompt's prefix in
    FILE finds pages 4.. under page 3, not under the root."""
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir)
    sub = subscriber(short_tmp)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=3))
        assert conn.store(keys[:4], [0, 1, 2, 3], engine=blocks(4, 100)).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 4, what="4 pages in L3")
        eng = blocks(4, 104, parent=103)
        assert conn.store(keys[4:], [4, 5, 6, 7], parent_key=keys[3], engine=eng).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 8, what="8 pages in L3")
        router = Router().apply(drain(sub))
        want = chain_parents(list(range(100, 108)))
        assert router.held("CPU") == want  # L2's events get the chain right
        assert router.held("FILE") == want
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_l3_block_stored_of_one_write_batch_keeps_two_chains_apart(daemon_factory, short_tmp):
    """Under write-back, a SYNC queues every page not in L3 and the writer puts pages of one
    namespace in one batch: the FILE BlockStored events keep two chains of one batch
    apart (chain Y's head is never made the child of chain X's tail)."""
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--hicache-write-policy",
        "write_back",
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir)
    sub = subscriber(short_tmp)
    try:
        x = conn.page_keys(tokens(3 * SMALL.page_size, salt=4))
        y = conn.page_keys(tokens(3 * SMALL.page_size, salt=5))
        assert conn.store(x, [0, 1, 2], engine=blocks(3, 200)).wait()
        assert conn.store(y, [3, 4, 5], engine=blocks(3, 300)).wait()
        assert counters(d)["l3_write_written_pages"] == 0  # write-back: nothing written yet
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            assert admin.sync(10.0).left == 0
        router = Router().apply(drain(sub))
        want = {**chain_parents([200, 201, 202]), **chain_parents([300, 301, 302])}
        assert router.held("CPU") == want
        assert router.held("FILE") == want
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_a_router_holds_in_l3_exactly_the_pages_the_file_store_keeps(daemon_factory, short_tmp):
    """256 pages written through to a 1 MiB file store, in concurrent batches: the store
    evicts for room, and pages of one batch may be dropped by another batch's put before
    the first batch's own put has come back. A router following the stream must end up
    holding in FILE exactly the pages L3 keeps: never a BlockRemoved (FILE) before the
    BlockStored (FILE) of the same page."""
    extra = {"capacity": "1MiB", "segment_bytes": "512KiB"}
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", extra, prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir, num_pages=64)
    sub = subscriber(short_tmp)
    try:
        key_of: dict[int, bytes] = {}
        handles = []
        for c in range(4):  # issued together: their L3 writes overlap
            keys = conn.page_keys(tokens(64 * SMALL.page_size, salt=10 + c))
            eng = blocks(64, c * 1000)
            key_of.update(zip(eng.hashes, keys))
            handles.append(conn.store(keys, list(range(64)), engine=eng))
        assert all(h.wait() for h in handles)
        settled = ("l3_write_written_pages", "l3_write_failed_pages", "l3_write_skipped_pages")
        wait_for(lambda: sum(counters(d)[k] for k in settled) >= 256, what="every write settled")
        router = Router().apply(drain(sub))
        flush(d, "l2")  # from here a page's lookup can only find it in L3
        in_l3 = {h for h, k in key_of.items() if conn.lookup([k]).l3 == 1}
        held = set(router.held("FILE"))
        assert held - in_l3 == set(), (
            f"the router holds {len(held - in_l3)} FILE blocks L3 dropped; "
            f"{len(router.removed_unknown)} were removed before they were stored"
        )
        assert held == in_l3
    finally:
        sub.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- namespaces
def test_the_same_page_key_in_two_namespaces_is_removed_from_each_by_its_engine_hash(
    daemon_factory, short_tmp
):
    """SGLang's page keys are its own page hashes, the same for every TP rank, tenant or
    model that sees the same tokens, each in its own namespace (topic), with the same engine
    hash (``hash_str_to_int64`` of the key). Each namespace's copy is removed under the
    engine hash it was stored under, whichever namespace evicts its copy first."""
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool_a, conn_a = engine(d.runtime_dir, num_pages=128, model="a")
    pool_b, conn_b = engine(d.runtime_dir, num_pages=128, model="b")
    sub = subscriber(short_tmp)
    try:
        keys = conn_a.page_keys(tokens(4 * SMALL.page_size, salt=6))  # one key list for both
        assert conn_a.store(keys, [0, 1, 2, 3], engine=blocks(4, 1000)).wait()
        assert conn_b.store(keys, [0, 1, 2, 3], engine=blocks(4, 1000)).wait()
        assert conn_a.lookup(keys).l2 == 4 and conn_b.lookup(keys).l2 == 4
        for c in range(5):  # 640 pages through a pool of 512: both copies are evicted
            more = conn_a.page_keys(tokens(128 * SMALL.page_size, salt=700 + c))
            assert conn_a.store(more, list(range(128))).wait()
        assert conn_a.lookup(keys).l2 == 0 and conn_b.lookup(keys).l2 == 0
        topic_a = E.namespace_topic("a", conn_a.ns_fingerprint)
        topic_b = E.namespace_topic("b", conn_b.ns_fingerprint)
        router = Router().apply(drain(sub))
        assert router.held("CPU", topic_b) == {}, "namespace b's router keeps evicted blocks"
        assert set(router.held("CPU", topic_a)).isdisjoint(range(1000, 1004))
        assert router.removed_unknown == []
    finally:
        sub.close()
        conn_b.close()
        pool_b.close()
        conn_a.close()
        pool_a.close()


# ---------------------------------------------------------------------------- restarts
def test_a_restarted_daemon_announces_adopted_pages_on_their_models_topic(
    daemon_factory, short_tmp
):
    """docs/events.md: a router subscribes to ``kvtier/<model id>/``, and a restarted
    kvtierd announces the L2 pages it adopted at the start of its new stream, on the same
    model's topic (the model id saved with the namespace): otherwise the router would take
    the node for empty after a restart."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir, model="m/x")
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=7))
        assert conn.store(keys, [0, 1, 2, 3], engine=blocks(4, 500)).wait()
        topic = E.namespace_topic("m/x", conn.ns_fingerprint)
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    d = daemon_factory(*event_flags(short_tmp))
    with subscriber(short_tmp) as every, subscriber(short_tmp, topic=E.model_topic("m/x")) as model:
        everything = wait_for(
            lambda: events(every.replay(0), E.BlockStored, "CPU"), what="the announcement"
        )
        assert hashes(everything) == [500, 501, 502, 503]
        got = model.replay(0)
        seen = {m.topic for m in every.replay(0)}
        assert {m.topic for m in got} == {topic}, f"announced on {seen}, not on {topic}"
        assert hashes(events(got, E.BlockStored, "CPU")) == [500, 501, 502, 503]


def test_a_following_subscriber_reads_a_restarted_daemons_new_stream(daemon_factory, short_tmp):
    """The reference subscriber follows a daemon's stream up to sequence N; the daemon
    restarts (a new stream from 0, on the same endpoints). Every batch of the new stream has
    a sequence number below N: ``EventSubscriber.iter`` takes a sequence number going back
    (a batch no replay brought) as a new stream and reads it from its start."""
    d = daemon_factory(*event_flags(short_tmp))
    pool, conn = engine(d.runtime_dir)
    sub = EventSubscriber(f"ipc://{short_tmp}/ev.sock", replay=f"ipc://{short_tmp}/evr.sock")
    try:
        for c in range(12):  # twelve batches, a STORE each
            keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=100 + c))
            before = published(d)
            assert conn.store(keys, [0, 1]).wait()
            wait_for(lambda n=before: published(d) > n, what="a batch")
        sub.next_seq = 0
        first = drain(sub)
        assert [m.seq for m in first] == list(range(published(d)))
        assert sub.next_seq is not None and sub.next_seq >= 12
        conn.close()
        pool.close()
        assert d.stop() == 0
        d2 = daemon_factory(*event_flags(short_tmp))
        pool, conn = engine(d2.runtime_dir)
        got: list[EventMessage] = []
        new = conn.page_keys(tokens(3 * SMALL.page_size, salt=999))
        for _ in range(5):  # bounded: a few STOREs, each its own batch on the new stream
            keys = conn.page_keys(tokens(SMALL.page_size, salt=next(_salts)))
            assert conn.store(keys, [0]).wait()
            got += list(sub.iter(0.5))
            if got:
                break
        assert conn.store(new, [0, 1, 2]).wait()
        got += list(sub.iter(1.0))
        assert published(d2) < 12  # the new stream is still below the old position
        stored = hashes(events(got, E.BlockStored, "CPU"))
        assert set(new) <= set(stored), "the subscriber read nothing of the new stream"
    finally:
        sub.close()
        conn.close()
        pool.close()


_salts = itertools.count(2000)


# ---------------------------------------------------------------------------- replay
def test_a_subscriber_recovers_a_gap_longer_than_one_replay_answer(daemon_factory, short_tmp):
    """A replay answer holds at most ``kv_events_replay_max`` batches: the reference
    subscriber asks again from past the last batch received until the gap is filled."""
    d = daemon_factory(*event_flags(short_tmp, "--kv-events-replay-max", "2"))
    pool, conn = engine(d.runtime_dir)
    try:
        for c in range(6):  # six batches before the subscriber comes
            before = published(d)
            assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=300 + c)), [0]).wait()
            wait_for(lambda n=before: published(d) > n, what="a batch")
        with subscriber(short_tmp) as sub:
            got: list[EventMessage] = []
            for c in range(30):  # bounded: until one batch reaches it as sent
                keys = conn.page_keys(tokens(SMALL.page_size, salt=400 + c))
                assert conn.store(keys, [0]).wait()
                got += list(sub.iter(0.3))
                if any(not m.replayed for m in got):
                    break
            assert any(not m.replayed for m in got), "no batch reached the subscriber as sent"
            seqs = [m.seq for m in got]
            assert seqs == list(range(len(seqs))), (
                f"batches lost: {sorted(set(range(max(seqs) + 1)) - set(seqs))}"
            )
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- consistency
def test_a_router_replaying_the_stream_holds_exactly_the_resident_pages(daemon_factory, short_tmp):
    """PASSES (coverage). STOREs of chains and continuations, an eviction storm, a partial
    STORE over resident pages and a FLUSH of one namespace: the router's CPU index is
    exactly the READY pages of each namespace, parents included, and it never removed a
    block it had not been told of."""
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool_a, conn_a = engine(d.runtime_dir, num_pages=100, model="a")
    pool_b, conn_b = engine(d.runtime_dir, num_pages=100, model="b")
    sub = subscriber(short_tmp)
    try:
        name: dict[bytes, int] = {}
        parent_of: dict[int, int | None] = {}
        chains: list[tuple[object, list[bytes]]] = []
        for c in range(6):
            conn = conn_a if c % 2 else conn_b
            keys = conn.page_keys(tokens(100 * SMALL.page_size, salt=500 + c))
            eng = blocks(60, c * 1000)
            assert conn.store(keys[:60], list(range(60)), engine=eng).wait()
            more = blocks(40, c * 1000 + 60, parent=c * 1000 + 59)
            assert conn.store(keys[60:], list(range(40)), parent_key=keys[59], engine=more).wait()
            name.update(zip(keys, [*eng.hashes, *more.hashes]))
            parent_of.update(chain_parents([c * 1000 + i for i in range(100)]))
            chains.append((conn, keys))
        # the oldest chain (evicted) stored again: only the pages L2 lacks are new
        conn, keys = chains[0]
        assert conn.store(keys[:80], list(range(80)), engine=blocks(80, 0)).wait()
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:  # one namespace flushed
            rep = admin.call(P.Flush(req_id=0, tier="l2", namespace=conn_a.ns_fingerprint.hex()))
            assert isinstance(rep, P.FlushReply) and rep.l2_pages > 0
        assert stats(d)["pool"]["evictions"] > 0
        router = Router().apply(drain(sub))
        assert router.removed_unknown == []
        for conn in (conn_a, conn_b):
            topic = E.namespace_topic("a" if conn is conn_a else "b", conn.ns_fingerprint)
            resident = {
                name[k] for c, keys in chains if c is conn for k in keys[: conn.lookup(keys).l2]
            }
            held = router.held("CPU", topic)
            assert set(held) == resident
            assert all(held[h] == parent_of[h] for h in held)  # type: ignore[index]
        assert stats(d)["pool"]["evicted_unlogged"] == 0
    finally:
        sub.close()
        conn_b.close()
        pool_b.close()
        conn_a.close()
        pool_a.close()


def test_a_router_that_replays_after_an_l3_flush_holds_only_what_l2_has(daemon_factory, short_tmp):
    """PASSES (coverage). Pages in L2 and L3; L2 flushed, then half brought back by a
    prefetch; then L3 flushed: after AllBlocksCleared and the re-announcement the router's
    index is the prefetched pages in CPU with their parents, and nothing in FILE."""
    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(d.runtime_dir)
    sub = subscriber(short_tmp)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=8))
        assert conn.store(keys, list(range(8)), engine=blocks(8, 700)).wait()
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 8, what="8 pages in L3")
        flush(d, "l2")
        conn.prefetch(keys[:4])
        assert conn.claim(keys[:4], policy="wait_complete") == 4
        router = Router().apply(drain(sub))
        assert router.held("CPU") == chain_parents([700, 701, 702, 703])
        assert set(router.held("FILE")) == set(range(700, 708))
        flush(d, "l3")
        router.apply(drain(sub))
        assert router.held("FILE") == {}
        assert router.held("CPU") == chain_parents([700, 701, 702, 703])
        assert router.removed_unknown == []
    finally:
        sub.close()
        conn.close()
        pool.close()


def test_a_late_router_replaying_from_zero_matches_one_that_followed_live(
    daemon_factory, short_tmp
):
    """PASSES (coverage). A router that followed live and one that replays the whole buffer
    afterwards reach the same index (stream order is the same either way)."""
    d = daemon_factory(*event_flags(short_tmp), "--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool, conn = engine(d.runtime_dir, num_pages=200)
    live = subscriber(short_tmp)
    try:
        for c in range(4):
            keys = conn.page_keys(tokens(200 * SMALL.page_size, salt=600 + c))
            assert conn.store(keys, list(range(200)), engine=blocks(200, c * 1000)).wait()
            time.sleep(0.05)
        followed = Router().apply(drain(live))
        with subscriber(short_tmp) as late:
            replayed = Router().apply(late.replay(0))
        assert followed.blocks == replayed.blocks
        assert len(followed.held("CPU")) == stats(d)["pool"]["pages_ready"]
    finally:
        live.close()
        conn.close()
        pool.close()


def test_pages_prefetched_after_an_l1_hit_name_the_l1_page_as_their_parent(
    daemon_factory, short_tmp
):
    """An engine's cache manager holds a prompt's first pages on its device (L1) and L3 the
    rest: the prefetch its match starts brings the rest into L2, and their CPU BlockStored
    says they follow the last L1 page (``parent_block_hash``), as their first STORE did,
    so a router's index keeps one chain."""
    from kvtier.client.cache.manager import CacheManager
    from kvtier.engine.allocator import PageAllocator

    from tests.integration.test_l3_tier import wait_written

    d = daemon_factory(
        *event_flags(short_tmp),
        *l3_flags("file", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "st"),
    )
    pool, conn = engine(
        d.runtime_dir, num_pages=16, hicache_write_policy="write_through", prefetch_threshold=0
    )
    alloc = PageAllocator(16)
    cm = CacheManager(alloc, conn)
    sub = subscriber(short_tmp)
    try:
        toks = tokens(6 * SMALL.page_size + 5, salt=6).tolist()
        m = cm.match(toks)
        new = cm.alloc(6)
        assert cm.insert(m, new) == []  # computed and kept: stored into L2, then L3
        cm.release(m)
        cm.free(cm.alloc(alloc.free_count + 3))  # L1 keeps the first three pages only
        wait_written(d, 6)
        flush(d, "l2")
        m = cm.match(toks)
        assert (len(m.l1_pages), m.l2_pages, m.l3_pages, m.l3_coming) == (3, 0, 3, 3)
        ld = cm.load(m, cm.alloc(3))
        assert ld.finish() and ld.pages == 3
        cm.release(m)
        stored = events(drain(sub), E.BlockStored, "CPU")
        first = stored[0].block_hashes
        assert len(first) == 6 and stored[0].parent_block_hash is None
        fetched = [e for e in stored[1:] if e.block_hashes[0] == first[3]]
        assert fetched and fetched[0].block_hashes == first[3:]
        assert fetched[0].parent_block_hash == first[2], "the prefetched run starts a chain"
    finally:
        sub.close()
        cm.close()
        conn.close()
        pool.close()
