"""The host pool's state machine page by page in Python: the oracle its C paths are held to.

:class:`PageByPage` is the page table with allocate, commit, pin, unpin, release and flush
done one page at a time, and the eviction policy's steps (``take_slot``: quotas, free
extents, victims of other classes, L3, ``arc``'s and ``reuse``'s lists), step for step as
``daemon/pool/native/_alloc.c`` and ``_pins.c`` say they do them. Its evictable pages are
:class:`EvictableLists` and each page's children :class:`ResidentChildren`: plain Python
lists written here from the rules, not the pool's intrusive lists. The model takes no step
of ``kvtier.daemon.pool.links`` (the page table it extends still builds the pool's own
lists, which it replaces at once and never uses).
:class:`DictLookups` answers lookups key by key from the page table's dict, where the pool
probes its key table (``daemon/pool/native/_keyprobe.c``); :func:`page_by_page` gives a
host pool both. Tests run the same operations on a pool of each kind and compare
everything observable (:func:`observable`), the lists as the pool lays them out: link
columns and the ends of each list.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.pool.layout import HAS_CHECKSUM, KEY_BYTES, NIL, USED_AGAIN
from kvtier.daemon.pool.pages import PageTable
from kvtier.daemon.pool.policies import ReuseState
from kvtier.daemon.pool.records import EvictedPage, HostPoolError, PageState, PageStateError
from kvtier.daemon.pool.slots import SlotAllocator
from xxhash import xxh3_64_intdigest

RECENCY_WALK = 16
"""The most recent pages a page entering a list may pass over (``_lists.h``)."""

_READY, _WRITING = int(PageState.READY), int(PageState.WRITING)
_NO_PAGES: dict[bytes, int] = {}
_MAX_U64 = (1 << 64) - 1


class EvictableLists:
    """The evictable pages (READY, unpinned, childless) in recency order, the model's own:
    each list a Python list of slot ids, the cold end (the next victim) first.

    Every evictable page is on one global list and on its owner's list. Under a two-list
    policy (``arc``, ``reuse``) the global list is two: a page whose ``tier`` byte is 1 (T2,
    used again) is on the second, any other on the first; under ``lru`` (``tier`` None)
    every page is on the first. An owner's list holds its pages of both tiers.

    A page entering a list goes to the cold end if its last access (``stamp``) is not more
    recent than that of the page at the cold end; else after the first page, from the hot
    end, that is not more recent, looking at :data:`RECENCY_WALK` + 1 pages at most (when
    all are more recent, before the last one looked at). So a chain committed or pinned (stamped from
    its tail back to its head) keeps its tail colder, and a parent that becomes evictable
    when its last child leaves goes where its last access puts it among the most recent
    pages, or first when it is older than every page listed.

    Args:
        stamp: the pool's last-access column (larger is more recent).
        tier: per slot, which global list a page goes on (a two-list policy's T1/T2
            bytes); None: one global list.
    """

    def __init__(self, stamp: memoryview, tier: bytearray | None) -> None:
        self._stamp = stamp
        self._tier = tier
        self.globals: tuple[list[int], list[int]] = ([], [])  # T1 (or the only one), T2
        self.owners: dict[int, list[int]] = {}
        self._where: dict[int, tuple[int, int]] = {}  # slot -> (global list, owner)

    def _place(self, order: list[int], s: int) -> None:
        """Put ``s`` into ``order`` (cold end first) by its last access, as above."""
        stamp = self._stamp
        if not order or stamp[s] <= stamp[order[0]]:
            order.insert(0, s)
            return
        i = len(order) - 1  # the hot end
        for _ in range(RECENCY_WALK):
            if i == 0 or stamp[order[i]] <= stamp[s]:
                break
            i -= 1
        order.insert(i if stamp[order[i]] > stamp[s] else i + 1, s)

    def enqueue(self, s: int, owner: int) -> None:
        """Put the page ``s`` of ``owner`` on its global list and on its owner's."""
        assert s not in self._where, f"slot {s} is listed already"
        which = 1 if self._tier is not None and self._tier[s] else 0
        self._place(self.globals[which], s)
        self._place(self.owners.setdefault(owner, []), s)
        self._where[s] = (which, owner)

    def dequeue(self, s: int, owner: int) -> None:
        """Take the page ``s`` of ``owner`` off its lists: the global one it was put on
        (its tier byte changes only while it is off the lists) and its owner's."""
        which, listed_owner = self._where.pop(s)
        assert listed_owner == owner, f"slot {s} is listed for owner {listed_owner}"
        self.globals[which].remove(s)
        self.owners[owner].remove(s)

    def global_list(self, second: bool = False) -> list[int]:
        """The first global list (the second with ``second``), cold end first."""
        return self.globals[1 if second else 0]

    def owner_list(self, owner: int) -> list[int]:
        """``owner``'s list, cold end first."""
        return self.owners.get(owner, [])

    def walk(self, owner: int | None) -> list[int]:
        """The global lists, first then second (or ``owner``'s list), cold end first: what
        :meth:`HostPool.evictable_slots` answers."""
        if owner is not None:
            return list(self.owner_list(owner))
        return self.globals[0] + self.globals[1]

    def laid_out(self, free_prev: array[int], free_next: array[int]) -> dict[str, Any]:
        """These lists as the pool lays its own out: the global lists threaded through
        the link pair that the free lists (``free_prev`` / ``free_next``, the model's,
        holding nothing else) also use, the owner lists through a pair of their own
        (``oprev`` / ``onext``, NIL off every list), and each list's ``[cold, hot]`` ends
        (``[NIL, NIL]`` when empty; the owners whose lists are empty left out)."""
        prev, nxt = array("i", free_prev), array("i", free_next)
        oprev, onext = array("i", [NIL]) * len(prev), array("i", [NIL]) * len(prev)
        for order in self.globals:
            for s in order:
                assert prev[s] == nxt[s] == NIL, f"slot {s} is on a free list and evictable"
            _thread(prev, nxt, order)
        for order in self.owners.values():
            _thread(oprev, onext, order)
        return {
            "prev": prev.tobytes(),
            "next": nxt.tobytes(),
            "oprev": oprev.tobytes(),
            "onext": onext.tobytes(),
            "ends": _ends(self.globals[0]),
            "ends2": _ends(self.globals[1]),
            "own_ends": {o: _ends(order) for o, order in self.owners.items() if order},
        }


class ResidentChildren:
    """Each page's resident children, the model's own: per parent a Python list, the child
    linked last first, and a count per page.

    Args:
        n_slots: slot ids of the pool.
        parent: the pool's parent column, cleared here when a child leaves its parent.

    Attributes:
        count: per page, its resident children (an allocation counts the page it adds
            after a parent before that page has a slot, so that the evictions making room
            for it leave the parent alone).
        of: parent -> its linked children, the child linked last first (parents with
            none left out).
    """

    def __init__(self, n_slots: int, parent: memoryview) -> None:
        self.count = array("i", [0]) * n_slots
        self.of: dict[int, list[int]] = {}
        self._parent = parent

    def link(self, p: int, c: int) -> None:
        """Add ``c`` (whose parent column already says ``p``) to ``p``'s children."""
        self.of.setdefault(p, []).insert(0, c)

    def unlink(self, p: int, c: int) -> None:
        """Take ``c`` off ``p``'s children and clear its parent (the count is the
        caller's)."""
        kids = self.of[p]
        kids.remove(c)
        if not kids:
            del self.of[p]
        self._parent[c] = NIL

    def has_any(self, p: int) -> bool:
        """Whether ``p`` has a linked child or counts one."""
        return p in self.of or self.count[p] != 0

    def orphan_all(self, p: int) -> None:
        """Clear the parent of every child of ``p``, which then has none."""
        for c in self.of.pop(p, []):
            self._parent[c] = NIL
        self.count[p] = 0

    def laid_out(self) -> dict[str, bytes]:
        """These lists as the pool lays its own out: per parent its first child
        (``first``), each child linked to its siblings (``sib_prev`` / ``sib_next``), NIL
        elsewhere."""
        n = len(self.count)
        first, sib_prev, sib_next = (array("i", [NIL]) * n for _ in range(3))
        for p, kids in self.of.items():
            first[p] = kids[0]
            _thread(sib_prev, sib_next, kids)
        return {
            "first": first.tobytes(),
            "sib_prev": sib_prev.tobytes(),
            "sib_next": sib_next.tobytes(),
        }


def _thread(prev: array[int], nxt: array[int], order: list[int]) -> None:
    """Link the slots of ``order`` one after the other: each one's ``prev`` is the slot
    before it, its ``nxt`` the slot after it, NIL at either end."""
    for i, s in enumerate(order):
        prev[s] = order[i - 1] if i > 0 else NIL
        nxt[s] = order[i + 1] if i + 1 < len(order) else NIL


def _ends(order: list[int]) -> list[int]:
    """``[cold end, hot end]`` of ``order``; ``[NIL, NIL]`` when it is empty."""
    return [order[0], order[-1]] if order else [NIL, NIL]


class PageByPage(PageTable):
    """The page table, every allocation, commit, pin, unpin, release and flush page by
    page in Python, its evictable pages on :class:`EvictableLists` and each page's children
    on :class:`ResidentChildren`."""

    def __init__(self, meta: Any, **settings: Any) -> None:
        super().__init__(meta, **settings)
        split = self.evictor.split
        self.lists = EvictableLists(meta.stamp, None if split is None else split.tier)
        # the model's lists from here on, where the pool looks for them (HostPool's
        # evictable_slots and describe): a step of the pool's own list code run by
        # mistake fails on them
        self._lru = self.evictor.lru = self.lists  # type: ignore[assignment]
        self.kids = ResidentChildren(self.n_slots, meta.parent)  # type: ignore[assignment]
        self._children = self.kids.count

    def allocate(
        self,
        ns_id: int,
        owner: int,
        class_id: int,
        keys: Sequence[bytes],
        parent_key: bytes | None = None,
    ) -> list[tuple[int, int]]:
        self.slots.check_class(class_id)
        return self._allocate(ns_id, owner, class_id, keys, parent_key)

    def _allocate(
        self, ns_id: int, owner: int, class_id: int, keys: Sequence[bytes], parent_key: bytes | None
    ) -> list[tuple[int, int]]:
        """:meth:`PageTable.allocate`, page by page: each slot from the evictor."""
        if keys and max(map(len, keys)) > KEY_BYTES:
            raise HostPoolError(f"page keys must have at most {KEY_BYTES} bytes")
        cls = self._classes[class_id]
        ready = self.ready.get(ns_id, _NO_PAGES)  # evictions below only remove from it
        writing = self._writing.get(ns_id)
        if writing is None:
            writing = self._writing[ns_id] = {}
        meta = self.meta
        pack_key, key_col, key_len, length = meta.pack_key, meta.key, meta.key_len, meta.length
        state, stamp, ns, owners = self._state, self._stamp, self._ns, self._owner
        children, pins, take_slot = self._children, self._pins, self.take_slot
        out: list[tuple[int, int]] = []
        prev = NIL
        if parent_key is not None:
            p = ready.get(parent_key)
            if p is None:
                p = writing.get(parent_key)
            if p is not None:
                prev = p
        for i, key in enumerate(keys):
            s = ready.get(key)
            if s is None:
                s = writing.get(key)
            if s is not None:
                self._adopt(prev, s)
                prev = s
                continue
            if prev != NIL:  # a child's reference shields prev from the evictions below
                if children[prev] == 0 and state[prev] == _READY and pins[prev] == 0:
                    self.lists.dequeue(prev, owners[prev])
                children[prev] += 1
            try:
                s = take_slot(class_id, owner)
            except BaseException:  # the policy failed: prev's child reference dropped
                if prev != NIL:
                    self._drop_child_ref(prev)
                raise
            if s == NIL:
                if prev != NIL:
                    self._drop_child_ref(prev)
                break
            pack_key(key_col, s * KEY_BYTES, key)  # the row first, the state byte last
            key_len[s] = len(key)
            ns[s] = ns_id
            owners[s] = owner
            length[s] = cls.page_bytes
            self._parent[s] = prev
            self._clock += 1
            stamp[s] = self._clock
            state[s] = _WRITING
            self.keys[s] = key
            if prev != NIL:
                self.kids.link(prev, s)
            writing[key] = s
            if self._split is not None:
                self._split.admit(s, ns_id, key, self._clock)
            cls.writing += 1
            self._owned[owner] = self._owned.get(owner, 0) + 1
            out.append((i, s))
            prev = s
        return out

    def _adopt(self, p: int, s: int) -> None:
        """The present page ``s``, parentless, linked under ``p`` (the page of the key
        before it) unless that would close a cycle: a page stored before its prefix, or
        left when its parent was freed, rejoins its chain."""
        if p in (NIL, s) or self._parent[s] != NIL:
            return
        x = p
        while x != NIL:
            if x == s:
                return
            x = self._parent[x]
        if self._children[p] == 0 and self._state[p] == _READY and self._pins[p] == 0:
            self.lists.dequeue(p, self._owner[p])
        self._children[p] += 1
        self._parent[s] = p
        self.kids.link(p, s)

    def _drop_child_ref(self, p: int) -> None:
        self._children[p] -= 1
        assert self._children[p] >= 0
        if self.is_evictable(p):
            self.lists.enqueue(p, self._owner[p])

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        meta, state, keys, n_slots = self.meta, self._state, self.keys, self.n_slots
        for s in slots:
            if not 0 <= s < n_slots or state[s] != _WRITING:
                self._expect(s, PageState.WRITING, "commit")
        if checksums is not None and (
            len(checksums) != len(slots)
            or (checksums and (min(checksums) < 0 or max(checksums) > _MAX_U64))
        ):
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
            used = USED_AGAIN if self._split is not None and self._split.tier[s] else 0
            if checksums is None:
                csum = 0
                meta.flags[s] = used
            else:
                csum = meta.checksum[s] = checksums[j]
                meta.flags[s] = HAS_CHECKSUM | used
            meta.seal[s] = xxh3_64_intdigest(key, (csum ^ ns) & _MAX_U64)
            clock += 1
            self._stamp[s] = clock
            state[s] = _READY
            del self._writing[ns][key]
            self.ready.setdefault(ns, {})[key] = s
            cls = self._classes[self._ext_class[s // self._per_extent]]
            cls.writing -= 1
            cls.ready += 1
            if self._children[s] == 0:
                self.lists.enqueue(s, self._owner[s])
        self._clock = clock

    def pin_slots(self, out: list[int], used: bool = False, touch: bool = True) -> None:
        pins, children, stamp, owner = self._pins, self._children, self._stamp, self._owner
        if used and self._split is not None:
            self._split.using(out, stamp, self._clock + 1)
        for s in reversed(out):
            if pins[s] == 0:
                self.pins.pinned += 1
                if children[s] == 0:
                    self.lists.dequeue(s, owner[s])
            pins[s] += 1
            if touch:
                self._clock += 1
                stamp[s] = self._clock
        if used and self._split is not None:
            self._split.reused(out)

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
                self.pins.pinned -= 1
                if children[s] == 0:
                    self.lists.enqueue(s, owner[s])

    def abort(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._expect(s, PageState.WRITING, "abort")
        for j in range(len(slots) - 1, -1, -1):
            self._expect(slots[j], PageState.WRITING, "abort")
            self._free(slots[j])

    def flush(self, ns_id: int | None = None, owner: int | None = None) -> int:
        """:meth:`PageTable.flush`, over the model's lists: each global list (the first,
        then the second) from its cold end, every evictable page of ``ns_id`` and
        ``owner`` (None: any) released, and with it each ancestor that this leaves
        evictable and that matches too, before the walk goes on to the page that followed
        it on the list when it was reached (releasing a page enqueues only its ancestors,
        none of which was on a list then)."""
        ns, owners, parents = self._ns, self._owner, self._parent

        def matches(s: int) -> bool:
            return (ns_id is None or ns[s] == ns_id) and (owner is None or owners[s] == owner)

        dropped = 0
        for second in (False, True):
            order = self.lists.global_list(second)
            s = order[0] if order else NIL
            while s != NIL:
                i = order.index(s)
                following = order[i + 1] if i + 1 < len(order) else NIL
                while s != NIL and matches(s):
                    parent = parents[s]
                    self.release(s)
                    dropped += 1
                    s = parent if parent != NIL and self.is_evictable(parent) else NIL
                s = following
        return dropped

    def release(self, s: int) -> None:
        """:meth:`PageTable.release`, in Python: a WRITING or evictable page, off the
        evictable lists, FREE."""
        self.check_slot(s)
        state = self._state[s]
        if (
            self._pins[s]
            or self.keys[s] is None
            or (state != _WRITING and (state != _READY or self._children[s]))
        ):
            raise PageStateError(
                f"cannot release slot {s}: it is {PageState(state).name} "
                f"with {self._pins[s]} pins and {self._children[s]} resident children"
            )
        if state == _READY:
            self.lists.dequeue(s, self._owner[s])
        self._free(s)

    def _free(self, s: int, keep: bool = False) -> None:
        """A page off the evictable lists FREE (``keep``: its slot stays taken, for the
        allocation that evicted it)."""
        assert self._pins[s] == 0
        keys, state = self.keys, self._state
        key = keys[s]
        assert key is not None
        was_ready = state[s] == _READY
        state[s] = int(PageState.FREE)  # first: from here on a crash leaves the slot free
        self._in_l3[s] = 0
        ns = self._ns[s]
        idx = (self.ready if was_ready else self._writing)[ns]
        if idx.get(key) == s:  # a detached page's key may name another page, or none
            del idx[key]
        keys[s] = None
        if self._split is not None:
            self._split.released(s)
        p = self._parent[s]
        kids = self.kids
        if p != NIL:
            kids.unlink(p, s)
            self._drop_child_ref(p)
        if kids.has_any(s):
            kids.orphan_all(s)  # only an aborted page can still have children
        cls = self._classes[self._ext_class[s // self._per_extent]]
        if was_ready:
            cls.ready -= 1
        else:
            cls.writing -= 1
        self._owned[self._owner[s]] -= 1
        if not keep:
            give_back(self.slots, s)

    # -- the eviction policy's steps (C's take_slot), page by page -----------------------
    def take_slot(self, cid: int, owner: int) -> int:
        """A slot of class ``cid`` for ``owner``, evicting if needed, or NIL (a shortfall):
        an owner at its quota replaces its own pages first; then a free slot; then
        :meth:`_reclaim`."""
        ev = self.evictor
        quota = ev.quota.get(owner)
        scope: int | None = None  # whose pages may be evicted; None: anyone's
        if quota is not None and ev.owned.get(owner, 0) >= quota:
            scope, budget = owner, ev.budget
            while ev.owned.get(owner, 0) >= quota:  # replace own pages first
                v = self.coldest(owner, NIL)
                if v == NIL or budget == 0:
                    return NIL
                self.evict(v)
                budget -= 1
        s = slot_take(self.slots, cid)
        return s if s != NIL else self._reclaim(cid, scope)

    def _reclaim(self, cid: int, owner: int | None) -> int:
        """Evict (anyone's, or only ``owner``'s pages) until a slot of ``cid`` frees."""
        budget = self.evictor.budget
        ext_class, per_extent = self._ext_class, self._per_extent
        while budget > 0:
            v = self.coldest(owner, NIL)
            if v == NIL:
                break
            if ext_class[v // per_extent] == cid:
                self.evict(v, keep=True)
                return v
            self.evict(v)
            budget -= 1
            s = slot_take(self.slots, cid)
            if s != NIL:
                return s
        v = self.coldest(owner, cid)  # fall back to the class's own pages
        if v == NIL:
            return NIL
        self.evict(v, keep=True)
        return v

    def coldest(self, owner: int | None, cid: int) -> int:
        """The coldest page eviction may take from ``owner``'s list (None: the global
        list; under a two-list policy the one the policy names, then the other), of class
        ``cid`` unless NIL; NIL if none within the scan limit."""
        ev, lists = self.evictor, self.lists
        split = ev.split
        if owner is not None:
            return self._scan(lists.owner_list(owner), cid)
        if split is None:
            return self._scan(lists.global_list(), cid)
        resident = sum(ev.owned.values())
        if isinstance(split, ReuseState):  # each list's coldest page; reuse picks one
            s1 = self._scan(lists.global_list(False), cid)
            s2 = self._scan(lists.global_list(True), cid)
            stamp = self._stamp
            k = split.pick(
                None if s1 == NIL else int(stamp[s1]),
                None if s2 == NIL else int(stamp[s2]),
                self._clock,
                resident,
            )
            return s2 if k else s1
        second = split.victim_list(resident) == 1
        s = self._scan(lists.global_list(second), cid)
        return s if s != NIL else self._scan(lists.global_list(not second), cid)

    def _scan(self, order: list[int], cid: int) -> int:
        """The first of the ``scan_limit`` coldest pages of ``order`` that eviction may
        take (marked in L3 when that is required; of class ``cid`` unless NIL), or NIL."""
        ev = self.evictor
        for s in order[: ev.scan_limit]:
            if (not ev.requires_l3 or self._in_l3[s]) and (
                cid == NIL or self._ext_class[s // self._per_extent] == cid
            ):
                return s
        return NIL

    def evict(self, s: int, keep: bool = False) -> None:
        """Evict the evictable page ``s``: log it, tell the policy, take it off the lists,
        free it (with ``keep``, its slot stays taken)."""
        ev = self.evictor
        key = self.keys[s]
        assert key is not None
        ev.evictions += 1
        if len(ev.log) < ev.max_log:
            ev.log.append(EvictedPage(key, self._ns[s], s, bool(self._in_l3[s])))
        else:
            ev.unlogged += 1
        if ev.split is not None:
            ev.split.evicted_page(s, self._ns[s], key, int(self._stamp[s]), sum(ev.owned.values()))
        self.lists.dequeue(s, self._owner[s])
        self._free(s, keep)


def slot_take(a: SlotAllocator, cid: int) -> int:
    """A free slot of ``cid`` (free list, fresh slot, free extent), or NIL."""
    cls = a.classes[cid]
    s = cls.free
    if s != NIL:
        free_unlink(a, cls, s)
        a.ext_used[s // a.per_extent] += 1
        return s
    e = cls.bump
    if e == NIL:
        if not a.free_extents:
            return NIL
        e = a.free_extents.pop()
        a.ext_bytes[e] = cls.page_bytes  # persisted before any slot of it is used
        a.ext_class[e] = cid
        a.ext_bump[e] = 0
        a.cut(e, cls)
        cls.extents += 1
        cls.bump = e
    i = a.ext_bump[e]
    a.ext_bump[e] = i + 1
    if i + 1 == cls.n:
        cls.bump = NIL
    a.ext_used[e] += 1
    return e * a.per_extent + i


def free_unlink(a: SlotAllocator, cls: Any, s: int) -> None:
    """Take the free slot ``s`` off the free list of ``cls``."""
    p, n = a.prev[s], a.next[s]
    if p == NIL:
        cls.free = n
    else:
        a.next[p] = n
    if n != NIL:
        a.prev[n] = p
    a.prev[s] = a.next[s] = NIL


def give_back(a: SlotAllocator, s: int) -> None:
    """Return the FREE slot ``s`` to its class; an emptied extent is freed (what
    :meth:`PageTable.release` does to the slot allocator without ``keep``)."""
    e = s // a.per_extent
    cls = a.classes[a.ext_class[e]]
    a.ext_used[e] -= 1
    if a.ext_used[e] > 0:
        head = cls.free
        a.prev[s], a.next[s] = NIL, head
        if head != NIL:
            a.prev[head] = s
        cls.free = s
        return
    base = e * a.per_extent  # the extent is empty: its other slots off the free list
    for t in range(base, base + a.ext_bump[e]):
        if t != s:
            free_unlink(a, cls, t)
    if cls.bump == e:
        cls.bump = NIL
    a.ext_class[e] = NIL
    a.ext_bump[e] = 0
    a.offset_of[base : base + a.per_extent] = -1
    a.ext_bytes[e] = 0
    cls.extents -= 1
    a.free_extents.append(e)


def dict_run(table: PageTable, ns_id: int, keys: Sequence[bytes]) -> list[int]:
    """The slots of the leading run of ``keys`` READY in ``ns_id``, key by key from the
    page table's dict: what the key table's probe must answer."""
    ready = table.ready.get(ns_id, _NO_PAGES)
    out = []
    for key in keys:
        s = ready.get(key) if isinstance(key, bytes) else None
        if s is None:
            break
        out.append(s)
    return out


class DictLookups:
    """The host pool's lookups (:class:`~kvtier.daemon.pool.lookups.KeyLookups`) key by key
    from the page table's dict, no key table."""

    def __init__(self, pages: PageTable) -> None:
        self._pages = pages

    def close(self) -> None:
        """Nothing to release."""

    def rebuild(self) -> None:
        """Nothing to rebuild."""

    def committed(self, slots: Sequence[int]) -> None:
        """Nothing to enter."""

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        return len(dict_run(self._pages, ns_id, keys))

    def lookup_packed(self, ns_id: int, packed: bytes | memoryview) -> int:
        if len(packed) % KEY_BYTES:
            raise HostPoolError(
                f"packed keys of {len(packed)} bytes: not a multiple of {KEY_BYTES}"
            )
        keys = [bytes(packed[i : i + KEY_BYTES]) for i in range(0, len(packed), KEY_BYTES)]
        return self.lookup(ns_id, keys)

    def run_slots(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        return dict_run(self._pages, ns_id, keys)


def page_by_page(pool: HostPool) -> HostPool:
    """Give the empty ``pool`` a :class:`PageByPage` table and :class:`DictLookups` (its
    settings kept); returns it."""
    old = pool._pages
    ev = old.evictor
    pool._lookups.close()
    pool._pages = PageByPage(
        old.meta, max_log=ev.max_log, quota=ev.quota, requires_l3=ev.requires_l3, policy=ev.policy
    )
    pool._lookups = DictLookups(pool._pages)  # type: ignore[assignment]
    return pool


COLUMNS = (
    "stamp",
    "checksum",
    "seal",
    "ns",
    "owner",
    "length",
    "parent",
    "key",
    "state",
    "in_l3",
    "key_len",
    "flags",
)
"""The metadata columns :func:`observable` compares."""


def laid_out_children(t: PageTable) -> dict[str, bytes]:
    """The child lists of the page table ``t`` as the pool lays them out (see
    :meth:`ResidentChildren.laid_out`): the model's built from its plain lists, the pool's
    read as they are."""
    kids = t.kids
    if isinstance(kids, ResidentChildren):
        return kids.laid_out()
    return {name: getattr(kids, name).tobytes() for name in ("first", "sib_prev", "sib_next")}


def laid_out_lists(t: PageTable) -> dict[str, Any]:
    """The evictable lists of the page table ``t`` as the pool lays them out (see
    :meth:`EvictableLists.laid_out`): the model's built from its plain lists, the pool's
    read as they are (its link columns, global pair shared with the free lists, and its
    lists' ends)."""
    lists = t.evictor.lru
    if isinstance(lists, EvictableLists):
        return lists.laid_out(t.slots.prev, t.slots.next)
    return {
        "prev": t.slots.prev.tobytes(),
        "next": t.slots.next.tobytes(),
        "oprev": lists.oprev.tobytes(),
        "onext": lists.onext.tobytes(),
        "ends": list(lists.ends),
        "ends2": list(lists.ends2),
        "own_ends": {o: list(e) for o, e in lists.own_ends.items() if e != [NIL, NIL]},
    }


def observable(p: HostPool) -> dict[str, Any]:
    """Everything the pool holds and reports, for comparing two pools."""
    t = p._pages
    ev, kids, slots = t.evictor, t.kids, t.slots
    links = laid_out_lists(t)
    out: dict[str, Any] = {c: t.meta.array(c).tobytes() for c in COLUMNS}
    for name in ("prev", "next", "oprev", "onext"):
        out[name] = links[name]
    out.update(laid_out_children(t))
    for name, arr in (
        ("pins", t.pins.count),
        ("children", kids.count),
        ("ext_class", slots.ext_class),
        ("ext_used", slots.ext_used),
        ("ext_bump", slots.ext_bump),
    ):
        out[name] = arr.tobytes()
    out.update(
        ready=t.ready,
        # every READY page as a LOAD finds it: from the key table's probe (the pool) or
        # key by key from the dict (the model); a page the table calls absent differs
        found={ns: p._lookups.run_slots(ns, list(d)) for ns, d in t.ready.items()},
        writing={ns: d for ns, d in t._writing.items() if d},
        keys=t.keys,
        owned={o: n for o, n in ev.owned.items() if n},
        ends=links["ends"],
        own_ends=links["own_ends"],
        classes=[(c.free, c.bump, c.extents, c.ready, c.writing) for c in slots.classes],
        log=[(type(e), e.key, e.ns_id, e.slot, e.in_l3) for e in ev.log],
        evictions=(ev.evictions, ev.unlogged),
        clock=t._clock,
        free_extents=list(slots.free_extents),
        pinned=t.pins.pinned,
        offsets=np.asarray(slots.offset_of).tobytes(),
        stats=p.stats(),
        evictable=[p.evictable_slots(o) for o in (None, *ev.owned)],
    )
    split = ev.split
    if split is not None:
        core = getattr(split, "core", None)  # reuse: its lifetime and ghosts are C's
        policy = vars(split) if core is None else (core.life, core.histogram(), core.ghost_list())
        out.update(
            split=(
                split.t2,
                split.capacity,
                bytes(split.tier),
                list(split.evicted),
                links["ends2"],
                policy,
            )
        )
    return out
