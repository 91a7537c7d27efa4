"""The host pool's LOOKUPs and LOADs, answered from its key table in C.

Every LOOKUP, of one key or of a 128K-token context's 8,192, and every LOAD's pin find
their pages the same way: :class:`KeyLookups` probes the pool's
:class:`~kvtier.daemon.pool.keytable.KeyTable` in one C call
(``daemon/pool/native/_keyprobe.c``), and only a key that the probe leaves unresolved (its
bucket's run full, which keys crafted to share their first bytes make) is decided by the
page table's dict, the exact index that allocation, commit and eviction keep. A commit's
slots enter the key table as it is made (:meth:`KeyLookups.committed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from kvtier.daemon.pool.keytable import KeyTable, table_keys
from kvtier.daemon.pool.layout import KEY_BYTES
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.records import HostPoolError

__all__ = ["KeyLookups"]

_NO_PAGES: dict[bytes, int] = {}  # a namespace without pages; never written


class KeyLookups:
    """The key table of one page table, and the lookups it answers.

    Args:
        pages: the page table (its metadata, and its dict for unresolved keys).

    Attributes:
        table: the key table.
    """

    def __init__(self, pages: PageTable) -> None:
        self._pages = pages
        self.table = KeyTable(pages.meta)

    def close(self) -> None:
        """Drop the key table's views of the metadata."""
        self.table.close()

    def rebuild(self) -> None:
        """Refill the key table from the READY rows (after an adoption)."""
        self.table.rebuild()

    def committed(self, slots: Sequence[int]) -> None:
        """Enter committed ``slots`` into the key table."""
        self.table.add(slots)

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """See :meth:`~kvtier.daemon.pool.host_pool.HostPool.lookup`."""
        packed, lengths = table_keys(keys)
        return self._run(ns_id, packed, lengths, None)

    def lookup_packed(self, ns_id: int, packed: bytes | memoryview) -> int:
        """See :meth:`~kvtier.daemon.pool.host_pool.HostPool.lookup_packed`."""
        if len(packed) % KEY_BYTES:
            raise HostPoolError(
                f"packed keys of {len(packed)} bytes: not a multiple of {KEY_BYTES}"
            )
        return self._run(ns_id, packed, None, None)

    def run_slots(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """The slots of the leading READY run of ``keys`` in ``ns_id`` (a LOAD's pin
        looks no key up twice)."""
        packed, lengths = table_keys(keys)
        slots: list[int] = []
        self._run(ns_id, packed, lengths, slots)
        return slots

    def _run(
        self, ns_id: int, packed: bytes | memoryview, lengths: bytes | None, slots: list[int] | None
    ) -> int:
        """The leading READY run of ``packed`` by the C probe, each key it leaves
        unresolved decided by the dict; with ``slots``, each key's slot is appended to it."""
        leading_run = self.table.leading_run
        i, unresolved = leading_run(ns_id, packed, 0, slots, lengths)
        while unresolved:  # C stopped at an unfinished probe: the exact way decides the key
            at = i * KEY_BYTES
            key = bytes(packed[at : at + (KEY_BYTES if lengths is None else lengths[i])])
            s = self._pages.ready.get(ns_id, _NO_PAGES).get(key)
            if s is None:
                return i
            if slots is not None:
                slots.append(s)
            i, unresolved = leading_run(ns_id, packed, i + 1, slots, lengths)
        return i
