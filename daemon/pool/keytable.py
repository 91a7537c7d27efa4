"""The host pool's LOOKUP index: a hash table of the READY pages, probed in C.

:class:`KeyTable` holds the READY pages of a pool in an open-addressing array of slot ids,
probed for the keys of a request in one call of ``daemon/pool/native/_keyprobe.c`` (its
``Probe``), which checks each candidate against the pool's own columns (key bytes, key
length, namespace, state) before it counts: the table only proposes slots, the metadata
decides. Every LOOKUP, of one key or of 8,192, and every LOAD's pin find their pages here.

So the table never has to forget a page: a freed or reused slot left behind fails the
check, and an entry of a slot re-committed under another key is just a dead entry. Dead
entries only cost probes; the table is rebuilt from the READY rows once a quarter of it
is used, at eight entries per READY page (capacity: the power of two at or above that,
so at most 64 bytes per page).

What the table must never do is call a READY page absent. Every commit's slots are added
(:meth:`add`, in C) and an adoption rebuilds it (:meth:`rebuild`). A probe runs at most
:data:`MAX_ROUNDS` entries from its bucket, and so does an insertion: a page that finds
no free entry there is left out of the table, and since entries are never emptied (until
a rebuild, which enters every READY page again) a lookup of it meets
:data:`MAX_ROUNDS` taken entries too and reports it *unresolved*, for the caller's exact
probe (the page table's dict) to decide. An empty entry ends a probe with a true "absent".

Buckets come from the key's first 8 bytes and the namespace by multiply-shift hashing
with a multiplier drawn per table. Page keys are SHA-256 digests, so buckets spread; keys
a client crafts to share their first bytes fill one run of :data:`MAX_ROUNDS` entries and
then go the exact way, at no cost to correctness and bounded cost to everyone else.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
from kvtier.daemon.pool.layout import KEY_BYTES
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.records import PageState
from kvtier.ipc.packed import PackedKeyList, pack_keys

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
        meta: the pool's metadata region; the table keeps views of its ``key``,
            ``key_len``, ``ns`` and ``state`` columns until :meth:`close`.
    """

    def __init__(self, meta: PoolMeta) -> None:
        self._n_slots = meta.layout.n_slots
        self._keys = meta.array("key").view("<u8").reshape(self._n_slots, _WORDS)
        self._key_len = meta.array("key_len")
        self._ns = meta.array("ns")
        self._state = meta.array("state")
        self._mult = np.array([secrets.randbits(64) | 1 for _ in range(2)], dtype=np.uint64)
        self._used = 0
        self.left_out = 0
        """Pages that found no entry near their bucket since the table was made (their
        lookups take the exact probe)."""
        self._new_table(MIN_CAPACITY)

    def _new_table(self, capacity: int) -> None:
        """An empty table of ``capacity`` entries, and the C probe over it."""
        old = getattr(self, "_probe", None)
        if old is not None:
            old.close()
        self._table = np.full(capacity, _EMPTY, dtype=np.int32)
        self._shift = 64 - (capacity.bit_length() - 1)
        self._used = 0
        self._probe = _keyprobe.Probe(
            self._table,
            self._keys,
            self._ns,
            self._state,
            self._key_len,
            int(self._mult[0]),
            int(self._mult[1]),
            self._shift,
            MAX_ROUNDS,
            _READY,
        )

    def close(self) -> None:
        """Drop the views of the metadata (the table is unusable afterwards)."""
        self._probe.close()
        for name in ("_keys", "_key_len", "_ns", "_state"):  # a second close is a no-op
            self.__dict__.pop(name, None)

    @property
    def capacity(self) -> int:
        """Entries of the table (a power of two)."""
        return len(self._table)

    # ------------------------------------------------------------------ updates
    def add(self, slots: Sequence[int] | np.ndarray) -> None:
        """Enter committed ``slots`` (ids out of range are ignored; a slot that is not
        READY costs an entry and nothing else)."""
        if LOAD_LIMIT * (self._used + len(slots)) > len(self._table):
            self.rebuild()  # the pages of slots are READY by now: the rebuild takes them
            return
        self._used += len(slots)
        self.left_out += self._probe.add(slots)

    def rebuild(self) -> None:
        """Refill the table from the READY rows of the metadata, sized for them."""
        ready = np.flatnonzero(self._state == _READY)
        cap = MIN_CAPACITY
        while cap < 2 * LOAD_LIMIT * len(ready):
            cap *= 2
        self._new_table(cap)
        self._used = len(ready)
        self.left_out += self._probe.add(ready)

    # ------------------------------------------------------------------ lookups
    def leading_run(
        self,
        ns_id: int,
        packed: bytes | memoryview,
        start: int = 0,
        slots: list[int] | None = None,
        lengths: bytes | None = None,
    ) -> tuple[int, bool]:
        """The first key from ``start`` that is not READY in ``ns_id``, probed in C (it
        stops at that key).

        Args:
            ns_id: the namespace.
            packed: the keys, 32 bytes each, back to back (each zero-padded past its
                length).
            start: the key to begin with (those before it are taken as found).
            slots: a list, or None; the slot found for each key from ``start`` up to the
                returned index is appended to it.
            lengths: one byte per key, its length; None: every key is 32 bytes.

        Returns:
            ``(index, unresolved)``: the index of that key (``n`` when all are READY), and
            whether its probe ran out of :data:`MAX_ROUNDS` rounds (the caller's exact
            probe decides it) rather than ended at an empty entry (a true miss).
        """
        i, open_ = self._probe.leading_run(packed, ns_id, start, slots, lengths)
        return i, bool(open_)


def table_keys(keys: Sequence[bytes]) -> tuple[bytes | memoryview, bytes | None]:
    """``keys`` as :meth:`KeyTable.leading_run` takes them: packed back to back, and their
    lengths (None: all 32 bytes). Keys that came packed
    (:class:`~kvtier.ipc.protocol.PackedKeyList`) are probed as they came; a key that no
    page can hold (not bytes, or longer than 32 bytes) ends the list, it and the keys after
    it left out (a lookup's run stops there anyway)."""
    if isinstance(keys, PackedKeyList):
        return keys.packed, None
    packed = pack_keys(keys)  # in C: None unless every key is a bytes object of 32 bytes
    if packed is not None:
        return packed, None
    end = next(
        (i for i, k in enumerate(keys) if not isinstance(k, bytes) or len(k) > KEY_BYTES),
        len(keys),
    )
    held = keys[:end]
    return b"".join(k.ljust(KEY_BYTES, b"\0") for k in held), bytes(map(len, held))
