"""The page table's steps in one C call each: a STORE's allocation and commit, and the
release of pages (an abort, an eviction, a flush).

A STORE allocates a WRITING slot per key the pool lacks and, once the copy has landed,
commits them READY. Page by page in Python, into a full pool (where every new page first
evicts a cold one), that costs microseconds of event-loop time a page: an 8,192-page STORE
of a long context would hold the loop for a large fraction of a second, during which no
other engine is answered.

:class:`PageSteps`, which the page table owns, holds the pool's columns as
``daemon/pool/native/_alloc.c`` takes them and makes those calls, for any number of pages.
The C code does the same steps in the same order as the page-by-page model
(``tests/pool_model.py``), which the tests hold it to: the pool's metadata, indexes,
evictable lists, counters and eviction log end up exactly as page by page. Every slot comes
from C's ``take_slot``, which takes every step of the policy
(:mod:`~kvtier.daemon.pool.eviction`): a free slot of the class, else the victims the policy
names (quotas, evictions that need L3, another class's pages), asking ``arc``'s target and
ghosts of its Python state. The ``reuse`` policy's state is C's own (``_alloc.Reuse``), so C
evicts from the list it names and admits each new page to T1 or T2 itself; a commit that the
page table refuses changes nothing, and the table names what is wrong.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvtier.daemon.pool.eviction import Evictor
from kvtier.daemon.pool.links import ChildLists
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.native import _alloc
from kvtier.daemon.pool.policies import ReuseState
from kvtier.daemon.pool.records import EvictedPage
from kvtier.daemon.pool.slots import PageClass, SlotAllocator

__all__ = ["PageSteps"]


class PageSteps:
    """A STORE's allocation and commit, and the release of pages, over one page table's
    state, in C.

    Args:
        meta / slots / kids / evictor: the table's metadata, slot allocator, child lists
            and evictor (whose evictable lists, owner counts and log C updates).
        pins: the pin count of each slot.
        keys: the key of each slot (None: FREE).
        ready / writing: the table's index, ``ns -> key -> slot``, READY and WRITING.
    """

    def __init__(
        self,
        meta: PoolMeta,
        slots: SlotAllocator,
        kids: ChildLists,
        evictor: Evictor,
        pins: array[int],
        keys: list[bytes | None],
        ready: dict[int, dict[bytes, int]],
        writing: dict[int, dict[bytes, int]],
    ) -> None:
        lru = evictor.lru
        self._cols = (
            meta.stamp,
            meta.ns,
            meta.owner,
            meta.length,
            meta.parent,
            meta.key,
            meta.state,
            meta.in_l3,
            meta.key_len,
            pins,
            kids.count,
            kids.first,
            kids.sib_prev,
            kids.sib_next,
            lru.prev,
            lru.next,
            lru.oprev,
            lru.onext,
            slots.ext_class,
            slots.ext_used,
            slots.ext_bump,
        )
        self._extra = (meta.checksum, meta.seal, meta.flags)

        self._slots, self._ev, self._lru = slots, evictor, lru
        self._keys, self._ready, self._writing = keys, ready, writing
        self._per_extent = slots.per_extent

    def allocate(
        self, ns_id: int, owner: int, class_id: int, keys: list[bytes], prev: int, clock: list[int]
    ) -> list[tuple[int, int]] | None:
        """Allocate WRITING slots for ``keys`` as :meth:`PageTable.allocate` says: each
        slot by C's ``take_slot``, the policy's every step (a free slot of the class, else
        the victims it names; ``arc``'s target and ghosts asked of
        :class:`~kvtier.daemon.pool.policies.ArcState`, ``reuse``'s state run in C). Under
        ``arc`` and ``reuse`` each new page is admitted to T1 or T2
        (:meth:`SplitState.admit`; ``reuse``'s in C).

        Args:
            prev: the slot ``keys[0]`` extends (NIL: none).
            clock: the table's access clock, in a one-item list: advanced by one a page
                allocated, also when an error stops the allocation.

        Returns:
            ``(index into keys, slot)`` per page allocated (a shortfall shows as missing
            pairs); None, having changed nothing, when a key is not ``bytes`` of at most 32
            bytes.
        """
        cls: PageClass = self._slots.classes[class_id]
        split = self._ev.split
        admit = split.admit if split is not None and not isinstance(split, ReuseState) else None
        out: list[tuple[int, int]] = []
        done = _alloc.run(
            self._cols,
            keys,
            prev,
            clock,
            ns_id,
            owner,
            class_id,
            cls.page_bytes,
            self._per_extent,
            self._ready.get(ns_id, {}),  # read only: a namespace's first commit makes it
            self._writing.setdefault(ns_id, {}),
            self._ready,
            self._keys,
            self._ev.owned,
            self._lru.ends,
            self._lru.own_ends,
            out,
            self._env(),
            admit,
        )
        return None if done is None else out

    def commit(
        self, slots: Sequence[int], checksums: Sequence[int] | None, clock: int
    ) -> tuple[int, int] | None:
        """Commit the WRITING ``slots`` as the page table does (under a two-list policy, each page
        enters T1 or T2 by its tier).

        Returns:
            ``(stop, clock)``: ``stop`` is 0, or ``j + 1`` where ``slots[j]`` was listed
            twice (those after it are committed); None, having changed nothing, when a
            slot or checksum is refused (the page table names it).
        """
        if type(slots) is not list or (checksums is not None and type(checksums) is not list):
            return None
        lru = self._lru
        tiers = () if lru.tier is None else (lru.ends2, lru.tier)  # arc, reuse: T1 and T2
        return _alloc.commit(
            self._cols,
            self._extra,
            slots,
            checksums,
            clock,
            self._per_extent,
            self._writing,
            self._ready,
            self._keys,
            self._slots.classes,
            lru.ends,
            lru.own_ends,
            *tiers,
        )

    def release(self, slots: list[int]) -> int:
        """Free the WRITING or evictable pages ``slots``, in order, as
        :meth:`PageTable.release` says.

        Returns:
            How many were freed: ``len(slots)``, or the index of the first that is not a
            page this frees (FREE, pinned, READY with resident children, outside the pool),
            those before it freed.
        """
        lru = self._lru
        return _alloc.release(
            self._cols,
            slots,
            self._per_extent,
            self._env(),
            self._ready,
            self._keys,
            self._ev.owned,
            lru.ends,
            lru.own_ends,
        )

    def _env(self) -> tuple[object, ...]:
        """What C's ``take_slot`` and ``release`` read besides the columns, as they are now
        (adoption replaces the free extents' list, a drain the log); the evictor counts
        the evictions itself, also when an error stops a call."""
        ev, slots, lru = self._ev, self._slots, self._lru
        return (
            self._writing,
            slots.classes,
            slots.offset_of,
            slots.ext_bytes,
            slots.free_extents,
            slots.span,
            slots.headroom,
            ev.quota,
            ev.requires_l3,
            ev.budget,
            ev.scan_limit,
            ev.log,
            ev.max_log,
            EvictedPage,
            *((None, None, None) if lru.tier is None else (lru.ends2, lru.tier, ev.split)),
            ev,
        )
