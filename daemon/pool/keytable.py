"""A hash table of the READY pages that answers a whole LOOKUP in one C call.

The page table's dict answers one key at a time: a long key list (8,192 keys for a 128K
token context) costs a Python object, a hash and a probe per key. :class:`KeyTable` holds
the same pages in an open-addressing array of slot ids (filled in numpy), probed for the
keys of a request in one call of ``daemon/pool/native/_keyprobe.c``, which checks each
candidate against the pool's own columns (key bytes, key length, namespace, state) before
it counts: the table only proposes slots, the metadata decides.

So the table never has to forget a page: a freed or reused slot left behind fails the
check, and an entry of a slot re-committed under another key is just a dead entry. Dead
entries only cost probes; the table is rebuilt from the READY rows once a quarter of it
is used, at eight entries per READY page (32 bytes per page at most).

What the table must never do is call a READY page absent. Every commit's slots are added
(:meth:`add`; the host pool batches them and adds them before any probe of the table) and
an adoption rebuilds it (:meth:`rebuild`). A probe runs at most
:data:`MAX_ROUNDS` entries from its bucket, and so does an insertion: a page that finds
no free entry there is left out of the table, and since entries are never emptied (until
a rebuild, which enters every READY page again) a lookup of it meets
:data:`MAX_ROUNDS` taken entries too and reports it *unresolved*, for the caller's exact
probe to decide. An empty entry ends a probe with a true "absent".

Buckets come from the key's first 8 bytes and the namespace by multiply-shift hashing
with a multiplier drawn per table. Page keys are SHA-256 digests, so buckets spread; keys
a client crafts to share their first bytes fill one run of :data:`MAX_ROUNDS` entries and
then go the exact way, at no cost to correctness and bounded cost to everyone else.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import cast

import numpy as np
from kvtier.daemon.pool.layout import KEY_BYTES
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.records import PageState
from kvtier.ipc.packed import PACK_NATIVE, PackedKeyList, pack_keys

from kvtier.daemon.pool.native import _keyprobe

__all__ = ["MAX_ROUNDS", "MIN_CAPACITY", "KeyTable", "table_keys"]

MAX_ROUNDS = 4
"""Probe rounds a lookup runs; keys still open then are left to the exact probe."""
MIN_CAPACITY = 1 << 12
"""Smallest table (entries)."""
LOAD_LIMIT = 4
"""The table is rebuilt once more than 1/LOAD_LIMIT of it is used (dead entries included),
at twice LOAD_LIMIT entries per READY page: most keys are found at their first probe."""
_EMPTY = -1
_WORDS = KEY_BYTES // 8
_READY = int(PageState.READY)


class KeyTable:
    """Slot ids of the READY pages of one pool, by (namespace, key); see the module docstring.

    Args:
        meta: the pool's metadata region; the table keeps numpy views of its ``key``,
            ``key_len``, ``ns`` and ``state`` columns until :meth:`close`.
    """

    def __init__(self, meta: PoolMeta) -> None:
        self._n_slots = meta.layout.n_slots
        self._keys = meta.array("key").view("<u8").reshape(self._n_slots, _WORDS)
        self._key_len = meta.array("key_len")
        self._ns = meta.array("ns")
        self._state = meta.array("state")
        self._mult = np.array([secrets.randbits(64) | 1 for _ in range(2)], dtype=np.uint64)
        self._table = np.full(MIN_CAPACITY, _EMPTY, dtype=np.int32)
        self._shift = np.uint64(64 - (MIN_CAPACITY.bit_length() - 1))
        self._used = 0
        self.left_out = 0
        """Pages that found no entry near their bucket since the table was made (their
        lookups take the exact probe)."""

    def close(self) -> None:
        """Drop the views of the metadata (the table is unusable afterwards)."""
        del self._keys, self._key_len, self._ns, self._state

    @property
    def capacity(self) -> int:
        """Entries of the table (a power of two)."""
        return len(self._table)

    # ------------------------------------------------------------------ hashing
    def _hash(self, words: np.ndarray, ns: np.ndarray | int) -> np.ndarray:
        """Bucket of each row of ``words`` (n x 4 uint64) in namespace(s) ``ns``."""
        with np.errstate(over="ignore"):
            h = np.asarray(ns, dtype=np.int64).astype(np.uint64) * self._mult[1]
            h ^= words[:, 0]
            h *= self._mult[0]
        h >>= self._shift
        return cast("np.ndarray", h.astype(np.intp))

    # ------------------------------------------------------------------ updates
    def add(self, slots: Sequence[int] | np.ndarray) -> None:
        """Enter committed ``slots`` (ids out of range are ignored; a slot that is not
        READY costs an entry and nothing else)."""
        s = np.asarray(slots, dtype=np.int64)
        s = s[(s >= 0) & (s < self._n_slots)]
        if not len(s):
            return
        if LOAD_LIMIT * (self._used + len(s)) > len(self._table):
            self.rebuild()  # the pages of s are READY by now: the rebuild takes them
            return
        self._place(s.astype(np.int32))

    def rebuild(self) -> None:
        """Refill the table from the READY rows of the metadata, sized for them."""
        ready = np.flatnonzero(self._state == _READY).astype(np.int32)
        cap = MIN_CAPACITY
        while cap < 2 * LOAD_LIMIT * len(ready):
            cap *= 2
        self._table = np.full(cap, _EMPTY, dtype=np.int32)
        self._shift = np.uint64(64 - (cap.bit_length() - 1))
        self._used = 0
        self._place(ready)

    def _place(self, slots: np.ndarray) -> None:
        """Insert ``slots`` by linear probing, a batch of probes per round, at most
        :data:`MAX_ROUNDS` entries from each one's bucket (the rest stay out)."""
        table, mask = self._table, len(self._table) - 1
        self._used += len(slots)
        pos = self._hash(self._keys[slots], self._ns[slots])
        for _ in range(MAX_ROUNDS):
            if not len(slots):
                return
            free = np.flatnonzero(table.take(pos) == _EMPTY)
            # of the slots landing on one free entry, one takes it (whichever numpy wrote
            # last); reading the entries back tells which (slot ids are distinct)
            table[pos[free]] = slots[free]
            left = np.ones(len(slots), dtype=bool)
            left[free[table.take(pos[free]) == slots[free]]] = False
            slots, pos = slots[left], (pos[left] + 1) & mask
        self.left_out += len(slots)

    # ------------------------------------------------------------------ lookups
    def leading_run(
        self, ns_id: int, words: np.ndarray, start: int = 0, slots: np.ndarray | None = None
    ) -> tuple[int, bool]:
        """The first key from ``start`` that is not READY in ``ns_id``, probed in C (it
        stops at that key).

        Args:
            ns_id: the namespace.
            words: the keys, a C-contiguous n x 4 array of little-endian uint64.
            start: the key to begin with (those before it are taken as found).
            slots: a writable int64 array of one entry per key, or None; the slot found
                for each key from ``start`` up to the returned index is written to it.

        Returns:
            ``(index, unresolved)``: the index of that key (``n`` when all are READY), and
            whether its probe ran out of :data:`MAX_ROUNDS` rounds (the caller's exact
            probe decides it) rather than ended at an empty entry (a true miss).

        """
        i, open_ = _keyprobe.leading_run(
            self._table,
            self._keys,
            self._ns,
            self._state,
            self._key_len,
            words,
            ns_id,
            int(self._mult[0]),
            int(self._mult[1]),
            int(self._shift),
            start,
            MAX_ROUNDS,
            _READY,
            *(() if slots is None else (slots,)),
        )
        return i, bool(open_)


def table_keys(keys: Sequence[bytes], min_keys: int) -> bytes | memoryview | None:
    """``keys`` packed back to back for a probe of the table, or None when there are fewer
    than ``min_keys`` or one is not a table's key (32 bytes). Keys that came packed
    (:class:`~kvtier.ipc.protocol.PackedKeyList`) are probed as they came."""
    if len(keys) < min_keys:
        return None
    if isinstance(keys, PackedKeyList):
        return keys.packed
    if type(keys) is list and PACK_NATIVE:
        return pack_keys(keys)  # in C: every key checked to be 32 bytes
    if max(map(len, keys)) != KEY_BYTES:
        return None
    packed = b"".join(keys)
    return packed if len(packed) == KEY_BYTES * len(keys) else None  # a shorter key too
