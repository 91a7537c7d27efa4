"""Host pool bookkeeping (L2): the page index and eviction over one arena's slots.

Pure and synchronous (no I/O, no mapping, no locks, no ``await``): the arena is mapped
elsewhere; this module hands out byte offsets into it and keeps every page's state. Slot
geometry (extents, page classes, free lists) is :mod:`kvtier.daemon.pool.slots`; the
persistent metadata is :mod:`kvtier.daemon.pool.layout`.

Page metadata lives in flat per-slot arrays created once. What must survive a restart
(state, key, namespace, owner, payload length, parent, last access, in-L3 flag, checksum,
seal) is a column of the metadata buffer, for a daemon the start of the pool's
shared-memory file, so every change persists as it is made. Pins, child lists and links
are private arrays, rebuilt by :meth:`HostPool.adopt`. Intrusive doubly linked lists
allocate nothing: a free list per class, the global evictable list and one per owner
(recency order, cold end first), and each page's list of resident children.

Life cycle (:class:`PageState`): FREE -allocate-> WRITING -commit-> READY
-evict/flush-> FREE, and WRITING -abort-> FREE. WRITING pages are invisible to
lookups and never evicted; a READY page is evictable when it has no pins and no
resident children (pages that extend it). Write order makes a crash at any instant
safe: a row is completed while WRITING and its state flips to READY last; freeing
flips the state first.

Eviction policy, LRU and tail first:

- A page with a resident child is never evicted, so a chain goes tail to head.
  Touching a chain ``k0..kn`` (commit, pin) stamps it in reverse, so its tail is the
  colder end. A page that becomes evictable (its last child left, its last pin
  dropped) goes to the cold end if it is not more recent than the current cold end,
  else to the hot end.
- A slot of class ``c`` comes from, in order: the free list of ``c``; a fresh slot of
  the extent ``c`` is cutting; a free extent; eviction from the cold end of the global
  list, any class (a victim of ``c`` frees a slot of ``c``; one of another class frees
  its slot and, when that empties its extent, the extent is free for ``c``), at most
  ``EVICT_FACTOR`` x the largest slots-per-extent victims; then the coldest page of
  ``c`` itself (bounded scan). Otherwise the allocation fails (a shortfall).
- An owner at its quota evicts only its own pages, coldest first, same bounds.

Write-back hook: with :attr:`HostPool.evict_requires_l3` set, eviction skips pages not
marked in L3 (within the bounded scan), so no slot is reused before its page reached
L3. A write-back task pins cold pages, copies them to L3, calls
:meth:`HostPool.mark_in_l3` and unpins them.

Restart (:meth:`HostPool.adopt`): READY pages that verify come back with their keys,
namespaces, owners, offsets and in-L3 flags; WRITING pages and pins are dropped; the
rest is rebuilt (the evictable lists by last-access stamp). Hot paths: lookup is a dict
probe per key at C speed (``_ready``: the READY keys of each namespace); commit adds one xxh3 of the key (the seal).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from kvtier.config.errors import ConfigError
from kvtier.daemon.pool.layout import (
    HAS_CHECKSUM,
    HEADROOM_ALIGN,
    HEADROOM_MIN_PAGE_BYTES,
    KEY_BYTES,
    NIL,
    AdoptResult,
    ClassStats,
    EvictedPage,
    HostPoolError,
    HostPoolStats,
    IdTable,
    PageInfo,
    PageState,
    PoolLayout,
    PoolMeta,
    tenant_digest,
)
from kvtier.daemon.pool.slots import (
    ChildLists,
    PageClass,
    RecencyLists,
    SlotAllocator,
    filled,
)
from xxhash import xxh3_64_intdigest

if TYPE_CHECKING:
    from kvtier.config import DaemonConfig

__all__ = [
    "EVICT_FACTOR", "MIN_SCAN", "NIL", "AdoptResult", "ClassStats", "EvictedPage", "HostPool",
    "HostPoolError", "HostPoolStats", "PageInfo", "PageState", "PageStateError", "PoolLayout",
]  # fmt: skip

EVICT_FACTOR = 2
"""Victims per slot allocation: at most EVICT_FACTOR x the largest slots-per-extent."""

MIN_SCAN = 256
"""Lower bound of the scan length when a victim must match a filter."""

_MAX_U64 = (1 << 64) - 1


class PageStateError(HostPoolError):
    """A page state transition was asked of a page in the wrong state."""


class HostPool:
    """Slot allocator and L2 index over one host arena (see the module docstring).

    The constructor builds an empty pool whose metadata lives in private memory (nothing
    persists); :meth:`adopt` moves it onto persistent metadata and adopts what it holds.

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
            ConfigError: ``hicache_size`` cannot hold one extent with its headroom.
        """
        if not headroom:
            return cls(cfg.hicache_size, cfg.extent_size)
        span = cfg.extent_size + cfg.extent_size // HEADROOM_MIN_PAGE_BYTES * headroom
        if cfg.hicache_size < span:
            raise ConfigError(
                f"hicache_size ({cfg.hicache_size}) must hold at least one extent_size "
                f"({cfg.extent_size}) extent with its slots' headroom ({span} bytes in all) "
                f"when hicache_storage_backend is {cfg.hicache_storage_backend!r}"
            )
        return cls(cfg.hicache_size, cfg.extent_size, HEADROOM_ALIGN,
                   min_page_bytes=HEADROOM_MIN_PAGE_BYTES, headroom=headroom)

    def __init__(
        self,
        capacity_bytes: int,
        extent_bytes: int,
        align: int = 4096,
        *,
        min_page_bytes: int | None = None,
        max_evicted_log: int = 65536,
        headroom: int = 0,
    ) -> None:
        layout = PoolLayout.plan(capacity_bytes, extent_bytes, align, min_page_bytes,
                                 headroom=headroom)
        meta = PoolMeta(bytearray(layout.meta_bytes), layout)
        meta.format(zero=False)
        self.evict_requires_l3 = False  # write-back hook: evict only pages marked in L3
        self._max_log = max_evicted_log
        self._quota: dict[int, int] = {}
        self._setup(meta)

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
        reason = pm.mismatch() if not cold_start else (
            cold_start if isinstance(cold_start, str) else "cold start requested")
        if reason is not None:
            pm.format()
        gen = 1 if reason is not None else pm.bump_generation()
        self._setup(pm)
        for page_bytes in classes:
            self.register_class(page_bytes)
        if reason is not None:
            return AdoptResult(False, reason, 0, 0, 0, time.perf_counter() - t0, gen)
        scan = pm.adopt_rows(self._slots.usable_per_extent(), arena)
        self._adopt(scan.slots, scan.keys, scan.parents)
        return AdoptResult(True, "metadata matches the config", len(scan.keys), scan.dropped,
                           scan.payload_bytes, time.perf_counter() - t0, gen)  # fmt: skip

    def _setup(self, meta: PoolMeta) -> None:
        """Bind the metadata columns and create the private arrays (an empty pool)."""
        layout = meta.layout
        self.capacity_bytes, self.extent_bytes = layout.capacity_bytes, layout.extent_bytes
        self.align, self.n_extents, self.n_slots = layout.align, layout.n_extents, layout.n_slots
        self._per_extent = layout.per_extent
        self._meta = meta
        self._slots = slots = SlotAllocator(layout, meta.ext_bytes)
        self._classes: list[PageClass] = slots.classes
        self._ext_class = slots.ext_class
        # persistent columns (shared memory for a daemon's pool), then private arrays
        self._state, self._in_l3, self._stamp = meta.state, meta.in_l3, meta.stamp
        self._ns, self._owner, self._parent = meta.ns, meta.owner, meta.parent
        self._pins = filled("i", 0, self.n_slots)
        self._kids = ChildLists(self.n_slots, meta.parent)  # resident children per page
        self._children = self._kids.count
        self._key: list[bytes | None] = [None] * self.n_slots
        self._evict_budget = 1
        self._scan_limit = MIN_SCAN
        # (namespace, key) -> slot of every resident page; a key is only ever seen from
        # its own namespace, so one tenant cannot even probe another's keys
        self._index: dict[bytes, int] = {}
        # ns_id -> keys of its READY pages: lookups run over it at C speed (the LOOKUP hot path)
        self._ready: dict[int, set[bytes]] = {}
        self._lru = RecencyLists(slots, meta.stamp)  # the evictable pages
        self._owned: dict[int, int] = {}
        self._clock = 0
        self._n_pinned = self._evictions = self._unlogged = 0
        self._evicted: list[EvictedPage] = []

    def _adopt(self, slots: np.ndarray, keys: list[bytes], parents: np.ndarray) -> None:
        """Rebuild the private state of an empty pool from adopted READY rows."""
        meta = self._meta
        self._slots.rebuild(slots)
        sl = slots.tolist()
        for s, key in zip(sl, keys):
            self._key[s] = key
        nss = meta.array("ns")[slots].tolist()
        self._index = {_ik(n, k): s for n, k, s in zip(nss, keys, sl)}
        self._ready = {}
        for n, k in zip(nss, keys):
            self._ready.setdefault(n, set()).add(k)
        cids = np.frombuffer(self._ext_class, dtype=np.int32)[slots // self._per_extent]
        for cid, count in zip(*np.unique(cids, return_counts=True)):
            self._classes[int(cid)].ready = int(count)
        for cls in self._classes:
            self._evict_budget = max(self._evict_budget, EVICT_FACTOR * cls.n)
        self._scan_limit = max(MIN_SCAN, self._evict_budget)
        owners = meta.array("owner")[slots]
        for o, count in zip(*np.unique(owners, return_counts=True)):
            self._owned[int(o)] = int(count)
        self._kids.rebuild(slots, parents)
        # evictable lists: childless pages by last access, cold end first
        stamps = meta.array("stamp")[slots]
        ev = np.frombuffer(self._children, dtype=np.int32)[slots] == 0
        order = np.lexsort((slots[ev], stamps[ev]))
        self._lru.rebuild(slots[ev][order], owners[ev][order])
        self._clock = int(stamps.max()) if len(stamps) else 0

    def close(self) -> None:
        """Release the views of the metadata buffer, so its mapping can close.

        The pool is unusable afterwards. Nothing is written: the metadata already holds
        everything (closing is not needed for a restart to adopt the pool).
        """
        self._meta.release()

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
        self._evict_budget = max(self._evict_budget, EVICT_FACTOR * self._classes[cid].n)
        self._scan_limit = max(MIN_SCAN, self._evict_budget)
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

    # ------------------------------------------------------------ page index

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` READY in ``ns_id``.

        Pages of other namespaces are never seen. Recency is not touched.

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            How many leading keys are READY.
        """
        ready = self._ready.get(ns_id)
        if not ready:
            return 0
        found = list(map(ready.__contains__, keys))
        return len(found) if all(found) else found.index(False)

    def resident_run(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` resident in ``ns_id``,
        READY or WRITING (what a store leaves stored or being stored).

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            How many leading keys are READY or WRITING.
        """
        index = self._index
        n = 0
        for key in keys:
            if _ik(ns_id, key) not in index:
                break
            n += 1
        return n

    def allocate(
        self,
        ns_id: int,
        owner: int,
        class_id: int,
        keys: Sequence[bytes],
        parent_key: bytes | None = None,
    ) -> list[tuple[int, int]]:
        """Allocate WRITING slots for the keys the pool lacks (the store path).

        Present keys (READY or WRITING) are skipped but parent the next key. A new
        page's parent is the previous key's page, or for ``keys[0]`` the page of
        ``parent_key`` when resident in ``ns_id``. Stops at the first key that cannot
        be allocated (pool full, nothing evictable, quota) or that another namespace
        holds: later pages are useless without it.

        Args:
            ns_id: namespace of the pages.
            owner: tenant charged for the pages (see :meth:`set_quota`).
            class_id: page class from :meth:`register_class`.
            keys: page keys in chain order, at most 32 bytes each.
            parent_key: key of the page ``keys[0]`` extends, if any.

        Returns:
            ``(index into keys, slot)`` per page allocated, in key order; a shortfall
            shows as missing pairs, never as an exception.

        Raises:
            HostPoolError: unknown class id, or a key longer than 32 bytes.
        """
        self._slots.check_class(class_id)
        if keys and max(map(len, keys)) > KEY_BYTES:
            raise HostPoolError(f"page keys must have at most {KEY_BYTES} bytes")
        cls = self._classes[class_id]
        index = self._index
        meta = self._meta
        pack_key, key_col, key_len, length = meta.pack_key, meta.key, meta.key_len, meta.length
        state, stamp, ns, owners = self._state, self._stamp, self._ns, self._owner
        out: list[tuple[int, int]] = []
        prev = NIL
        if parent_key is not None:
            p = index.get(_ik(ns_id, parent_key))
            if p is not None:
                prev = p
        for i, key in enumerate(keys):
            s = index.get(_ik(ns_id, key))
            if s is not None:
                prev = s
                continue
            if prev != NIL:
                self._add_child_ref(prev)  # shields prev from the evictions below
            s = self._take_slot(class_id, owner)
            if s == NIL:
                if prev != NIL:
                    self._drop_child_ref(prev)
                break
            pack_key(key_col, s * KEY_BYTES, key)  # the row first, the state byte last
            key_len[s] = len(key)
            ns[s] = ns_id
            owners[s] = owner
            length[s] = cls.page_bytes
            self._parent[s] = prev
            stamp[s] = self._tick()
            state[s] = PageState.WRITING
            self._key[s] = key
            if prev != NIL:
                self._kids.link(prev, s)
            index[_ik(ns_id, key)] = s
            cls.writing += 1
            self._owned[owner] = self._owned.get(owner, 0) + 1
            out.append((i, s))
            prev = s
        return out

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        """Mark filled pages READY (visible) and touch them, the last slot first.

        A page with no resident children becomes evictable. Each row is sealed (its
        key, namespace and checksum bound by one xxh3) before its state flips.

        Args:
            slots: WRITING slots, in chain order (the tail ends up coldest).
            checksums: the payload checksum of each slot (:func:`page_checksum` of its
                page bytes, computed once they landed), same order; None records none
                (such pages are not adopted by a verifying :meth:`adopt`).

        Raises:
            PageStateError: a slot is not WRITING. Checked before any change, except a
                slot listed twice, which fails at its second occurrence.
            HostPoolError: a slot id is out of range, or ``checksums`` does not match
                ``slots`` (length, or a value outside 64 bits).
        """
        for s in slots:
            self._expect(s, PageState.WRITING, "commit")
        if checksums is not None and (len(checksums) != len(slots) or (
                checksums and (min(checksums) < 0 or max(checksums) > _MAX_U64))):  # fmt: skip
            raise HostPoolError(f"need one 64-bit checksum per slot ({len(slots)})")
        meta, state, ready, keys = self._meta, self._state, self._ready, self._key
        checksum, flags, seal, stamp = meta.checksum, meta.flags, meta.seal, self._stamp
        digest = xxh3_64_intdigest
        for j in range(len(slots) - 1, -1, -1):
            s = slots[j]
            self._expect(s, PageState.WRITING, "commit")
            key = keys[s]
            assert key is not None
            ns = self._ns[s]
            if checksums is None:
                csum = flags[s] = 0
            else:
                csum = checksum[s] = checksums[j]
                flags[s] = HAS_CHECKSUM
            seal[s] = digest(key, (csum ^ ns) & _MAX_U64)  # = seal_of(key, ns, csum)
            stamp[s] = self._tick()
            state[s] = PageState.READY  # last: the row is complete
            ready.setdefault(ns, set()).add(key)
            cls = self._classes[self._ext_class[s // self._per_extent]]
            cls.writing -= 1
            cls.ready += 1
            if self._children[s] == 0:
                self._lru.enqueue(s, self._owner[s])

    def abort(self, slots: Sequence[int]) -> None:
        """Free pages whose fill failed (WRITING -> FREE, keys leave the index).

        Parents lose a resident child; resident children lose their parent link.

        Args:
            slots: WRITING slots.

        Raises:
            PageStateError: as for :meth:`commit`.
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._expect(s, PageState.WRITING, "abort")
        for j in range(len(slots) - 1, -1, -1):
            self._expect(slots[j], PageState.WRITING, "abort")
            self._release(slots[j])

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """Pin the leading READY run of ``keys`` and touch it, the last key first.

        Pinned pages are not evictable. The caller keeps the returned slots and hands
        them to :meth:`unpin` once.

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            The pinned slots, one per key of the leading READY run.
        """
        out = [self._index[_ik(ns_id, key)] for key in keys[: self.lookup(ns_id, keys)]]
        pins = self._pins
        for j in range(len(out) - 1, -1, -1):
            s = out[j]
            if pins[s] == 0:
                self._n_pinned += 1
                if self._children[s] == 0:
                    self._lru.dequeue(s, self._owner[s])
            pins[s] += 1
            self._stamp[s] = self._tick()
        return out

    def unpin(self, slots: Sequence[int]) -> None:
        """Drop one pin per slot; pages left unpinned and childless become evictable.

        Args:
            slots: slots returned by :meth:`pin`.

        Raises:
            PageStateError: a slot is not a pinned READY page. Checked before any
                change, except a slot listed more often than pinned.
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._expect(s, PageState.READY, "unpin")
        pins = self._pins
        for s in slots:
            self._expect(s, PageState.READY, "unpin")
            pins[s] -= 1
            if pins[s] == 0:
                self._n_pinned -= 1
                if self._children[s] == 0:
                    self._lru.enqueue(s, self._owner[s])

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
        if max_pages is None:
            self._quota.pop(owner, None)
        elif max_pages < 0:
            raise HostPoolError(f"max_pages must be >= 0 or None, got {max_pages}")
        else:
            self._quota[owner] = max_pages

    def owned_pages(self, owner: int) -> int:
        """Return the resident (READY + WRITING) pages charged to ``owner``."""
        return self._owned.get(owner, 0)

    def mark_in_l3(self, slots: Sequence[int]) -> None:
        """Record that these pages are in L3 (evictable under ``evict_requires_l3``).

        Args:
            slots: READY or WRITING slots.

        Raises:
            PageStateError: a slot is FREE (checked before any change).
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._check_slot(s)
            if self._state[s] == PageState.FREE:
                raise PageStateError(f"cannot mark slot {s} in L3: it is FREE")
        for s in slots:
            self._in_l3[s] = 1

    def flush(self, ns_id: int | None = None, owner: int | None = None) -> int:
        """Drop every evictable page, optionally only of one namespace and/or owner.

        Chains go tail to head; pinned and WRITING pages (and their ancestors) stay.
        Dropped pages are neither counted as evictions nor logged.

        Args:
            ns_id: only pages of this namespace, if given.
            owner: only pages of this owner, if given.

        Returns:
            The number of pages dropped.
        """
        dropped = 0
        s, links = self._lru.start(None)
        while s != NIL:
            nxt = links[s]  # dropping s only enqueues its parent, never removes nxt
            while (
                s != NIL
                and (ns_id is None or self._ns[s] == ns_id)
                and (owner is None or self._owner[s] == owner)
            ):
                parent = self._parent[s]
                self._lru.dequeue(s, self._owner[s])
                self._release(s)
                dropped += 1
                s = parent if parent != NIL and self._is_evictable(parent) else NIL
            s = nxt
        return dropped

    def drain_evicted(self) -> list[EvictedPage]:
        """Return the evictions logged since the last drain and clear the log."""
        out, self._evicted = self._evicted, []
        return out

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
            evictions=self._evictions,
            evicted_unlogged=self._unlogged,
            extents_free=len(self._slots.free_extents),
            extents_total=self.n_extents,
            classes=classes,
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
        return (self._key[slot], self._ns[slot], self._parent[slot], bool(self._in_l3[slot]),
                self._ext_class[slot // self._per_extent])

    def evictable_slots(self, owner: int | None = None) -> list[int]:
        """Return the evictable slots, cold end first, walking the global list or
        ``owner``'s list. O(pages): for admin views and tests."""
        return self._lru.walk(owner)

    # ------------------------------------------------------- slot allocation

    def _take_slot(self, cid: int, owner: int) -> int:
        """Return a slot of class ``cid`` for ``owner``, evicting if needed, or NIL."""
        quota = self._quota.get(owner)
        scope: int | None = None  # whose pages may be evicted; None: anyone's
        if quota is not None and self._owned.get(owner, 0) >= quota:
            scope, budget = owner, self._evict_budget
            while self._owned.get(owner, 0) >= quota:  # replace own pages first
                v = self._coldest(owner, NIL)
                if v == NIL or budget == 0:
                    return NIL
                self._evict(v)
                budget -= 1
        s = self._slots.take(cid)
        return s if s != NIL else self._reclaim(cid, scope)

    def _reclaim(self, cid: int, owner: int | None) -> int:
        """Evict (anyone's, or only ``owner``'s pages) until a slot of ``cid`` frees."""
        budget = self._evict_budget
        while budget > 0:
            v = self._coldest(owner, NIL)
            if v == NIL:
                break
            self._evict(v)
            budget -= 1
            s = self._slots.take(cid)
            if s != NIL:
                return s
        v = self._coldest(owner, cid)  # fall back to the class's own pages
        if v == NIL:
            return NIL
        self._evict(v)
        return self._slots.take(cid)

    def _coldest(self, owner: int | None, cid: int) -> int:
        """Coldest page eviction may take from the global (or ``owner``'s) list, of
        class ``cid`` unless NIL; NIL if none within the scan limit."""
        s, nxt = self._lru.start(owner)
        need_l3 = self.evict_requires_l3
        steps = self._scan_limit
        while s != NIL and steps > 0:
            if (not need_l3 or self._in_l3[s]) and (
                cid == NIL or self._ext_class[s // self._per_extent] == cid
            ):
                return s
            s = nxt[s]
            steps -= 1
        return NIL

    def _evict(self, s: int) -> None:
        self._evictions += 1
        if len(self._evicted) < self._max_log:
            key = self._key[s]
            assert key is not None
            self._evicted.append(EvictedPage(key, self._ns[s], s, bool(self._in_l3[s])))
        else:
            self._unlogged += 1
        self._lru.dequeue(s, self._owner[s])
        self._release(s)

    def _release(self, s: int) -> None:
        """Turn the READY or WRITING page ``s``, off the evictable lists, FREE."""
        assert self._pins[s] == 0
        key = self._key[s]
        assert key is not None
        was_ready = self._state[s] == PageState.READY
        self._state[s] = PageState.FREE  # first: from here on a crash leaves the slot free
        self._in_l3[s] = 0
        del self._index[_ik(self._ns[s], key)]
        self._key[s] = None
        p = self._parent[s]
        if p != NIL:
            self._kids.unlink(p, s)
            self._drop_child_ref(p)
        self._kids.orphan_all(s)  # only an aborted page can still have children
        cls = self._classes[self._ext_class[s // self._per_extent]]
        if was_ready:
            cls.ready -= 1
            self._ready[self._ns[s]].discard(key)
        else:
            cls.writing -= 1
        self._owned[self._owner[s]] -= 1
        self._slots.give_back(s)

    # ------------------------------------------------------ intrusive lists

    def _is_evictable(self, s: int) -> bool:
        return self._state[s] == PageState.READY and self._pins[s] == 0 and self._children[s] == 0

    def _add_child_ref(self, p: int) -> None:
        if self._is_evictable(p):
            self._lru.dequeue(p, self._owner[p])
        self._children[p] += 1

    def _drop_child_ref(self, p: int) -> None:
        self._children[p] -= 1
        assert self._children[p] >= 0
        if self._is_evictable(p):
            self._lru.enqueue(p, self._owner[p])

    # ---------------------------------------------------------------- checks

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise HostPoolError(f"slot {slot} out of range [0, {self.n_slots})")

    def _expect(self, s: int, want: PageState, op: str) -> None:
        self._check_slot(s)
        state = self._state[s]
        if state != want:
            raise PageStateError(
                f"cannot {op} slot {s}: it is {PageState(state).name}, not {want.name}"
            )
        if op == "unpin" and self._pins[s] == 0:
            raise PageStateError(f"cannot unpin slot {s}: it is READY with no pins")


def _ik(ns_id: int, key: bytes) -> bytes:
    """The index key of ``key`` in namespace ``ns_id``."""
    return ns_id.to_bytes(4, "little") + key
