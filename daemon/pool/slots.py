"""Slot geometry of the host arena: extents, page classes, free lists, intrusive links.

Pure and synchronous bookkeeping under :class:`kvtier.daemon.pool.host_pool.HostPool`: which
extent belongs to which page class, which slots of a class are free, and where a slot
lies in the arena. The arena is cut into ``n_extents`` extents; an extent is free or
belongs to one page class, which cuts it into slots of its stride (``page_bytes``
rounded up to ``align``). Every extent reserves ``per_extent`` global slot ids::

      extent 0: class 0 (stride 8K)   extent 1: free       extent 2: class 1 (stride 12K)
    +------+------+------+-----+   +-----------------+   +--------+--------+-----+---+
    | s 0  | s 1  | s 2  | ... |   |                 |   | s 2M   | s 2M+1 | ... |pad|
    +------+------+------+-----+   +-----------------+   +--------+--------+-----+---+
    ^0     ^8K    ^16K             ^E                    ^2E      ^2E+12K

    slot id = extent * M + i          offset = extent * extent_bytes + i * stride

In a pool with slot headroom (``H`` bytes, see :class:`~kvtier.daemon.pool.layout.PoolLayout`),
each slot is ``H`` bytes of headroom then the payload, and extents lie ``span =
extent_bytes + M * H`` apart, so a class cuts as many slots from an extent as without::

    offset = extent * span + i * (H + round_up(page_bytes, align)) + H

A free slot of a class is taken from, in order: the class's free list (an intrusive
doubly linked list through :attr:`SlotAllocator.prev` / ``next``), a fresh slot
of the extent the class is cutting (ascending offsets, so consecutive allocations are
contiguous), a free extent (lowest first). A slot given back (by the page table's
release, in C: :meth:`~kvtier.daemon.pool.page_steps.PageSteps.release`) goes to its
class's free list; the last slot of an extent gives the whole extent back.

Each extent's page size is mirrored into the persistent extent table (0 = free):
written before the extent's first slot is handed out, cleared after its last slot is
FREE. :meth:`SlotAllocator.rebuild` relinks everything at once with numpy when a pool is
adopted. The other intrusive lists through slot ids (LRU, children) are
:mod:`kvtier.daemon.pool.links`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from kvtier.daemon.pool.layout import NIL, PoolLayout, round_up
from kvtier.daemon.pool.links import filled, link_in_order
from kvtier.daemon.pool.native import _alloc
from kvtier.daemon.pool.records import HostPoolError

__all__ = ["MAX_NEW_CLASSES", "PageClass", "SlotAllocator"]

MAX_NEW_CLASSES = 256
"""The most page sizes engines may register in one pool at once (an adopted pool's extents
bring theirs regardless): every honest deployment has a few, and each class costs the daemon
state and the metrics endpoint a series. A class that holds no page and no open session's
size is given to the next new size past it."""


@dataclass(slots=True)
class PageClass:
    """One page size and its free slots.

    Attributes:
        page_bytes: page size the class was registered with.
        stride: slot size (the headroom, then ``page_bytes`` rounded up to the alignment).
        n: slots the class cuts from one extent.
        free: head of the free list (lowest slot first after a rebuild), or NIL.
        bump: extent being cut into fresh slots in ascending order, or NIL.
        extents: extents the class holds.
        ready / writing: pages of the class in each state (kept by the pool).
    """

    page_bytes: int
    stride: int
    n: int
    free: int = NIL
    bump: int = NIL
    extents: int = 0
    ready: int = 0
    writing: int = 0


class SlotAllocator:
    """Extents, page classes and free lists of one arena (see the module docstring).

    Args:
        layout: the pool's geometry.
        ext_bytes: the persistent extent table (int64 page bytes per extent, 0 = free),
            kept in step with :attr:`ext_class`.
    """

    def __init__(self, layout: PoolLayout, ext_bytes: memoryview) -> None:
        self.layout = layout
        self.extent_bytes = layout.extent_bytes
        self.span = layout.span
        self.headroom = layout.headroom
        self.align = layout.align
        self.per_extent = layout.per_extent
        self.n_extents = layout.n_extents
        self.n_slots = layout.n_slots
        self.prev = filled("i", NIL, layout.n_slots)  # free list, or the pool's evictable list
        self.next = filled("i", NIL, layout.n_slots)
        self.ext_class = filled("i", NIL, layout.n_extents)
        self.ext_used = filled("i", 0, layout.n_extents)  # slots handed out and not given back
        self.ext_bump = filled("i", 0, layout.n_extents)  # slots cut since the extent was assigned
        # the payload offset of every slot its extent's class cuts, -1 elsewhere: what
        # slot_offsets reads (one gather), kept in step with ext_class
        self.offset_of = np.full(layout.n_slots, -1, dtype=np.int64)
        self.free_extents = list(range(layout.n_extents - 1, -1, -1))  # pop() -> lowest first
        self.classes: list[PageClass] = []
        self.class_of_bytes: dict[int, int] = {}
        self.ext_bytes = ext_bytes

    def register_class(
        self, page_bytes: int, max_classes: int | None = None, in_use: Iterable[int] = ()
    ) -> int:
        """Register a page size; the same size always gets the same class id while it has
        one.

        Past ``max_classes`` classes, a new size takes over the id of an idle class: one
        that holds no extent and no page, and that no class id in ``in_use`` (the open
        sessions') names. So page sizes of engines long gone never lock new ones out.

        Args:
            page_bytes: the page size.
            max_classes: refuse a new size when this many classes exist and none is idle
                (None: no bound).
            in_use: class ids that must keep their page size.

        Raises:
            HostPoolError: ``page_bytes`` is not positive, its stride exceeds an extent, or
                it is new, ``max_classes`` classes exist and none is idle.
        """
        cid = self.class_of_bytes.get(page_bytes)
        if cid is not None:
            return cid
        if page_bytes <= 0:
            raise HostPoolError(f"page_bytes must be positive, got {page_bytes}")
        payload = round_up(page_bytes, self.align)
        if payload > self.extent_bytes:
            raise HostPoolError(
                f"page_bytes={page_bytes} (rounded up to {payload}) exceeds "
                f"extent_bytes={self.extent_bytes}"
            )
        cls = PageClass(
            page_bytes,
            self.layout.stride_of(page_bytes),
            min(self.extent_bytes // payload, self.per_extent),
        )
        if max_classes is not None and len(self.classes) >= max_classes:
            cid = self._idle_class(set(in_use))
            if cid is None:
                raise HostPoolError(
                    f"page_bytes={page_bytes} would be a page size past the {max_classes} "
                    "this pool takes from engines (each holds pages or an open session)"
                )
            del self.class_of_bytes[self.classes[cid].page_bytes]
            self.classes[cid] = cls
        else:
            cid = len(self.classes)
            self.classes.append(cls)
        self.class_of_bytes[page_bytes] = cid
        return cid

    def _idle_class(self, in_use: set[int]) -> int | None:
        """The lowest class id holding no extent, no page and not in ``in_use``, or None."""
        for cid, cls in enumerate(self.classes):
            if (
                cid not in in_use
                and cls.extents == 0
                and cls.ready == 0
                and cls.writing == 0
                and cls.free == NIL
                and cls.bump == NIL
            ):
                return cid
        return None

    def check_class(self, class_id: int) -> None:
        """Raise HostPoolError unless ``class_id`` is registered."""
        if not 0 <= class_id < len(self.classes):
            raise HostPoolError(f"unknown page class {class_id}")

    def slot_offset(self, slot: int) -> int:
        """Return the byte offset of ``slot``'s payload in the arena (in a pool with
        headroom, the slot's ``headroom`` bytes lie right before it).

        Raises:
            HostPoolError: the slot id is out of range or its extent has no class.
        """
        if not 0 <= slot < self.n_slots:
            raise HostPoolError(f"slot {slot} out of range [0, {self.n_slots})")
        e = slot // self.per_extent
        cid = self.ext_class[e]
        if cid == NIL:
            raise HostPoolError(f"slot {slot} lies in extent {e}, which is not allocated")
        return (
            e * self.span + (slot - e * self.per_extent) * self.classes[cid].stride + self.headroom
        )

    def slot_offsets(self, slots: Sequence[int]) -> np.ndarray:
        """The payload offsets of ``slots`` (int64, same order), as :meth:`slot_offset`
        gives them one by one (in one C call over :attr:`offset_of`).

        Raises:
            HostPoolError: a slot id is out of range or its extent has no class.
        """
        if type(slots) is not list:
            slots = list(slots)
        out = np.empty(len(slots), dtype=np.int64)
        bad = _alloc.offsets(self.offset_of, slots, out)
        if bad is None:
            return out
        slot = slots[bad]
        if not 0 <= slot < self.n_slots:
            raise HostPoolError(f"slot {slot} out of range [0, {self.n_slots})")
        raise HostPoolError(f"slot {slot} (extent {slot // self.per_extent}) is not allocated")

    def cut(self, e: int, cls: PageClass) -> None:
        """Record the payload offsets of the ``cls.n`` slots extent ``e`` cuts for ``cls``."""
        base = e * self.per_extent
        self.offset_of[base : base + cls.n] = np.arange(
            e * self.span + self.headroom,
            e * self.span + self.headroom + cls.n * cls.stride,
            cls.stride,
            dtype=np.int64,
        )

    def usable_per_extent(self, holding: np.ndarray) -> np.ndarray:
        """Register the class of every extent the persistent table names that ``holding``
        (a bool per extent: it holds a READY row) marks, smallest page size first, and
        return, per extent, how many slots its class cuts (0 for a free extent, one that
        holds no READY row, or one whose page size cannot be a class). For adoption: an
        extent left with no page is freed by :meth:`rebuild` and registers no class, so
        page sizes of the past never use up the classes the pool takes
        (``MAX_NEW_CLASSES``)."""
        pbs = np.frombuffer(self.ext_bytes, dtype=np.int64)
        usable = np.zeros(self.n_extents, dtype=np.int64)
        for pb in sorted(set(pbs[(pbs > 0) & holding].tolist())):
            if round_up(pb, self.align) <= self.extent_bytes:
                usable[(pbs == pb) & holding] = self.classes[self.register_class(pb)].n
        del pbs
        return usable

    def rebuild(self, used: np.ndarray) -> None:
        """Rebuild extents and free lists from the sorted slot ids ``used`` (adoption).

        Extents holding a used slot keep their class and are cut whole (their unused
        slots go to the free list, lowest first); every other extent becomes free.
        :meth:`usable_per_extent` registered the classes before.
        """
        pbs = np.frombuffer(self.ext_bytes, dtype=np.int64)
        counts = np.bincount(used // self.per_extent, minlength=self.n_extents)
        self.free_extents = [e for e in range(self.n_extents - 1, -1, -1) if counts[e] == 0]
        pbs[counts == 0] = 0
        in_use = np.zeros(self.n_slots, dtype=bool)
        in_use[used] = True
        free_by_class: dict[int, list[np.ndarray]] = {}
        for e in np.flatnonzero(counts).tolist():
            cid = self.class_of_bytes[int(pbs[e])]
            cls = self.classes[cid]
            self.ext_class[e], self.ext_used[e], self.ext_bump[e] = cid, int(counts[e]), cls.n
            self.cut(e, cls)
            cls.extents += 1
            ids = np.arange(e * self.per_extent, e * self.per_extent + cls.n)
            free_by_class.setdefault(cid, []).append(ids[~in_use[ids]])
        del pbs
        for cid, parts in free_by_class.items():
            self.classes[cid].free = link_in_order(self.prev, self.next, np.concatenate(parts))[0]
