"""The engine-facing cache manager: L1 radix tree, L2 through kvtierd, HiCache write policies.

One :class:`CacheManager` per engine rank. It owns the rank's :class:`RadixTree` (the L1 index)
and, when given a :class:`Connection`, uses the daemon as L2 (and L3). A request goes::

    m = cm.match(tokens)             L1 hit (locked) + keys of the rest + ONE lookup round trip
    pages = cm.alloc(n)              device pages; evicts L1 (per the write policy) when short
    ld = cm.load(m, pages[:m.l2_pages])
    model.prefill(..., layer_wait=ld.wait_layer)   loading overlaps computing, layer by layer
    ld.finish()                      False: recompute from the L1 boundary (cm.recover_failed_load)
    dups = cm.insert(m, table)       tree takes the prompt's full pages; write policy may STORE
    ... decode ...
    cm.release(m); cm.free(request-owned pages)

Write policies (HiCache's): ``write_through`` stores a page on its first insert;
``write_through_selective`` once ``write_through_threshold`` requests have inserted it (the
request that computed it counts, as HiCache counts the creating insert); ``write_back`` only
when L1 evicts it, before its device page is reused.

Page ownership: L1 pages belong to the tree; pages from :meth:`CacheManager.alloc` belong to
the request until :meth:`CacheManager.insert` hands its full prompt pages to the tree. A device
page goes back to the allocator only after every STORE reading it has completed, and never while
a LOAD might still write it (a failed load's pages are quarantined while the daemon lives).

Not thread-safe: call it from the engine's scheduler thread. A prompt's last token is always
computed (as SGLang matches ``tokens[:-1]``), so at most ``(len - 1) // page_size`` pages hit.

The manager keeps the request path, eviction and the quarantine of failed loads; a request's
state (:class:`MatchResult`, :class:`LoadHandle`) is in :mod:`kvtier.client.cache.request`, the
STORE bookkeeping of the write policies in :mod:`kvtier.client.cache.store_tracker`, the counters in
:mod:`kvtier.client.cache.counters`. Those names are imported here for the manager's users.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.client.cache.counters import CacheCounters
from kvtier.client.cache.link import CacheLink
from kvtier.client.cache.request import LoadHandle, MatchResult
from kvtier.client.cache.store_tracker import StoreTracker
from kvtier.client.page_keys import page_keys, token_ids
from kvtier.client.radix.results import EvictedPage
from kvtier.client.radix.tree import RadixTree
from kvtier.config import ClientConfig, KvtierError, client_config

__all__ = [
    "CacheCounters",
    "CacheManager",
    "DeviceAllocator",
    "DevicePoolExhausted",
    "LoadHandle",
    "MatchResult",
]

log = logging.getLogger("kvtier.client")

_LOCAL_SEED = hashlib.sha256(b"kvtier local L1 namespace").digest()


class DevicePoolExhausted(KvtierError):
    """Not enough device pages, even after evicting every unlocked L1 page."""


class DeviceAllocator(Protocol):
    """What the manager needs from the engine's device page allocator."""

    @property
    def free_count(self) -> int:
        """Pages free now."""
        ...

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, or None (taking nothing) when fewer are free."""
        ...

    def free(self, pages: Iterable[int]) -> None:
        """Return pages."""
        ...


QUARANTINE_POLL_S = 0.005
"""How often a recompute waiting for a failed load's pages asks whether the daemon ended it."""


@dataclass(slots=True)
class _Quarantine:
    """Pages of a failed load kept out of use while kvtierd may still write them.

    ``handed``: those of them the manager gives back to the allocator once no late write
    can land (the request took fresh pages in their place, or freed them meanwhile); the
    others go back to the request, which frees them itself.
    """

    load: LoadHandle
    pages: list[int]
    handed: set[int] = field(default_factory=set)


class CacheManager:
    """L1 prefix cache of one engine rank, backed by kvtierd when a connection is given.

    Args:
        allocator: the engine's device page allocator; evicted pages are freed into it.
        connection: a registered link to kvtierd: a :class:`~kvtier.client.connection.connection.Connection`
            or a :class:`~kvtier.client.cache.staged.StagedConnection` (None: a plain L1 prefix
            cache, nothing stored).
        config: write policy and threshold, timeouts (default: the connection's, else defaults).
        page_size: tokens per page; required without a connection (else the geometry's).
        key_seed: chain seed without a connection (default: a fixed local seed).

    Raises:
        KvtierError: no page size, or a connection that is not registered.
    """

    __slots__ = (
        "_alloc",
        "_cfg",
        "_conn",
        "_deferred",
        "_loading",
        "_marks_epoch",
        "_page_size",
        "_quarantine",
        "_quarantined",
        "_seed",
        "_stores",
        "_tree",
        "counters",
    )

    def __init__(
        self,
        allocator: DeviceAllocator,
        connection: CacheLink | None = None,
        config: ClientConfig | None = None,
        page_size: int | None = None,
        key_seed: bytes | None = None,
    ) -> None:
        if connection is not None:
            page_size = connection.geometry.page_size
            if len(connection.ns_fingerprint) != 32:
                raise KvtierError("the connection is not registered (no namespace fingerprint)")
        if page_size is None:
            raise KvtierError("page_size is required without a connection")
        self._alloc = allocator
        self._conn = connection
        self._cfg = config or (connection.config if connection is not None else client_config())
        self._page_size = page_size
        self._seed = (
            connection.ns_fingerprint if connection is not None else (key_seed or _LOCAL_SEED)
        )
        self._tree = RadixTree(page_size)
        # the daemon epoch the tree's in-L2 marks were made under (another daemon may not
        # hold those pages: a cold start, a pool discarded for a changed configuration)
        self._marks_epoch = connection.epoch if connection is not None else 0
        self._quarantine: list[_Quarantine] = []
        self._quarantined: set[int] = set()
        self._deferred: set[int] = set()  # freed while a failed STORE may still read them
        # loads not yet settled; one whose request dropped it unsettled leaves with it
        self._loading: weakref.WeakSet[LoadHandle] = weakref.WeakSet()
        self.counters = CacheCounters()
        policy = self._cfg.hicache_write_policy
        threshold = (
            1
            if policy == "write_through"
            else self._cfg.write_through_threshold
            if policy == "write_through_selective"
            else 0
        )
        self._stores = StoreTracker(connection, self._tree, self.counters, threshold)

    @property
    def tree(self) -> RadixTree:
        """The L1 index (read it; change it only through the manager)."""
        return self._tree

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def write_policy(self) -> str:
        """``write_through``, ``write_through_selective`` or ``write_back``."""
        return self._cfg.hicache_write_policy

    @property
    def quarantined_pages(self) -> int:
        """Device pages held back after failed loads and stores (a live daemon might still
        write or read them)."""
        return len(self._quarantined) + len(self._deferred)

    @property
    def pending_stores(self) -> int:
        """STOREs issued and not yet reaped."""
        return self._stores.pending

    # ------------------------------------------------------------------ request path
    def match(self, tokens: Sequence[int]) -> MatchResult:
        """Find the cached prefix of ``tokens``: the L1 hit (locked), then L2/L3 in one lookup.

        Args:
            tokens: the prompt.

        Returns:
            The match; pass it to :meth:`load`, :meth:`insert` and :meth:`release`.
        """
        self._forget_marks_of_another_epoch()
        toks = token_ids(tokens)
        size = self._page_size
        n_full = len(toks) // size
        usable = max(len(toks) - 1, 0) // size
        pm = self._tree.match_prefix(toks[: usable * size])
        seed = pm.keys[-1] if pm.keys else self._seed
        keys = pm.keys + page_keys(seed, toks[pm.matched_tokens : n_full * size], size)
        l1 = pm.device_pages
        self._tree.lock(pm.last_node)
        l2 = l3 = coming = 0
        rest = keys[l1:usable]
        if self._conn is not None and rest:
            try:
                rep = self._conn.lookup(rest)
            except BaseException:
                self._tree.unlock(pm.last_node)
                raise
            l2 = min(rep.l2, len(rest))
            l3 = min(rep.l3, len(rest) - l2)
            if l3 and l3 * size >= self._cfg.prefetch_threshold:
                # L3 to L2 from now on: load() claims what came (HiCache's prefetch); the
                # last L1 key leads, skipped, so that the fetched run extends it in L2
                lead = 1 if l1 else 0
                try:
                    coming = min(
                        l3,
                        self._conn.prefetch_coming(keys[l1 - lead : l1 + l2 + l3], skip=l2 + lead),
                    )
                except BaseException:
                    self._tree.unlock(pm.last_node)
                    raise
            self._tree.mark_in_l2(rest[:l2])
            # L2 lost what the tree took for held there (evicted by others, flushed, a cold
            # restart): unmarked, so an eviction writes them back and a STORE sends them
            self._tree.set_in_l2(rest[l2:], False)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += len(toks)
        c.l1_hit_tokens += l1 * size
        c.l2_hit_tokens += l2 * size
        c.l3_hit_tokens += l3 * size
        return MatchResult(
            toks,
            keys,
            size,
            pm.device_page_ids,
            pm.in_l2[:l1],
            l2,
            l3,
            pm.last_node,
            l3_coming=coming,
            epoch=self._marks_epoch,
            seed=self._seed,
        )

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` device pages, evicting unlocked L1 pages (per the write policy) if short.

        Args:
            n: pages wanted.

        Returns:
            The page ids, owned by the caller.

        Raises:
            DevicePoolExhausted: fewer than ``n`` pages even after evicting all it could;
                nothing is evicted when even every L1 page could not make room.
        """
        self._drain_quarantine()
        pages = self._alloc.alloc(n)
        # quarantined and deferred pages come back only in a later drain, not in this loop
        if pages is None and n > self._alloc.free_count + self._tree.evictable_page_count:
            raise DevicePoolExhausted(self._short(n))
        while pages is None:  # pages a stalled STORE may still read come back later: more
            if not self._evict(n - self._alloc.free_count):
                raise DevicePoolExhausted(self._short(n))
            pages = self._alloc.alloc(n)
        return pages

    def _short(self, n: int) -> str:
        return (
            f"{n} device pages needed, {self._alloc.free_count} free; "
            f"{self._tree.device_page_count} held by L1 "
            f"({self._tree.evictable_page_count} evictable), "
            f"{len(self._quarantined) + len(self._deferred)} quarantined"
        )

    def load(self, match: MatchResult, device_pages: Sequence[int]) -> LoadHandle:
        """Start loading the L2 run of ``match`` into ``device_pages``: with a prefetch from
        L3 running (``match.l3_coming``), first claim it, as the client's
        ``hicache_storage_prefetch_policy`` says (else the daemon's), and load the run L2
        then holds.

        Args:
            match: from :meth:`match`.
            device_pages: pages from :meth:`alloc`: ``match.l2_pages`` to load the L2 run,
                ``match.l2_pages + match.l3_coming`` to load what the prefetch brings too.

        Returns:
            The handle; ``handle.pages`` may be below what was asked for (L2 evicted some
            meanwhile, a prefetch ended short, the daemon is away, or, under
            ``write_back``, this engine's loads in flight already take the link's room for
            loads, :attr:`CacheLink.load_room`, which keeps the rest for the STOREs of
            evicted pages): compute the rest.

        Raises:
            KvtierError: ``device_pages`` names a page twice, or a page the tree holds (the
                match's L1 hit among them): the load would write over KV other requests read.
        """
        self._check_request_pages(device_pages, "device_pages")
        l1 = len(match.l1_pages)
        want = min(match.l2_pages + match.l3_coming, len(device_pages))
        if match.l3_coming and self._conn is not None:
            # the keys the prefetch was started with (the whole L3 run, however many of
            # its pages come): the daemon finds a prefetch by its last key
            held = self._conn.claim(match.keys[l1 : l1 + match.l2_pages + match.l3_pages])
            self.counters.l3_claimed_tokens += max(0, held - match.l2_pages) * self._page_size
            n = min(held, want)
        else:
            n = min(match.l2_pages, want)
        transfer = None
        if n and self._conn is not None and self._cfg.hicache_write_policy == "write_back":
            # an eviction's STORE is then the only copy kvtier makes of a page: loads leave
            # it the slots it needs
            loads, room = self._conn.load_room
            busy = len(self._loading) + len(self._quarantine)
            pages = sum(h.pages for h in self._loading)
            n = 0 if busy >= loads else min(n, room - pages)
        if n > 0 and self._conn is not None:
            transfer = self._conn.load(match.keys[l1 : l1 + n], list(device_pages[:n]))
        handle = LoadHandle(match, transfer, device_pages, self._load_settled)
        if handle.pages:
            self._loading.add(handle)
        match.load = handle
        return handle

    def _check_request_pages(self, pages: Sequence[int], name: str) -> None:
        """Refuse ``pages`` (a request's) naming one twice or one the tree holds."""
        held = self._tree.first_held(pages)
        if held is not None:
            raise KvtierError(
                f"{name} names device page {held}, an L1 page the tree holds (a request's "
                "pages are those alloc() gave it that the tree did not take)"
            )
        if len(set(pages)) != len(pages):
            raise KvtierError(f"{name} names a device page twice")

    def recover_failed_load(self, load: LoadHandle) -> list[int]:
        """Pages to recompute into after ``load`` failed, in place of ``load.page_ids``.

        Args:
            load: a settled, failed load.

        Returns:
            ``load.page_ids`` when no late write can reach them (the daemon is gone, or it
            ended the load), else as many fresh pages (the old ones stay quarantined, owned
            by the manager). When the pool has no room for them, the daemon is given up to
            ``load_timeout_s`` to end the load (its RELEASE is on its way), and the same
            pages are used then.

        Raises:
            DevicePoolExhausted: no room for fresh pages, and the daemon did not end the
                load in time (it stays stalled: the pages may still be written).
        """
        assert load.failed, "recover_failed_load() of a load that did not fail"
        self._drain_quarantine()  # ended already: its pages are the request's again
        if not load.quarantined:
            return list(load.page_ids)
        try:
            fresh = self.alloc(len(load.page_ids))
        except DevicePoolExhausted:
            deadline = time.monotonic() + self._cfg.load_timeout_s
            while load.copying() and time.monotonic() < deadline:
                time.sleep(QUARANTINE_POLL_S)
            if load.copying():
                raise
        else:
            if not load.quarantined:  # ended meanwhile (the alloc drained it)
                self._alloc.free(fresh)
                return list(load.page_ids)
            for q in self._quarantine:
                if q.load is load:  # the old pages are the manager's from now on
                    q.handed.update(q.pages)
            return fresh
        # ended: no late write can land any more, the pages go back to the caller
        self._quarantine = [q for q in self._quarantine if q.load is not load]
        self._quarantined.difference_update(load.page_ids)
        load.quarantined = False
        return list(load.page_ids)

    def record_computed(self, tokens: int) -> None:
        """Count prompt tokens the engine computed (for :attr:`counters`)."""
        self.counters.computed_tokens += tokens

    def insert(self, match: MatchResult, device_pages: Sequence[int]) -> list[int]:
        """Hand the prompt's full pages to the tree after prefill and apply the write policy.

        The request's lock moves to the inserted path, so its pages stay put until release.

        Args:
            match: from :meth:`match`, not released.
            device_pages: one device page per full page of ``match.tokens`` (the L1 pages
                first, as in the page table).

        Returns:
            Pages of ``device_pages`` the tree did not take (another copy was already on the
            device); the caller frees them when done reading them.

        Raises:
            KvtierError: wrong number of pages, or a released match.
        """
        size = self._page_size
        n = len(match.tokens) // size
        if match.released:
            raise KvtierError("insert() of a released match")
        if len(device_pages) != n:
            raise KvtierError(f"{n} full pages need {n} device pages, got {len(device_pages)}")
        pages = list(device_pages)
        restarted = self._forget_marks_of_another_epoch() or match.epoch != self._marks_epoch
        if restarted and match.seed != self._seed:  # keyed under the namespace's old name
            match.keys = page_keys(self._seed, match.tokens[: len(match.keys) * size], size)
            match.seed = self._seed
        keys = match.keys[:n]
        res = self._tree.insert(match.tokens[: n * size], pages, keys)
        self._tree.lock(res.last_node)
        if match.node is not None:
            self._tree.unlock(match.node)
        match.node = res.last_node
        l1, loaded = len(match.l1_pages), match.loaded_pages
        l1_in_l2 = match.l1_in_l2
        if restarted:
            l1_in_l2, loaded = [False] * l1, 0  # the daemon restarted since the match
        if loaded:
            self._tree.mark_in_l2(keys[l1 : l1 + loaded])
        self._stores.inserted(keys, pages, l1, l1_in_l2, loaded)
        return res.duplicate_page_ids

    def release(self, match: MatchResult) -> None:
        """End a request: settle its load, unlock its pages and reap finished STOREs.

        Call it before freeing the request's pages. Idempotent.

        Args:
            match: from :meth:`match`.
        """
        if match.released:
            return
        match.released = True
        if match.load is not None:
            match.load.finish()
        if match.node is not None:
            self._tree.unlock(match.node)
            match.node = None
        self.sync()

    def free(self, pages: Iterable[int]) -> None:
        """Return request-owned pages to the allocator once no STORE reads them.

        Pages the manager quarantined (a failed load's) are skipped: it frees them itself,
        once no late write can reach them.

        Args:
            pages: pages from :meth:`alloc` that the tree did not take.

        Raises:
            KvtierError: a page the tree holds, or one named twice (nothing is freed):
                handed out again, an L1 page would serve another prompt's KV as a hit.
        """
        pages = list(pages)
        self._check_request_pages(pages, "free()")
        kept = [p for p in pages if p in self._quarantined] if self._quarantined else []
        if kept:
            for q in self._quarantine:
                q.handed.update(p for p in kept if p in q.pages)
            pages = [p for p in pages if p not in self._quarantined]
        self._stores.reap_pages(pages)
        self._release(pages)

    # ------------------------------------------------------------------ maintenance
    def _forget_marks_of_another_epoch(self) -> bool:
        """When the connection has registered with another daemon epoch since the tree's
        in-L2 marks were made, clear them all (pages only L2 held leave the tree): the new
        daemon may hold none of those pages, and a marked L1 page is never stored again.
        Whether it cleared them."""
        conn = self._conn
        if conn is None or conn.epoch == self._marks_epoch:
            return False
        self._marks_epoch = conn.epoch
        self._tree.clear_l2_marks()
        seed = conn.ns_fingerprint
        if len(seed) == 32 and seed != self._seed:  # the new daemon names the namespace anew
            self._seed = seed
            new_of = self._tree.rekey(seed, lambda p, toks: page_keys(p, toks, self._page_size))
            self._stores.rekey(new_of)
        return True

    def sync(self) -> None:
        """Wait for every STORE in flight and record what L2 now holds."""
        self._stores.sync()

    def flush_l1(self) -> int:
        """Evict every unlocked L1 page (write_back stores them first): a cold L1.

        Returns:
            Pages freed.
        """
        return self._evict(self._tree.device_page_count)

    def stored_prefix_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens of the leading full pages of ``tokens`` that L2 holds now (one lookup).

        Args:
            tokens: a prompt.

        Returns:
            The L2 run times the page size (0 without a connection).
        """
        if self._conn is None:
            return 0
        keys = page_keys(self._seed, token_ids(tokens), self._page_size)
        return self._conn.lookup(keys).l2 * self._page_size if keys else 0

    def close(self) -> None:
        """Wait for STOREs in flight and end quarantines whose daemon is gone. Idempotent."""
        self.sync()
        self._drain_quarantine()

    # ------------------------------------------------------------------ internals
    def _evict(self, n: int) -> int:
        """Free up to ``n`` unlocked L1 pages; under write_back, STORE those L2 lacks first."""
        if n <= 0:
            return 0
        self.sync()  # the tree must know what L2 holds before it picks pages to drop
        evicted = self._tree.evict(n)
        for e in evicted:
            self._stores.forget(e.key)
        parents = [e.parent for e in evicted]  # the tree's chain, also for pages L2 held
        if self._cfg.hicache_write_policy == "write_back":
            lost = self._lost_from_l2(evicted, parents)
            backup = [
                (e.key, e.page_id, parent)
                for e, parent in zip(evicted, parents)
                if not e.in_l2 or e.key in lost
            ]
            self._stores.write_back(backup)
        self._release([e.page_id for e in evicted])
        self.counters.evicted_pages += len(evicted)
        return len(evicted)

    def _lost_from_l2(
        self, evicted: Sequence[EvictedPage], parents: list[bytes | None]
    ) -> set[bytes]:
        """Keys of evicted pages marked as held by L2 that L2 no longer holds (evicted there
        while the page stayed on the device, where hits never refresh L2's copy): one LOOKUP
        per chain run of them, parent first (eviction runs tail first); the pages past each
        run's leading L2 run."""
        if self._conn is None:
            return set()
        runs: list[list[bytes]] = []
        for e, parent in zip(reversed(evicted), reversed(parents)):
            if not e.in_l2:
                continue
            if runs and parent == runs[-1][-1]:
                runs[-1].append(e.key)
            else:
                runs.append([e.key])
        lost: set[bytes] = set()
        for run in runs:
            try:
                held = self._conn.lookup(run).l2
            except Exception as err:  # the daemon is away: no STORE would land either
                log.debug("write-back lookup failed: %s", err)
                return lost
            lost.update(run[held:])
        return lost

    def _load_settled(self, load: LoadHandle, match: MatchResult, ok: bool) -> None:
        """Record a load's outcome; quarantine its pages if a live daemon might still write them."""
        self._loading.discard(load)
        if ok:
            match.loaded_pages = load.pages
            self.counters.loaded_tokens += load.tokens
            return
        match.loaded_pages = 0
        self.counters.load_failures += 1
        if load.page_ids and load.copying():
            # A live daemon may still copy one more layer into these pages (it checks a
            # cancel between layers, and a stalled one copies when it resumes): keep them
            # out of use until it has ended the load or is gone.
            load.quarantined = True
            self._quarantined.update(load.page_ids)
            self._quarantine.append(_Quarantine(load, list(load.page_ids)))

    def _release(self, pages: list[int]) -> None:
        """Give ``pages`` back to the allocator, except those a STORE whose wait failed may
        still read (a stalled daemon that resumes would store what a new owner wrote there
        under the old keys): those go back once it has ended (:meth:`_drain_quarantine`)."""
        held = self._stores.still_read(pages)
        if held:
            self._deferred.update(held)
            pages = [p for p in pages if p not in held]
        self._alloc.free(pages)

    def _drain_quarantine(self) -> None:
        if self._deferred:
            done = self._deferred - self._stores.still_read(self._deferred)
            self._deferred -= done
            self._alloc.free(sorted(done))
        if not self._quarantine:
            return
        keep = []
        for q in self._quarantine:
            if not q.load.copying():
                self._quarantined.difference_update(q.pages)
                q.load.quarantined = False  # those not handed are the request's again
                self._alloc.free([p for p in q.pages if p in q.handed])
            else:
                keep.append(q)
        self._quarantine = keep
