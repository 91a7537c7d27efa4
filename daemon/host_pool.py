"""Host pool bookkeeping (L2): a slot allocator over one arena plus the L2 page index.

Pure and synchronous (no I/O, no mapping, no locks, no ``await``): the arena is mapped
elsewhere; this module hands out byte offsets into it and keeps every page's state.

The arena is cut into ``n_extents = capacity_bytes // extent_bytes`` extents (the
remainder is unused). An extent is free or belongs to one page class, which cuts it
into slots of its stride (``page_bytes`` rounded up to ``align``). Every extent
reserves ``M = extent_bytes // min_stride`` global slot ids::

      extent 0: class 0 (stride 8K)   extent 1: free       extent 2: class 1 (stride 12K)
    +------+------+------+-----+   +-----------------+   +--------+--------+-----+---+
    | s 0  | s 1  | s 2  | ... |   |                 |   | s 2M   | s 2M+1 | ... |pad|
    +------+------+------+-----+   +-----------------+   +--------+--------+-----+---+
    ^0     ^8K    ^16K             ^E                    ^2E      ^2E+12K

    slot id = extent * M + i          offset = extent * extent_bytes + i * stride

Page metadata lives in flat per-slot arrays created once, at construction (a slot's
class is kept per extent). Intrusive doubly linked lists thread through them and
allocate nothing: a free list per class, the global evictable list and one evictable
list per owner (both in recency order, cold end first), and each page's list of
resident children. A FREE slot is only on a free list and an evictable page only on
the evictable lists, so those two share one pair of link arrays.

Life cycle (:class:`PageState`): FREE -allocate-> WRITING -commit-> READY
-evict/flush-> FREE, and WRITING -abort-> FREE. WRITING pages are invisible to
lookups and never evicted; a READY page is evictable when it has no pins and no
resident children (pages that extend it).

Eviction policy, LRU and tail first:

- A page with a resident child is never evicted, so a chain goes tail to head.
  Touching a chain ``k0..kn`` (commit, pin) stamps it in reverse, so its tail is the
  colder end. A page that becomes evictable (its last child left, its last pin
  dropped) goes to the cold end if it is not more recent than the current cold end,
  else to the hot end.
- A slot of class ``c`` comes from, in order: the free list of ``c``; a fresh slot of
  the extent ``c`` is cutting (ascending offsets, so consecutive allocations are
  contiguous); a free extent; eviction from the cold end of the global list, any
  class (a victim of ``c`` frees a slot of ``c``; one of another class frees its slot
  and, when that empties its extent, the extent is free for ``c``), at most
  ``EVICT_FACTOR`` x the largest slots-per-extent victims; then the coldest page of
  ``c`` itself (bounded scan). Otherwise the allocation fails (a shortfall).
- An owner at its quota evicts only its own pages, coldest first, same bounds.

Write-back hook: with :attr:`HostPool.evict_requires_l3` set, eviction skips pages not
marked in L3 (within the bounded scan), so no slot is reused before its page reached
L3. A write-back task pins cold pages, copies them to L3, calls
:meth:`HostPool.mark_in_l3` and unpins them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from kvtier.config.errors import KvtierError

NIL = -1
"""The null slot / extent id in every intrusive link."""

EVICT_FACTOR = 2
"""Victims per slot allocation: at most EVICT_FACTOR x the largest slots-per-extent."""

MIN_SCAN = 256
"""Lower bound of the scan length when a victim must match a filter."""


class HostPoolError(KvtierError):
    """Misuse of the host pool: bad geometry, unknown class or slot id."""


class PageStateError(HostPoolError):
    """A page state transition was asked of a page in the wrong state."""


class PageState(IntEnum):
    """State of one host page (slot)."""

    FREE = 0
    WRITING = 1
    READY = 2


class EvictedPage(NamedTuple):
    """One eviction, as :meth:`HostPool.drain_evicted` reports it.

    Attributes:
        key: the page key.
        ns_id: the page's namespace.
        slot: the slot it occupied (free now, maybe reused).
        in_l3: whether the page was marked as present in L3.
    """

    key: bytes
    ns_id: int
    slot: int
    in_l3: bool


@dataclass(frozen=True, slots=True)
class ClassStats:
    """Counters of one page class.

    Attributes:
        class_id: id from :meth:`HostPool.register_class`.
        page_bytes: page size the class was registered with.
        stride: slot size (``page_bytes`` rounded up to the alignment).
        slots_per_extent: slots the class cuts from one extent.
        extents: extents the class holds.
        pages_ready: READY pages of the class.
        pages_writing: WRITING pages of the class.
    """

    class_id: int
    page_bytes: int
    stride: int
    slots_per_extent: int
    extents: int
    pages_ready: int
    pages_writing: int


@dataclass(frozen=True, slots=True)
class HostPoolStats:
    """A snapshot of the pool's counters.

    Attributes:
        capacity_bytes: the arena size the pool was built with.
        used_bytes: bytes of READY and WRITING slots (pages x stride).
        pages_ready / pages_writing: pages in each state.
        pages_pinned: pages with at least one pin.
        evictions: pages evicted since construction (flushes not counted).
        evicted_unlogged: evictions left out of the full eviction log.
        extents_free / extents_total: extents owned by no class / in the arena.
        classes: per-class counters, by class id.
    """

    capacity_bytes: int
    used_bytes: int
    pages_ready: int
    pages_writing: int
    pages_pinned: int
    evictions: int
    evicted_unlogged: int
    extents_free: int
    extents_total: int
    classes: tuple[ClassStats, ...]


@dataclass(frozen=True, slots=True)
class PageInfo:
    """What the pool records about one slot (admin views, tests).

    Attributes:
        slot: the slot id.
        state: its page state.
        key: the page key, None when FREE.
        ns_id / owner: namespace and tenant (stale when FREE).
        class_id / offset: class and arena offset, -1 when the extent is free.
        pins: pin count.
        parent: slot of the resident page this page extends, or -1.
        children: resident pages that extend this page.
        in_l3: whether the page is marked as present in L3.
        last_access: recency stamp (larger is more recent).
        evictable: READY with no pins and no resident children.
    """

    slot: int
    state: PageState
    key: bytes | None
    ns_id: int
    owner: int
    class_id: int
    offset: int
    pins: int
    parent: int
    children: int
    in_l3: bool
    last_access: int
    evictable: bool


@dataclass(slots=True)
class _PageClass:
    page_bytes: int
    stride: int
    n: int  # slots per extent
    free: int = NIL  # free list head
    bump: int = NIL  # extent being cut into fresh slots, in ascending order
    extents: int = 0
    ready: int = 0
    writing: int = 0


def _filled(typecode: str, value: int, n: int) -> array[int]:
    return array(typecode, [value]) * n


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _push(prev: array[int], nxt: array[int], ends: list[int], stamp: array[int], s: int) -> None:
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


def _unlink(prev: array[int], nxt: array[int], ends: list[int], s: int) -> None:
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


class HostPool:
    """Slot allocator and L2 index over one host arena (see the module docstring).

    Args:
        capacity_bytes: arena size; ``capacity_bytes // extent_bytes`` extents are used.
        extent_bytes: size of one extent, a multiple of ``align``.
        align: slot alignment, a power of two; strides are multiples of it.
        min_page_bytes: smallest page size expected. Metadata (about 74 bytes per id)
            is sized for ``extent_bytes // round_up(min_page_bytes, align)`` slots per
            extent; None means pages of ``align`` bytes. A class with smaller pages
            still works but uses only that many slots of each extent.
        max_evicted_log: evictions kept for :meth:`drain_evicted`; more are counted only.

    Raises:
        HostPoolError: the geometry is invalid or the arena holds no extent.
    """

    def __init__(
        self,
        capacity_bytes: int,
        extent_bytes: int,
        align: int = 4096,
        *,
        min_page_bytes: int | None = None,
        max_evicted_log: int = 65536,
    ) -> None:
        if align <= 0 or align & (align - 1):
            raise HostPoolError(f"align must be a power of two, got {align}")
        if extent_bytes <= 0 or extent_bytes % align:
            raise HostPoolError(f"extent_bytes={extent_bytes} is not a multiple of {align}")
        n_extents = capacity_bytes // extent_bytes
        if n_extents < 1:
            raise HostPoolError(f"capacity_bytes={capacity_bytes} holds no {extent_bytes}B extent")
        min_stride = _round_up(max(1, min_page_bytes or align), align)
        if min_stride > extent_bytes:
            raise HostPoolError(f"min_page_bytes={min_page_bytes} exceeds extent_bytes")
        per_extent = extent_bytes // min_stride
        n_slots = n_extents * per_extent
        if n_slots >= 2**31:
            raise HostPoolError(f"{n_slots} slot ids exceed 2**31; raise min_page_bytes")

        self.capacity_bytes = capacity_bytes
        self.extent_bytes = extent_bytes
        self.align = align
        self.n_extents = n_extents
        self.n_slots = n_slots
        self.evict_requires_l3 = False  # write-back hook: evict only pages marked in L3
        self._per_extent = per_extent
        self._max_log = max_evicted_log

        self._state = _filled("b", PageState.FREE, n_slots)
        self._in_l3 = _filled("b", 0, n_slots)
        self._pins = _filled("i", 0, n_slots)
        self._parent = _filled("i", NIL, n_slots)
        self._children = _filled("i", 0, n_slots)
        self._first_child = _filled("i", NIL, n_slots)
        self._sib_prev = _filled("i", NIL, n_slots)
        self._sib_next = _filled("i", NIL, n_slots)
        self._prev = _filled("i", NIL, n_slots)  # free list or global evictable list
        self._next = _filled("i", NIL, n_slots)
        self._oprev = _filled("i", NIL, n_slots)  # owner's evictable list
        self._onext = _filled("i", NIL, n_slots)
        self._ns = _filled("q", 0, n_slots)
        self._owner = _filled("q", 0, n_slots)
        self._stamp = _filled("q", 0, n_slots)
        self._key: list[bytes | None] = [None] * n_slots

        self._ext_class = _filled("i", NIL, n_extents)
        self._ext_used = _filled("i", 0, n_extents)  # non-FREE slots
        self._ext_bump = _filled("i", 0, n_extents)  # slots handed out since assigned
        self._free_extents = list(range(n_extents - 1, -1, -1))  # pop() -> lowest first

        self._classes: list[_PageClass] = []
        self._class_of_bytes: dict[int, int] = {}
        self._evict_budget = 1
        self._scan_limit = MIN_SCAN
        self._index: dict[bytes, int] = {}
        # key -> ns_id of READY pages only: lookups run over it at C speed (the LOOKUP hot path)
        self._ready_ns: dict[bytes, int] = {}
        self._ends = [NIL, NIL]  # global evictable list: [cold end, hot end]
        self._own_ends: dict[int, list[int]] = {}  # per owner, created on first use
        self._owned: dict[int, int] = {}
        self._quota: dict[int, int] = {}
        self._clock = 0
        self._n_pinned = self._evictions = self._unlogged = 0
        self._evicted: list[EvictedPage] = []

    # ------------------------------------------------------------- geometry

    def register_class(self, page_bytes: int) -> int:
        """Register a page size; the same size always gets the same class id.

        Args:
            page_bytes: bytes of one page of an engine's model.

        Returns:
            The class id (0, 1, ... in registration order).

        Raises:
            HostPoolError: ``page_bytes`` is not positive or its stride exceeds an extent.
        """
        cid = self._class_of_bytes.get(page_bytes)
        if cid is not None:
            return cid
        if page_bytes <= 0:
            raise HostPoolError(f"page_bytes must be positive, got {page_bytes}")
        stride = _round_up(page_bytes, self.align)
        if stride > self.extent_bytes:
            raise HostPoolError(
                f"page_bytes={page_bytes} (stride {stride}) exceeds extent_bytes={self.extent_bytes}"
            )
        n = min(self.extent_bytes // stride, self._per_extent)
        cid = len(self._classes)
        self._classes.append(_PageClass(page_bytes, stride, n))
        self._class_of_bytes[page_bytes] = cid
        self._evict_budget = max(self._evict_budget, EVICT_FACTOR * n)
        self._scan_limit = max(MIN_SCAN, self._evict_budget)
        return cid

    def class_stride(self, class_id: int) -> int:
        """Return the slot stride in bytes of ``class_id`` (HostPoolError if unknown)."""
        self._check_class(class_id)
        return self._classes[class_id].stride

    def slot_offset(self, slot: int) -> int:
        """Return the byte offset of ``slot`` in the arena.

        Raises:
            HostPoolError: the slot id is out of range or its extent has no class.
        """
        self._check_slot(slot)
        e = slot // self._per_extent
        cid = self._ext_class[e]
        if cid == NIL:
            raise HostPoolError(f"slot {slot} lies in extent {e}, which is not allocated")
        return e * self.extent_bytes + (slot - e * self._per_extent) * self._classes[cid].stride

    # ------------------------------------------------------------ page index

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` READY in ``ns_id``.

        Pages of other namespaces are never seen. Recency is not touched.

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            How many leading keys are READY.
        """
        found = list(map(self._ready_ns.get, keys))
        if found.count(ns_id) == len(found):
            return len(found)
        for n, v in enumerate(found):
            if v != ns_id:
                return n
        raise AssertionError("unreachable")

    def resident_run(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` resident in ``ns_id``,
        READY or WRITING (what a store leaves stored or being stored).

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            How many leading keys are READY or WRITING.
        """
        index, ns = self._index, self._ns
        n = 0
        for key in keys:
            s = index.get(key)
            if s is None or ns[s] != ns_id:
                break
            n += 1
        return n

    def allocate(
        self,
        ns_id: int,
        owner: int,
        class_id: int,
        keys: Sequence[bytes],
        parent_key: bytes | None = None,
    ) -> list[tuple[int, int]]:
        """Allocate WRITING slots for the keys the pool lacks (the store path).

        Present keys (READY or WRITING) are skipped but parent the next key. A new
        page's parent is the previous key's page, or for ``keys[0]`` the page of
        ``parent_key`` when resident in ``ns_id``. Stops at the first key that cannot
        be allocated (pool full, nothing evictable, quota) or that another namespace
        holds: later pages are useless without it.

        Args:
            ns_id: namespace of the pages.
            owner: tenant charged for the pages (see :meth:`set_quota`).
            class_id: page class from :meth:`register_class`.
            keys: page keys in chain order.
            parent_key: key of the page ``keys[0]`` extends, if any.

        Returns:
            ``(index into keys, slot)`` per page allocated, in key order; a shortfall
            shows as missing pairs, never as an exception.

        Raises:
            HostPoolError: unknown class id.
        """
        self._check_class(class_id)
        cls = self._classes[class_id]
        index = self._index
        out: list[tuple[int, int]] = []
        prev = NIL
        if parent_key is not None:
            p = index.get(parent_key)
            if p is not None and self._ns[p] == ns_id:
                prev = p
        for i, key in enumerate(keys):
            s = index.get(key)
            if s is not None:
                if self._ns[s] != ns_id:
                    break
                prev = s
                continue
            if prev != NIL:
                self._add_child_ref(prev)  # shields prev from the evictions below
            s = self._take_slot(class_id, owner)
            if s == NIL:
                if prev != NIL:
                    self._drop_child_ref(prev)
                break
            self._state[s] = PageState.WRITING
            self._key[s] = key
            self._ns[s] = ns_id
            self._owner[s] = owner
            self._stamp[s] = self._tick()
            self._parent[s] = prev
            if prev != NIL:
                self._link_child(prev, s)
            index[key] = s
            self._ext_used[s // self._per_extent] += 1
            cls.writing += 1
            self._owned[owner] = self._owned.get(owner, 0) + 1
            out.append((i, s))
            prev = s
        return out

    def commit(self, slots: Sequence[int]) -> None:
        """Mark filled pages READY (visible) and touch them, the last slot first.

        A page with no resident children becomes evictable.

        Args:
            slots: WRITING slots, in chain order (the tail ends up coldest).

        Raises:
            PageStateError: a slot is not WRITING. Checked before any change, except a
                slot listed twice, which fails at its second occurrence.
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._expect(s, PageState.WRITING, "commit")
        for j in range(len(slots) - 1, -1, -1):
            s = slots[j]
            self._expect(s, PageState.WRITING, "commit")
            self._state[s] = PageState.READY
            self._ready_ns[self._key[s]] = self._ns[s]
            cls = self._classes[self._ext_class[s // self._per_extent]]
            cls.writing -= 1
            cls.ready += 1
            self._stamp[s] = self._tick()
            if self._children[s] == 0:
                self._enqueue(s)

    def abort(self, slots: Sequence[int]) -> None:
        """Free pages whose fill failed (WRITING -> FREE, keys leave the index).

        Parents lose a resident child; resident children lose their parent link.

        Args:
            slots: WRITING slots.

        Raises:
            PageStateError: as for :meth:`commit`.
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._expect(s, PageState.WRITING, "abort")
        for j in range(len(slots) - 1, -1, -1):
            self._expect(slots[j], PageState.WRITING, "abort")
            self._release(slots[j])

    def pin(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """Pin the leading READY run of ``keys`` and touch it, the last key first.

        Pinned pages are not evictable. The caller keeps the returned slots and hands
        them to :meth:`unpin` once.

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            The pinned slots, one per key of the leading READY run.
        """
        out = [self._index[key] for key in keys[: self.lookup(ns_id, keys)]]
        pins = self._pins
        for j in range(len(out) - 1, -1, -1):
            s = out[j]
            if pins[s] == 0:
                self._n_pinned += 1
                if self._children[s] == 0:
                    self._dequeue(s)
            pins[s] += 1
            self._stamp[s] = self._tick()
        return out

    def unpin(self, slots: Sequence[int]) -> None:
        """Drop one pin per slot; pages left unpinned and childless become evictable.

        Args:
            slots: slots returned by :meth:`pin`.

        Raises:
            PageStateError: a slot is not a pinned READY page. Checked before any
                change, except a slot listed more often than pinned.
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._expect(s, PageState.READY, "unpin")
        pins = self._pins
        for s in slots:
            self._expect(s, PageState.READY, "unpin")
            pins[s] -= 1
            if pins[s] == 0:
                self._n_pinned -= 1
                if self._children[s] == 0:
                    self._enqueue(s)

    def set_quota(self, owner: int, max_pages: int | None) -> None:
        """Limit the resident (READY + WRITING) pages of ``owner``.

        An owner at or over its quota evicts only its own pages to allocate (so it
        cannot evict another owner's); lowering a quota evicts nothing at once.

        Args:
            owner: the tenant.
            max_pages: the limit, or None to lift it.

        Raises:
            HostPoolError: ``max_pages`` is negative.
        """
        if max_pages is None:
            self._quota.pop(owner, None)
        elif max_pages < 0:
            raise HostPoolError(f"max_pages must be >= 0 or None, got {max_pages}")
        else:
            self._quota[owner] = max_pages

    def owned_pages(self, owner: int) -> int:
        """Return the resident (READY + WRITING) pages charged to ``owner``."""
        return self._owned.get(owner, 0)

    def mark_in_l3(self, slots: Sequence[int]) -> None:
        """Record that these pages are in L3 (evictable under ``evict_requires_l3``).

        Args:
            slots: READY or WRITING slots.

        Raises:
            PageStateError: a slot is FREE (checked before any change).
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self._check_slot(s)
            if self._state[s] == PageState.FREE:
                raise PageStateError(f"cannot mark slot {s} in L3: it is FREE")
        for s in slots:
            self._in_l3[s] = 1

    def flush(self, ns_id: int | None = None, owner: int | None = None) -> int:
        """Drop every evictable page, optionally only of one namespace and/or owner.

        Chains go tail to head; pinned and WRITING pages (and their ancestors) stay.
        Dropped pages are neither counted as evictions nor logged.

        Args:
            ns_id: only pages of this namespace, if given.
            owner: only pages of this owner, if given.

        Returns:
            The number of pages dropped.
        """
        dropped = 0
        s = self._ends[0]
        while s != NIL:
            nxt = self._next[s]  # dropping s only enqueues its parent, never removes nxt
            while (
                s != NIL
                and (ns_id is None or self._ns[s] == ns_id)
                and (owner is None or self._owner[s] == owner)
            ):
                parent = self._parent[s]
                self._dequeue(s)
                self._release(s)
                dropped += 1
                s = parent if parent != NIL and self._is_evictable(parent) else NIL
            s = nxt
        return dropped

    def drain_evicted(self) -> list[EvictedPage]:
        """Return the evictions logged since the last drain and clear the log."""
        out, self._evicted = self._evicted, []
        return out

    # --------------------------------------------------------- introspection

    def stats(self) -> HostPoolStats:
        """Return a snapshot of the pool's counters."""
        classes = tuple(
            ClassStats(c, k.page_bytes, k.stride, k.n, k.extents, k.ready, k.writing)
            for c, k in enumerate(self._classes)
        )
        return HostPoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=sum((c.pages_ready + c.pages_writing) * c.stride for c in classes),
            pages_ready=sum(c.pages_ready for c in classes),
            pages_writing=sum(c.pages_writing for c in classes),
            pages_pinned=self._n_pinned,
            evictions=self._evictions,
            evicted_unlogged=self._unlogged,
            extents_free=len(self._free_extents),
            extents_total=self.n_extents,
            classes=classes,
        )

    def describe(self, slot: int) -> PageInfo:
        """Return what the pool records about ``slot`` (HostPoolError if out of range)."""
        self._check_slot(slot)
        cid = self._ext_class[slot // self._per_extent]
        return PageInfo(
            slot, PageState(self._state[slot]), self._key[slot], self._ns[slot],
            self._owner[slot], cid, self.slot_offset(slot) if cid != NIL else NIL,
            self._pins[slot], self._parent[slot], self._children[slot],
            bool(self._in_l3[slot]), self._stamp[slot], self._is_evictable(slot),
        )  # fmt: skip

    def evictable_slots(self, owner: int | None = None) -> list[int]:
        """Return the evictable slots, cold end first, walking the global list or
        ``owner``'s list. O(pages): for admin views and tests."""
        out: list[int] = []
        s, nxt = self._list_start(owner)
        while s != NIL:
            out.append(s)
            s = nxt[s]
        return out

    # ------------------------------------------------------- slot allocation

    def _take_slot(self, cid: int, owner: int) -> int:
        """Return a slot of class ``cid`` for ``owner``, evicting if needed, or NIL."""
        quota = self._quota.get(owner)
        scope: int | None = None  # whose pages may be evicted; None: anyone's
        if quota is not None and self._owned.get(owner, 0) >= quota:
            scope, budget = owner, self._evict_budget
            while self._owned.get(owner, 0) >= quota:  # replace own pages first
                v = self._coldest(owner, NIL)
                if v == NIL or budget == 0:
                    return NIL
                self._evict(v)
                budget -= 1
        s = self._take_free(cid)
        return s if s != NIL else self._reclaim(cid, scope)

    def _reclaim(self, cid: int, owner: int | None) -> int:
        """Evict (anyone's, or only ``owner``'s pages) until a slot of ``cid`` frees."""
        budget = self._evict_budget
        while budget > 0:
            v = self._coldest(owner, NIL)
            if v == NIL:
                break
            self._evict(v)
            budget -= 1
            s = self._take_free(cid)
            if s != NIL:
                return s
        v = self._coldest(owner, cid)  # fall back to the class's own pages
        if v == NIL:
            return NIL
        self._evict(v)
        return self._take_free(cid)

    def _take_free(self, cid: int) -> int:
        """Pop a free slot of ``cid``: free list, fresh slot, free extent; or NIL."""
        cls = self._classes[cid]
        s = cls.free
        if s != NIL:
            self._free_unlink(cls, s)
            return s
        e = cls.bump
        if e == NIL:
            if not self._free_extents:
                return NIL
            e = self._free_extents.pop()
            self._ext_class[e] = cid
            self._ext_bump[e] = 0
            cls.extents += 1
            cls.bump = e
        i = self._ext_bump[e]
        self._ext_bump[e] = i + 1
        if i + 1 == cls.n:
            cls.bump = NIL
        return e * self._per_extent + i

    def _coldest(self, owner: int | None, cid: int) -> int:
        """Coldest page eviction may take from the global (or ``owner``'s) list, of
        class ``cid`` unless NIL; NIL if none within the scan limit."""
        s, nxt = self._list_start(owner)
        need_l3 = self.evict_requires_l3
        steps = self._scan_limit
        while s != NIL and steps > 0:
            if (not need_l3 or self._in_l3[s]) and (
                cid == NIL or self._ext_class[s // self._per_extent] == cid
            ):
                return s
            s = nxt[s]
            steps -= 1
        return NIL

    def _evict(self, s: int) -> None:
        self._evictions += 1
        if len(self._evicted) < self._max_log:
            key = self._key[s]
            assert key is not None
            self._evicted.append(EvictedPage(key, self._ns[s], s, bool(self._in_l3[s])))
        else:
            self._unlogged += 1
        self._dequeue(s)
        self._release(s)

    def _release(self, s: int) -> None:
        """Turn the READY or WRITING page ``s``, off the evictable lists, FREE."""
        assert self._pins[s] == 0
        key = self._key[s]
        assert key is not None
        del self._index[key]
        self._key[s] = None
        p = self._parent[s]
        if p != NIL:
            self._unlink_child(p, s)
            self._drop_child_ref(p)
        c = self._first_child[s]
        while c != NIL:  # only an aborted page can still have children: orphan them
            nxt = self._sib_next[c]
            self._parent[c] = self._sib_prev[c] = self._sib_next[c] = NIL
            c = nxt
        self._first_child[s] = NIL
        self._children[s] = 0
        e = s // self._per_extent
        cls = self._classes[self._ext_class[e]]
        if self._state[s] == PageState.READY:
            cls.ready -= 1
            del self._ready_ns[key]
        else:
            cls.writing -= 1
        self._state[s] = PageState.FREE
        self._in_l3[s] = 0
        self._owned[self._owner[s]] -= 1
        self._ext_used[e] -= 1
        if self._ext_used[e] > 0:
            self._free_push(cls, s)
            return
        # The extent is empty: pull its other slots off the free list and give it back.
        base = e * self._per_extent
        for t in range(base, base + self._ext_bump[e]):
            if t != s:
                self._free_unlink(cls, t)
        if cls.bump == e:
            cls.bump = NIL
        self._ext_class[e] = NIL
        self._ext_bump[e] = 0
        cls.extents -= 1
        self._free_extents.append(e)

    # ------------------------------------------------------ intrusive lists

    def _list_start(self, owner: int | None) -> tuple[int, array[int]]:
        if owner is None:
            return self._ends[0], self._next
        ends = self._own_ends.get(owner)
        return (NIL if ends is None else ends[0]), self._onext

    def _free_push(self, cls: _PageClass, s: int) -> None:
        head = cls.free
        self._prev[s], self._next[s] = NIL, head
        if head != NIL:
            self._prev[head] = s
        cls.free = s

    def _free_unlink(self, cls: _PageClass, s: int) -> None:
        p, n = self._prev[s], self._next[s]
        if p == NIL:
            cls.free = n
        else:
            self._next[p] = n
        if n != NIL:
            self._prev[n] = p
        self._prev[s] = self._next[s] = NIL

    def _is_evictable(self, s: int) -> bool:
        return self._state[s] == PageState.READY and self._pins[s] == 0 and self._children[s] == 0

    def _enqueue(self, s: int) -> None:
        """Put ``s`` on the global and its owner's evictable lists."""
        _push(self._prev, self._next, self._ends, self._stamp, s)
        ends = self._own_ends.get(self._owner[s])
        if ends is None:
            ends = self._own_ends[self._owner[s]] = [NIL, NIL]
        _push(self._oprev, self._onext, ends, self._stamp, s)

    def _dequeue(self, s: int) -> None:
        """Take ``s`` off the global and its owner's evictable lists."""
        _unlink(self._prev, self._next, self._ends, s)
        _unlink(self._oprev, self._onext, self._own_ends[self._owner[s]], s)

    def _add_child_ref(self, p: int) -> None:
        if self._is_evictable(p):
            self._dequeue(p)
        self._children[p] += 1

    def _drop_child_ref(self, p: int) -> None:
        self._children[p] -= 1
        assert self._children[p] >= 0
        if self._is_evictable(p):
            self._enqueue(p)

    def _link_child(self, p: int, c: int) -> None:
        head = self._first_child[p]
        self._sib_prev[c], self._sib_next[c] = NIL, head
        if head != NIL:
            self._sib_prev[head] = c
        self._first_child[p] = c

    def _unlink_child(self, p: int, c: int) -> None:
        sp, sn = self._sib_prev[c], self._sib_next[c]
        if sp == NIL:
            self._first_child[p] = sn
        else:
            self._sib_next[sp] = sn
        if sn != NIL:
            self._sib_prev[sn] = sp
        self._parent[c] = self._sib_prev[c] = self._sib_next[c] = NIL

    # ---------------------------------------------------------------- checks

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_class(self, class_id: int) -> None:
        if not 0 <= class_id < len(self._classes):
            raise HostPoolError(f"unknown page class {class_id}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise HostPoolError(f"slot {slot} out of range [0, {self.n_slots})")

    def _expect(self, s: int, want: PageState, op: str) -> None:
        self._check_slot(s)
        state = self._state[s]
        if state != want:
            raise PageStateError(
                f"cannot {op} slot {s}: it is {PageState(state).name}, not {want.name}"
            )
        if op == "unpin" and self._pins[s] == 0:
            raise PageStateError(f"cannot unpin slot {s}: it is READY with no pins")
