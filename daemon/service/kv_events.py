"""KV events: kvtierd tells routers what its node holds, in vLLM's event format.

When ``kv_events_endpoint`` is set, kvtierd publishes (:mod:`kvtier.ipc.kv_events`):

- ``BlockStored`` (medium ``CPU``) when pages become readable in L2: a STORE committed,
  a prefetch from L3 committed;
- ``BlockRemoved`` (``CPU``) when they leave L2: evicted (the pool's eviction log), or
  dropped by FLUSH;
- ``BlockStored`` with the L3 backend's name (``FILE``, ``REDIS``, ...) once a page is
  written to L3 (or found there by the writer);
- ``BlockRemoved`` with the L3 backend's name when the backend drops pages on its own
  (evicted for room, discarded as damaged), for backends that can tell
  (:meth:`~kvtier.daemon.storage.base.StorageBackend.dropped`: ``file``);
- ``AllBlocksCleared`` when FLUSH empties L3 of a namespace, followed by a ``BlockStored``
  of what L2 still holds of it.

Each namespace publishes on its own topic (:func:`~kvtier.ipc.kv_events.namespace_topic`).
A page is named by the engine's block hash where its STORE carried one
(:class:`~kvtier.ipc.protocol.EngineBlocks`; remembered per key, up to
``kv_events_max_hashes``, so its eviction names it the same way), else by its page key.

Never in the event loop's way: events gather for ``kv_events_interval_s`` and go out as
batches (at most ``kv_events_max_batch`` events) from one timer callback, so an eviction
storm is a few batches, not thousands of sends, and back-to-back STOREs share a batch. Every send is NOBLOCK on an XPUB socket that refuses
rather than queues past ``kv_events_hwm`` (``XPUB_NODROP``): a refused batch is counted
(``kv_events_dropped_batches``) and stays in the replay buffer (the last
``kv_events_buffer_steps`` batches) like every other, so a subscriber that sees a gap in
the sequence numbers asks the replay socket for it. The replay socket reads requests from a
reader callback, answers at most ``kv_events_replay_max`` batches per request and stops when
the requester's queue is full; a request that is not exactly ``[b"", 8-byte start]`` (or a
frame over 64 bytes, which ZeroMQ refuses with the connection) gets no answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import zmq
from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.ipc import kv_events as E
from kvtier.ipc.sockets import make_zmq_socket

if TYPE_CHECKING:
    from kvtier.daemon.pool.records import EvictedPage
    from kvtier.daemon.tier.tier import TierStore
    from kvtier.ipc.protocol import EngineBlocks

__all__ = [
    "REMOVED_CHUNK",
    "REPLAY_BURST",
    "REPLAY_MAX_FRAME",
    "SUBSCRIPTION_BURST",
    "SUBSCRIPTION_MAX_FRAME",
    "KvEventPublisher",
    "open_publisher",
]

log = logging.getLogger("kvtier.daemon.events")

REPLAY_BURST = 16
"""Replay requests answered in a row before the event loop gets a turn."""
REMOVED_CHUNK = 4096
"""Most block hashes in one BlockRemoved (an eviction storm is a few events of this many)."""
SUBSCRIPTION_MAX_FRAME = 8192
"""Largest frame the PUB socket takes from a subscriber: a (un)subscription of a topic
(``kvtier/<model id>/<fingerprint>``; a model id has at most 4,096 characters)."""
SUBSCRIPTION_BURST = 256
"""Subscription messages read (and dropped) in a row before the event loop gets a turn."""
REPLAY_MAX_FRAME = 64
"""Largest frame the replay socket takes (a request is 8 bytes): ZeroMQ drops a bigger one,
and its connection, before buffering it."""

_NB = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(slots=True)
class _PendingStore:
    """What a STORE said about its pages, kept until its copy is committed or dropped."""

    ns_id: int
    keys: Sequence[bytes]  # the STORE's keys
    index: list[int] | None  # the keys this transfer copies (None: all of them)
    parent_key: bytes | None
    engine: EngineBlocks | None
    block_size: int


class KvEventPublisher:
    """Publishes the node's KV events (see the module docstring).

    Args:
        cfg: the daemon's configuration (``kv_events_*``; the L3 backend names the medium).
        counters: the daemon's counters (``kv_events_*``).
        zctx: the daemon's ZeroMQ context.
        fingerprint_of: the fingerprint of a pool namespace id (None if unknown), for the
            topics of namespaces no session has named since the daemon started.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        counters: Counters,
        zctx: zmq.Context[Any],
        fingerprint_of: Callable[[int], bytes | None],
    ) -> None:
        assert cfg.kv_events_endpoint is not None
        self.counters = counters
        self.l3_medium = cfg.hicache_storage_backend.upper()
        self._max_batch = cfg.kv_events_max_batch
        self._interval_s = cfg.kv_events_interval_s
        self._replay_max = cfg.kv_events_replay_max
        self._max_hashes = cfg.kv_events_max_hashes
        self._fingerprint_of = fingerprint_of
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=cfg.kv_events_buffer_steps)
        self._seq = itertools.count()
        self._pending: dict[bytes, list[E.Event]] = {}
        self._deferred: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._flush_scheduled = False
        self._flushing = False
        self._topics: dict[int, bytes] = {}
        self._block_size: dict[int, int] = {}
        self._hashes: dict[bytes, E.BlockHash] = {}  # insertion order: the oldest first
        self._stores: dict[tuple[int, int, int], _PendingStore] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pub = make_zmq_socket(
            zctx,
            cfg.kv_events_endpoint,
            zmq.XPUB,
            bind=True,
            hwm=cfg.kv_events_hwm,
            max_msg_bytes=SUBSCRIPTION_MAX_FRAME,
        )
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if cfg.kv_events_replay_endpoint is not None:
                self._replay = make_zmq_socket(
                    zctx,
                    cfg.kv_events_replay_endpoint,
                    zmq.ROUTER,
                    bind=True,
                    hwm=1000,
                    max_msg_bytes=REPLAY_MAX_FRAME,
                )
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        except BaseException:
            self._pub.close(linger=0)
            raise

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin answering replay requests (call from the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(cast(int, self._pub.getsockopt(zmq.FD)), self._drop_subscriptions)
        self._drop_subscriptions()
        if self._replay is not None:
            fd = cast(int, self._replay.getsockopt(zmq.FD))
            self._loop.add_reader(fd, self._read_replays)
            self._read_replays()  # what came before the reader was registered signalled no one

    def close(self) -> None:
        """Send what is pending, stop the replay reader, close the sockets."""
        if self._pending or self._deferred:
            self._flush()
        if self._replay is not None:
            if self._loop is not None and not self._replay.closed:
                self._loop.remove_reader(cast(int, self._replay.getsockopt(zmq.FD)))
            self._replay.close(linger=0)
        if self._loop is not None and not self._pub.closed:
            self._loop.remove_reader(cast(int, self._pub.getsockopt(zmq.FD)))
        self._pub.close(linger=0)
        self._loop = None

    # ------------------------------------------------------------------ namespaces
    def name(self, ns_id: int, model_id: str, fingerprint: bytes, page_size: int) -> None:
        """A session registered namespace ``ns_id``: its topic and block size."""
        self._topics[ns_id] = E.namespace_topic(model_id, fingerprint).encode()
        self._block_size[ns_id] = page_size

    def _topic(self, ns_id: int) -> bytes:
        topic = self._topics.get(ns_id)
        if topic is None:  # adopted from before a restart, not named since
            fp = self._fingerprint_of(ns_id)
            topic = E.namespace_topic("", fp or b"").encode()
            if fp is not None:
                self._topics[ns_id] = topic
        return topic

    # ------------------------------------------------------------------ STORE
    def store_started(
        self,
        ns_id: int,
        session_id: int,
        slot: int,
        seq: int,
        keys: Sequence[bytes],
        index: list[int] | None,
        parent_key: bytes | None,
        engine: EngineBlocks | None,
        page_size: int,
    ) -> None:
        """A STORE's copy starts (its ``engine`` was checked against its keys): keep what
        its BlockStored will say until :meth:`store_ended`."""
        self._stores[(session_id, slot, seq)] = _PendingStore(
            ns_id,
            keys,
            index,
            parent_key,
            engine,
            engine.block_size or page_size if engine is not None else page_size,
        )

    def store_ended(self, session_id: int, slot: int, seq: int, committed: bool) -> None:
        """A STORE's copy ended: committed pages are announced (after the engine was told:
        the event is built in the flush, off the STORE's path), dropped ones forgotten."""
        p = self._stores.pop((session_id, slot, seq), None)
        if p is not None and committed:
            self._defer(self._announce, p)

    def _announce(self, p: _PendingStore) -> None:
        """The BlockStored events of a committed STORE (a chain each run of its pages)."""
        keys, eng, bs = p.keys, p.engine, p.block_size
        index = p.index if p.index is not None else range(len(keys))
        if eng is not None:
            hashes: Sequence[E.BlockHash] = eng.hashes
            self._remember(
                keys if p.index is None else [keys[i] for i in index],
                hashes if p.index is None else [hashes[i] for i in index],
            )
        else:
            hashes = keys
        parent_of_first = eng.parent if eng is not None else p.parent_key
        if p.index is None:  # every key was copied: one chain
            self._stored_run(p, 0, len(keys), hashes, parent_of_first, bs)
            return
        run: list[int] = []
        for i in index:
            if run and i != run[-1] + 1:
                self._stored_run(p, run[0], run[-1] + 1, hashes, parent_of_first, bs)
                run = []
            run.append(i)
        if run:
            self._stored_run(p, run[0], run[-1] + 1, hashes, parent_of_first, bs)

    def _stored_run(
        self,
        p: _PendingStore,
        a: int,
        b: int,
        hashes: Sequence[E.BlockHash],
        parent_of_first: E.BlockHash | None,
        bs: int,
    ) -> None:
        """The BlockStored of the STORE's pages ``a .. b`` (one chain)."""
        eng = p.engine
        tokens = (
            E.packed_token_ids(eng.token_ids, a * bs, b * bs)
            if eng is not None and eng.token_ids
            else []
        )
        self._add(
            p.ns_id,
            E.BlockStored(
                block_hashes=list(hashes[a:b]),
                parent_block_hash=hashes[a - 1] if a else parent_of_first,
                token_ids=tokens,
                block_size=bs,
                lora_id=None,
                medium=E.MEDIUM_L2,
                lora_name=eng.lora_name if eng is not None else None,
            ),
        )
        self.counters.kv_events_stored_blocks += b - a

    # ------------------------------------------------------------------ L2 and L3
    def l2_filled(self, ns_id: int, keys: Sequence[bytes], parent_key: bytes | None) -> None:
        """Pages read from L3 became readable in L2 (a prefetch committed them)."""
        self.stored(ns_id, E.MEDIUM_L2, keys, parent_key)

    def evicted(self, pages: Sequence[EvictedPage]) -> None:
        """Pages left L2 (the pool's eviction log): one BlockRemoved per namespace, built
        in the flush (off the allocating request's path)."""
        if pages:
            self._defer(self._evicted, pages)

    def _evicted(self, pages: Sequence[EvictedPage]) -> None:
        """The BlockRemoved of an eviction log. A page still in L3 keeps its engine hash
        remembered (L3's events name it too); the others' are forgotten."""
        hashes = self._hashes
        keys, nss, _, in_l3 = zip(*pages)
        ns0 = nss[0]
        if nss.count(ns0) == len(nss) and not any(in_l3):  # the usual case, at C speed
            self._removed(ns0, E.MEDIUM_L2, list(map(hashes.pop, keys, keys)))
            return
        get, pop = hashes.get, hashes.pop
        by_ns: dict[int, list[E.BlockHash]] = {}
        for key, ns_id, l3 in zip(keys, nss, in_l3):
            by_ns.setdefault(ns_id, []).append(get(key, key) if l3 else pop(key, key))
        for ns_id, hs in by_ns.items():
            self._removed(ns_id, E.MEDIUM_L2, hs)

    def l2_dropped(self, ns_id: int, keys: Iterable[bytes]) -> None:
        """Pages a FLUSH dropped from L2."""
        self._defer(self._l2_dropped, ns_id, list(keys))

    def _l2_dropped(self, ns_id: int, keys: list[bytes]) -> None:
        self._removed(ns_id, E.MEDIUM_L2, [self._hashes.get(k, k) for k in keys])

    def l3_written(self, pages: Sequence[tuple[int, bytes]]) -> None:
        """Pages ``(ns_id, key)`` are in L3 (written, or found there), in chain order."""
        by_ns: dict[int, list[bytes]] = {}
        for ns_id, key in pages:
            by_ns.setdefault(ns_id, []).append(key)
        for ns_id, keys in by_ns.items():
            self.stored(ns_id, self.l3_medium, keys, None)

    def l3_dropped(self, pages: Sequence[tuple[int, bytes]]) -> None:
        """Pages ``(ns_id, key)`` the L3 backend dropped on its own: one BlockRemoved per
        namespace."""
        if pages:
            self._defer(self._l3_dropped, pages)

    def _l3_dropped(self, pages: Sequence[tuple[int, bytes]]) -> None:
        by_ns: dict[int, list[E.BlockHash]] = {}
        hashes = self._hashes
        for ns_id, key in pages:
            by_ns.setdefault(ns_id, []).append(hashes.get(key, key))
        for ns_id, hs in by_ns.items():
            self._removed(ns_id, self.l3_medium, hs)

    def l3_cleared(self, ns_id: int, l2_pages: Sequence[tuple[bytes, bytes | None]]) -> None:
        """FLUSH emptied L3 of ``ns_id``: AllBlocksCleared on its topic, then what L2 still
        holds of it (``(key, parent key)`` per READY page)."""
        self._add(ns_id, E.AllBlocksCleared())
        self.counters.kv_events_cleared += 1
        for key, parent in l2_pages:
            self.stored(ns_id, E.MEDIUM_L2, [key], parent)

    def stored(
        self, ns_id: int, medium: str, keys: Sequence[bytes], parent_key: bytes | None
    ) -> None:
        """A BlockStored of ``keys`` (a chain extending ``parent_key``), named by the
        engine's hashes where known (when the flush builds it: after the STOREs before it
        remembered theirs)."""
        if keys:
            self._defer(self._stored, ns_id, medium, keys, parent_key)

    def _stored(
        self, ns_id: int, medium: str, keys: Sequence[bytes], parent_key: bytes | None
    ) -> None:
        hashes = self._hashes
        self._add(
            ns_id,
            E.BlockStored(
                block_hashes=[hashes.get(k, k) for k in keys],
                parent_block_hash=None
                if parent_key is None
                else hashes.get(parent_key, parent_key),
                token_ids=[],
                block_size=self._block_size.get(ns_id, 0),
                lora_id=None,
                medium=medium,
                lora_name=None,
            ),
        )
        self.counters.kv_events_stored_blocks += len(keys)

    def _removed(self, ns_id: int, medium: str, hashes: list[E.BlockHash]) -> None:
        if not hashes:
            return
        for a in range(0, len(hashes), REMOVED_CHUNK):  # a storm: a few events, not thousands
            self._add(
                ns_id, E.BlockRemoved(block_hashes=hashes[a : a + REMOVED_CHUNK], medium=medium)
            )
        self.counters.kv_events_removed_blocks += len(hashes)

    def _remember(self, keys: Sequence[bytes], hs: Sequence[E.BlockHash]) -> None:
        """Remember the engine's hash of each key; the oldest go beyond the bound."""
        hashes = self._hashes
        hashes.update(zip(keys, hs))
        excess = len(hashes) - self._max_hashes
        if excess > 0:
            for key in list(itertools.islice(hashes, excess)):
                del hashes[key]

    # ------------------------------------------------------------------ batches
    def _add(self, ns_id: int, event: E.Event) -> None:
        """Queue ``event`` on its namespace's topic, in order with the deferred ones."""
        if not self._flushing:
            self._defer(self._add, ns_id, event)
            return
        topic = self._topic(ns_id)
        events = self._pending.get(topic)
        if events is None:
            events = self._pending[topic] = []
        events.append(event)

    def _defer(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` at the next flush, in call order with the other events."""
        self._deferred.append((fn, args))
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self._loop is not None:
                self._loop.call_later(self._interval_s, self._flush)
            else:  # not started (or closed): publish at once
                self._flush()

    def _flush(self) -> None:
        """Build the deferred events, then publish what gathered: per topic, batches of at
        most ``max_batch``."""
        deferred, self._deferred = self._deferred, []
        self._flushing = True
        try:
            for fn, args in deferred:
                fn(*args)  # their events join _pending, in call order
        finally:
            self._flushing = False
            self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        ts = time.time()
        for topic, events in pending.items():
            for a in range(0, len(events), self._max_batch):
                self._publish(
                    topic,
                    E.encode_batch(E.KVEventBatch(ts=ts, events=events[a : a + self._max_batch])),
                )

    def _publish(self, topic: bytes, payload: bytes) -> None:
        seq = next(self._seq)
        self._buffer.append((seq, topic, payload))
        if self._pub.closed:
            return
        pub = self._pub
        try:  # frame by frame with int flags (pyzmq's enum or-ing costs per call); a
            pub.send(topic, _MORE)  # message is atomic: refused whole at its first frame
            pub.send(seq.to_bytes(8, "big"), _MORE)
            pub.send(payload, _NB)
        except zmq.Again:  # a subscriber's queue is full: it replays what it missed
            self.counters.kv_events_dropped_batches += 1
        else:
            self.counters.kv_events_batches += 1

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (for tests and the bench)."""
        return self._buffer[-1][0] + 1 if self._buffer else 0

    def _drop_subscriptions(self) -> None:
        """Read and drop the subscription messages the XPUB hands up (ZeroMQ filters by
        them itself; unread, a subscriber sending many distinct topics would grow them)."""
        pub = self._pub
        if pub.closed or self._loop is None:
            return
        for _ in range(SUBSCRIPTION_BURST):
            if not cast(int, pub.getsockopt(_EVENTS)) & _POLLIN:
                return
            pub.recv(_NB)
        self._loop.call_soon(self._drop_subscriptions)

    # ------------------------------------------------------------------ replay
    def _read_replays(self) -> None:
        """Answer queued replay requests (the reader callback), a burst at a time."""
        sock = self._replay
        if sock is None or sock.closed or self._loop is None:
            return
        for _ in range(REPLAY_BURST):
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            frames = _read_request(sock)
            if frames is None or frames[1] != b"" or len(frames[2]) != 8:
                self.counters.kv_events_replays_refused += 1
                continue  # garbage gets nothing
            self._answer(sock, frames[0], int.from_bytes(frames[2], "big", signed=True))
        self._loop.call_soon(self._read_replays)  # more may be queued: after the others

    def _answer(self, sock: zmq.Socket[Any], peer: bytes, start: int) -> None:
        """Send the buffered batches from ``start`` on (at most ``replay_max``), then the
        end marker; stop at the first the requester cannot take."""
        self.counters.kv_events_replays += 1
        buf = self._buffer
        first = max(0, start - buf[0][0]) if buf else 0
        try:
            for seq, topic, payload in itertools.islice(buf, first, first + self._replay_max):
                sock.send(peer, _MORE)
                sock.send(b"", _MORE)
                sock.send(topic, _MORE)
                sock.send(seq.to_bytes(8, "big"), _MORE)
                sock.send(payload, _NB)
            sock.send_multipart((peer, b"", b"", E.END_SEQ, b""), _NB)
        except (zmq.Again, zmq.ZMQError) as err:  # full, or gone: it may ask again
            log.debug("replay to a subscriber cut short: %s", err)


def _read_request(sock: zmq.Socket[Any]) -> list[bytes] | None:
    """Read one message off the replay socket frame by frame: its three frames, or None
    for any other count (the frames past the third are read and dropped one at a time,
    never collected)."""
    frames = [sock.recv(_NB)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(_NB)
        if len(frames) < 4:
            frames.append(frame)
    return frames if len(frames) == 3 else None


def open_publisher(
    cfg: DaemonConfig, counters: Counters, tier: TierStore, zctx: zmq.Context[Any]
) -> KvEventPublisher:
    """Bind the publisher's sockets, start its replay reader and hook it to the tier's
    evictions, prefetch commits and L3 writes (call from the event loop; close it with
    :meth:`KvEventPublisher.close`).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (in use, bad address).
    """
    pub = KvEventPublisher(cfg, counters, zctx, tier.namespace_of)
    try:
        pub.start()
    except BaseException:
        pub.close()
        raise
    tier.on_evicted = pub.evicted
    tier.prefetcher.on_committed = pub.l2_filled
    tier.writer.on_written = pub.l3_written

    def l3_dropped(dropped: list[tuple[bytes, bytes]]) -> None:
        ids = tier.pool.namespaces()  # fingerprint -> pool namespace id
        pub.l3_dropped([(ids[fp], key) for fp, key in dropped if fp in ids])

    tier.l3.on_dropped = l3_dropped
    log.info(
        "publishing KV events on %s (replay: %s)",
        cfg.kv_events_endpoint,
        cfg.kv_events_replay_endpoint or "off",
    )
    return pub
