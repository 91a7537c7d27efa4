"""The host pool's page table: the L2 index and the state machine of its pages.

Pure and synchronous (no I/O, no locks, no ``await``): the event loop calls into it. What
must survive a restart (state, key, namespace, owner, length, parent, last access, in-L3
flag, checksum, seal) is a column of the metadata region (:class:`~kvtier.daemon.pool.meta.
PoolMeta`), so every change persists as it is made. Pins, child lists and links are private
arrays rebuilt on adoption; the intrusive lists (:mod:`~kvtier.daemon.pool.links`) allocate
nothing.

Life cycle (:class:`PageState`): FREE -allocate-> WRITING -commit-> READY
-evict/flush-> FREE, and WRITING -abort-> FREE. WRITING pages are invisible to
lookups and never evicted; a READY page is evictable when it has no pins and no
resident children (pages that extend it). Write order makes a crash at any instant
safe: a row is completed while WRITING and its state flips to READY last; freeing
flips the state first. Which page to evict is :mod:`~kvtier.daemon.pool.eviction`.

The exact index is a dict per namespace, key -> slot, of the READY pages (``_ready``) and
one of the WRITING pages (``_writing``): allocation asks it which keys are present,
commit, eviction and release move keys in and out of it. LOOKUPs and a LOAD's pin are
answered by the host pool's key table in C (:mod:`~kvtier.daemon.pool.lookups`), which
asks this dict only about a key its probe leaves unresolved. Allocate and commit run in C
(:class:`~kvtier.daemon.pool.page_steps.PageSteps`, the eviction policy's steps within the
allocation), pin and unpin too (:class:`~kvtier.daemon.pool.pins.Pins`), and so does
freeing a page (:meth:`PageTable.release`: an abort, a flush), whatever the number of
pages. A key is one bytes object, in ``keys`` (slot -> key) and its
namespace's dict (built in C at adoption).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence

import numpy as np
from kvtier.daemon.pool.eviction import Evictor
from kvtier.daemon.pool.layout import KEY_BYTES, NIL, USED_AGAIN
from kvtier.daemon.pool.links import ChildLists
from kvtier.daemon.pool.meta import PoolMeta
from kvtier.daemon.pool.pins import Pins
from kvtier.daemon.pool.records import HostPoolError, PageState, PageStateError, ResidentPages
from kvtier.daemon.pool.slots import PageClass, SlotAllocator
from kvtier.daemon.pool.page_steps import PageSteps

__all__ = ["PageTable"]

_NO_PAGES: dict[bytes, int] = {}  # stands in for a namespace without pages; never written

_MAX_U64 = (1 << 64) - 1
_READY, _FREE = int(PageState.READY), int(PageState.FREE)  # plain ints: compared per page
_WRITING = int(PageState.WRITING)


class PageTable:
    """The pages of one host pool: index, states, pins, parent links, LRU placement.

    Built over a metadata region (formatted, or about to be adopted: :meth:`adopt_rows`
    then refills it from the adoption scan). :class:`~kvtier.daemon.pool.host_pool.HostPool`
    holds one and adds geometry, ids, adoption and introspection. Slots come from an
    :class:`~kvtier.daemon.pool.eviction.Evictor`, whose victims C frees as :meth:`release` does.

    Args:
        meta: the metadata region.
        max_log / quota / requires_l3 / policy: the eviction settings (see
            :class:`Evictor`).

    Attributes (for reading; the operations below change them):
        meta: the metadata region.
        slots: the slot allocator (extents, page classes, free lists).
        evictor: victim choice, quotas, the evictable lists, the eviction log.
        pins: the pin counts.
        kids: each page's resident children.
        keys: the key of each slot (None: FREE).
        ready: ``ns -> key -> slot`` of the READY pages.
        n_slots: slot ids of the pool.
    """

    def __init__(
        self,
        meta: PoolMeta,
        *,
        max_log: int,
        quota: dict[int, int],
        requires_l3: bool,
        policy: str = "lru",
    ) -> None:
        layout = meta.layout
        self.n_slots = layout.n_slots
        self._per_extent = layout.per_extent
        self.meta = meta
        self.slots = slots = SlotAllocator(layout, meta.ext_bytes)
        self._classes: list[PageClass] = slots.classes
        self._ext_class = slots.ext_class
        # persistent columns (shared memory for a daemon's pool), then private arrays
        self._state, self._in_l3, self._stamp = meta.state, meta.in_l3, meta.stamp
        self._ns, self._owner, self._parent = meta.ns, meta.owner, meta.parent
        self.kids = ChildLists(self.n_slots, meta.parent)  # resident children
        self._children = self.kids.count
        self.keys: list[bytes | None] = [None] * self.n_slots
        # ns_id -> key -> slot of the READY pages and of the WRITING ones (the exact index);
        # a key is only ever seen from its own namespace, so one tenant cannot even probe
        # another's keys
        self.ready: dict[int, dict[bytes, int]] = {}
        self._writing: dict[int, dict[bytes, int]] = {}
        self._index = ResidentPages(self.ready, self._writing)  # len: resident pages
        self.evictor = Evictor(
            slots,
            meta,
            max_log=max_log,
            quota=quota,
            requires_l3=requires_l3,
            policy=policy,
        )
        self._split = self.evictor.split  # a two-list policy's state (None: lru)
        self._lru = self.evictor.lru  # the evictable pages
        self._owned = self.evictor.owned
        self.pins = Pins(
            self.n_slots, meta.stamp, meta.state, meta.owner, self._children, self._lru
        )
        self._pins = self.pins.count
        self._steps = PageSteps(
            meta, slots, self.kids, self.evictor, self._pins, self.keys, self.ready, self._writing
        )
        self._clock = 0

    def adopt_rows(
        self, slots: np.ndarray, ready: dict[int, dict[bytes, int]], parents: np.ndarray
    ) -> None:
        """Fill the private state of an empty table from adopted READY rows.

        Everything is built in numpy: no Python loop per page.

        Args:
            slots: the adopted slot ids, ascending; ``parents`` (after cleaning, NIL: none)
                in the same order.
            ready: their index (:func:`~kvtier.daemon.pool.adopt.scan_rows`, which has
                put each key into ``keys`` too).
        """
        meta = self.meta
        self.slots.rebuild(slots)
        self.ready.update(ready)  # in place: the index dicts are shared (PageSteps)
        cids = np.frombuffer(self._ext_class, dtype=np.int32)[slots // self._per_extent]
        for cid, count in enumerate(np.bincount(cids, minlength=len(self._classes)).tolist()):
            self._classes[cid].ready = count
        for cls in self._classes:
            self.evictor.fit_class(cls.n)
        owners = meta.array("owner")[slots]
        if len(owners) and (owners == owners[0]).all():  # one owner: the usual case
            self._owned[int(owners[0])] = len(owners)
        else:
            for o, count in zip(*np.unique(owners, return_counts=True)):
                self._owned[int(o)] = int(count)
        self.kids.rebuild(slots, parents)
        if self._split is not None:  # the pages used again: T2, as before the restart
            used = slots[(meta.array("flags")[slots] & USED_AGAIN) != 0]
            np.frombuffer(self._split.tier, dtype=np.uint8)[used] = 1
            self._split.t2 = len(used)
        # evictable lists: childless pages by last access, cold end first
        stamps = meta.array("stamp")[slots]
        ev = np.frombuffer(self._children, dtype=np.int32)[slots] == 0
        order = np.argsort(stamps[ev], kind="stable")  # ties: ascending slots
        self._lru.rebuild(slots[ev][order], owners[ev][order])
        self._clock = int(stamps.max()) if len(stamps) else 0

    # ------------------------------------------------------------ page index

    def resident_run(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` resident in ``ns_id``,
        READY or WRITING (what a store leaves stored or being stored).

        Args:
            ns_id: the caller's namespace.
            keys: page keys in chain order.

        Returns:
            How many leading keys are READY or WRITING.
        """
        ready = self.ready.get(ns_id, _NO_PAGES)
        writing = self._writing.get(ns_id, _NO_PAGES)
        n = 0
        for key in keys:
            if key not in ready and key not in writing:
                break
            n += 1
        return n

    def stored_run(self, ns_id: int, keys: Sequence[bytes], mine: Collection[int]) -> int:
        """Return the length of the leading run of ``keys`` that a STORE whose own WRITING
        slots are ``mine`` may report as stored: READY, or being written in one of
        ``mine``. A key another transfer is still writing ends the run (that transfer may
        yet be cancelled, and its pages discarded).
        """
        ready = self.ready.get(ns_id, _NO_PAGES)
        writing = self._writing.get(ns_id, _NO_PAGES)
        n = 0
        for key in keys:
            if key not in ready and writing.get(key, NIL) not in mine:
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
        ``parent_key`` when resident in ``ns_id``; so is a present page's that has none (a
        page stored before its prefix, or left when its parent was freed, rejoins its chain:
        its prefix is no longer evicted before it), unless it is that page's ancestor. Stops at the first key that cannot
        be allocated (pool full, nothing evictable, quota) or that another namespace
        holds: later pages are useless without it.

        Args:
            ns_id: namespace of the pages.
            owner: tenant charged for the pages (see :meth:`HostPool.set_quota`).
            class_id: page class from :meth:`HostPool.register_class`.
            keys: page keys in chain order, at most 32 bytes each.
            parent_key: key of the page ``keys[0]`` extends, if any.

        Returns:
            ``(index into keys, slot)`` per page allocated, in key order; a shortfall
            shows as missing pairs, never as an exception.

        Raises:
            HostPoolError: unknown class id, or a key longer than 32 bytes.
        """
        self.slots.check_class(class_id)
        keys = keys if type(keys) is list else list(keys)
        prev = NIL
        if parent_key is not None:
            p = self.ready.get(ns_id, _NO_PAGES).get(parent_key)
            if p is None:
                p = self._writing.get(ns_id, _NO_PAGES).get(parent_key)
            prev = NIL if p is None else p
        clock = [self._clock]
        try:
            out = self._steps.allocate(ns_id, owner, class_id, keys, prev, clock)
        finally:  # the pages an error leaves allocated keep their stamps: so does the clock
            self._clock = clock[0]
            if self._split is not None:  # a ghost's return may have moved the lifetime
                self._split.save()
        if out is None:  # checked before any change
            raise HostPoolError(f"page keys must be bytes of at most {KEY_BYTES} bytes")
        return out

    def commit(self, slots: Sequence[int], checksums: Sequence[int] | None = None) -> None:
        """Mark filled pages READY (visible) and touch them, the last slot first.

        A page with no resident children becomes evictable. Each row is sealed (its
        key, namespace and checksum bound by one xxh3) before its state flips.

        Args:
            slots: WRITING slots, in chain order (the tail ends up coldest).
            checksums: the payload checksum of each slot (:func:`page_checksum` of its
                page bytes, computed once they landed), same order; None records none
                (such pages are not adopted by a pool that verifies its arena).

        Raises:
            PageStateError: a slot is not WRITING. Checked before any change, except a
                slot listed twice, which fails at its second occurrence.
            HostPoolError: a slot id is out of range, or ``checksums`` does not match
                ``slots`` (length, or a value outside 64 bits).
        """
        done = self._steps.commit(slots, checksums, self._clock)
        if done is None:  # refused, having changed nothing: name why, else ints that are not int
            self._check_commit(slots, checksums)
            sums = None if checksums is None else list(map(int, checksums))
            done = self._steps.commit(list(map(int, slots)), sums, self._clock)
            if done is None:  # pragma: no cover - _check_commit names every refusal
                raise HostPoolError(f"cannot commit slots {list(slots)[:8]}")
        stop, self._clock = done
        if stop:  # listed twice: no longer WRITING
            self._expect(slots[stop - 1], PageState.WRITING, "commit")

    def _check_commit(self, slots: Sequence[int], checksums: Sequence[int] | None) -> None:
        """Raise the error that names what :meth:`commit` refuses in its arguments."""
        for s in slots:
            self._expect(s, PageState.WRITING, "commit")
        if checksums is not None and (
            len(checksums) != len(slots)
            or (checksums and (min(checksums) < 0 or max(checksums) > _MAX_U64))
        ):
            raise HostPoolError(f"need one 64-bit checksum per slot ({len(slots)})")

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
        order = [int(s) for s in reversed(slots)]
        done = self._steps.release(order)
        if done < len(order):  # listed twice: FREE at its second occurrence
            self._expect(order[done], PageState.WRITING, "abort")
            raise PageStateError(f"cannot abort slot {order[done]}")  # pragma: no cover

    def detach(self, slots: Sequence[int]) -> None:
        """Take the keys of WRITING pages whose fill will be aborted (their STORE was
        cancelled) out of the index now, the pages staying WRITING for the copy that may
        still write them: another STORE of those keys then writes them itself, rather than
        count on pages that will never be READY. :meth:`abort` frees them later. A slot
        that is not WRITING, or whose key names another page, is left alone.

        Args:
            slots: WRITING slots of one cancelled STORE.
        """
        for s in slots:
            s = int(s)
            key = self.keys[s]
            if key is None or self._state[s] != PageState.WRITING:
                continue
            idx = self._writing.get(int(self._ns[s]))
            if idx is not None and idx.get(key) == s:
                del idx[key]

    def pin_slots(self, out: list[int], used: bool = False, touch: bool = True) -> None:
        """Pin the READY slots ``out`` (a lookup's leading run, in chain order) and touch
        them, the last first; pinned pages are not evictable. The caller hands them to
        :meth:`unpin` once. ``used``: the pages are being used (a LOAD), under ``arc`` or ``reuse``
        they move to T2. ``touch`` False: their stamps and the clock stay."""
        if used and self._split is not None:  # their last use, before the pin restamps them
            self._split.using(out, self._stamp, self._clock + 1)
            self._split.save()
        if touch:
            self._clock = self.pins.pin(out, self._clock)
        else:
            self.pins.pin(out, -1)
        if used and self._split is not None:  # off the lists now: into T2
            self._split.reused(out)

    def unpin(self, slots: Sequence[int]) -> None:
        """Drop one pin per slot; pages left unpinned and childless become evictable.

        Args:
            slots: slots pinned by :meth:`pin_slots`.

        Raises:
            PageStateError: a slot is not a pinned READY page, or is listed more often
                than pinned. Checked before any change.
            HostPoolError: a slot id is out of range.
        """
        if not self.pins.unpin(slots):
            self._refuse_unpin(slots)

    def _refuse_unpin(self, slots: Sequence[int]) -> None:
        """Raise the error that names why :class:`Pins` refused to unpin ``slots``."""
        for s in slots:
            self._expect(s, PageState.READY, "unpin")
        listed = Counter(slots)
        for s, times in listed.items():
            if times > self._pins[s]:
                raise PageStateError(
                    f"cannot unpin slot {s}: listed {times} times, pinned {self._pins[s]}"
                )
        raise PageStateError(f"cannot unpin slots {list(slots)[:8]}...")  # pragma: no cover

    def mark_in_l3(self, slots: Sequence[int]) -> None:
        """Record that these pages are in L3 (evictable under ``evict_requires_l3``).

        Args:
            slots: READY or WRITING slots.

        Raises:
            PageStateError: a slot is FREE (checked before any change).
            HostPoolError: a slot id is out of range.
        """
        for s in slots:
            self.check_slot(s)
            if self._state[s] == PageState.FREE:
                raise PageStateError(f"cannot mark slot {s} in L3: it is FREE")
        for s in slots:
            self._in_l3[s] = 1

    def clear_in_l3(self, ns_id: int, keys: Iterable[bytes] | None = None) -> int:
        """Record that READY pages of ``ns_id`` are no longer in L3 (their objects were
        deleted or dropped there): a write to L3 backs them up again, and under
        ``evict_requires_l3`` they are not evicted before it.

        Args:
            ns_id: the pages' namespace.
            keys: the pages' keys (None: every READY page of the namespace); keys of no
                READY page are skipped.

        Returns:
            Pages whose flag was set.
        """
        ready = self.ready.get(ns_id)
        if not ready:
            return 0
        slots = (
            ready.values() if keys is None else [s for k in keys if (s := ready.get(k)) is not None]
        )
        in_l3, n = self._in_l3, 0
        for s in slots:
            if in_l3[s]:
                in_l3[s] = 0
                n += 1
        return n

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
        lru, ns, owners, parents = self._lru, self._ns, self._owner, self._parent
        for second in (False, True):
            s, links = lru.start(None, second)
            while s != NIL:
                nxt = links[s]  # dropping s only enqueues its parent, never removes nxt
                while (
                    s != NIL
                    and (ns_id is None or ns[s] == ns_id)
                    and (owner is None or owners[s] == owner)
                ):
                    parent = parents[s]
                    self.release(s)  # off the evictable lists, then FREE
                    dropped += 1
                    s = parent if parent != NIL and self.is_evictable(parent) else NIL
                s = nxt
        return dropped

    def release(self, s: int) -> None:
        """Turn the WRITING or evictable (READY, unpinned, childless) page ``s`` FREE, in
        C (:meth:`PageSteps.release`): an evictable page leaves the evictable lists first;
        its parent loses a resident child (and becomes evictable when that was its last),
        its children lose their parent link, and its slot goes back to its class.

        Raises:
            PageStateError: ``s`` is FREE, pinned, or READY with resident children.
            HostPoolError: ``s`` is not a slot of the pool.
        """
        if self._steps.release([s]) != 1:
            self.check_slot(s)
            raise PageStateError(
                f"cannot release slot {s}: it is {PageState(self._state[s]).name} "
                f"with {self._pins[s]} pins and {self._children[s]} resident children"
            )

    # ------------------------------------------------------ intrusive lists

    def is_evictable(self, s: int) -> bool:
        """Whether the page ``s`` is READY, unpinned and childless."""
        return self._state[s] == PageState.READY and self._pins[s] == 0 and self._children[s] == 0

    # ---------------------------------------------------------------- checks

    def resident(self) -> int:
        """Resident (READY + WRITING) pages."""
        return len(self._index)

    def check_slot(self, slot: int) -> None:
        """Raise HostPoolError when ``slot`` is out of range."""
        if not 0 <= slot < self.n_slots:
            raise HostPoolError(f"slot {slot} out of range [0, {self.n_slots})")

    def _expect(self, s: int, want: PageState, op: str) -> None:
        self.check_slot(s)
        state = self._state[s]
        if state != want:
            raise PageStateError(
                f"cannot {op} slot {s}: it is {PageState(state).name}, not {want.name}"
            )
        if op == "unpin" and self._pins[s] == 0:
            raise PageStateError(f"cannot unpin slot {s}: it is READY with no pins")
