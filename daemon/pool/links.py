"""Intrusive doubly linked lists threaded through slot ids: the LRU and the child lists.

Every list here is a pair of ``array('i')`` link arrays indexed by slot id plus its two
ends, created once per pool: linking and unlinking a page allocates nothing. The
evictable lists are linked and unlinked page by page in C (``daemon/pool/native/_lists.h``)
and relinked whole with numpy when a pool is adopted.
:class:`RecencyLists` holds the evictable pages (its global list shares the free lists'
link pair, since a FREE slot is never evictable); :class:`ChildLists` holds each page's
resident children. The free lists themselves are
:class:`~kvtier.daemon.pool.slots.SlotAllocator`'s.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
from kvtier.daemon.pool.layout import NIL

__all__ = ["ChildLists", "RecencyLists", "filled", "link_in_order"]


def filled(typecode: str, value: int, n: int) -> array[int]:
    """Return an ``array(typecode)`` of ``n`` copies of ``value``."""
    return array(typecode, [value]) * n


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


class RecencyLists:
    """The evictable pages in recency order: global lists and one list per owner.

    All are intrusive doubly linked lists, cold end first. The global pages are split in
    two lists by ``tier`` (the ``arc`` and ``reuse`` policies' T1 and T2; with ``tier``
    None, as for ``lru``, every page is on the first): both thread through the allocator's
    link pair (:attr:`SlotAllocator.prev` / ``next``), which a FREE slot uses for its free
    list instead, since a page is on one of them at most. The C code moves pages on them
    (``daemon/pool/native/_lists.h``): a page enters at the cold end if it is not more
    recent than the page there, else where its last access puts it among the 17 most
    recent pages (before all 17 when it is older than they are).

    Args:
        prev / nxt: the link pair the global lists share with the free lists (one entry
            per slot id).
        tier: per slot, which global list (0 or 1) a page goes on; None: the first.
    """

    def __init__(self, prev: array[int], nxt: array[int], tier: bytearray | None = None) -> None:
        self.prev, self.next = prev, nxt
        self.oprev = filled("i", NIL, len(prev))
        self.onext = filled("i", NIL, len(prev))
        self.ends = [NIL, NIL]  # first global list: [cold end, hot end]
        self.ends2 = [NIL, NIL]  # second global list (tier 1)
        self.own_ends: dict[int, list[int]] = {}  # per owner, created on first use
        self.tier = tier

    def start(self, owner: int | None, second: bool = False) -> tuple[int, array[int]]:
        """Return the cold end of the first global list (the second with ``second``, or
        ``owner``'s) and its next links."""
        if owner is None:
            return (self.ends2 if second else self.ends)[0], self.next
        ends = self.own_ends.get(owner)
        return (NIL if ends is None else ends[0]), self.onext

    def cold_first(self, owner: int | None) -> Iterator[int]:
        """The slots :meth:`walk` returns, one at a time (the lists must not change while
        this is iterated): a caller that needs a few stops early."""
        for second in (False, True) if owner is None else (False,):
            s, nxt = self.start(owner, second)
            while s != NIL:
                yield s
                s = nxt[s]

    def alternating(self) -> Iterator[int]:
        """The slots of both global lists, one of each in turn from their cold ends (the
        rest of one when the other has no more; the lists must not change while this is
        iterated)."""
        a, nxt = self.start(None, False)
        b, _ = self.start(None, True)
        while a != NIL or b != NIL:
            if a != NIL:
                yield a
                a = nxt[a]
            if b != NIL:
                yield b
                b = nxt[b]

    def walk(self, owner: int | None) -> list[int]:
        """Return the slots of the global lists, first then second (or ``owner``'s
        list), cold end first. O(n)."""
        out: list[int] = []
        for second in (False, True) if owner is None else (False,):
            s, nxt = self.start(owner, second)
            while s != NIL:
                out.append(s)
                s = nxt[s]
        return out

    def rebuild(self, cold_first: np.ndarray, owners: np.ndarray) -> None:
        """Link empty lists from the evictable slots ``cold_first`` (adoption), each on
        the global list its tier names (set before this).

        Args:
            cold_first: slot ids, coldest first.
            owners: the owner of each, same order.
        """
        if self.tier is None:
            self.ends = link_in_order(self.prev, self.next, cold_first)
        else:
            second = np.frombuffer(self.tier, dtype=np.uint8)[cold_first] != 0
            self.ends = link_in_order(self.prev, self.next, cold_first[~second])
            self.ends2 = link_in_order(self.prev, self.next, cold_first[second])
        if len(owners) and (owners == owners[0]).all():  # one owner: the usual case
            self.own_ends[int(owners[0])] = link_in_order(self.oprev, self.onext, cold_first)
            return
        for o in sorted(set(owners.tolist())):  # not np.unique: it imports numpy.ma
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
            slots: the pages, ascending, and ``parents`` their parent slots (NIL: none),
                same order.
        """
        has = parents != NIL
        kids, ps = slots[has], parents[has]
        order = np.argsort(ps, kind="stable")  # by parent, then ascending child
        kids, ps = kids[order], ps[order]
        np.frombuffer(self.count, dtype=np.int32)[:] = np.bincount(ps, minlength=len(self.count))
        head = np.ones(len(ps), dtype=bool)
        head[1:] = ps[1:] != ps[:-1]
        np.frombuffer(self.first, dtype=np.int32)[ps[head]] = kids[head]
        same = ~head[1:]
        np.frombuffer(self.sib_next, dtype=np.int32)[kids[:-1][same]] = kids[1:][same]
        np.frombuffer(self.sib_prev, dtype=np.int32)[kids[1:][same]] = kids[:-1][same]
