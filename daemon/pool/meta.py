"""The pool file's metadata region, mapped: typed column views, header, keys, id tables.

Writes through these views are the persistence: the region is the start of the pool's
shared-memory file, so a store to a column is on "disk" the moment it is made, and a
killed daemon loses nothing it wrote. The format itself (where each region lies, the
header's fields) is :mod:`kvtier.daemon.pool.layout`; deciding which rows survive a
restart is :mod:`kvtier.daemon.pool.adopt`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container
from typing import Any

import numpy as np
from kvtier.daemon.pool.layout import (
    COLUMNS,
    DIGEST_BYTES,
    GENERATION_OFFSET,
    POLICY_OFFSET,
    HEADER_BYTES,
    HEADER_REGION,
    KEY_BYTES,
    MAGIC,
    IdTable,
    PoolLayout,
)
from kvtier.daemon.pool.records import HostPoolError

__all__ = ["PoolMeta", "tenant_digest"]

_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1


class PoolMeta:
    """The metadata region of one pool, mapped: typed views over a writable buffer.

    Every attribute named after a column (``stamp``, ``checksum``, ``seal``, ``ns``,
    ``owner``, ``length``, ``parent``, ``key``, ``state``, ``in_l3``, ``key_len``,
    ``flags``) is a memoryview indexed by slot id (``key`` by byte: slot ``s`` owns
    ``key[32 s : 32 s + 32]``); ``ext_bytes`` holds the page bytes of each extent's class
    (0: free); ``policy_state`` (one int64) the ``reuse`` policy's lifetime. Writes through
    them are the persistence: there is no separate flush.

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
            raise HostPoolError(
                f"the pool metadata buffer has {n} bytes, needs {layout.meta_bytes}"
            )
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
        for (name, fmt, off), (_, _, size) in zip(layout.columns, COLUMNS):
            cols[name] = self._raw[off : off + size * n].cast(fmt)  # type: ignore[call-overload]
        self.stamp, self.checksum, self.seal = cols["stamp"], cols["checksum"], cols["seal"]
        self.ns, self.owner, self.length = cols["ns"], cols["owner"], cols["length"]
        self.parent, self.key, self.state = cols["parent"], cols["key"], cols["state"]
        self.in_l3, self.key_len, self.flags = cols["in_l3"], cols["key_len"], cols["flags"]
        self.policy_state = self._raw[POLICY_OFFSET : POLICY_OFFSET + 8].cast("q")
        self._views = [
            self._raw,
            self.ext_bytes,
            self.policy_state,
            *self._digests,
            *self._used,
            *cols.values(),
        ]
        self._id_cache = [self._read_ids(t) for t in IdTable]
        self.pack_key = struct.Struct(f"{KEY_BYTES}s").pack_into

    # ------------------------------------------------------------------ header

    def mismatch(self) -> str | None:
        """Return why the stored header does not describe :attr:`layout` (None: it does)."""
        return self.layout.mismatch(self._raw[:HEADER_BYTES])

    @property
    def generation(self) -> int:
        """The generation counter stored in the header."""
        return int(_U64.unpack_from(self._raw, GENERATION_OFFSET)[0])

    def bump_generation(self) -> int:
        """Increment the stored generation (one 8-byte store) and return the new value."""
        gen = (self.generation + 1) & _MASK64
        _U64.pack_into(self._raw, GENERATION_OFFSET, gen)
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
        self.policy_state[0] = 0  # a lifetime belongs to the pages it was measured on
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

    def id_of(self, table: IdTable, digest: bytes, avoid: Container[int] = ()) -> int:
        """Return the id of ``digest`` in ``table``, appending it if new (digest bytes
        first, used flag last, so a crash never leaves a half-written entry in use) in the
        first free entry whose id is not in ``avoid``.

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
        flags = used.tobytes()
        i = flags.find(b"\x00")
        while i >= 0 and i + 1 in avoid:
            i = flags.find(b"\x00", i + 1)
        if i < 0:
            raise HostPoolError(
                f"the {table.name.lower()} table is full ({self.layout.id_capacity} entries)"
            )
        self._digests[table][i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] = digest
        used[i] = 1
        known[digest] = i + 1
        return i + 1

    def release_id(self, table: IdTable, id_: int) -> None:
        """Free entry ``id_`` of ``table`` for :meth:`id_of` to give to another digest (used
        flag first, so a crash never leaves the old digest in use half-cleared). The caller
        makes sure nothing refers to the id any more."""
        known = self._id_cache[table]
        digest = next((d for d, i in known.items() if i == id_), None)
        if digest is None:
            return
        i = id_ - 1
        self._used[table][i] = 0
        self._digests[table][i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] = bytes(DIGEST_BYTES)
        del known[digest]

    def _read_ids(self, table: IdTable) -> dict[bytes, int]:
        digests = self._digests[table]
        used = np.flatnonzero(np.frombuffer(self._used[table], dtype=np.uint8)).tolist()
        return {bytes(digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]): i + 1 for i in used}

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
