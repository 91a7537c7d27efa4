"""Long LOOKUPs and LOADs of the host pool, answered from its key table in C.

The page table's dict answers a LOOKUP key by key; for a long key list (a 128K-token
context names 8,192 keys) :class:`LongLookups` probes the pool's
:class:`~kvtier.daemon.pool.keytable.KeyTable` instead, in one C call
(``daemon/pool/native/_keyprobe.c``), each key it leaves unresolved decided by the dict.
The committed slots enter the key table in batches (:meth:`LongLookups.committed`), before
any probe of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
from kvtier.daemon.pool.keytable import KeyTable, table_keys
from kvtier.daemon.pool.layout import KEY_BYTES
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.records import HostPoolError

__all__ = ["TABLE_BATCH", "TABLE_MIN_KEYS", "LongLookups"]

TABLE_MIN_KEYS = 256
"""Lookups of this many keys or more are answered from the key table; shorter ones probe
the page table's dict key by key (cheaper below it)."""
TABLE_BATCH = 4096
"""Committed slots wait in a list until a long lookup needs the key table, or until this
many wait: one numpy insertion for many commits instead of one per STORE."""


class LongLookups:
    """The key table of one page table, and the lookups it answers.

    Args:
        pages: the page table (its metadata and READY index).

    Attributes:
        table: the key table.
    """

    def __init__(self, pages: PageTable) -> None:
        self._pages = pages
        self.table = KeyTable(pages.meta)
        self._unlisted: list[int] = []  # committed, not in the table yet

    def close(self) -> None:
        """Drop the key table's views of the metadata."""
        self.table.close()

    def rebuild(self) -> None:
        """Refill the key table from the READY rows (after an adoption)."""
        self.table.rebuild()
        self._unlisted = []

    def committed(self, slots: Sequence[int]) -> None:
        """Note committed ``slots``: they enter the table before its next probe."""
        self._unlisted += slots
        if len(self._unlisted) >= TABLE_BATCH:
            self.flush()

    def flush(self) -> None:
        """Enter the slots committed since the last time into the key table."""
        if self._unlisted:
            self.table.add(self._unlisted)  # a slot freed meanwhile costs an entry only
            self._unlisted = []

    def packed(self, keys: Sequence[bytes]) -> bytes | memoryview | None:
        """``keys`` packed for the table, or None when they are too few (or not all 32
        bytes): the dict answers those."""
        return table_keys(keys, TABLE_MIN_KEYS)

    def run_slots(self, ns_id: int, packed: bytes | memoryview) -> list[int]:
        """The slots of the leading READY run of ``packed`` in ``ns_id`` (a LOAD's pin
        looks no key up twice)."""
        slots = np.empty(len(packed) // KEY_BYTES, dtype=np.int64)
        return cast("list[int]", slots[: self.probe_run(ns_id, packed, slots)].tolist())

    def probe_run(
        self, ns_id: int, packed: bytes | memoryview, slots: np.ndarray | None = None
    ) -> int:
        """The leading READY run of ``packed`` (whole 32-byte keys) by the C probe, each key
        it leaves unresolved decided by the dict; with ``slots``, each key's slot is written
        there."""
        words = np.frombuffer(packed, dtype="<u8").reshape(-1, KEY_BYTES // 8)
        self.flush()
        ready = self._pages.ready.get(ns_id, {})
        i = 0
        while True:  # C: up to the first key not found, which may be an unfinished probe
            i, unresolved = self.table.leading_run(ns_id, words, i, slots)
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
        """See :meth:`~kvtier.daemon.pool.index.HostPool.lookup_packed`."""
        if len(packed) % KEY_BYTES:
            raise HostPoolError(
                f"packed keys of {len(packed)} bytes: not a multiple of {KEY_BYTES}"
            )
        n = len(packed) // KEY_BYTES
        if not n or not self._pages.ready.get(ns_id):
            return 0
        if n < TABLE_MIN_KEYS:
            keys = np.frombuffer(packed, dtype=f"V{KEY_BYTES}").tolist()
            return self._pages.lookup(ns_id, keys)
        return self.probe_run(ns_id, packed)
