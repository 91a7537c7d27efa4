"""The host pool's state machine page by page in Python: the oracle its C paths are held to.

:class:`PageByPage` is the page table with allocate, commit, pin and unpin done one page
at a time, step for step as ``daemon/pool/native/_alloc.c`` and ``_pins.c`` say they do
them; :func:`page_by_page` gives a host pool this table. Tests run the same operations on
a pool of each kind and compare everything observable.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.daemon.pool.index import HostPool
from kvtier.daemon.pool.layout import HAS_CHECKSUM
from kvtier.daemon.pool.longlookup import LongLookups
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.records import HostPoolError, PageState
from xxhash import xxh3_64_intdigest

_READY, _WRITING = int(PageState.READY), int(PageState.WRITING)
_MAX_U64 = (1 << 64) - 1


class PageByPage(PageTable):
    """The page table, every allocation, commit, pin and unpin page by page in Python."""

    def allocate(self, ns_id: int, owner: int, class_id: int, keys: Sequence[bytes],
                 parent_key: bytes | None = None) -> list[tuple[int, int]]:  # fmt: skip
        self.slots.check_class(class_id)
        return self._allocate(ns_id, owner, class_id, keys, parent_key)

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        meta, state, keys, n_slots = self.meta, self._state, self._key, self.n_slots
        for s in slots:
            if not 0 <= s < n_slots or state[s] != _WRITING:
                self._expect(s, PageState.WRITING, "commit")
        if checksums is not None and (len(checksums) != len(slots) or (
                checksums and (min(checksums) < 0 or max(checksums) > _MAX_U64))):  # fmt: skip
            raise HostPoolError(f"need one 64-bit checksum per slot ({len(slots)})")
        clock = self._clock
        for j in range(len(slots) - 1, -1, -1):
            s = slots[j]
            if state[s] != _WRITING:  # listed twice
                self._clock = clock
                self._expect(s, PageState.WRITING, "commit")
            key = keys[s]
            assert key is not None
            ns = self._ns[s]
            if checksums is None:
                csum = meta.flags[s] = 0
            else:
                csum = meta.checksum[s] = checksums[j]
                meta.flags[s] = HAS_CHECKSUM
            meta.seal[s] = xxh3_64_intdigest(key, (csum ^ ns) & _MAX_U64)
            clock += 1
            self._stamp[s] = clock
            state[s] = _READY
            del self._writing[ns][key]
            self._ready.setdefault(ns, {})[key] = s
            cls = self._classes[self._ext_class[s // self._per_extent]]
            cls.writing -= 1
            cls.ready += 1
            if self._children[s] == 0:
                self._lru.enqueue(s, self._owner[s])
        self._clock = clock

    def pin_slots(self, out: list[int], used: bool = False) -> None:
        pins, children, stamp, owner = self._pins, self._children, self._stamp, self._owner
        for s in reversed(out):
            if pins[s] == 0:
                self._pin.pinned += 1
                if children[s] == 0:
                    self._lru.dequeue(s, owner[s])
            pins[s] += 1
            self._clock += 1
            stamp[s] = self._clock
        if used and self._arc is not None:
            self._arc.reused(out)

    def unpin(self, slots: Sequence[int]) -> None:
        pins, state, children, owner = self._pins, self._state, self._children, self._owner
        for s in slots:
            if not 0 <= s < self.n_slots or state[s] != _READY or pins[s] == 0:
                self._expect(s, PageState.READY, "unpin")
        if any(slots.count(s) > pins[s] for s in set(slots)):  # type: ignore[attr-defined]
            self._refuse_unpin(slots)
        for s in slots:
            pins[s] -= 1
            if pins[s] == 0:
                self._pin.pinned -= 1
                if children[s] == 0:
                    self._lru.enqueue(s, owner[s])


def page_by_page(pool: HostPool) -> HostPool:
    """Give the empty ``pool`` a :class:`PageByPage` table (its settings kept); returns it."""
    old = pool._pages
    ev = old.evictor
    pool._long.close()
    pool._pages = PageByPage(old.meta, max_log=ev.max_log, quota=ev.quota,
                             requires_l3=ev.requires_l3, policy=ev.policy)  # fmt: skip
    pool._long = LongLookups(pool._pages)
    return pool
