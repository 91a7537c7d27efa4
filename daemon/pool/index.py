"""The L2 host pool: :class:`HostPool`, an index and slot allocator over one host arena.

Pure and synchronous (no I/O, no mapping, no locks, no ``await``): the arena and its
metadata are mapped elsewhere (:func:`~kvtier.daemon.pool.layout.map_pool_file`); the pool
hands out byte offsets into the arena and keeps every page's state. It is assembled from
one module per concept::

    index      HostPool: construction, adoption, ids, geometry, quotas, introspection
    bulk       pin and unpin of long runs in numpy
    pages      PageTable: the index and page state machine (lookup, allocate, commit,
               abort, pin, unpin, flush)
    eviction   Evictor: victim choice (lru or arc, tail first), quotas, the write-back hook
    arc        the arc policy's state: T1/T2 split, adaptive target, ghost lists
    slots      SlotAllocator: extents, page classes, free lists
    links      the intrusive lists: evictable pages (recency), each page's children
    layout     the pool file's format: header, id tables, columns; mapping the file
    meta       PoolMeta: the metadata region, mapped as typed column views
    adopt      the adoption scan: which rows survive a restart
    records    page states, the records the pool reports, its errors

Restart (:meth:`HostPool.adopt`): READY pages that verify come back with their keys,
namespaces, owners, offsets and in-L3 flags; WRITING pages and pins are dropped; the
rest is rebuilt (the evictable lists by last-access stamp). Names other modules import
from here (records, eviction constants, :class:`PoolLayout`) are re-exported.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from kvtier.config.errors import ConfigError
from kvtier.config.sizes import format_size
from kvtier.daemon.pool import keytable
from kvtier.daemon.pool.adopt import scan_rows
from kvtier.daemon.pool.bulk import pin_run, run_pages, unpin_run
from kvtier.daemon.pool.eviction import EVICT_FACTOR, MIN_SCAN
from kvtier.daemon.pool.keytable import KeyTable, table_keys
from kvtier.daemon.pool.layout import (
    HAS_CHECKSUM,
    HEADROOM_ALIGN,
    HEADROOM_MIN_PAGE_BYTES,
    KEY_BYTES,
    MAX_SLOT_IDS,
    NIL,
    IdTable,
    PoolLayout,
)
from kvtier.daemon.pool.meta import PoolMeta, tenant_digest
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.records import (
    AdoptResult,
    ClassStats,
    EvictedPage,
    HostPoolError,
    HostPoolStats,
    PageInfo,
    PageState,
    PageStateError,
)

if TYPE_CHECKING:
    from kvtier.config import DaemonConfig

TABLE_MIN_KEYS = 256
"""Lookups of this many keys or more are answered from the key table (:meth:`HostPool.lookup_packed`);
shorter ones probe the index key by key (cheaper below it)."""
TABLE_BATCH = 4096
"""Committed slots wait in a list until a long lookup needs the key table, or until this
many wait: one numpy insertion for many commits instead of one per STORE."""

# HostPool, and names re-exported from their homes (eviction, layout, records) for the
# modules that import them from here
__all__ = [
    "EVICT_FACTOR", "MIN_SCAN", "NIL", "AdoptResult", "ClassStats", "EvictedPage", "HostPool",
    "HostPoolError", "HostPoolStats", "PageInfo", "PageState", "PageStateError", "PoolLayout",
]  # fmt: skip


class HostPool(PageTable):
    """Slot allocator and L2 index over one host arena (see the module docstring).

    The constructor builds an empty pool whose metadata lives in private memory (nothing
    persists); :meth:`adopt` moves it onto persistent metadata and adopts what it holds.
    The page operations (:meth:`lookup`, :meth:`allocate`, :meth:`commit`, :meth:`abort`,
    :meth:`pin`, :meth:`unpin`, :meth:`mark_in_l3`, :meth:`flush`) are
    :class:`~kvtier.daemon.pool.pages.PageTable`'s.

    Args:
        capacity_bytes: arena size; ``capacity_bytes // layout.span`` extents are used
            (``span`` is ``extent_bytes`` without headroom).
        extent_bytes: payload bytes of one extent, a multiple of ``align``.
        align: slot alignment, a power of two; strides are multiples of it.
        min_page_bytes: smallest page size expected. Metadata (about 88 persistent and
            44 private bytes per id) is sized for ``extent_bytes // round_up(min_page_bytes,
            align)`` slots per extent; None means pages of ``align`` bytes. A class with
            smaller pages still works but uses only that many slots of each extent.
        headroom: bytes every slot keeps before its payload, for an L3 backend's object
            header (0: none; else a multiple of ``align`` of at least ``SLOT_HEADROOM``).
            Extents grow by ``headroom`` per slot id, so a class cuts as many pages from
            one as without (see :class:`PoolLayout`).
        max_evicted_log: evictions kept for :meth:`drain_evicted`; more are counted only.
        eviction_policy: ``"lru"`` or ``"arc"`` (:mod:`~kvtier.daemon.pool.eviction`).

    Raises:
        HostPoolError: the geometry is invalid or the arena holds no extent.
    """

    @classmethod
    def from_config(cls, cfg: DaemonConfig, headroom: int = 0) -> HostPool:
        """The daemon's empty host pool for ``cfg``.

        Args:
            cfg: the daemon's configuration (``hicache_size``, ``extent_size``).
            headroom: bytes before each payload that the L3 backend writes its object
                header into (0: none). Without headroom slots are 4 KiB-aligned; with it,
                payloads are 128-byte-aligned and extents keep the slot ids of 4 KiB pages.

        Raises:
            ConfigError: ``hicache_size`` cannot hold one extent with its headroom, or is
                so large that the index cannot number its slots (the message names the
                largest ``hicache_size`` allowed with this ``extent_size``).
        """
        if not headroom:
            _check_slot_ids(cfg, PoolLayout.max_capacity(cfg.extent_size))
            return cls(cfg.hicache_size, cfg.extent_size, eviction_policy=cfg.eviction_policy)
        _check_slot_ids(
            cfg,
            PoolLayout.max_capacity(
                cfg.extent_size, HEADROOM_ALIGN, HEADROOM_MIN_PAGE_BYTES, headroom
            ),
        )
        span = cfg.extent_size + cfg.extent_size // HEADROOM_MIN_PAGE_BYTES * headroom
        if cfg.hicache_size < span:
            raise ConfigError(
                f"hicache_size ({cfg.hicache_size}) must hold at least one extent_size "
                f"({cfg.extent_size}) extent with its slots' headroom ({span} bytes in all) "
                f"when hicache_storage_backend is {cfg.hicache_storage_backend!r}"
            )
        return cls(
            cfg.hicache_size,
            cfg.extent_size,
            HEADROOM_ALIGN,
            min_page_bytes=HEADROOM_MIN_PAGE_BYTES,
            headroom=headroom,
            eviction_policy=cfg.eviction_policy,
        )

    def __init__(
        self,
        capacity_bytes: int,
        extent_bytes: int,
        align: int = 4096,
        *,
        min_page_bytes: int | None = None,
        max_evicted_log: int = 65536,
        headroom: int = 0,
        eviction_policy: str = "lru",
    ) -> None:
        layout = PoolLayout.plan(
            capacity_bytes, extent_bytes, align, min_page_bytes, headroom=headroom
        )
        # anonymous memory is zero until touched: a bytearray would clear every byte now
        # (tens of MiB for a large pool), only for adopt() to move off it
        meta = PoolMeta(mmap.mmap(-1, layout.meta_bytes), layout)
        meta.format(zero=False)
        self._setup(
            meta, max_log=max_evicted_log, quota={}, requires_l3=False, policy=eviction_policy
        )

    def adopt(self, meta: Any, *, arena: Any | None = None,
              cold_start: bool | str | None = False) -> AdoptResult:  # fmt: skip
        """Move this pool, still empty, onto persistent metadata and adopt what it holds.

        When the stored header matches :attr:`layout` (magic, format version, checksum,
        geometry), the generation is incremented and READY pages that verify come back;
        WRITING pages and all pins are dropped (whoever held them is gone). Otherwise, or
        with ``cold_start``, the metadata is formatted: an empty pool, generation 1.
        Quotas, :attr:`evict_requires_l3` and registered classes (with their ids) are
        kept; the eviction counters restart; namespace and owner ids come from the
        adopted tables, so ask for them (:meth:`namespace_id`, :meth:`owner_id`) after.

        Args:
            meta: writable buffer of at least ``layout.meta_bytes`` bytes (the first bytes
                of the pool file's mapping); the pool keeps views of it until :meth:`close`.
            arena: the arena (``capacity_bytes`` from ``layout.arena_offset``), to verify
                each READY page's payload against its checksum; pages committed without
                one are then dropped. None adopts payloads unverified (row seals are
                checked either way).
            cold_start: discard on purpose; a string is the reason to report (such as
                the ``why_new`` of :func:`map_pool_file`); None or False adopts.

        Returns:
            What was adopted or why nothing was; ``summary`` is the line to log.

        Raises:
            HostPoolError: the pool holds pages, the buffer is read-only or too small, or
                the arena is too small. The pool is unchanged.
        """
        if self._index:
            raise HostPoolError(f"adopt needs an empty pool; {len(self._index)} pages are resident")
        old = self._meta
        result = self._bind(PoolMeta(meta, old.layout), arena, cold_start,
                            [c.page_bytes for c in self._classes])  # fmt: skip
        old.release()
        return result

    @property
    def layout(self) -> PoolLayout:
        """The pool's geometry and metadata layout (what :func:`map_pool_file` needs)."""
        return self._meta.layout

    def _bind(self, pm: PoolMeta, arena: Any | None, cold_start: bool | str | None,
              classes: Sequence[int]) -> AdoptResult:  # fmt: skip
        """Check, then format or adopt ``pm``, and rebuild this pool over it."""
        t0 = time.perf_counter()
        need = pm.layout.n_extents * pm.layout.span
        if arena is not None:
            with memoryview(arena) as view:
                nbytes = view.nbytes
            if nbytes < need:
                pm.release()
                raise HostPoolError(f"the arena has {nbytes} bytes, the pool needs {need}")
        reason = (
            pm.mismatch()
            if not cold_start
            else (cold_start if isinstance(cold_start, str) else "cold start requested")
        )
        if reason is not None:
            pm.format()
        gen = 1 if reason is not None else pm.bump_generation()
        ev = self._ev
        self._setup(
            pm, max_log=ev.max_log, quota=ev.quota, requires_l3=ev.requires_l3, policy=ev.policy
        )
        for page_bytes in classes:
            self.register_class(page_bytes)
        if reason is not None:
            return AdoptResult(False, reason, 0, 0, 0, time.perf_counter() - t0, gen)
        scan = scan_rows(pm, self._slots.usable_per_extent(), self._key, arena)
        self._rebuild(scan.slots, scan.ready, scan.parents)
        return AdoptResult(True, "metadata matches the config", len(scan.slots), scan.dropped,
                           scan.payload_bytes, time.perf_counter() - t0, gen)  # fmt: skip

    def close(self) -> None:
        """Release the views of the metadata buffer, so its mapping can close; the pool
        is unusable afterwards. Nothing is written: the metadata already holds everything
        (closing is not needed for a restart to adopt the pool)."""
        self._table.close()
        self._meta.release()

    # ------------------------------------------------------- long lookups

    def _setup(self, meta: PoolMeta, **kw: Any) -> None:
        old: KeyTable | None = getattr(self, "_table", None)
        if old is not None:
            old.close()  # its views of the old metadata go before that is released
        super()._setup(meta, **kw)
        self._table = KeyTable(meta)
        self._unlisted: list[int] = []  # committed, not in the table yet

    def _rebuild(self, slots: Any, ready: dict[int, dict[bytes, int]], parents: Any) -> None:
        super()._rebuild(slots, ready, parents)
        self._table.rebuild()
        self._unlisted = []

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        """See :meth:`PageTable.commit`; the committed pages also enter the key table."""
        try:
            super().commit(slots, checksums)
        finally:  # a commit that failed part-way made some pages READY all the same
            self._unlisted += slots
            if len(self._unlisted) >= TABLE_BATCH:
                self._list()

    def _pin_slots(self, out: list[int]) -> None:
        """See :meth:`PageTable.pin`; a run of :func:`~kvtier.daemon.pool.bulk.run_pages`
        pages or more is pinned in one pass (:func:`~kvtier.daemon.pool.bulk.pin_run`)."""
        if len(out) < run_pages() or not pin_run(self, out):
            super()._pin_slots(out)

    def unpin(self, slots: Sequence[int]) -> None:
        """See :meth:`PageTable.unpin`; a run of :func:`~kvtier.daemon.pool.bulk.run_pages`
        pages or more is unpinned in one pass (:func:`~kvtier.daemon.pool.bulk.unpin_run`)."""
        if len(slots) < run_pages() or not unpin_run(self, slots):
            super().unpin(slots)

    def _list(self) -> None:
        """Enter the slots committed since the last time into the key table."""
        if self._unlisted:
            self._table.add(self._unlisted)  # a slot freed meanwhile costs an entry only
            self._unlisted = []

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """See :meth:`PageTable.lookup`; a list of :data:`TABLE_MIN_KEYS` keys or more
        is answered from the key table (:meth:`lookup_packed`)."""
        packed = table_keys(keys, TABLE_MIN_KEYS)
        return super().lookup(ns_id, keys) if packed is None else self.lookup_packed(ns_id, packed)

    def _run_slots(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """See :meth:`PageTable._run_slots`; for :data:`TABLE_MIN_KEYS` keys or more the C
        probe of the key table returns the slots with the run (a LOAD's pin looks no key up
        twice: 8,192 probes of the dict after a copy had flushed the caches took ms)."""
        packed = table_keys(keys, TABLE_MIN_KEYS)
        if packed is None or not keytable.NATIVE:
            return super()._run_slots(ns_id, keys)
        slots = np.empty(len(keys), dtype=np.int64)
        return cast("list[int]", slots[: self._probe_run(ns_id, packed, slots)].tolist())

    def _probe_run(
        self, ns_id: int, packed: bytes | memoryview, slots: np.ndarray | None = None
    ) -> int:
        """The leading READY run of ``packed`` (whole 32-byte keys) by the C probe, each key
        it leaves unresolved decided by the dict; with ``slots``, each key's slot is written
        there."""
        words = np.frombuffer(packed, dtype="<u8").reshape(-1, KEY_BYTES // 8)
        self._list()
        ready = self._ready.get(ns_id, {})
        i = 0
        while True:  # C: up to the first key not found, which may be an unfinished probe
            i, unresolved = self._table.leading_run(ns_id, words, i, slots)
            s = (
                ready.get(bytes(packed[i * KEY_BYTES : (i + 1) * KEY_BYTES]))
                if unresolved
                else None
            )
            if s is None:
                return i
            if slots is not None:
                slots[i] = s
            i += 1  # the exact probe found it: go on after it

    def lookup_packed(self, ns_id: int, packed: bytes | memoryview) -> int:
        """Return the length of the leading run READY in ``ns_id`` of the keys in
        ``packed``: 32-byte keys back to back, as LOOKUP's ``packed_keys`` carries them.

        The same answer as :meth:`lookup` on the split keys, for any bytes: a key counts
        only when a READY row of ``ns_id`` holds exactly its 32 bytes.

        Raises:
            HostPoolError: ``packed`` is not a whole number of keys.
        """
        if len(packed) % KEY_BYTES:
            raise HostPoolError(
                f"packed keys of {len(packed)} bytes: not a multiple of {KEY_BYTES}"
            )
        n = len(packed) // KEY_BYTES
        if not n or not self._ready.get(ns_id):
            return 0
        if n < TABLE_MIN_KEYS:
            return super().lookup(ns_id, np.frombuffer(packed, dtype=f"V{KEY_BYTES}").tolist())
        words = np.frombuffer(packed, dtype="<u8").reshape(n, KEY_BYTES // 8)
        self._list()
        ready = self._ready[ns_id]
        if not keytable.NATIVE:  # numpy: every key at once, then the exact probe for the rest
            slot, unresolved = self._table.find(ns_id, words)
            found = slot >= 0
            for j in unresolved.tolist():  # probe sequences too long to finish
                found[j] = bytes(packed[j * KEY_BYTES : (j + 1) * KEY_BYTES]) in ready
            return n if found.all() else int(found.argmin())
        return self._probe_run(ns_id, packed)

    # ------------------------------------------------------------- geometry

    def register_class(self, page_bytes: int) -> int:
        """Register a page size; the same size always gets the same class id.

        Args:
            page_bytes: bytes of one page of an engine's model.

        Returns:
            The class id (0, 1, ... in registration order; :meth:`adopt` keeps the ids
            given before it, then registers its extents' page sizes, smallest first).

        Raises:
            HostPoolError: ``page_bytes`` is not positive or its stride exceeds an extent.
        """
        cid = self._slots.register_class(page_bytes)
        self._ev.fit_class(self._classes[cid].n)
        return cid

    def class_stride(self, class_id: int) -> int:
        """Return the slot stride in bytes of ``class_id`` (HostPoolError if unknown)."""
        self._slots.check_class(class_id)
        return self._classes[class_id].stride

    def slot_offset(self, slot: int) -> int:
        """Return the byte offset of ``slot``'s payload in the arena (a multiple of
        ``align``; in a pool with headroom, the ``layout.headroom`` bytes before it belong
        to the slot too).

        Raises:
            HostPoolError: the slot id is out of range or its extent has no class.
        """
        return self._slots.slot_offset(slot)

    def slot_offsets(self, slots: list[int]) -> np.ndarray:
        """The payload offsets of ``slots`` (int64, same order): :meth:`slot_offset` of
        each, computed at once.

        Raises:
            HostPoolError: a slot id is out of range or its extent has no class.
        """
        return self._slots.slot_offsets(slots)

    # ------------------------------------------------------- persistent ids

    def namespace_id(self, fingerprint: bytes) -> int:
        """Return the id of a namespace fingerprint (32 bytes), registering it if new.

        Ids are 1, 2, ... in registration order and persist with the pool: an adopted
        pool gives every fingerprint the id its pages were stored under.

        Raises:
            HostPoolError: the fingerprint is not 32 bytes or the table is full.
        """
        return self._meta.id_of(IdTable.NAMESPACES, fingerprint)

    def namespaces(self) -> dict[bytes, int]:
        """Return a copy of the persistent ``fingerprint -> namespace id`` table."""
        return self._meta.ids(IdTable.NAMESPACES)

    def owner_id(self, tenant: str) -> int:
        """Return the owner id of ``tenant``, registering it if new: 1, 2, ... in
        registration order, persistent like :meth:`namespace_id` (the table holds a
        SHA-256 of the name). Raises HostPoolError when the table is full."""
        return self._meta.id_of(IdTable.OWNERS, tenant_digest(tenant))

    # ------------------------------------------------------------- eviction

    @property
    def evict_requires_l3(self) -> bool:
        """The write-back hook: when True, eviction takes only pages marked in L3
        (:meth:`mark_in_l3`). Kept across :meth:`adopt`."""
        return self._ev.requires_l3

    @evict_requires_l3.setter
    def evict_requires_l3(self, value: bool) -> None:
        self._ev.requires_l3 = value

    def set_quota(self, owner: int, max_pages: int | None) -> None:
        """Limit the resident (READY + WRITING) pages of ``owner``.

        An owner at or over its quota evicts only its own pages to allocate (so it
        cannot evict another owner's); lowering a quota evicts nothing at once.

        Args:
            owner: the tenant.
            max_pages: the limit, or None to lift it.

        Raises:
            HostPoolError: ``max_pages`` is negative.
        """
        self._ev.set_quota(owner, max_pages)

    def owned_pages(self, owner: int) -> int:
        """Return the resident (READY + WRITING) pages charged to ``owner``."""
        return self._owned.get(owner, 0)

    def drain_evicted(self) -> list[EvictedPage]:
        """Return the evictions logged since the last drain and clear the log."""
        return self._ev.drain()

    # --------------------------------------------------------- introspection

    def stats(self) -> HostPoolStats:
        """Return a snapshot of the pool's counters."""
        classes = tuple(
            ClassStats(c, k.page_bytes, k.stride, k.n, k.extents, k.ready, k.writing)
            for c, k in enumerate(self._classes)
        )
        return HostPoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=sum((c.pages_ready + c.pages_writing) * c.stride for c in classes),
            pages_ready=sum(c.pages_ready for c in classes),
            pages_writing=sum(c.pages_writing for c in classes),
            pages_pinned=self._n_pinned,
            evictions=self._ev.evictions,
            evicted_unlogged=self._ev.unlogged,
            extents_free=len(self._slots.free_extents),
            extents_total=self.n_extents,
            classes=classes,
            eviction_policy=self._ev.policy,
            evictions_by_reason=self._ev.by_reason(),
        )

    def describe(self, slot: int) -> PageInfo:
        """Return what the pool records about ``slot`` (HostPoolError if out of range)."""
        self._check_slot(slot)
        cid = self._ext_class[slot // self._per_extent]
        meta, ready = self._meta, self._state[slot] == PageState.READY
        return PageInfo(
            slot, PageState(self._state[slot]), self._key[slot], self._ns[slot],
            self._owner[slot], cid, self.slot_offset(slot) if cid != NIL else NIL,
            self._pins[slot], self._parent[slot], self._children[slot],
            bool(self._in_l3[slot]), self._stamp[slot], self._is_evictable(slot),
            meta.checksum[slot] if ready and meta.flags[slot] & HAS_CHECKSUM else None,
        )  # fmt: skip

    def chain_link(self, slot: int) -> tuple[bytes | None, int, int, bool, int]:
        """Return (key, namespace id, parent slot, in L3, class id) of ``slot``: the
        few fields a walk up a chain needs, without building a :class:`PageInfo`."""
        self._check_slot(slot)
        return (
            self._key[slot],
            self._ns[slot],
            self._parent[slot],
            bool(self._in_l3[slot]),
            self._ext_class[slot // self._per_extent],
        )

    def ready_pages(self, ns_id: int) -> list[tuple[bytes, bytes | None]]:
        """Return ``(key, parent key or None)`` of every READY page of ``ns_id``.
        O(pages): for FLUSH's KV events and tests."""
        keys, parent = self._key, self._parent
        return [
            (key, keys[parent[s]] if parent[s] != NIL else None)
            for key, s in self._ready.get(ns_id, {}).items()
        ]

    def evictable_slots(self, owner: int | None = None) -> list[int]:
        """Return the evictable slots, cold end first, walking the global list or
        ``owner``'s list. O(pages): for admin views and tests."""
        return self._lru.walk(owner)


def _check_slot_ids(cfg: DaemonConfig, largest: int) -> None:
    """Raise ConfigError when ``cfg.hicache_size`` exceeds ``largest`` (slot ids run out)."""
    if cfg.hicache_size > largest:
        raise ConfigError(
            f"hicache_size = {format_size(cfg.hicache_size)} ({cfg.hicache_size} bytes) is too "
            f"large: the pool's index numbers at most {MAX_SLOT_IDS} slots (one per 4 KiB), so "
            f"the largest hicache_size with extent_size {format_size(cfg.extent_size)} is "
            f"{format_size(largest)} ({largest} bytes)"
        )
