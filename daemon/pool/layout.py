"""Persistent layout of the host pool: the metadata that lets a restarted kvtierd adopt L2.

The pool's page bytes live in a shared-memory file that outlives the daemon; so does its
index, in a metadata region at the start of the same file. One file means the index and
the bytes it describes cannot get out of step (removed, resized or replaced separately)::

    pool file (/dev/shm/kvtier-pool-<tag>)
    0        4 KiB             ext_off        slot columns (64-byte aligned)    meta_bytes
    +--------+-----------------+--------------+---------------------------------+---------- - -
    | header | id tables       | extent table | stamp checksum seal ns owner    | arena:
    | 104 B  | ns: cap x 32 B  | n_extents x  | length (8 B each), parent (4),  | capacity_bytes;
    |        | owners: cap x 32| page bytes   | key (32), state in_l3 key_len   | slot offsets are
    |        | + used flags    | (0 = free)   | flags (1 each) = 88 B per slot  | relative to here
    +--------+-----------------+--------------+---------------------------------+---------- - -

``meta_bytes`` is rounded up to 2 MiB (or to ``align`` when larger), so the arena keeps
every alignment the allocator promises. The header holds a magic, the format version,
the geometry (capacity, extent size, alignment, slot ids per extent, extents, slots, key
bytes, id-table capacity, metadata size, slot headroom), an xxh3 checksum of those, and
a generation counter that each adoption increments (outside the checksum, so bumping it can never
corrupt the header).

Crash safety comes from write order alone, since a killed process loses no store it
already made to shared memory: a page's key, namespace, owner, length, parent, payload
checksum and seal are written while it is FREE or WRITING, and its state byte flips to
READY last; freeing flips the state byte first. A page is adopted only when READY and
its seal, ``xxh3_64(key, seed=checksum ^ ns)``, matches: a torn or stray write to a
row is a drop, never a page served under the wrong key. With the arena at hand the
payload is verified as well (xxh3-64, about 0.1 s per GiB).

Namespace fingerprints and tenant names are persisted in two id tables (an id is the
entry index + 1; an entry's digest is written before its used flag), because ids are
what the per-slot columns store. The records the pool reports (:class:`PageInfo`,
:class:`EvictedPage`, :class:`HostPoolStats`, :class:`AdoptResult`) live here too, so
that the pool and its persistence share them.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash
from kvtier.config.errors import KvtierError
from kvtier.ipc.shm import SharedMemorySegment

MAGIC = b"KVTPOOL\x00"
"""First eight bytes of every pool file."""

FORMAT_VERSION = 2
"""Version of this layout; any other version is discarded, never read (version 2 added
the slot headroom to the header)."""

KEY_BYTES = 32
"""Bytes reserved per page key (keys are SHA-256 digests; shorter keys are allowed)."""

DIGEST_BYTES = 32
"""Bytes of one id-table entry (a namespace fingerprint or a SHA-256 of a tenant name)."""

ID_CAPACITY = 4096
"""Default number of entries of each id table (namespaces, owners)."""

HEADER_REGION = 4096
"""Bytes reserved for the header at the start of the file."""

SLOT_HEADROOM = 128
"""Headroom of a slot in a pool built with headroom: the bytes right before each page's
payload that belong to the slot (see :class:`PoolLayout`). Nothing but the slot's holder
touches them; an L3 backend may write the page's object header (96 bytes) there while it
holds the page, so that header and payload move as one contiguous buffer."""

HEADROOM_ALIGN = SLOT_HEADROOM
"""Slot alignment of a daemon pool with headroom: payloads start on 128-byte boundaries
(whole cache lines), so a headroom costs 128 bytes a slot rather than a 4 KiB page."""

HEADROOM_MIN_PAGE_BYTES = 4096
"""Smallest page a daemon pool with headroom sizes its slot ids (and so its extents'
slack) for: ``extent_bytes // 4096`` ids per extent, as a pool without headroom has."""

META_ROUND = 2 << 20
"""The metadata region is rounded up to this (or to ``align`` when larger)."""

HAS_CHECKSUM = 1
"""Bit of the per-slot flags byte: the checksum column holds the payload's xxh3-64."""

NIL = -1
"""The null slot / extent id in every link and in the parent column."""

_MASK64 = (1 << 64) - 1

# magic, version, header size, capacity, extent, align, slot ids per extent, extents,
# slots, key bytes, id capacity, meta bytes, headroom; then the checksum of those; then
# the generation.
_HEADER = struct.Struct("<8sIIQQQQQQIIQQ")
_SUM = struct.Struct("<Q")
_SUM_OFF = _HEADER.size
_GEN_OFF = _SUM_OFF + 8
HEADER_BYTES = _GEN_OFF + 8

# Slot columns: (name, memoryview format, bytes per slot), widest first.
_COLUMNS = (
    ("stamp", "q", 8), ("checksum", "Q", 8), ("seal", "Q", 8), ("ns", "q", 8),
    ("owner", "q", 8), ("length", "q", 8), ("parent", "i", 4), ("key", "B", KEY_BYTES),
    ("state", "b", 1), ("in_l3", "b", 1), ("key_len", "B", 1), ("flags", "B", 1),
)  # fmt: skip
SLOT_META_BYTES = sum(size for _, _, size in _COLUMNS)
"""Bytes of persistent metadata per slot id."""


class HostPoolError(KvtierError):
    """Misuse of the host pool: bad geometry, unknown class or slot id, bad key or id."""


class PageState(IntEnum):
    """State of one host page (slot), as stored in the state column."""

    FREE = 0
    WRITING = 1
    READY = 2


class IdTable(IntEnum):
    """The two persistent id tables."""

    NAMESPACES = 0
    OWNERS = 1


def round_up(n: int, align: int) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def page_checksum(payload: Any) -> int:
    """Return the xxh3-64 of one page's bytes (what :meth:`HostPool.commit` records).

    Pure and thread-safe: the daemon's copy thread calls it once a store's bytes landed.

    Args:
        payload: a C-contiguous buffer (memoryview, numpy array, bytes) of the page.
    """
    return xxhash.xxh3_64_intdigest(payload)


def page_checksums(arena: Any, offsets: Sequence[int], page_bytes: int) -> list[int]:
    """Return :func:`page_checksum` of ``page_bytes`` at each offset of ``arena``.

    Args:
        arena: the arena (not the whole file) as a buffer: memoryview, mmap or uint8 array.
        offsets: byte offsets of the pages (from :meth:`HostPool.slot_offset`).
        page_bytes: bytes of one page (the class's page size, not its stride).

    Returns:
        One checksum per offset, in order.
    """
    view = memoryview(arena).cast("B")
    digest = xxhash.xxh3_64_intdigest
    try:
        return [digest(view[off : off + page_bytes]) for off in offsets]
    finally:
        view.release()


def seal_of(key: bytes, ns_id: int, checksum: int) -> int:
    """Return the seal binding a row's key, namespace and payload checksum:
    ``xxh3_64(key, seed=(checksum ^ ns_id) mod 2**64)``.

    Args:
        key: the page key.
        ns_id: the page's namespace id.
        checksum: its payload checksum, 0 when none was recorded.
    """
    return xxhash.xxh3_64_intdigest(key, (checksum ^ ns_id) & _MASK64)


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Geometry of a pool and where each metadata region lies in the pool file.

    Build with :meth:`plan`. All offsets are from the start of the file.

    A pool with ``headroom`` gives every slot that many bytes before its payload. So
    that the headroom never costs a page (a 2 MiB page would no longer fit an extent
    twice), extents are spaced :attr:`span` apart: ``extent_bytes`` for the payloads plus
    ``per_extent * headroom`` of slack for the headrooms::

        extent e (span = extent_bytes + per_extent * headroom)
        | h | page 0 | pad | h | page 1 | pad | ... | h | page n-1 | pad | (unused slack)
        ^ e * span  ^ slot_offset(slot 0) = e * span + h, a multiple of align

    A slot of a ``page_bytes`` class is :meth:`stride_of` bytes; a class still cuts
    ``extent_bytes // round_up(page_bytes, align)`` slots from an extent (at most
    ``per_extent``), headroom or not.

    Attributes:
        capacity_bytes: arena size asked for; ``n_extents * span`` of it is used.
        extent_bytes: payload bytes of one extent.
        align: slot alignment (a power of two); every payload offset is a multiple of it.
        per_extent: slot ids every extent reserves.
        n_extents / n_slots: extents and slot ids of the arena.
        id_capacity: entries of each id table.
        ids_off: start of the id tables (digests of both tables, then their used flags).
        ext_off: start of the extent table (int64 page bytes per extent).
        columns: ``(name, format, offset)`` of each per-slot column.
        meta_bytes: size of the metadata region; the arena starts here.
        headroom: bytes of each slot before its payload (0: none, else a multiple of
            ``align`` of at least :data:`SLOT_HEADROOM`).
    """

    capacity_bytes: int
    extent_bytes: int
    align: int
    per_extent: int
    n_extents: int
    n_slots: int
    id_capacity: int
    ids_off: int
    ext_off: int
    columns: tuple[tuple[str, str, int], ...]
    meta_bytes: int
    headroom: int = 0

    @classmethod
    def plan(
        cls,
        capacity_bytes: int,
        extent_bytes: int,
        align: int = 4096,
        min_page_bytes: int | None = None,
        id_capacity: int = ID_CAPACITY,
        headroom: int = 0,
    ) -> PoolLayout:
        """Check a geometry and lay its metadata out.

        Args:
            capacity_bytes: arena size; ``capacity_bytes // span`` extents are used.
            extent_bytes: payload bytes of one extent, a multiple of ``align``.
            align: slot alignment, a power of two.
            min_page_bytes: smallest page size expected; sizes the slot id space
                (``extent_bytes // round_up(min_page_bytes, align)`` ids per extent).
                None means pages of ``align`` bytes.
            id_capacity: entries of each id table (namespaces, owners).
            headroom: bytes each slot keeps before its payload: 0, or a multiple of
                ``align`` of at least :data:`SLOT_HEADROOM`.

        Raises:
            HostPoolError: the geometry is invalid or the arena holds no extent.
        """
        if align <= 0 or align & (align - 1):
            raise HostPoolError(f"align must be a power of two, got {align}")
        if extent_bytes <= 0 or extent_bytes % align:
            raise HostPoolError(f"extent_bytes={extent_bytes} is not a multiple of {align}")
        if headroom and (headroom < SLOT_HEADROOM or headroom % align):
            raise HostPoolError(f"headroom must be 0 or a multiple of align={align} of at "
                                f"least {SLOT_HEADROOM}, got {headroom}")  # fmt: skip
        min_stride = round_up(max(1, min_page_bytes or align), align)
        if min_stride > extent_bytes:
            raise HostPoolError(f"min_page_bytes={min_page_bytes} exceeds extent_bytes")
        if id_capacity < 1:
            raise HostPoolError(f"id_capacity must be >= 1, got {id_capacity}")
        per_extent = extent_bytes // min_stride
        span = extent_bytes + per_extent * headroom
        n_extents = capacity_bytes // span
        if n_extents < 1:
            raise HostPoolError(f"capacity_bytes={capacity_bytes} holds no {extent_bytes}B extent"
                                + (f" ({span}B with its slots' headroom)" if headroom else ""))
        n_slots = n_extents * per_extent
        if n_slots >= 2**31:
            raise HostPoolError(f"{n_slots} slot ids exceed 2**31; raise min_page_bytes")
        ids_off = HEADER_REGION
        ext_off = round_up(ids_off + 2 * id_capacity * (DIGEST_BYTES + 1), 64)
        off = round_up(ext_off + 8 * n_extents, 64)
        columns = []
        for name, fmt, size in _COLUMNS:
            columns.append((name, fmt, off))
            off = round_up(off + size * n_slots, 64)
        meta_bytes = round_up(off, max(META_ROUND, align))
        return cls(capacity_bytes, extent_bytes, align, per_extent, n_extents, n_slots,
                   id_capacity, ids_off, ext_off, tuple(columns), meta_bytes,
                   headroom)  # fmt: skip

    @property
    def span(self) -> int:
        """Distance between the starts of two extents: ``extent_bytes`` plus the slack
        for ``per_extent`` headrooms."""
        return self.extent_bytes + self.per_extent * self.headroom

    def stride_of(self, page_bytes: int) -> int:
        """Slot size of ``page_bytes`` pages: the headroom, then the payload rounded up
        to ``align``."""
        return self.headroom + round_up(page_bytes, self.align)

    @property
    def arena_offset(self) -> int:
        """Offset of the arena in the pool file (= ``meta_bytes``)."""
        return self.meta_bytes

    @property
    def file_bytes(self) -> int:
        """Size of the pool file: metadata region plus ``capacity_bytes``."""
        return self.meta_bytes + self.capacity_bytes

    def header(self, generation: int) -> bytes:
        """Return the header bytes that describe this layout (checksum included)."""
        fixed = _HEADER.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, self.capacity_bytes, self.extent_bytes,
            self.align, self.per_extent, self.n_extents, self.n_slots, KEY_BYTES,
            self.id_capacity, self.meta_bytes, self.headroom,
        )  # fmt: skip
        return fixed + _SUM.pack(xxhash.xxh3_64_intdigest(fixed)) + _SUM.pack(generation)

    def mismatch(self, header: bytes | memoryview) -> str | None:
        """Return why ``header`` (the first bytes of a pool file) does not describe this
        layout, or None when it does. The reason is one short phrase for a log line."""
        raw = bytes(header[:HEADER_BYTES])
        if len(raw) < HEADER_BYTES:
            return f"pool file too small for a header ({len(raw)} bytes)"
        if not any(raw):
            return "no pool metadata (new pool file)"
        fields = _HEADER.unpack_from(raw)
        if not any(fields[0]):
            return "pool metadata incomplete (a format was interrupted)"
        if fields[0] != MAGIC:
            return f"not a kvtier pool header (magic {fields[0]!r})"
        if fields[1] != FORMAT_VERSION:
            return f"metadata format version {fields[1]}, this build reads {FORMAT_VERSION}"
        (want_sum,) = _SUM.unpack_from(raw, _SUM_OFF)
        if xxhash.xxh3_64_intdigest(raw[:_SUM_OFF]) != want_sum:
            return "pool header checksum mismatch (corrupted header)"
        ours = _HEADER.unpack_from(self.header(0))
        names = ("magic", "version", "header_bytes", "capacity_bytes", "extent_bytes",
                 "align", "slot ids per extent", "extents", "slots", "key_bytes",
                 "id_capacity", "meta_bytes", "headroom")  # fmt: skip
        diffs = [f"{n} {old} -> {new}" for n, old, new in zip(names, fields, ours) if old != new]
        return "geometry changed: " + ", ".join(diffs) if diffs else None


class EvictedPage(NamedTuple):
    """One eviction, as :meth:`HostPool.drain_evicted` reports it.

    Attributes:
        key: the page key.
        ns_id: the page's namespace.
        slot: the slot it occupied (free now, maybe reused).
        in_l3: whether the page was marked as present in L3.
    """

    key: bytes
    ns_id: int
    slot: int
    in_l3: bool


@dataclass(frozen=True, slots=True)
class PageInfo:
    """What the pool records about one slot (admin views, tests).

    Attributes:
        slot: the slot id.
        state: its page state.
        key: the page key, None when FREE.
        ns_id / owner: namespace and tenant (stale when FREE).
        class_id / offset: class and arena offset, -1 when the extent is free.
        pins: pin count.
        parent: slot of the resident page this page extends, or -1.
        children: resident pages that extend this page.
        in_l3: whether the page is marked as present in L3.
        last_access: recency stamp (larger is more recent).
        evictable: READY with no pins and no resident children.
        checksum: the payload's xxh3-64 recorded at commit, None when none was (or the
            page is not READY); the same value an L3 object of the page records.
    """

    slot: int
    state: PageState
    key: bytes | None
    ns_id: int
    owner: int
    class_id: int
    offset: int
    pins: int
    parent: int
    children: int
    in_l3: bool
    last_access: int
    evictable: bool
    checksum: int | None = None


@dataclass(frozen=True, slots=True)
class ClassStats:
    """Counters of one page class.

    Attributes:
        class_id: id from :meth:`HostPool.register_class`.
        page_bytes: page size the class was registered with.
        stride: slot size (the slot headroom, if any, then ``page_bytes`` rounded up to the
            alignment).
        slots_per_extent: slots the class cuts from one extent.
        extents: extents the class holds.
        pages_ready: READY pages of the class.
        pages_writing: WRITING pages of the class.
    """

    class_id: int
    page_bytes: int
    stride: int
    slots_per_extent: int
    extents: int
    pages_ready: int
    pages_writing: int


@dataclass(frozen=True, slots=True)
class HostPoolStats:
    """A snapshot of the pool's counters.

    Attributes:
        capacity_bytes: the arena size the pool was built with.
        used_bytes: bytes of READY and WRITING slots (pages x stride).
        pages_ready / pages_writing: pages in each state.
        pages_pinned: pages with at least one pin.
        evictions: pages evicted since construction or adoption (flushes not counted).
        evicted_unlogged: evictions left out of the full eviction log.
        extents_free / extents_total: extents owned by no class / in the arena.
        classes: per-class counters, by class id.
    """

    capacity_bytes: int
    used_bytes: int
    pages_ready: int
    pages_writing: int
    pages_pinned: int
    evictions: int
    evicted_unlogged: int
    extents_free: int
    extents_total: int
    classes: tuple[ClassStats, ...]


@dataclass(frozen=True, slots=True)
class AdoptScan:
    """The rows an adoption keeps (from :meth:`PoolMeta.adopt_rows`).

    Attributes:
        slots: adopted slot ids, ascending (int64).
        keys: their keys, same order.
        parents: their parent slot ids after cleaning (NIL: none), same order.
        dropped: rows that were not FREE and are FREE now.
        payload_bytes: sum of the adopted pages' payload lengths.
    """

    slots: np.ndarray
    keys: list[bytes]
    parents: np.ndarray
    dropped: int
    payload_bytes: int


@dataclass(frozen=True, slots=True)
class AdoptResult:
    """What :meth:`HostPool.adopt` did with the metadata it found.

    Attributes:
        adopted: True when the pages were adopted, False when everything was discarded.
        reason: why it was discarded (one phrase), or that the metadata matched.
        pages_adopted: READY pages visible again.
        pages_dropped: pages found but not adopted (WRITING, failed checks); 0 on a discard.
        bytes_adopted: payload bytes of the adopted pages.
        seconds: time :meth:`HostPool.adopt` took (header, scan, verification, rebuild).
        generation: the pool's generation now (1 after a discard, +1 per adoption).
    """

    adopted: bool
    reason: str
    pages_adopted: int
    pages_dropped: int
    bytes_adopted: int
    seconds: float
    generation: int

    @property
    def summary(self) -> str:
        """One log line: what was adopted, or what was discarded and why."""
        if not self.adopted:
            return f"host pool started empty (generation 1): {self.reason}"
        return (f"host pool adopted (generation {self.generation}): {self.pages_adopted} pages, "
                f"{self.bytes_adopted / 2**20:.1f} MiB, {self.pages_dropped} dropped, "
                f"in {self.seconds * 1e3:.0f} ms")  # fmt: skip


class PoolMeta:
    """The metadata region of one pool, mapped: typed views over a writable buffer.

    Every attribute named after a column (``stamp``, ``checksum``, ``seal``, ``ns``,
    ``owner``, ``length``, ``parent``, ``key``, ``state``, ``in_l3``, ``key_len``,
    ``flags``) is a memoryview indexed by slot id (``key`` by byte: slot ``s`` owns
    ``key[32 s : 32 s + 32]``); ``ext_bytes`` holds the page bytes of each extent's class
    (0: free). Writes through them are the persistence: there is no separate flush.

    Args:
        buf: a writable buffer of at least ``layout.meta_bytes`` bytes (the start of the
            pool file's mapping, or a bytearray for a pool that need not persist).
        layout: the layout the caller expects.

    Raises:
        HostPoolError: the buffer is read-only or too small.
    """

    def __init__(self, buf: Any, layout: PoolLayout) -> None:
        view = memoryview(buf)
        if view.readonly:
            view.release()
            raise HostPoolError("the pool metadata buffer is read-only")
        if view.nbytes < layout.meta_bytes:
            n = view.nbytes
            view.release()
            raise HostPoolError(f"the pool metadata buffer has {n} bytes, needs {layout.meta_bytes}")
        self.layout = layout
        self._raw = view.cast("B")[: layout.meta_bytes]
        view.release()
        cap, n = layout.id_capacity, layout.n_slots
        ids = layout.ids_off
        self._digests = [
            self._raw[ids + t * cap * DIGEST_BYTES : ids + (t + 1) * cap * DIGEST_BYTES]
            for t in IdTable
        ]
        used = ids + 2 * cap * DIGEST_BYTES
        self._used = [self._raw[used + t * cap : used + (t + 1) * cap] for t in IdTable]
        self.ext_bytes = self._raw[layout.ext_off : layout.ext_off + 8 * layout.n_extents].cast("q")
        cols: dict[str, memoryview] = {}
        for (name, fmt, off), (_, _, size) in zip(layout.columns, _COLUMNS):
            cols[name] = self._raw[off : off + size * n].cast(fmt)  # type: ignore[call-overload]
        self.stamp, self.checksum, self.seal = cols["stamp"], cols["checksum"], cols["seal"]
        self.ns, self.owner, self.length = cols["ns"], cols["owner"], cols["length"]
        self.parent, self.key, self.state = cols["parent"], cols["key"], cols["state"]
        self.in_l3, self.key_len, self.flags = cols["in_l3"], cols["key_len"], cols["flags"]
        self._views = [self._raw, self.ext_bytes, *self._digests, *self._used, *cols.values()]
        self._id_cache = [self._read_ids(t) for t in IdTable]
        self.pack_key = struct.Struct(f"{KEY_BYTES}s").pack_into

    # ------------------------------------------------------------------ header

    def mismatch(self) -> str | None:
        """Return why the stored header does not describe :attr:`layout` (None: it does)."""
        return self.layout.mismatch(self._raw[:HEADER_BYTES])

    @property
    def generation(self) -> int:
        """The generation counter stored in the header."""
        return int(_SUM.unpack_from(self._raw, _GEN_OFF)[0])

    def bump_generation(self) -> int:
        """Increment the stored generation (one 8-byte store) and return the new value."""
        gen = (self.generation + 1) & _MASK64
        _SUM.pack_into(self._raw, _GEN_OFF, gen)
        return gen

    def format(self, *, zero: bool = True) -> None:
        """Discard everything: an empty pool of :attr:`layout`, generation 1.

        The magic is cleared first and written last, so a crash while formatting leaves
        a header that is discarded again, never half-trusted.

        Args:
            zero: clear the id tables, extent table and slot columns (False only when
                the buffer is known to be all zeros, e.g. a fresh bytearray).
        """
        self._raw[: len(MAGIC)] = bytes(len(MAGIC))
        if zero:
            body = np.frombuffer(self._raw, dtype=np.uint8)
            body[HEADER_REGION:] = 0
            del body
        head = self.layout.header(1)
        self._raw[len(MAGIC) : len(head)] = head[len(MAGIC) :]
        self._raw[: len(MAGIC)] = MAGIC
        self._id_cache = [self._read_ids(t) for t in IdTable]

    # --------------------------------------------------------------- page keys

    def put_key(self, slot: int, key: bytes) -> None:
        """Write ``key`` (at most :data:`KEY_BYTES`) into the row of ``slot``.

        The hot path inlines it: ``pack_key(key, slot * KEY_BYTES, k)`` then ``key_len``.
        """
        self.pack_key(self.key, slot * KEY_BYTES, key)
        self.key_len[slot] = len(key)

    def get_key(self, slot: int) -> bytes:
        """Return the key stored in the row of ``slot`` (its stored length, capped)."""
        off = slot * KEY_BYTES
        return bytes(self.key[off : off + min(self.key_len[slot], KEY_BYTES)])

    # --------------------------------------------------------------- id tables

    def ids(self, table: IdTable) -> dict[bytes, int]:
        """Return a copy of ``digest -> id`` of ``table`` (ids are 1-based)."""
        return dict(self._id_cache[table])

    def id_of(self, table: IdTable, digest: bytes) -> int:
        """Return the id of ``digest`` in ``table``, appending it if new (digest bytes
        first, used flag last, so a crash never leaves a half-written entry in use).

        Raises:
            HostPoolError: the digest is not :data:`DIGEST_BYTES` long or the table is full.
        """
        known = self._id_cache[table]
        got = known.get(digest)
        if got is not None:
            return got
        if len(digest) != DIGEST_BYTES:
            raise HostPoolError(f"an id digest must have {DIGEST_BYTES} bytes, got {len(digest)}")
        used = self._used[table]
        i = used.tobytes().find(b"\x00")
        if i < 0:
            raise HostPoolError(
                f"the {table.name.lower()} table is full ({self.layout.id_capacity} entries)"
            )
        self._digests[table][i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] = digest
        used[i] = 1
        known[digest] = i + 1
        return i + 1

    def _read_ids(self, table: IdTable) -> dict[bytes, int]:
        digests = self._digests[table]
        used = np.flatnonzero(np.frombuffer(self._used[table], dtype=np.uint8)).tolist()
        return {bytes(digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]): i + 1 for i in used}

    # ---------------------------------------------------------------- adoption

    def adopt_rows(self, usable: np.ndarray, arena: Any | None = None) -> AdoptScan:
        """Decide which rows survive an adoption, and leave only those non-FREE.

        A row is adopted when it is READY; its extent's class cuts its slot (``usable``)
        and matches its payload length; its key fits; its seal matches its key,
        namespace and checksum; with ``arena``, it has a checksum and its payload still
        hashes to it; and no more recent READY row holds the same key in the same
        namespace. Every other
        non-FREE row (WRITING, failed, duplicate) is set FREE, state byte first. Parent
        links are kept only to an adopted page of the same namespace, and cut on any
        cycle (which only corruption could make); the cleaned links are written back.

        Args:
            usable: per extent, the slots its class cuts (0: free or unusable), from
                :meth:`SlotAllocator.usable_per_extent`.
            arena: the arena (``capacity_bytes`` from the arena offset), to verify
                payloads; None trusts them.

        Returns:
            The adopted rows, in ascending slot order.

        Raises:
            HostPoolError: ``arena`` is smaller than the extents it must hold.
        """
        lay = self.layout
        per = lay.per_extent
        state = self.array("state")
        live = np.flatnonzero(state != PageState.FREE)
        cand = live[state[live] == PageState.READY]
        pbs = self.array("ext_bytes")
        e = cand // per
        length = self.array("length")[cand]
        flags = self.array("flags")[cand]
        ok = (cand - e * per < usable[e]) & (length == pbs[e])
        ok &= self.array("key_len")[cand] <= KEY_BYTES
        if arena is not None:
            ok &= (flags & HAS_CHECKSUM) != 0
        cand, e, length, flags = cand[ok], e[ok], length[ok], flags[ok]
        strides = lay.headroom + (pbs[e] + lay.align - 1) // lay.align * lay.align
        offsets = e * lay.span + (cand - e * per) * strides + lay.headroom
        del pbs
        view = None if arena is None else memoryview(arena).cast("B")
        try:
            if view is not None and view.nbytes < lay.n_extents * lay.span:
                raise HostPoolError(f"the arena has {view.nbytes} bytes, the pool needs "
                                    f"{lay.n_extents * lay.span}")  # fmt: skip
            by_key = self._verify(cand, offsets, length, flags, view)
        finally:
            if view is not None:
                view.release()
        pairs = sorted((s, key) for (_, key), s in by_key.items())
        slots = np.array([s for s, _ in pairs], dtype=np.int64)
        keys = [key for _, key in pairs]
        gone = np.setdiff1d(live, slots)
        state[gone] = PageState.FREE  # first: the rows are free from here on
        in_l3 = self.array("in_l3")  # allocate leaves it alone: no FREE row may keep it
        kept = in_l3[slots]
        in_l3[:] = 0
        in_l3[slots] = kept
        parents = self._clean_parents(slots)
        del state, in_l3
        return AdoptScan(slots, keys, parents, len(gone), int(self.array("length")[slots].sum()))

    def _verify(self, cand: np.ndarray, offsets: np.ndarray, length: np.ndarray,
                flags: np.ndarray, view: memoryview | None) -> dict[tuple[int, bytes], int]:  # fmt: skip
        """Seal (and payload) checks of candidate READY rows; return (ns, key) -> slot.

        The columns are gathered with numpy first, so the per-row loop only slices a key,
        hashes it (and the payload) and fills a dict.
        """
        n = len(cand)
        blob = self.array("key").reshape(-1, KEY_BYTES)[cand].tobytes()
        key_len = self.array("key_len")[cand].tolist()
        has = (flags & HAS_CHECKSUM) != 0
        sums = np.where(has, self.array("checksum")[cand], 0).tolist()
        seeds = ((self.array("checksum")[cand] * has) ^ self.array("ns")[cand].view(np.uint64))
        seals = self.array("seal")[cand].tolist()
        stamps = self.array("stamp")[cand].tolist()
        digest = xxhash.xxh3_64_intdigest
        by_key: dict[tuple[int, bytes], int] = {}
        best: dict[tuple[int, bytes], int] = {}  # (ns, key) -> stamp of the row holding it
        nss = self.array("ns")[cand].tolist()
        rows = zip(range(n), cand.tolist(), seeds.tolist(), seals, key_len, stamps,
                   offsets.tolist(), length.tolist(), sums, nss)  # fmt: skip
        for j, s, seed, seal, kl, stamp, off, nbytes, csum, ns in rows:
            key = blob[j * KEY_BYTES : j * KEY_BYTES + kl]
            if digest(key, seed) != seal:
                continue
            if view is not None and digest(view[off : off + nbytes]) != csum:
                continue
            if best.get((ns, key), -1) < stamp:
                by_key[(ns, key)], best[(ns, key)] = s, stamp
        return by_key

    def _clean_parents(self, slots: np.ndarray) -> np.ndarray:
        """Keep parent links to adopted pages of the same namespace, cut cycles, write
        the result back (NIL for every other row) and return it, one per slot."""
        n, m = self.layout.n_slots, len(slots)
        col = self.array("parent")
        ns = self.array("ns")
        par = col[slots].astype(np.int64)
        pos = np.searchsorted(slots, np.clip(par, 0, n - 1)) if m else par
        pos = np.minimum(pos, max(m - 1, 0))
        ok = (par >= 0) & (par < n) & (par != slots)
        if m:
            ok &= slots[pos] == par
            ok &= ns[slots[pos]] == ns[slots]
        par[~ok] = NIL
        # A forest reaches the sentinel m within m steps: 2**bit_length(m) > m jumps.
        jump = np.full(m + 1, m, dtype=np.int64)
        jump[:m] = np.where(ok, pos, m)
        for _ in range(max(1, m.bit_length())):
            jump = jump[jump]
        par[jump[:m] != m] = NIL
        col[:] = NIL
        col[slots] = par
        del col, ns
        return par

    # ------------------------------------------------------------- bulk access

    def array(self, name: str) -> np.ndarray:
        """Return a numpy view of column ``name`` (or ``"ext_bytes"``) for bulk scans.

        The view holds an export of the buffer: delete it when done.
        """
        if name == "ext_bytes":
            return np.frombuffer(self.ext_bytes, dtype=np.int64)
        view = getattr(self, name)
        dtype = np.uint8 if name == "key" else np.dtype(view.format)
        return np.frombuffer(view, dtype=dtype)

    def release(self) -> None:
        """Release every view of the buffer (the object is unusable afterwards)."""
        for view in reversed(self._views):
            view.release()
        self._views = []


def tenant_digest(name: str) -> bytes:
    """Return the owner-table digest of tenant ``name`` (SHA-256 of its UTF-8)."""
    return hashlib.sha256(name.encode()).digest()


def map_pool_file(
    path: str | Path, layout: PoolLayout, *, prefault: bool = True, mode: int = 0o600
) -> tuple[SharedMemorySegment, str | None]:
    """Map the pool file at ``path``, keeping it when its size matches ``layout``.

    An existing file of ``layout.file_bytes`` bytes is mapped as it is (pre-faulted when
    asked), so its metadata can be adopted. Otherwise the file is created (replacing a
    file of another size) and the reason is returned for the caller's log line. The
    segment is opened as a peer: closing it never removes the file, so the pool survives
    a restart; remove it explicitly (``segment.close(unlink=True)``) to discard it.

    Args:
        path: the pool file (``pool_path(cfg.pool_dir, runtime_dir)``).
        layout: from :meth:`PoolLayout.plan` with the daemon's config.
        prefault: pre-fault the mapping (and reserve the memory of a new file).
        mode: permission bits of a new file.

    Returns:
        ``(segment, why_new)``: ``why_new`` is None when an existing file was mapped,
        else why a new one was created (pass it as ``cold_start`` to :meth:`HostPool.adopt`).

    Raises:
        SharedMemoryError: the file can be neither opened nor created.
    """
    path = str(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        why = "no pool file (first start)"
    else:
        if st.st_size == layout.file_bytes:
            return SharedMemorySegment.open(path, size=layout.file_bytes, populate=prefault), None
        why = _size_mismatch(path, st.st_size, layout)
    # Created, then reopened as a peer: closing the daemon's pool must not remove it.
    SharedMemorySegment.create(path, layout.file_bytes, prefault=prefault, mode=mode,
                               exist_ok=True).close(unlink=False)  # fmt: skip
    return SharedMemorySegment.open(path, size=layout.file_bytes, populate=prefault), why


def _size_mismatch(path: str, size: int, layout: PoolLayout) -> str:
    """Why a pool file of ``size`` bytes cannot be adopted, from its header if readable."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as err:
        return f"pool file unreadable ({err.strerror}); recreated"
    why = layout.mismatch(head)
    if why is None or why.startswith("no pool metadata"):
        why = f"pool file has {size} bytes, expected {layout.file_bytes}"
    return why

