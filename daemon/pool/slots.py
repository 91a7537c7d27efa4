"""Slot geometry of the host arena: extents, page classes, free lists, intrusive links.

Pure and synchronous bookkeeping under :class:`kvtier.daemon.pool.index.HostPool`: which
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
contiguous), a free extent (lowest first). A slot given back goes to its class's free
list; the last slot of an extent gives the whole extent back.

Each extent's page size is mirrored into the persistent extent table (0 = free):
written before the extent's first slot is handed out, cleared after its last slot is
FREE. Also here, the other intrusive lists the pool threads through slot ids, all
allocation-free: :class:`RecencyLists` (the evictable pages, LRU; its global list shares
the free lists' link arrays, since a FREE slot is never evictable) and
:class:`ChildLists` (each page's resident children). The ``rebuild`` methods relink
everything at once with numpy when a pool is adopted.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
from kvtier.daemon.pool.layout import NIL, HostPoolError, PoolLayout, round_up


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


def filled(typecode: str, value: int, n: int) -> array[int]:
    """Return an ``array(typecode)`` of ``n`` copies of ``value``."""
    return array(typecode, [value]) * n


def push(prev: array[int], nxt: array[int], ends: list[int], stamp: memoryview, s: int) -> None:
    """Link ``s`` into the list ``ends = [cold, hot]``: at the cold end if it is not
    more recent than the current cold end, else at the hot end."""
    cold, hot = ends
    if cold == NIL:
        prev[s] = nxt[s] = NIL
        ends[0] = ends[1] = s
    elif stamp[s] <= stamp[cold]:
        prev[s], nxt[s], prev[cold] = NIL, cold, s
        ends[0] = s
    else:
        prev[s], nxt[s], nxt[hot] = hot, NIL, s
        ends[1] = s


def unlink(prev: array[int], nxt: array[int], ends: list[int], s: int) -> None:
    """Unlink ``s`` from the list ``ends = [cold, hot]``."""
    p, n = prev[s], nxt[s]
    if p == NIL:
        ends[0] = n
    else:
        nxt[p] = n
    if n == NIL:
        ends[1] = p
    else:
        prev[n] = p
    prev[s] = nxt[s] = NIL


def link_in_order(prev: array[int], nxt: array[int], order: np.ndarray) -> list[int]:
    """Link the slots of ``order`` into one list, in that order, at C speed.

    Args:
        prev / nxt: the link arrays (slots not in ``order`` are left alone).
        order: slot ids, first (cold end or head) to last.

    Returns:
        ``[first, last]``, both NIL when ``order`` is empty.
    """
    if len(order) == 0:
        return [NIL, NIL]
    p = np.frombuffer(prev, dtype=np.int32)
    n = np.frombuffer(nxt, dtype=np.int32)
    p[order[1:]] = order[:-1]
    n[order[:-1]] = order[1:]
    p[order[0]] = n[order[-1]] = NIL
    del p, n
    return [int(order[0]), int(order[-1])]


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
        self.free_extents = list(range(layout.n_extents - 1, -1, -1))  # pop() -> lowest first
        self.classes: list[PageClass] = []
        self.class_of_bytes: dict[int, int] = {}
        self._ext_bytes = ext_bytes

    def register_class(self, page_bytes: int) -> int:
        """Register a page size; the same size always gets the same class id.

        Raises:
            HostPoolError: ``page_bytes`` is not positive or its stride exceeds an extent.
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
        cid = len(self.classes)
        self.classes.append(PageClass(page_bytes, self.layout.stride_of(page_bytes),
                                      min(self.extent_bytes // payload, self.per_extent)))
        self.class_of_bytes[page_bytes] = cid
        return cid

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
        return (e * self.span + (slot - e * self.per_extent) * self.classes[cid].stride
                + self.headroom)

    def take(self, cid: int) -> int:
        """Hand out a free slot of ``cid`` (free list, fresh slot, free extent), or NIL."""
        cls = self.classes[cid]
        s = cls.free
        if s != NIL:
            self.free_unlink(cls, s)
            self.ext_used[s // self.per_extent] += 1
            return s
        e = cls.bump
        if e == NIL:
            if not self.free_extents:
                return NIL
            e = self.free_extents.pop()
            self._ext_bytes[e] = cls.page_bytes  # persisted before any slot of it is used
            self.ext_class[e] = cid
            self.ext_bump[e] = 0
            cls.extents += 1
            cls.bump = e
        i = self.ext_bump[e]
        self.ext_bump[e] = i + 1
        if i + 1 == cls.n:
            cls.bump = NIL
        self.ext_used[e] += 1
        return e * self.per_extent + i

    def give_back(self, s: int) -> None:
        """Return the slot ``s`` (already FREE) to its class; an emptied extent is freed."""
        e = s // self.per_extent
        cls = self.classes[self.ext_class[e]]
        self.ext_used[e] -= 1
        if self.ext_used[e] > 0:
            self._free_push(cls, s)
            return
        # The extent is empty: pull its other slots off the free list and give it back.
        base = e * self.per_extent
        for t in range(base, base + self.ext_bump[e]):
            if t != s:
                self.free_unlink(cls, t)
        if cls.bump == e:
            cls.bump = NIL
        self.ext_class[e] = NIL
        self.ext_bump[e] = 0
        self._ext_bytes[e] = 0  # after every slot of it is FREE
        cls.extents -= 1
        self.free_extents.append(e)

    def usable_per_extent(self) -> np.ndarray:
        """Register the class of every extent the persistent table names (smallest page
        size first) and return, per extent, how many slots its class cuts (0 for a free
        extent or one whose page size cannot be a class). For adoption."""
        pbs = np.frombuffer(self._ext_bytes, dtype=np.int64)
        usable = np.zeros(self.n_extents, dtype=np.int64)
        for pb in sorted(set(pbs[pbs > 0].tolist())):
            if round_up(pb, self.align) <= self.extent_bytes:
                usable[pbs == pb] = self.classes[self.register_class(pb)].n
        del pbs
        return usable

    def rebuild(self, used: np.ndarray) -> None:
        """Rebuild extents and free lists from the sorted slot ids ``used`` (adoption).

        Extents holding a used slot keep their class and are cut whole (their unused
        slots go to the free list, lowest first); every other extent becomes free.
        :meth:`usable_per_extent` registered the classes before.
        """
        pbs = np.frombuffer(self._ext_bytes, dtype=np.int64)
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
            cls.extents += 1
            ids = np.arange(e * self.per_extent, e * self.per_extent + cls.n)
            free_by_class.setdefault(cid, []).append(ids[~in_use[ids]])
        del pbs
        for cid, parts in free_by_class.items():
            self.classes[cid].free = link_in_order(self.prev, self.next, np.concatenate(parts))[0]

    def _free_push(self, cls: PageClass, s: int) -> None:
        head = cls.free
        self.prev[s], self.next[s] = NIL, head
        if head != NIL:
            self.prev[head] = s
        cls.free = s

    def free_unlink(self, cls: PageClass, s: int) -> None:
        """Take the free slot ``s`` off the free list of ``cls``."""
        p, n = self.prev[s], self.next[s]
        if p == NIL:
            cls.free = n
        else:
            self.next[p] = n
        if n != NIL:
            self.prev[n] = p
        self.prev[s] = self.next[s] = NIL


class RecencyLists:
    """The evictable pages in recency order: one global list and one per owner.

    Both are intrusive doubly linked lists, cold end first; the global one threads
    through the allocator's link pair (:attr:`SlotAllocator.prev` / ``next``),
    which a FREE slot uses for its free list instead. A page is placed by
    :func:`push`: at the cold end if not more recent than it, else at the hot end.

    Args:
        slots: the allocator whose link pair the global list shares.
        stamp: the last-access column (larger is more recent).
    """

    def __init__(self, slots: SlotAllocator, stamp: memoryview) -> None:
        self.prev, self.next = slots.prev, slots.next
        self.oprev = filled("i", NIL, slots.n_slots)
        self.onext = filled("i", NIL, slots.n_slots)
        self.ends = [NIL, NIL]  # global list: [cold end, hot end]
        self.own_ends: dict[int, list[int]] = {}  # per owner, created on first use
        self._stamp = stamp

    def enqueue(self, s: int, owner: int) -> None:
        """Put ``s`` on the global list and on ``owner``'s."""
        push(self.prev, self.next, self.ends, self._stamp, s)
        ends = self.own_ends.get(owner)
        if ends is None:
            ends = self.own_ends[owner] = [NIL, NIL]
        push(self.oprev, self.onext, ends, self._stamp, s)

    def dequeue(self, s: int, owner: int) -> None:
        """Take ``s`` off the global list and off ``owner``'s."""
        unlink(self.prev, self.next, self.ends, s)
        unlink(self.oprev, self.onext, self.own_ends[owner], s)

    def start(self, owner: int | None) -> tuple[int, array[int]]:
        """Return the cold end of the global list (or ``owner``'s) and its next links."""
        if owner is None:
            return self.ends[0], self.next
        ends = self.own_ends.get(owner)
        return (NIL if ends is None else ends[0]), self.onext

    def walk(self, owner: int | None) -> list[int]:
        """Return the slots of the global list (or ``owner``'s), cold end first. O(n)."""
        out: list[int] = []
        s, nxt = self.start(owner)
        while s != NIL:
            out.append(s)
            s = nxt[s]
        return out

    def rebuild(self, cold_first: np.ndarray, owners: np.ndarray) -> None:
        """Link empty lists from the evictable slots ``cold_first`` (adoption).

        Args:
            cold_first: slot ids, coldest first.
            owners: the owner of each, same order.
        """
        self.ends = link_in_order(self.prev, self.next, cold_first)
        for o in np.unique(owners).tolist():
            self.own_ends[o] = link_in_order(self.oprev, self.onext, cold_first[owners == o])


class ChildLists:
    """Each page's resident children: a count and an intrusive sibling list per parent.

    The parent links themselves are the pool's persistent parent column; these lists
    are private and rebuilt from it on adoption.

    Args:
        n_slots: slot ids of the pool.
        parent: the parent column (NIL: none), cleared here when a child is unlinked.
    """

    def __init__(self, n_slots: int, parent: memoryview) -> None:
        self.count = filled("i", 0, n_slots)
        self.first = filled("i", NIL, n_slots)
        self.sib_prev = filled("i", NIL, n_slots)
        self.sib_next = filled("i", NIL, n_slots)
        self._parent = parent

    def link(self, p: int, c: int) -> None:
        """Put ``c`` (whose parent column already says ``p``) on ``p``'s list."""
        head = self.first[p]
        self.sib_prev[c], self.sib_next[c] = NIL, head
        if head != NIL:
            self.sib_prev[head] = c
        self.first[p] = c

    def unlink(self, p: int, c: int) -> None:
        """Take ``c`` off ``p``'s list and clear its parent link (the count is the
        caller's)."""
        sp, sn = self.sib_prev[c], self.sib_next[c]
        if sp == NIL:
            self.first[p] = sn
        else:
            self.sib_next[sp] = sn
        if sn != NIL:
            self.sib_prev[sn] = sp
        self._parent[c] = self.sib_prev[c] = self.sib_next[c] = NIL

    def orphan_all(self, p: int) -> None:
        """Clear the parent link of every child of ``p`` and empty its list."""
        c = self.first[p]
        while c != NIL:
            nxt = self.sib_next[c]
            self._parent[c] = self.sib_prev[c] = self.sib_next[c] = NIL
            c = nxt
        self.first[p] = NIL
        self.count[p] = 0

    def rebuild(self, slots: np.ndarray, parents: np.ndarray) -> None:
        """Build every list of empty child lists at once, at C speed (adoption).

        Args:
            slots: the pages, and ``parents`` their parent slots (NIL: none), same order.
        """
        has = parents != NIL
        kids, ps = slots[has], parents[has]
        order = np.lexsort((kids, ps))
        kids, ps = kids[order], ps[order]
        np.frombuffer(self.count, dtype=np.int32)[:] = np.bincount(ps, minlength=len(self.count))
        head = np.ones(len(ps), dtype=bool)
        head[1:] = ps[1:] != ps[:-1]
        np.frombuffer(self.first, dtype=np.int32)[ps[head]] = kids[head]
        same = ~head[1:]
        np.frombuffer(self.sib_next, dtype=np.int32)[kids[:-1][same]] = kids[1:][same]
        np.frombuffer(self.sib_prev, dtype=np.int32)[kids[1:][same]] = kids[:-1][same]

