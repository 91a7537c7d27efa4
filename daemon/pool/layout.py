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
corrupt the header). At 1 KiB, also outside the checksum, the file names the runtime
directory of the daemon that maps it (for ``kvtier pools``); at 3.5 KiB it keeps the
``reuse`` eviction policy's lifetime (:data:`POLICY_OFFSET`), so a restart keeps it.

Crash safety comes from write order alone, since a killed process loses no store it
already made to shared memory: a page's key, namespace, owner, length, parent, payload
checksum and seal are written while it is FREE or WRITING, and its state byte flips to
READY last; freeing flips the state byte first. A page is adopted only when READY and
its seal, ``xxh3_64(key, seed=checksum ^ ns)``, matches: a torn or stray write to a
row is a drop, never a page served under the wrong key. With the arena at hand the
payload is verified as well (xxh3-64).

Namespace fingerprints and tenant names are persisted in two id tables (an id is the
entry index + 1; an entry's digest is written before its used flag), because ids are
what the per-slot columns store.

The file is the daemon's alone (this uid, mode 0600, one link; checked on the descriptor
that is mapped): :mod:`~kvtier.daemon.pool.poolfile`. This module is the format: the
constants, :class:`PoolLayout` (geometry, header), the hashes rows and payloads are
checked with, and :func:`map_pool_file`. The
mapped columns are :class:`~kvtier.daemon.pool.meta.PoolMeta`; the adoption scan is
:mod:`~kvtier.daemon.pool.adopt`; the records the pool reports are
:mod:`~kvtier.daemon.pool.records` (re-exported here for importers of this module).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import xxhash
from kvtier.daemon.pool.poolfile import (
    create_pool_segment,
    open_pool_segment,
    write_owner_tag,
)
from kvtier.daemon.pool.records import (
    AdoptResult,
    ClassStats,
    EvictedPage,
    HostPoolError,
    HostPoolStats,
    PageInfo,
    PageState,
)
from kvtier.ipc.shm import SharedMemorySegment

# The format, and the records re-exported from kvtier.daemon.pool.records (defined here
# before the split): AdoptResult, ClassStats, EvictedPage, HostPoolError, HostPoolStats,
# PageInfo, PageState.
__all__ = [
    "COLUMNS",
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "GENERATION_OFFSET",
    "HAS_CHECKSUM",
    "HEADER_BYTES",
    "HEADER_REGION",
    "HEADROOM_ALIGN",
    "HEADROOM_MIN_PAGE_BYTES",
    "ID_CAPACITY",
    "KEY_BYTES",
    "MAGIC",
    "MAX_SLOT_IDS",
    "META_ROUND",
    "NIL",
    "POLICY_OFFSET",
    "SLOT_HEADROOM",
    "SLOT_META_BYTES",
    "USED_AGAIN",
    "AdoptResult",
    "ClassStats",
    "EvictedPage",
    "HostPoolError",
    "HostPoolStats",
    "IdTable",
    "PageInfo",
    "PageState",
    "PoolLayout",
    "map_pool_file",
    "page_checksum",
    "page_checksums",
    "round_up",
    "seal_of",
]


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

USED_AGAIN = 2
"""Bit of the per-slot flags byte: the page was used again since it was stored (T2 of the
``arc`` and ``reuse`` eviction policies), so an adopted pool keeps their split."""

NIL = -1

MAX_SLOT_IDS = 2**31
"""Slot ids are int32 (the parent column and the private links): a pool has fewer."""
"""The null slot / extent id in every link and in the parent column."""

_MASK64 = (1 << 64) - 1

# magic, version, header size, capacity, extent, align, slot ids per extent, extents,
# slots, key bytes, id capacity, meta bytes, headroom; then the checksum of those; then
# the generation.
_HEADER = struct.Struct("<8sIIQQQQQQIIQQ")
_SUM = struct.Struct("<Q")
_SUM_OFF = _HEADER.size
GENERATION_OFFSET = _SUM_OFF + 8
"""Offset in the header of the generation counter (uint64, outside the checksum)."""

HEADER_BYTES = GENERATION_OFFSET + 8
"""Bytes of the header proper. The rest of :data:`HEADER_REGION` is zeros but for the
runtime-directory tag at 1 KiB (:func:`~kvtier.daemon.pool.poolfile.write_owner_tag`) and
the policy's lifetime at :data:`POLICY_OFFSET`, outside the checksum: adoption never
trusts them (the lifetime is checked, and ignored when out of range)."""

POLICY_OFFSET = 3584
"""Offset in the pool file of the ``reuse`` policy's lifetime (int64, in access ticks; 0:
none), written as the policy re-estimates it and read back by the pool that adopts the
file. Outside the header's checksum, past the runtime-directory tag's room (1 KiB + 2 KiB),
cleared by a format."""

COLUMNS = (
    ("stamp", "q", 8),
    ("checksum", "Q", 8),
    ("seal", "Q", 8),
    ("ns", "q", 8),
    ("owner", "q", 8),
    ("length", "q", 8),
    ("parent", "i", 4),
    ("key", "B", KEY_BYTES),
    ("state", "b", 1),
    ("in_l3", "b", 1),
    ("key_len", "B", 1),
    ("flags", "B", 1),
)
"""The per-slot columns, in file order: ``(name, memoryview format, bytes per slot)``,
widest first (so each stays aligned to its width)."""

SLOT_META_BYTES = sum(size for _, _, size in COLUMNS)
"""Bytes of persistent metadata per slot id."""


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
    that the headroom never costs a page (a 2 MiB page would not fit a 4 MiB extent
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
            raise HostPoolError(
                f"headroom must be 0 or a multiple of align={align} of at "
                f"least {SLOT_HEADROOM}, got {headroom}"
            )
        min_stride = round_up(max(1, min_page_bytes or align), align)
        if min_stride > extent_bytes:
            raise HostPoolError(f"min_page_bytes={min_page_bytes} exceeds extent_bytes")
        if id_capacity < 1:
            raise HostPoolError(f"id_capacity must be >= 1, got {id_capacity}")
        per_extent = extent_bytes // min_stride
        span = extent_bytes + per_extent * headroom
        n_extents = capacity_bytes // span
        if n_extents < 1:
            raise HostPoolError(
                f"capacity_bytes={capacity_bytes} holds no {extent_bytes}B extent"
                + (f" ({span}B with its slots' headroom)" if headroom else "")
            )
        n_slots = n_extents * per_extent
        if n_slots >= MAX_SLOT_IDS:
            largest = cls.max_capacity(extent_bytes, align, min_page_bytes, headroom)
            raise HostPoolError(
                f"capacity_bytes={capacity_bytes} needs {n_slots} slot ids, "
                f"more than the index's {MAX_SLOT_IDS}; at most {largest} bytes "
                f"with extent_bytes={extent_bytes}"
            )
        ids_off = HEADER_REGION
        ext_off = round_up(ids_off + 2 * id_capacity * (DIGEST_BYTES + 1), 64)
        off = round_up(ext_off + 8 * n_extents, 64)
        columns = []
        for name, fmt, size in COLUMNS:
            columns.append((name, fmt, off))
            off = round_up(off + size * n_slots, 64)
        meta_bytes = round_up(off, max(META_ROUND, align))
        return cls(
            capacity_bytes,
            extent_bytes,
            align,
            per_extent,
            n_extents,
            n_slots,
            id_capacity,
            ids_off,
            ext_off,
            tuple(columns),
            meta_bytes,
            headroom,
        )

    @staticmethod
    def max_capacity(
        extent_bytes: int, align: int = 4096, min_page_bytes: int | None = None, headroom: int = 0
    ) -> int:
        """Largest ``capacity_bytes`` whose slot ids fit the index (below :data:`MAX_SLOT_IDS`).

        Args:
            extent_bytes, align, min_page_bytes, headroom: as for :meth:`plan` (valid).

        Returns:
            The whole extents that fit, in bytes (``span`` each).
        """
        per_extent = extent_bytes // round_up(max(1, min_page_bytes or align), align)
        span = extent_bytes + per_extent * headroom
        return (MAX_SLOT_IDS - 1) // per_extent * span

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
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            self.capacity_bytes,
            self.extent_bytes,
            self.align,
            self.per_extent,
            self.n_extents,
            self.n_slots,
            KEY_BYTES,
            self.id_capacity,
            self.meta_bytes,
            self.headroom,
        )
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
        names = (
            "magic",
            "version",
            "header_bytes",
            "capacity_bytes",
            "extent_bytes",
            "align",
            "slot ids per extent",
            "extents",
            "slots",
            "key_bytes",
            "id_capacity",
            "meta_bytes",
            "headroom",
        )
        diffs = [f"{n} {old} -> {new}" for n, old, new in zip(names, fields, ours) if old != new]
        return "geometry changed: " + ", ".join(diffs) if diffs else None

    def explain_size(self, head: bytes, size: int) -> str:
        """Why a pool file of ``size`` bytes starting with ``head`` cannot be adopted."""
        why = self.mismatch(head)
        if why is None or why.startswith("no pool metadata"):
            why = f"pool file has {size} bytes, expected {self.file_bytes}"
        return why


def map_pool_file(
    path: str | Path,
    layout: PoolLayout,
    *,
    prefault: bool = True,
    populate_existing: bool | None = None,
    runtime_dir: str | Path | None = None,
) -> tuple[SharedMemorySegment, str | None]:
    """Map the pool file at ``path``, keeping it when it is the daemon's and its size
    matches ``layout``.

    An existing file is first checked (see :mod:`~kvtier.daemon.pool.poolfile`): a regular
    file of this uid, mode 0600, one link. One that passes and has ``layout.file_bytes``
    bytes is mapped as it is (pre-faulted when asked), so its metadata can be adopted. One
    of this uid that fails a check is removed, one of another size replaced once the new
    one is sure to fit (a start refused for its size keeps it), and the file created
    afresh (``O_EXCL``, mode 0600); the reason is returned for the caller's log line. The
    segment is opened as a peer: closing it never removes the file, so the pool survives a
    restart; remove it explicitly (``segment.close(unlink=True)``) to discard it.

    Args:
        path: the pool file (``pool_path(cfg.pool_dir, runtime_dir)``).
        layout: from :meth:`PoolLayout.plan` with the daemon's config.
        prefault: pre-fault the mapping (and reserve the memory of a new file, after
            checking the directory's free space).
        populate_existing: pre-fault the mapping of an existing file (default:
            ``prefault``). Its pages are resident already; the daemon passes False and
            builds the page tables after it is serving
            (:func:`~kvtier.daemon.pool.poolfile.populate`).
        runtime_dir: the daemon's runtime directory, recorded in the file's header region
            (``kvtier pools`` shows it); None records nothing.

    Returns:
        ``(segment, why_new)``: ``why_new`` is None when an existing file was mapped,
        else why a new one was created (pass it as :class:`HostPool`'s ``cold_start``).

    Raises:
        PoolFileError: the file is someone else's, a symlink or not a regular file (it is
            left alone), or it can be neither opened nor created.
        PoolSpaceError: ``pool_dir`` has no room for a new file of ``layout.file_bytes``.
    """
    populate = prefault if populate_existing is None else populate_existing
    seg, why = open_pool_segment(
        path, layout.file_bytes, populate=populate, explain=layout.explain_size
    )
    if seg is None:  # a file of another size is replaced once the new one is sure to fit
        seg = create_pool_segment(
            path,
            layout.file_bytes,
            capacity=layout.capacity_bytes,
            prefault=prefault,
            replace=True,
        )
    if runtime_dir is not None:
        write_owner_tag(seg.view, runtime_dir)
    return seg, why
