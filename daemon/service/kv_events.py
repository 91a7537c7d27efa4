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
  (:meth:`~kvtier.daemon.storage.base.StorageBackend.dropped`: ``file``, ``redis``);
- ``AllBlocksCleared`` when FLUSH empties L3 of a namespace, or the store may have lost
  everything (:meth:`~kvtier.daemon.storage.base.StorageBackend.replaced`: a Redis server
  that restarted), followed by a ``BlockStored`` of what L2 still holds of it.

Each namespace publishes on its own topic (:func:`~kvtier.ipc.kv_events.namespace_topic`).
A page is named by the engine's block hash where its STORE carried one
(:class:`~kvtier.ipc.protocol.EngineBlocks`; remembered per namespace and key, up to
``kv_events_max_hashes``, so its eviction names it the same way), else by its page key.

Never in the event loop's way: events gather for ``kv_events_interval_s`` and go out as
batches (at most ``kv_events_max_batch`` events) from one timer callback, so an eviction
storm is a few batches, not thousands of sends, and back-to-back STOREs share a batch. The
transport (sequence numbers, slow subscribers, replay) is
:mod:`~kvtier.daemon.service.kv_event_stream`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from kvtier.config import DaemonConfig
from kvtier.config.loader import state_dir
from kvtier.daemon.counters import Counters
from kvtier.daemon.service import kv_event_state
from kvtier.daemon.service.kv_event_stream import EventStream
from kvtier.ipc import kv_events as E

PagesHeld = tuple[list[tuple[bytes, bytes | None]], Callable[[Sequence[bytes]], int]]
"""A namespace's READY pages ``(key, parent key)`` and its leading-READY-run function."""

if TYPE_CHECKING:
    from kvtier.daemon.pool.records import EvictedPage
    from kvtier.daemon.service.connections import ConnectionGuard
    from kvtier.daemon.tier.tier import TierStore
    from kvtier.daemon.service.sessions import Session
    from kvtier.ipc.protocol import EngineBlocks, Store

__all__ = [
    "ANNOUNCE_PAGES",
    "REMOVED_CHUNK",
    "KvEventPublisher",
    "open_publisher",
]

log = logging.getLogger("kvtier.daemon.events")

ANNOUNCE_PAGES = 8192
"""Adopted pages announced per event-loop turn at start."""
REMOVED_CHUNK = 4096
"""Most block hashes in one BlockRemoved (an eviction storm is a few events of this many)."""


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
        state: where the engine hashes are saved at :meth:`close` and read back here
            (:mod:`~kvtier.daemon.service.kv_event_state`); None: nowhere.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        counters: Counters,
        zctx: zmq.Context[Any],
        fingerprint_of: Callable[[int], bytes | None],
        state: Path | None = None,
    ) -> None:
        assert cfg.kv_events_endpoint is not None
        self.counters = counters
        self.l3_medium = cfg.hicache_storage_backend.upper()
        self._max_batch = cfg.kv_events_max_batch
        self._interval_s = cfg.kv_events_interval_s
        self._max_hashes = cfg.kv_events_max_hashes
        self._fingerprint_of = fingerprint_of
        self._pending: dict[bytes, list[E.Event]] = {}
        self._deferred: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._flush_scheduled = False
        self._flushing = False
        self._topics: dict[int, bytes] = {}
        self._block_size: dict[int, int] = {}
        self._state = state
        # fingerprint ‖ page key -> engine hash, insertion order: the oldest first (engines
        # of several namespaces may name pages by the same keys); per fingerprint: block
        # size, model id
        loaded = (
            kv_event_state.load(state, self._max_hashes)
            if state is not None
            else kv_event_state.Loaded({}, {}, {})
        )
        self._hashes: dict[bytes, E.BlockHash] = loaded.hashes
        # those of pages that left L2 (kept for L3's events): a restart names them lost
        # no more
        self._left_l2: set[bytes] = loaded.left_l2
        self._fp_block_size: dict[bytes, int] = loaded.block_sizes
        self._fp_model: dict[bytes, str] = loaded.models
        # the namespaces named since the last clean stop (newer than its file): what a
        # crash would lose otherwise; and what is on disk, so a name is written once
        self._names = (
            kv_event_state.NameLog(state.with_name(kv_event_state.NAMES_FILE))
            if state is not None
            else None
        )
        self._recorded: dict[bytes, tuple[int, str]] = {
            fp: (n, self._fp_model.get(fp, "")) for fp, n in self._fp_block_size.items()
        }
        for fp, (n, model) in (self._names.load() if self._names is not None else {}).items():
            self._fp_block_size.pop(fp, None)
            self._fp_model.pop(fp, None)
            self._fp_block_size[fp], self._fp_model[fp] = n, model
            self._recorded[fp] = (n, model)
        self._fps: dict[int, bytes] = {}  # pool namespace id -> fingerprint
        self._announcing: asyncio.Task[None] | None = None
        self._stores: dict[tuple[int, int, int], _PendingStore] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream = EventStream(cfg, counters, zctx)

    # ------------------------------------------------------------------ lifecycle
    def start(self, guard: ConnectionGuard | None = None) -> None:
        """Begin answering replay requests (call from the event loop); ``guard`` bounds
        the sockets' connections (subscribers, replay requesters)."""
        self._loop = asyncio.get_running_loop()
        self._stream.start(guard)

    def close(self) -> None:
        """Send what is pending, stop the replay reader, close the sockets, save the engine
        hashes (where a state file is set)."""
        if self._announcing is not None:
            self._announcing.cancel()
            self._announcing = None
        if self._pending or self._deferred:
            self._flush()
        if self._state is not None:
            kept = self._kept_namespaces()  # those of sessions long gone are not saved
            try:
                kv_event_state.save(
                    self._state,
                    self._hashes,
                    {fp: n for fp, n in self._fp_block_size.items() if fp in kept},
                    {fp: m for fp, m in self._fp_model.items() if fp in kept},
                    self._left_l2,
                )
            except OSError as err:
                log.warning("KV events: cannot save engine hashes to %s: %s", self._state, err)
            else:
                if self._names is not None:
                    self._names.remove()  # the file just saved holds what it held
        self._stream.close()
        self._loop = None

    # ------------------------------------------------------------------ namespaces
    def name(self, ns_id: int, model_id: str, fingerprint: bytes, page_size: int) -> None:
        """A session registered namespace ``ns_id``: its topic and block size."""
        self._topics[ns_id] = E.namespace_topic(model_id, fingerprint).encode()
        self._fp_block_size.pop(fingerprint, None)  # re-inserted: the newest
        self._fp_model.pop(fingerprint, None)
        self._block_size[ns_id] = self._fp_block_size[fingerprint] = page_size
        self._fp_model[fingerprint] = model_id
        self._fps[ns_id] = fingerprint
        if len(self._fp_model) > kv_event_state.MAX_NAMESPACES:
            self._forget_namespaces()
        if self._names is not None and self._recorded.get(fingerprint) != (page_size, model_id):
            self._recorded[fingerprint] = (page_size, model_id)
            self._names.append(fingerprint, page_size, model_id, self._kept_names)

    def model_of(self, fingerprint: bytes) -> str:
        """The model id the namespace ``fingerprint`` was last registered with ("" when
        not known)."""
        return self._fp_model.get(fingerprint, "")

    def _kept_names(self) -> dict[bytes, tuple[int, str]]:
        """Fingerprint -> (block size, model id) of every namespace kept now."""
        return {fp: (n, self._fp_model.get(fp, "")) for fp, n in self._fp_block_size.items()}

    def _kept_namespaces(self) -> set[bytes]:
        """The fingerprints of kept engine hashes and of the namespaces named since start."""
        fp = kv_event_state.FP_BYTES
        return {key[:fp] for key in self._hashes} | set(self._fps.values())

    def _forget_namespaces(self) -> None:
        """Forget the block size and model id of the oldest namespaces without a kept hash
        (down to half of :data:`~kvtier.daemon.service.kv_event_state.MAX_NAMESPACES`, or
        as far as those go): sessions of many models come and go over a daemon's life."""
        kept, target = self._kept_namespaces(), kv_event_state.MAX_NAMESPACES // 2
        for fp in [fp for fp in self._fp_model if fp not in kept]:
            if len(self._fp_model) <= target:
                break
            del self._fp_model[fp]
            self._fp_block_size.pop(fp, None)
            self._recorded.pop(fp, None)

    def announce_held(
        self, namespaces: dict[bytes, int], held: Callable[[int], PagesHeld]
    ) -> asyncio.Task[None]:
        """Announce, on this new stream, the L2 pages the daemon holds from before it started
        (a BlockStored per chain, by the saved engine hashes), a few thousand pages per
        event-loop turn; pages evicted before their turn are left out. Each namespace's
        announcement starts with a BlockRemoved (``CPU``) of the pages the saved hashes
        name that L2 does not hold (all of them after a cold start): a router that replays
        the new stream forgets what the restart lost.

        Args:
            namespaces: fingerprint -> pool namespace id of the adopted pool.
            held: the pool's pages of a namespace: ``(key, parent key)`` per READY page, and
                the leading READY run of a list of keys (:meth:`HostPool.lookup`).
        """
        for fp, ns_id in namespaces.items():
            if ns_id not in self._block_size and fp in self._fp_block_size:
                self._block_size[ns_id] = self._fp_block_size[fp]
        # what the restart lost first, at once: before any engine can store a page again
        fpn = kv_event_state.FP_BYTES
        saved: dict[bytes, list[tuple[bytes, E.BlockHash]]] = {}
        for named, h in self._hashes.items():  # what the last stop named, by namespace
            saved.setdefault(named[:fpn], []).append((named[fpn:], h))
        for fp, gone in saved.items():
            kept = namespaces.get(fp)
            ready = {key for key, _ in held(kept)[0]} if kept is not None else set()
            self._lost(fp, [(key, h) for key, h in gone if key not in ready])
        self._announcing = asyncio.get_running_loop().create_task(
            self._announce_held(list(namespaces.values()), held), name="kvtier-events-announce"
        )
        return self._announcing

    async def _announce_held(self, ns_ids: list[int], held: Callable[[int], PagesHeld]) -> None:
        for ns_id in ns_ids:
            pages, leading = held(ns_id)
            budget = ANNOUNCE_PAGES
            for run, parent in kv_event_state.chain_runs(pages):
                n = leading(run)
                if n:
                    self.stored(ns_id, E.MEDIUM_L2, run[:n], parent)
                budget -= len(run)
                if budget <= 0:
                    await asyncio.sleep(0)
                    budget = ANNOUNCE_PAGES
            await asyncio.sleep(0)

    def _lost(self, fp: bytes, pages: list[tuple[bytes, E.BlockHash]]) -> None:
        """BlockRemoved (``CPU``) of ``pages`` (key, engine hash) of namespace ``fp``, which
        the last daemon held in L2 and this one does not, on that namespace's topic (those
        whose removal the last daemon announced left out). Their hashes stay (L3 may hold
        the pages: its events name them), marked as out of L2."""
        topic = E.namespace_topic(self._fp_model.get(fp, ""), fp).encode()
        left = self._left_l2
        hashes = [h for key, h in pages if fp + key not in left]
        left.update(fp + key for key, _ in pages)
        for a in range(0, len(hashes), REMOVED_CHUNK):
            gone = E.BlockRemoved(block_hashes=hashes[a : a + REMOVED_CHUNK], medium=E.MEDIUM_L2)
            self._defer(self._add_to, topic, gone)
        self.counters.kv_events_removed_blocks += len(hashes)

    def _topic(self, ns_id: int) -> bytes:
        topic = self._topics.get(ns_id)
        if topic is None:  # adopted from before a restart, not named since: the model id
            fp = self._fingerprint_of(ns_id)  # saved with it then
            topic = E.namespace_topic(self._fp_model.get(fp or b"", ""), fp or b"").encode()
            if fp is not None:
                self._topics[ns_id] = topic
        return topic

    def _fp(self, ns_id: int) -> bytes:
        """The fingerprint of pool namespace ``ns_id``: the first half of its pages' keys in
        :attr:`_hashes` (zeros for one the pool does not know)."""
        fp = self._fps.get(ns_id)
        if fp is None:
            fp = self._fingerprint_of(ns_id)
            if fp is None:
                return bytes(kv_event_state.FP_BYTES)
            self._fps[ns_id] = fp
        return fp

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

    def store_of(
        self, s: Session, m: Store, keys: Sequence[bytes], index: list[int] | None
    ) -> None:
        """:meth:`store_started` for STORE ``m`` of session ``s``, copying ``keys[i]`` for
        each ``i`` of ``index`` (None: every key)."""
        self.store_started(
            s.ns_id,
            s.session_id,
            m.slot,
            m.seq,
            keys,
            index,
            m.parent_key,
            m.engine,
            s.geometry.page_size,
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
                p.ns_id,
                keys if p.index is None else [keys[i] for i in index],
                hashes if p.index is None else [hashes[i] for i in index],
            )
        else:
            hashes = keys
        parent_of_first = eng.parent if eng is not None else p.parent_key
        if eng is None and p.parent_key is not None:  # named as it was announced
            parent_of_first = self._hashes.get(self._fp(p.ns_id) + p.parent_key, p.parent_key)
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
            named = map(self._fp(ns0).__add__, keys)
            self._removed(ns0, E.MEDIUM_L2, list(map(hashes.pop, named, keys)))
            return
        get, pop, fp, left = hashes.get, hashes.pop, self._fp, self._left_l2
        by_ns: dict[int, list[E.BlockHash]] = {}
        for key, ns_id, l3 in zip(keys, nss, in_l3):
            named = fp(ns_id) + key
            if l3 and named in hashes:
                left.add(named)
            by_ns.setdefault(ns_id, []).append(get(named, key) if l3 else pop(named, key))
        for ns_id, hs in by_ns.items():
            self._removed(ns_id, E.MEDIUM_L2, hs)

    def l2_dropped(self, ns_id: int, keys: Iterable[bytes]) -> None:
        """Pages a FLUSH dropped from L2."""
        self._defer(self._l2_dropped, ns_id, list(keys))

    def _l2_dropped(self, ns_id: int, keys: list[bytes]) -> None:
        get, fp = self._hashes.get, self._fp(ns_id)
        self._left_l2.update(k for k in map(fp.__add__, keys) if k in self._hashes)
        self._removed(ns_id, E.MEDIUM_L2, [get(fp + k, k) for k in keys])

    def l3_written(
        self,
        pages: Sequence[tuple[int, bytes]],
        parents: Callable[[int, Sequence[bytes]], list[bytes | None]] | None = None,
    ) -> None:
        """Pages ``(ns_id, key)`` are in L3 (written, or found there), in any order: one
        BlockStored per chain run, head first, naming its parent (``parents`` tells each
        page's parent key in L2; None: every page a run of its own without one)."""
        by_ns: dict[int, list[bytes]] = {}
        for ns_id, key in pages:
            by_ns.setdefault(ns_id, []).append(key)
        for ns_id, keys in by_ns.items():
            ups = parents(ns_id, keys) if parents is not None else [None] * len(keys)
            for run, parent in kv_event_state.chain_runs(list(zip(keys, ups))):
                self.stored(ns_id, self.l3_medium, run, parent)

    def l3_dropped(self, pages: Sequence[tuple[int, bytes]]) -> None:
        """Pages ``(ns_id, key)`` the L3 backend dropped on its own: one BlockRemoved per
        namespace."""
        if pages:
            self._defer(self._l3_dropped, pages)

    def _l3_dropped(self, pages: Sequence[tuple[int, bytes]]) -> None:
        by_ns: dict[int, list[E.BlockHash]] = {}
        get, fp = self._hashes.get, self._fp
        for ns_id, key in pages:
            by_ns.setdefault(ns_id, []).append(get(fp(ns_id) + key, key))
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
        get, fp = self._hashes.get, self._fp(ns_id)
        if medium == E.MEDIUM_L2 and self._left_l2:  # back in L2
            self._left_l2.difference_update(map(fp.__add__, keys))
        self._add(
            ns_id,
            E.BlockStored(
                block_hashes=[get(fp + k, k) for k in keys],
                parent_block_hash=None if parent_key is None else get(fp + parent_key, parent_key),
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

    def _remember(self, ns_id: int, keys: Sequence[bytes], hs: Sequence[E.BlockHash]) -> None:
        """Remember the engine's hash of each key of ``ns_id``; the oldest go beyond the
        bound."""
        hashes, left = self._hashes, self._left_l2
        named = list(map(self._fp(ns_id).__add__, keys))
        hashes.update(zip(named, hs))
        if left:  # stored: in L2 again
            left.difference_update(named)
        excess = len(hashes) - self._max_hashes
        if excess > 0:
            for key in list(itertools.islice(hashes, excess)):
                del hashes[key]
                left.discard(key)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (for tests and the bench)."""
        return self._stream.next_seq

    # ------------------------------------------------------------------ batches
    def _add(self, ns_id: int, event: E.Event) -> None:
        """Queue ``event`` on its namespace's topic, in order with the deferred ones."""
        if not self._flushing:
            self._defer(self._add, ns_id, event)
            return
        self._add_to(self._topic(ns_id), event)

    def _add_to(self, topic: bytes, event: E.Event) -> None:
        """Queue ``event`` on ``topic`` (while the flush builds events)."""
        events = self._pending.get(topic)
        if events is None:
            events = self._pending[topic] = []
        events.append(event)

    def publish_now(self) -> None:
        """Build and publish what is pending now (before a namespace id changes hands: the
        events of its old namespace go to the old namespace's topic)."""
        if self._deferred or self._pending:
            self._flush()

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
                self._stream.publish(
                    topic,
                    E.encode_batch(E.KVEventBatch(ts=ts, events=events[a : a + self._max_batch])),
                )


def open_publisher(
    cfg: DaemonConfig,
    counters: Counters,
    tier: TierStore,
    zctx: zmq.Context[Any],
    guard: ConnectionGuard | None = None,
) -> KvEventPublisher:
    """Bind the publisher's sockets, start its replay reader and hook it to the tier's
    evictions, prefetch commits and L3 writes (call from the event loop; close it with
    :meth:`KvEventPublisher.close`). ``guard`` bounds the sockets' connections.

    Raises:
        ConfigError: an endpoint cannot be bound (in use, bad address), naming its setting.
    """
    pub = KvEventPublisher(
        cfg, counters, zctx, tier.namespace_of, state_dir(cfg.state_dir) / kv_event_state.FILE_NAME
    )
    try:
        pub.start(guard)
    except BaseException:
        pub.close()
        raise
    tier.on_evicted = pub.evicted
    tier.prefetcher.on_committed = pub.l2_filled
    tier.writer.on_written = lambda pages: pub.l3_written(pages, tier.pool.parent_keys)

    def l3_dropped(dropped: list[tuple[bytes, bytes]]) -> None:
        ids = tier.pool.namespaces()  # fingerprint -> pool namespace id
        pub.l3_dropped([(ids[fp], key) for fp, key in dropped if fp in ids])

    tier.on_l3_dropped = l3_dropped
    pool = tier.pool

    def l3_replaced() -> None:  # as after a FLUSH of every namespace
        for ns_id in sorted(set(pool.namespaces().values())):
            if ns_id >= 0:
                pub.l3_cleared(ns_id, pool.ready_pages(ns_id))

    tier.on_l3_replaced = l3_replaced

    def held(ns_id: int) -> PagesHeld:
        return pool.ready_pages(ns_id), lambda keys: pool.lookup(ns_id, keys)

    pub.announce_held(pool.namespaces(), held)
    log.info(
        "publishing KV events on %s (replay: %s)",
        cfg.kv_events_endpoint,
        cfg.kv_events_replay_endpoint or "off",
    )
    return pub
