"""The L2 host pool: :class:`HostPool`, an index and slot allocator over one host arena.

Pure and synchronous (no I/O, no mapping, no locks, no ``await``): the arena and its
metadata are mapped elsewhere (:func:`~kvtier.daemon.pool.layout.map_pool_file`); the pool
hands out byte offsets into the arena and keeps every page's state. It is assembled from
one module per concept::

    host_pool   HostPool: construction (adoption), ids, geometry, quotas, introspection
    pages       PageTable: the exact index and page state machine (allocate, commit,
                abort, pin, unpin, flush)
    page_steps  PageSteps: a STORE's allocation, its commit, the release of pages, in C
    pins        Pins: the pin counts, pin and unpin in C
    lookups     KeyLookups: every LOOKUP and LOAD from the key table (keytable), in C
    native      the pool's C code (required)
    eviction    Evictor: victim choice (lru, arc or reuse, tail first), quotas, write-back
    policies    arc's and reuse's state: T1/T2 split, adaptive target, ghosts
    slots       SlotAllocator: extents, page classes, free lists
    links       the intrusive lists: evictable pages (recency), each page's children
    layout      the pool file's format: header, id tables, columns; mapping the file
    meta        PoolMeta: the metadata region, mapped as typed column views
    adopt       the adoption scan: which rows survive a restart
    records     page states, the records the pool reports, its errors
    sizing      a daemon's configuration as the pool's geometry

Restart (a :class:`HostPool` built over the pool file's metadata): READY pages that verify come back with their keys,
namespaces, owners, offsets and in-L3 flags; WRITING pages and pins are dropped; the
rest is rebuilt (the evictable lists by last-access stamp). Names other modules import
from here (records, eviction constants, :class:`PoolLayout`) are re-exported.
"""

from __future__ import annotations

import dataclasses
import mmap
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from kvtier.daemon.pool.adopt import scan_rows
from kvtier.daemon.pool.eviction import EVICT_FACTOR, MIN_SCAN
from kvtier.daemon.pool.layout import DIGEST_BYTES, HAS_CHECKSUM, NIL, IdTable, PoolLayout
from kvtier.daemon.pool.meta import PoolMeta, tenant_digest
from kvtier.daemon.pool.lookups import KeyLookups
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.sizing import geometry_of
from kvtier.daemon.pool.records import (
    MATCHED,
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

# HostPool, and names re-exported from their homes (eviction, layout, records) for the
# modules that import them from here
__all__ = [
    "EVICT_FACTOR",
    "MIN_SCAN",
    "NIL",
    "AdoptResult",
    "ClassStats",
    "EvictedPage",
    "HostPool",
    "HostPoolError",
    "HostPoolStats",
    "PageInfo",
    "PageState",
    "PageStateError",
    "PoolLayout",
    "Reclaim",
    "plan_layout",
]

Reclaim = Callable[[dict[int, list[bytes]]], None]
"""Told the pages a namespace or page class gave up for a new one (namespace id -> the
keys dropped), before the id changes hands: :meth:`HostPool.namespace_id`,
:meth:`HostPool.register_class`."""


def plan_layout(
    capacity_bytes: int,
    extent_bytes: int,
    align: int = 4096,
    min_page_bytes: int | None = None,
    headroom: int = 0,
    **_: Any,
) -> PoolLayout:
    """The layout of a pool built with these arguments (:class:`HostPool`'s; the others
    are ignored). Raises HostPoolError when the geometry is invalid."""
    return PoolLayout.plan(capacity_bytes, extent_bytes, align, min_page_bytes, headroom=headroom)


class HostPool:
    """Slot allocator and L2 index over one host arena (see the module docstring).

    Built over the metadata it is given (``meta``): the pages a previous pool left in it
    are adopted, or it is formatted (see :attr:`adopted`); without ``meta``, over private
    memory (nothing persists). The page operations (:meth:`allocate`, :meth:`commit`,
    :meth:`abort`, :meth:`pin`, :meth:`unpin`, :meth:`mark_in_l3`, :meth:`flush`) are
    those of its :class:`~kvtier.daemon.pool.pages.PageTable`; lookups (and a pin's) are
    answered from its key table (:class:`~kvtier.daemon.pool.lookups.KeyLookups`).

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
        max_evicted_log: evictions kept for :meth:`drain_evicted`; more are counted only
            (None: 65,536, or as many as the pool has slots if more, so that no single
            allocation, which evicts each page at most once, overflows it between two
            drains).
        eviction_policy: ``"lru"``, ``"arc"`` or ``"reuse"``
            (:mod:`~kvtier.daemon.pool.eviction`); a pool built here defaults to plain
            recency, the daemon's (:meth:`from_config`) to its configuration's default,
            ``"reuse"``.
        meta: writable buffer of at least ``layout.meta_bytes`` bytes (the first bytes of
            the pool file's mapping), kept in views until :meth:`close`. When its header
            matches the layout (magic, format version, checksum, geometry), the generation
            is incremented and READY pages that verify come back; WRITING pages and all
            pins are dropped (whoever held them is gone). Otherwise, or with
            ``cold_start``, it is formatted: an empty pool, generation 1. None: private
            memory.
        arena: the arena (``capacity_bytes`` from ``layout.arena_offset``), to verify each
            adopted READY page's payload against its checksum; pages committed without
            one are then dropped. None adopts payloads unverified (row seals are checked
            either way).
        cold_start: discard what ``meta`` holds on purpose; a string is the reason to
            report (such as the ``why_new`` of :func:`map_pool_file`).
        classes: page sizes registered first, in this order (class ids 0, 1, ...); an
            adoption then registers its extents' other page sizes, smallest first.

    Attributes:
        adopted: what was adopted from ``meta`` or why nothing was (``summary`` is the
            line to log); None over private memory.

    Raises:
        HostPoolError: the geometry is invalid, the arena holds no extent, ``meta`` is
            read-only or too small, or ``arena`` is too small.
    """

    @classmethod
    def from_config(
        cls,
        cfg: DaemonConfig,
        headroom: int = 0,
        *,
        meta: Any | None = None,
        arena: Any | None = None,
        cold_start: bool | str | None = False,
    ) -> HostPool:
        """The daemon's host pool for ``cfg``, over ``meta`` (``arena``, ``cold_start``:
        see the constructor).

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
        args, geometry = geometry_of(cfg, headroom)
        return cls(*args, **geometry, meta=meta, arena=arena, cold_start=cold_start)

    @staticmethod
    def layout_of(cfg: DaemonConfig, headroom: int = 0) -> PoolLayout:
        """The layout :meth:`from_config` gives the pool (what :func:`map_pool_file` maps
        before the pool is built over it). Raises ConfigError as :meth:`from_config`."""
        args, geometry = geometry_of(cfg, headroom)
        return plan_layout(*args, **geometry)

    def __init__(
        self,
        capacity_bytes: int,
        extent_bytes: int,
        align: int = 4096,
        *,
        min_page_bytes: int | None = None,
        max_evicted_log: int | None = None,
        headroom: int = 0,
        eviction_policy: str = "lru",
        meta: Any | None = None,
        arena: Any | None = None,
        cold_start: bool | str | None = False,
        classes: Sequence[int] = (),
    ) -> None:
        t0 = time.perf_counter()
        self.adopted: AdoptResult | None = None
        layout = plan_layout(capacity_bytes, extent_bytes, align, min_page_bytes, headroom)
        if meta is None:  # anonymous memory is zero until touched: nothing to clear
            pm = PoolMeta(mmap.mmap(-1, layout.meta_bytes), layout)
        else:
            need = layout.n_extents * layout.span
            if arena is not None:
                with memoryview(arena) as view:
                    nbytes = view.nbytes
                if nbytes < need:
                    raise HostPoolError(f"the arena has {nbytes} bytes, the pool needs {need}")
            pm = PoolMeta(meta, layout)
        try:
            if meta is None:
                pm.format(zero=False)
                reason: str | None = "private memory"
            else:
                reason = (
                    pm.mismatch()
                    if not cold_start
                    else (cold_start if isinstance(cold_start, str) else "cold start requested")
                )
                if reason is not None:
                    pm.format()
            self._build(pm, meta is None, reason, arena, classes, max_evicted_log, eviction_policy)
        except BaseException:  # nothing keeps a view of the caller's buffer
            pm.release()
            raise
        if self.adopted is not None:
            self.adopted = dataclasses.replace(self.adopted, seconds=time.perf_counter() - t0)

    def _build(
        self,
        pm: PoolMeta,
        private: bool,
        reason: str | None,
        arena: Any | None,
        classes: Sequence[int],
        max_evicted_log: int | None,
        eviction_policy: str,
    ) -> None:
        """The constructor's second half, over the checked metadata ``pm``: the page table,
        its lookups, the classes given, and the adoption of what ``pm`` holds (unless
        ``reason`` says why it was formatted)."""
        layout = pm.layout
        gen = 1 if reason is not None else pm.bump_generation()
        self.capacity_bytes, self.extent_bytes = layout.capacity_bytes, layout.extent_bytes
        self.align, self.n_extents, self.n_slots = layout.align, layout.n_extents, layout.n_slots
        self._pages = pages = PageTable(
            pm,
            max_log=max(layout.n_slots, 1 << 16) if max_evicted_log is None else max_evicted_log,
            quota={},
            requires_l3=False,
            policy=eviction_policy,
        )
        self._lookups = KeyLookups(pages)
        for page_bytes in classes:
            self.register_class(page_bytes)
        self.adopted = None
        # ids adopted pages carry that their table does not hold: never given to a new
        # namespace or tenant, which would be served those pages (only damage makes them)
        self._stray_ids: dict[IdTable, frozenset[int]] = {t: frozenset() for t in IdTable}
        if private:
            return
        if reason is not None:
            self.adopted = AdoptResult(False, reason, 0, 0, 0, 0.0, gen)
            return
        ready = np.flatnonzero(pm.array("state") == PageState.READY)
        holding = np.zeros(layout.n_extents, dtype=bool)
        holding[ready // layout.per_extent] = True
        del ready
        scan = scan_rows(pm, pages.slots.usable_per_extent(holding), pages.keys, arena)
        pages.adopt_rows(scan.slots, scan.ready, scan.parents)
        self._stray_ids = {t: _stray_ids(pm, t, scan.slots) for t in IdTable}
        self._lookups.rebuild()
        reason = MATCHED
        if scan.unchecked:
            reason += (
                f"; {scan.unchecked} pages stored without a checksum dropped (verify_on_adopt "
                "is on and they were stored while it was off)"
            )
        self.adopted = AdoptResult(
            True,
            reason,
            len(scan.slots),
            scan.dropped,
            scan.payload_bytes,
            0.0,  # the constructor's whole time, set by it
            gen,
        )

    @property
    def layout(self) -> PoolLayout:
        """The pool's geometry and metadata layout (what :func:`map_pool_file` needs)."""
        return self._pages.meta.layout

    def close(self) -> None:
        """Release the views of the metadata buffer, so its mapping can close; the pool
        is unusable afterwards. Nothing is written: the metadata already holds everything
        (closing is not needed for a restart to adopt the pool)."""
        self._lookups.close()
        self._pages.meta.release()

    # ------------------------------------------------------- page operations

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` READY in ``ns_id``.

        Pages of other namespaces are never seen; recency is not touched. Answered from
        the key table in C, whatever the number of keys
        (:class:`~kvtier.daemon.pool.lookups.KeyLookups`).

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order (a key that no page can hold, not bytes or
                longer than 32 bytes, ends the run).

        Returns:
            How many leading keys are READY.
        """
        return self._lookups.lookup(ns_id, keys)

    def lookup_packed(self, ns_id: int, packed: bytes | memoryview) -> int:
        """Return the length of the leading run READY in ``ns_id`` of the keys in
        ``packed``: 32-byte keys back to back, as LOOKUP's ``packed_keys`` carries them.

        The same answer as :meth:`lookup` on the split keys, for any bytes: a key counts
        only when a READY row of ``ns_id`` holds exactly its 32 bytes.

        Raises:
            HostPoolError: ``packed`` is not a whole number of keys.
        """
        return self._lookups.lookup_packed(ns_id, packed)

    def resident_run(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """See :meth:`PageTable.resident_run`."""
        return self._pages.resident_run(ns_id, keys)

    def stored_run(self, ns_id: int, keys: Sequence[bytes], mine: Collection[int]) -> int:
        """See :meth:`PageTable.stored_run`."""
        return self._pages.stored_run(ns_id, keys, mine)

    def allocate(
        self,
        ns_id: int,
        owner: int,
        class_id: int,
        keys: Sequence[bytes],
        parent_key: bytes | None = None,
    ) -> list[tuple[int, int]]:
        """See :meth:`PageTable.allocate`."""
        return self._pages.allocate(ns_id, owner, class_id, keys, parent_key)

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        """See :meth:`PageTable.commit`; the committed pages also enter the key table."""
        try:
            self._pages.commit(slots, checksums)
        finally:  # a commit that failed part-way made some pages READY all the same
            self._lookups.committed(slots)

    def abort(self, slots: Sequence[int]) -> None:
        """See :meth:`PageTable.abort`."""
        self._pages.abort(slots)

    def detach(self, slots: Sequence[int]) -> None:
        """See :meth:`PageTable.detach`."""
        self._pages.detach(slots)

    def run_slots(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """The slots of the leading READY run of ``keys`` (nothing pinned nor touched)."""
        return self._lookups.run_slots(ns_id, keys)

    def pin(
        self, ns_id: int, keys: Sequence[bytes], used: bool = False, touch: bool = True
    ) -> list[int]:
        """Pin the leading READY run of ``keys`` and touch it, the last key first.

        Pinned pages are not evictable. The caller keeps the returned slots and hands
        them to :meth:`unpin` once. The key table's probe finds the slots, as for
        :meth:`lookup` (a LOAD's pin looks no key up twice); :meth:`PageTable.pin_slots`
        pins them.

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.
            used: the pages are being used (a LOAD): under ``arc`` or ``reuse`` they
                move to T2.
            touch: False: their access stamps stay (the daemon's own use, a write to
                L3: no engine used them); unpinned, they go back by those stamps.

        Returns:
            The pinned slots, one per key of the leading READY run.
        """
        out = self._lookups.run_slots(ns_id, keys)
        self._pages.pin_slots(out, used, touch)
        return out

    def pin_slots(self, slots: list[int]) -> None:
        """Pin READY ``slots`` (see :meth:`PageTable.pin_slots`); hand them to
        :meth:`unpin` once."""
        self._pages.pin_slots(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        """See :meth:`PageTable.unpin`."""
        self._pages.unpin(slots)

    def mark_in_l3(self, slots: Sequence[int]) -> None:
        """See :meth:`PageTable.mark_in_l3`."""
        self._pages.mark_in_l3(slots)

    def clear_in_l3(self, ns_id: int, keys: Iterable[bytes] | None = None) -> int:
        """See :meth:`PageTable.clear_in_l3`."""
        return self._pages.clear_in_l3(ns_id, keys)

    def flush(self, ns_id: int | None = None, owner: int | None = None) -> int:
        """See :meth:`PageTable.flush`."""
        return self._pages.flush(ns_id, owner)

    # ------------------------------------------------------------- geometry

    def register_class(
        self,
        page_bytes: int,
        max_classes: int | None = None,
        in_use: Iterable[int] = (),
        reclaim: Reclaim | None = None,
    ) -> int:
        """Register a page size; the same size always gets the same class id while it has
        one (:meth:`SlotAllocator.register_class`).

        Args:
            page_bytes: bytes of one page of an engine's model.
            max_classes: past this many classes, a new size takes over an idle class's id
                (no page, not in ``in_use``), or is refused (None: no bound).
            in_use: the class ids of the open sessions.
            reclaim: with no idle class, the class no open session uses whose pages are all
                READY and unpinned, its newest page the oldest, is emptied for the new size
                (its pages dropped as a FLUSH drops them); ``reclaim`` is told what was
                dropped, per namespace, before the id changes hands. None: refused instead.

        Returns:
            The class id (0, 1, ... in registration order; an adopted pool has
            registered its extents' page sizes, smallest first, after ``classes``).

        Raises:
            HostPoolError: ``page_bytes`` is not positive, its stride exceeds an extent,
                or it is new past ``max_classes`` and no class is idle.
        """
        slots, used = self._pages.slots, set(in_use)
        if (
            reclaim is not None
            and max_classes is not None
            and page_bytes not in slots.class_of_bytes
            and len(slots.classes) >= max_classes
            and slots._idle_class(used) is None
        ):
            owner = self._column_of_classes()
            victim = self._coldest(owner, used)
            if victim is not None:
                reclaim(self._drop(owner == victim))
        cid = slots.register_class(page_bytes, max_classes, used)
        self._pages.evictor.fit_class(self._pages.slots.classes[cid].n)
        return cid

    def _column_of_classes(self) -> np.ndarray:
        """The class id of every slot (NIL where its extent is free)."""
        slots = self._pages.slots
        ext = np.frombuffer(slots.ext_class, dtype=np.int32)
        return np.repeat(ext, slots.per_extent)[: self.n_slots]

    def _coldest(self, group: np.ndarray, in_use: set[int]) -> int | None:
        """Of the groups (a namespace or a class id per slot) holding pages, not in
        ``in_use``, whose pages are all READY and unpinned: the one whose newest page was
        used the longest ago, or None."""
        meta = self._pages.meta
        state, stamp = meta.array("state"), meta.array("stamp")
        try:
            pins = np.frombuffer(self._pages.pins.count, dtype=np.int32)
            live = state != PageState.FREE
            busy = live & ((state != PageState.READY) | (pins != 0))
            blocked = set(np.unique(group[busy]).tolist()) | in_use
            ids, inverse = np.unique(group[live], return_inverse=True)
            newest = np.full(len(ids), np.iinfo(np.int64).min, dtype=np.int64)
            np.maximum.at(newest, inverse, stamp[live].astype(np.int64))
        finally:
            del state, stamp
        best: tuple[int, int] | None = None
        for gid, when in zip(ids.tolist(), newest.tolist()):
            if gid != NIL and gid not in blocked and (best is None or when < best[0]):
                best = (when, gid)
        return None if best is None else best[1]

    def _drop(self, chosen: np.ndarray) -> dict[int, list[bytes]]:
        """Drop the READY, unpinned pages of the ``chosen`` slots (a mask over every slot:
        whole chains), children before parents, as :meth:`flush` does; their keys per
        namespace."""
        pages = self._pages
        meta = pages.meta
        state = meta.array("state")
        try:
            todo = np.flatnonzero(chosen & (state == PageState.READY)).tolist()
        finally:
            del state
        ns, parent, keys = meta.ns, meta.parent, pages.keys
        dropped: dict[int, list[bytes]] = {}
        mine = set(todo)
        for s in todo:
            while s != NIL and s in mine and pages.is_evictable(s):
                mine.discard(s)
                key, up = keys[s], parent[s]
                assert key is not None
                dropped.setdefault(ns[s], []).append(key)
                pages.release(s)
                s = up
        return dropped

    def class_stride(self, class_id: int) -> int:
        """Return the slot stride in bytes of ``class_id`` (HostPoolError if unknown)."""
        self._pages.slots.check_class(class_id)
        return self._pages.slots.classes[class_id].stride

    def slot_offset(self, slot: int) -> int:
        """Return the byte offset of ``slot``'s payload in the arena (a multiple of
        ``align``; in a pool with headroom, the ``layout.headroom`` bytes before it belong
        to the slot too).

        Raises:
            HostPoolError: the slot id is out of range or its extent has no class.
        """
        return self._pages.slots.slot_offset(slot)

    def slot_offsets(self, slots: list[int]) -> np.ndarray:
        """The payload offsets of ``slots`` (int64, same order): :meth:`slot_offset` of
        each, computed at once.

        Raises:
            HostPoolError: a slot id is out of range or its extent has no class.
        """
        return self._pages.slots.slot_offsets(slots)

    # ------------------------------------------------------- persistent ids

    def namespace_id(
        self, fingerprint: bytes, in_use: Iterable[int] = (), reclaim: Reclaim | None = None
    ) -> int:
        """Return the id of a namespace fingerprint (32 bytes), registering it if new.

        Ids are 1, 2, ... in registration order and persist with the pool: an adopted
        pool gives every fingerprint the id its pages were stored under. When the table is
        full, the id of a namespace that holds no page (in any state) and is not in
        ``in_use`` (the open sessions' namespaces) is given to the new fingerprint: models
        that come and go never fill the table for good. With none such and ``reclaim``
        given, the namespace not in ``in_use`` whose pages are all READY and unpinned, its
        newest page the oldest, gives its pages up (dropped as a FLUSH drops them;
        ``reclaim`` is told which, before the id changes hands) and its id: pages cached
        for a namespace nobody uses never keep another one out.

        Raises:
            HostPoolError: the fingerprint is not 32 bytes, or the table is full of
                namespaces that hold pages being written, pinned or in use.
        """
        meta = self._pages.meta
        stray = self._stray_ids[IdTable.NAMESPACES]
        try:
            return meta.id_of(IdTable.NAMESPACES, fingerprint, stray)
        except HostPoolError as err:
            if len(fingerprint) != DIGEST_BYTES:
                raise
            used = set(in_use)
            idle = self._idle_namespace(used)
            if idle is None and reclaim is not None:
                ns = meta.array("ns")
                try:
                    strays = self._stray_ids[IdTable.NAMESPACES]
                    victim = self._coldest(ns, used | set(strays))
                    chosen = ns == victim if victim is not None else None
                finally:
                    del ns
                if chosen is not None:
                    reclaim(self._drop(chosen))
                    idle = self._idle_namespace(used)
            if idle is None:
                raise HostPoolError(
                    f"{err}: every namespace in it holds pages or has an open session"
                ) from err
            meta.release_id(IdTable.NAMESPACES, idle)
            return meta.id_of(IdTable.NAMESPACES, fingerprint, stray)

    def _idle_namespace(self, in_use: set[int]) -> int | None:
        """The lowest namespace id no page (in any state) and nothing in ``in_use`` has."""
        meta = self._pages.meta
        ns, state = meta.array("ns"), meta.array("state")
        try:
            held = set(np.unique(ns[state != PageState.FREE]).tolist())
        finally:
            del ns, state
        idle = [i for i in meta.ids(IdTable.NAMESPACES).values() if i not in held | in_use]
        return min(idle) if idle else None

    def namespace_tenants(self, tenants: Iterable[str]) -> dict[bytes, str]:
        """``fingerprint -> tenant`` of the namespaces whose pages are all charged to one of
        ``tenants`` (the owner table keeps a digest of each name). O(slots), in numpy."""
        meta = self._pages.meta
        by_digest = {tenant_digest(t): t for t in tenants}
        names = {i: by_digest[d] for d, i in meta.ids(IdTable.OWNERS).items() if d in by_digest}
        ns, owner, state = meta.array("ns"), meta.array("owner"), meta.array("state")
        try:  # one int64 per (namespace, owner) pair: ids are far below 2**31
            held = state != PageState.FREE
            pairs = np.unique((ns[held] << 32) | owner[held], return_counts=True)[0].tolist()
        finally:
            del ns, owner, state
        owners: dict[int, set[int]] = {}
        for pair in pairs:
            owners.setdefault(pair >> 32, set()).add(pair & 0xFFFFFFFF)
        out: dict[bytes, str] = {}
        for fp, n in meta.ids(IdTable.NAMESPACES).items():
            got = owners.get(n, set())
            if len(got) == 1 and (o := next(iter(got))) in names:  # none or several: not told
                out[fp] = names[o]
        return out

    def namespaces(self) -> dict[bytes, int]:
        """Return a copy of the persistent ``fingerprint -> namespace id`` table."""
        return self._pages.meta.ids(IdTable.NAMESPACES)

    def owner_id(self, tenant: str) -> int:
        """Return the owner id of ``tenant``, registering it if new: 1, 2, ... in
        registration order, persistent like :meth:`namespace_id` (the table holds a
        SHA-256 of the name). Raises HostPoolError when the table is full."""
        return self._pages.meta.id_of(
            IdTable.OWNERS, tenant_digest(tenant), self._stray_ids[IdTable.OWNERS]
        )

    # ------------------------------------------------------------- eviction

    @property
    def evict_requires_l3(self) -> bool:
        """The write-back hook: when True, eviction takes only pages marked in L3
        (:meth:`mark_in_l3`)."""
        return self._pages.evictor.requires_l3

    @evict_requires_l3.setter
    def evict_requires_l3(self, value: bool) -> None:
        self._pages.evictor.requires_l3 = value

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
        self._pages.evictor.set_quota(owner, max_pages)

    def owned_pages(self, owner: int) -> int:
        """Return the resident (READY + WRITING) pages charged to ``owner``."""
        return self._pages.evictor.owned.get(owner, 0)

    def drain_evicted(self) -> list[EvictedPage]:
        """Return the evictions logged since the last drain and clear the log."""
        return self._pages.evictor.drain()

    # --------------------------------------------------------- introspection

    def stats(self) -> HostPoolStats:
        """Return a snapshot of the pool's counters."""
        classes = tuple(
            ClassStats(c, k.page_bytes, k.stride, k.n, k.extents, k.ready, k.writing)
            for c, k in enumerate(self._pages.slots.classes)
        )
        split = self._pages.evictor.split
        return HostPoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=sum((c.pages_ready + c.pages_writing) * c.stride for c in classes),
            pages_ready=sum(c.pages_ready for c in classes),
            pages_writing=sum(c.pages_writing for c in classes),
            pages_pinned=self._pages.pins.pinned,
            evictions=self._pages.evictor.evictions,
            evicted_unlogged=self._pages.evictor.unlogged,
            extents_free=len(self._pages.slots.free_extents),
            extents_total=self.n_extents,
            classes=classes,
            eviction_policy=self._pages.evictor.policy,
            evictions_by_reason=self._pages.evictor.by_reason(),
            eviction_split={} if split is None else split.summary(),
        )

    def describe(self, slot: int) -> PageInfo:
        """Return what the pool records about ``slot`` (HostPoolError if out of range)."""
        pages = self._pages
        pages.check_slot(slot)
        meta = pages.meta
        cid = pages.slots.ext_class[slot // pages.slots.per_extent]
        state = PageState(meta.state[slot])
        return PageInfo(
            slot,
            state,
            pages.keys[slot],
            meta.ns[slot],
            meta.owner[slot],
            cid,
            self.slot_offset(slot) if cid != NIL else NIL,
            pages.pins.count[slot],
            meta.parent[slot],
            pages.kids.count[slot],
            bool(meta.in_l3[slot]),
            meta.stamp[slot],
            pages.is_evictable(slot),
            meta.checksum[slot]
            if state == PageState.READY and meta.flags[slot] & HAS_CHECKSUM
            else None,
        )

    def chain_link(self, slot: int) -> tuple[bytes | None, int, int, bool, int]:
        """Return (key, namespace id, parent slot, in L3, class id) of ``slot``: the
        few fields a walk up a chain needs, without building a :class:`PageInfo`."""
        pages = self._pages
        pages.check_slot(slot)
        meta = pages.meta
        return (
            pages.keys[slot],
            meta.ns[slot],
            meta.parent[slot],
            bool(meta.in_l3[slot]),
            pages.slots.ext_class[slot // pages.slots.per_extent],
        )

    def parent_keys(self, ns_id: int, keys: Sequence[bytes]) -> list[bytes | None]:
        """The key of each READY page's parent, for ``keys`` of ``ns_id`` (None: a chain's
        head, or a key not READY here)."""
        ready = self._pages.ready.get(ns_id, {})
        col, parent = self._pages.keys, self._pages.meta.parent
        out: list[bytes | None] = []
        for key in keys:
            s = ready.get(key)
            p = NIL if s is None else parent[s]
            out.append(col[p] if p != NIL else None)
        return out

    def ready_pages(self, ns_id: int) -> list[tuple[bytes, bytes | None]]:
        """Return ``(key, parent key or None)`` of every READY page of ``ns_id``.
        O(pages): for FLUSH's KV events and tests."""
        keys, parent = self._pages.keys, self._pages.meta.parent
        return [
            (key, keys[parent[s]] if parent[s] != NIL else None)
            for key, s in self._pages.ready.get(ns_id, {}).items()
        ]

    def ready_counts(self) -> dict[int, int]:
        """Return the READY pages of each namespace id that holds any. O(namespaces)."""
        return {ns: len(pages) for ns, pages in self._pages.ready.items() if pages}

    def ready_slots(self) -> list[int]:
        """Return the slots of every READY page, of every namespace. O(pages): for the
        walks of a SYNC, a back-up of L2 and a shutdown's write-back."""
        return [s for pages in self._pages.ready.values() for s in pages.values()]

    def iter_evictable(self, owner: int | None = None) -> Iterator[int]:
        """The slots :meth:`evictable_slots` returns, one at a time, cold ends first: what
        a caller that needs the coldest few walks (write-back; the pool must not change
        meanwhile). The two lists of ``arc`` and ``reuse`` are walked in turn, so the
        policy's choice between their cold ends finds pages in L3 at both."""
        lru = self._pages.evictor.lru
        if owner is not None or lru.tier is None:
            return lru.cold_first(owner)
        return lru.alternating()

    def at_quota(self, owner: int) -> bool:
        """Whether ``owner`` holds its quota's pages (or more): it then evicts only its own."""
        quota = self._pages.evictor.quota.get(owner)
        return quota is not None and self.owned_pages(owner) >= quota

    def evictable_slots(self, owner: int | None = None) -> list[int]:
        """Return the evictable slots, cold end first, walking the global list or
        ``owner``'s list. O(pages): for admin views and tests."""
        return self._pages.evictor.lru.walk(owner)


def _stray_ids(meta: PoolMeta, table: IdTable, slots: np.ndarray) -> frozenset[int]:
    """The ids of ``table`` (namespaces: the ``ns`` column; owners: ``owner``) that the
    adopted rows ``slots`` carry and the table does not hold."""
    col = meta.array("ns" if table is IdTable.NAMESPACES else "owner")
    try:
        # with counts: np.unique alone imports numpy.ma, start-up time
        carried = set(np.unique(col[slots], return_counts=True)[0].tolist())
    finally:
        del col
    return frozenset(carried - set(meta.ids(table).values()) - {0})
