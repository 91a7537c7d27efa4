"""Writing L2 pages to L3: the write-through queue and the write-back reserve.

Two policies, as SGLang HiCache has them (``hicache_write_policy``):

- ``write_through``: a page is queued as soon as its STORE commits. A batch pins its
  pages (so no slot is reused under the write), skips those L3 already holds, writes the
  rest and marks them in L3.
- ``write_back``: a page goes to L3 only when L2 needs its slot. The pool is told
  (:attr:`HostPool.evict_requires_l3`) to evict only pages marked in L3, and this writer
  keeps a reserve of such pages at the cold end of the eviction order: when the pool is
  nearly full (or an allocation fell short), the coldest :data:`WRITE_BACK_WINDOW`
  evictable pages that are not in L3 are written. Those pages are not pinned (a pin would
  make them the hottest); they cannot be evicted meanwhile, as they are not in L3 yet,
  and a FLUSH pins them for its duration (:meth:`L3Writer.flush_guard`).

Backpressure: at most ``write_back_queue`` pages wait, and L2 never waits for L3; a STORE's
page that does not fit (nor in the write-through backlog) is dropped and counted; one a
write-back scan finds no room for is offered again by a later scan. A failed write is retried :data:`MAX_RETRIES`
times with exponential backoff, then counted as failed and given up; under write-back a
given-up page is marked as if in L3, so L2 can still evict it (the cache loses that page's
L3 copy, never its L2 slot). A batch that raises (a bug, never a backend fault: the
backend calls do not raise for those) fails every page it had not settled, by the same rule.

The writer depends on two narrow interfaces, not on the tier that owns it: an
:class:`L3Store` (the guarded backend) and :class:`PageNames` (namespace fingerprints and
page sizes of pool ids).

At shutdown :meth:`L3Writer.drain` writes what is queued (write-through) or every page not
yet in L3 (write-back), within a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.daemon.pool.host_pool import HostPool, PageState

log = logging.getLogger("kvtier.daemon.tier.writer")

WRITE_BATCH = 64
"""Pages per backend ``put_from`` call."""

WRITE_CONCURRENCY = 4
"""Write batches in flight at once. With one, the file backend reaches only about half of raw
write speed through the daemon (a core waits while a batch is settled on the event loop);
more batches than cores keep every core writing."""

CANCEL_WAIT_S = 1.0
"""At a stop, how long the write batches abandoned at its deadline get to end once
cancelled (each only unwinds: its pages are unpinned)."""

MAX_RETRIES = 3
"""Attempts after the first before a page is given up."""
RETRY_BACKOFF_S = 0.05
"""First retry delay; doubled at every further attempt."""

WRITE_BACK_HIGH = 0.9
"""Write-back starts once the pool's used bytes pass this share of its capacity."""
WRITE_BACK_WINDOW = 512
"""Coldest evictable pages kept in L3 under write-back (eviction scans at least 256); one
scan walks at most 4 x as many chain tails (those in L3 already are passed over)."""

MAX_SHORT_OWNERS = 1024
"""Owners whose shortfall one write-back scan serves at most (more wait for the next)."""
WRITE_BACK_PERIOD_S = 0.25
"""How often write-back looks at the pool while it is nearly full."""


class L3Store(Protocol):
    """The L3 backend as the writer uses it (:class:`~kvtier.daemon.tier.guard.L3Backend`
    is one): calls that answer a fault with a miss instead of raising."""

    @property
    def available(self) -> bool:
        """Whether a backend is open (it may still be unhealthy)."""
        ...

    @property
    def healthy(self) -> bool:
        """Whether calls go to the backend (False while it is down)."""
        ...

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` in L3 (0 when down)."""
        ...

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool | None]:
        """Write pages from arena offsets; one flag per page: True written, False not (all
        False on a fault), None written and dropped by the store already."""
        ...


class PageNames(Protocol):
    """How a pool page is named in L3 (:class:`~kvtier.daemon.tier.tier.TierStore` is one)."""

    def namespace_of(self, ns_id: int) -> bytes | None:
        """The fingerprint of pool namespace ``ns_id`` (None if nobody named it)."""
        ...

    def page_bytes_of(self, class_id: int) -> int:
        """Page bytes of pool page class ``class_id``."""
        ...

    def before_l3_write(self, ns: bytes) -> bool:
        """Called before each batch of namespace ``ns`` is written (what must be on disk
        first is saved); False: ``ns`` must not be written to L3 yet."""
        ...


@dataclass(eq=False, slots=True)
class _SyncWait:
    """One SYNC in progress: the pages it waits for, and how they ended."""

    pending: set[tuple[int, bytes]]
    done: asyncio.Event
    written: int = 0
    failed: int = 0


@dataclass(eq=False, slots=True)
class _Item:
    ns: bytes
    ns_id: int
    key: bytes
    page_bytes: int
    pinned: bool  # write-through pins while writing; write-back relies on evict_requires_l3
    slot: int = -1  # write-back: the slot it was found in
    attempts: int = 0
    due: float = 0.0
    backup: bool = False  # a back-up of L2 as it stands (catch-up, SYNC): old pages mostly


class L3Writer:
    """The queue of pages bound for L3 and the tasks that write them.

    Args:
        cfg: the daemon's configuration (the write policy, ``write_back_queue``); the
            owner swaps :attr:`cfg` on a reload.
        l3: the backend pages are written to.
        names: namespace fingerprints and page sizes of pool ids (for write-back, which
            finds its pages in the pool).
        pool: the host pool.
        counters: the daemon's counters.

    Attributes:
        write_back_checks: times write-back looked at the pool's fill (or was urged to by
            a shortfall); tests and STATS use it to know a look has happened.
    """

    def __init__(
        self, cfg: DaemonConfig, l3: L3Store, names: PageNames, pool: HostPool, counters: Counters
    ) -> None:
        self.cfg = cfg
        self.l3 = l3
        self.names = names
        self.pool = pool
        self.counters = counters
        self._queue: deque[_Item] = deque()
        self._retry: list[_Item] = []
        # (ns_id, key) -> its item: queued, retrying or being written
        self._queued: dict[tuple[int, bytes], _Item] = {}
        self._writing: dict[tuple[int, bytes], _Item] = {}  # write-back pages being written
        self._tasks: dict[asyncio.Task[None], int] = {}  # batch being written -> its pages
        self._wake = asyncio.Event()
        self._urgent = False
        self._short_pool = False  # an allocation fell short of the pool's room
        self._short_owners: set[int] = set()  # owners at their quota that fell short
        self._last_scan = 0.0
        self._backlog: array[int] = array("q")  # slots a back-up of L2 queues (catch_up)
        self._backlog_at = 0
        self._syncs: list[_SyncWait] = []
        self._paused = 0  # FLUSHes under way: no write batch starts meanwhile
        self._draining = False  # shutting down: batches start even while paused
        # pages given up while L3 was down, oldest first: queued again once it is back
        self._given_up: OrderedDict[tuple[int, bytes], _Item] = OrderedDict()
        self.write_back_checks = 0
        self.on_written: Callable[[list[tuple[int, bytes]]], None] | None = None
        """Told ``(ns_id, key)`` of the pages now in L3 (written, or found there)."""

    @property
    def queued(self) -> int:
        """Pages waiting, retrying or being written."""
        return len(self._queued)

    @property
    def writing_unpinned(self) -> bool:
        """Whether write-back pages are being written (they rely on ``evict_requires_l3``)."""
        return bool(self._writing)

    @property
    def write_back(self) -> bool:
        """Whether the write-back policy is in force."""
        return self.cfg.hicache_write_policy == "write_back"

    def apply_policy(self) -> None:
        """Make the pool evict only pages in L3 while write-back is in force (and while
        pages written back unpinned are still in flight)."""
        wb = self.write_back and self.l3.available
        self.pool.evict_requires_l3 = wb or self.writing_unpinned

    # ------------------------------------------------------------------ producers
    def committed(
        self,
        ns: bytes,
        ns_id: int,
        keys: Sequence[bytes],
        page_bytes: int,
        slots: Sequence[int] | None = None,
    ) -> None:
        """A STORE committed these pages (into ``slots``): under write-through, queue them
        for L3; those past the queue's room (``write_back_queue``) wait in the back-up
        backlog (:meth:`catch_up`), queued once the queue has emptied."""
        if self.write_back or not self.l3.available:
            return
        self._enqueue(
            ns, ns_id, keys, page_bytes, pinned=True, slots=None if slots is None else list(slots)
        )

    def poke(self) -> None:
        """Look at the queue and the policy again now (after a reload)."""
        self._wake.set()

    def shortfall(self, owner: int | None = None) -> None:
        """An allocation fell short: under write-back, make evictable pages now, of
        ``owner`` (a tenant at its quota, which evicts only its own) or of the whole pool."""
        if self.write_back:
            self._urgent = True
            if owner is None:
                self._short_pool = True
            elif len(self._short_owners) < MAX_SHORT_OWNERS:
                self._short_owners.add(owner)
            self._wake.set()

    def _enqueue(
        self,
        ns: bytes,
        ns_id: int,
        keys: Sequence[bytes],
        page_bytes: int,
        pinned: bool,
        bound: bool = True,
        slots: list[int] | None = None,
        count_dropped: bool = True,
        backup: bool = False,
    ) -> int:
        """Queue the pages of ``keys`` not queued yet, within the queue's room (``bound``);
        how many were queued. Those past the room are counted as dropped only when
        ``count_dropped`` (a STORE's: a scan that picked them offers them again later).
        ``backup``: a back-up of L2 as it stands (see :meth:`_write_batch`)."""
        queued, queue = self._queued, self._queue
        room = (self.cfg.write_back_queue if bound else 1 << 62) - len(queued)
        added = dropped = 0
        later = pinned and slots is not None and not self.write_back  # write-through
        for j, key in enumerate(keys):
            ident = (ns_id, key)
            if ident in queued:
                continue
            if added >= room:
                # a STORE larger than the queue: the rest once it has emptied (at most a
                # pool's worth waiting: an L3 slower than the stores for good drops the rest)
                if later and len(self._backlog) - self._backlog_at < self.pool.n_slots:
                    assert slots is not None
                    self._backlog.append(slots[j])
                else:
                    dropped += 1
                continue
            it = _Item(ns, ns_id, key, page_bytes, pinned, slots[j] if slots is not None else -1)
            it.backup = backup
            queued[ident] = it
            queue.append(it)
            added += 1
        self.counters.l3_write_queued_pages += added
        if count_dropped:
            self.counters.l3_write_dropped_pages += dropped
        if added:
            self._wake.set()
        return added

    def catch_up(self) -> None:
        """Back L2 up as it stands, under write-through: the pages not in L3 (adopted after
        a restart, which keeps no L3 mark; stored while L3 was away; stored under
        write-back before a switch), found in one walk of the pool (as a SYNC's), each
        chain head first, are queued ``write_back_queue`` pages at a time, a window each
        time the queue has emptied (:meth:`_catch_up_pass`)."""
        if self.write_back:
            return
        self._backlog, self._backlog_at = self._cold_order(), 0
        self._wake.set()

    def _cold_order(self) -> array[int]:
        """The slots of every L2 page not in L3 nor queued, chains head first (a shared
        prefix once, before the pages after it)."""
        out: array[int] = array("q")
        seen: set[int] = set()
        link, queued = self.pool.chain_link, self._queued
        for leaf in self._every_chain():
            chain: list[int] = []
            slot = leaf
            while slot >= 0 and slot not in seen:
                seen.add(slot)
                key, ns_id, parent, in_l3, _ = link(slot)
                if in_l3 or key is None or (ns_id, key) in queued:
                    break
                chain.append(slot)
                slot = parent
            out.extend(reversed(chain))
        return out

    def _catch_up_pass(self) -> None:
        """Queue the next window of :meth:`catch_up`'s pages that are still in L2 and not
        in L3 (a slot evicted since holds another page, or none: skipped if in L3)."""
        window = max(1, self.cfg.write_back_queue)
        part = self._backlog[self._backlog_at : self._backlog_at + window]
        self._backlog_at += len(part)
        if self._backlog_at >= len(self._backlog):
            self._backlog, self._backlog_at = array("q"), 0
        link, queued = self.pool.chain_link, self._queued
        picked: dict[tuple[bytes, int, int], list[tuple[bytes, int]]] = {}
        for slot in part:
            key, ns_id, _, in_l3, class_id = link(slot)
            if in_l3 or key is None or (ns_id, key) in queued:
                continue
            ns = self.names.namespace_of(ns_id)
            if ns is None:  # a page no session has named here: it cannot be written
                self.pool.mark_in_l3([slot])
                continue
            group = picked.setdefault((ns, ns_id, self.names.page_bytes_of(class_id)), [])
            group.append((key, slot))
        self._enqueue_picked(picked, pinned=True, bound=False)

    def retry_given_up(self) -> int:
        """Queue again the pages given up while L3 was down that L2 still holds (L3 is back,
        or a SYNC asks for every page): a write-back page loses the in-L3 mark that let it
        be evicted meanwhile, so it is written before it is evicted. How many were queued."""
        items, self._given_up = list(self._given_up.values()), OrderedDict()
        picked: dict[tuple[bytes, int, int, bool], list[_Item]] = {}
        for it in items:
            if (it.ns_id, it.key) in self._queued:
                continue
            if it.pinned:
                if not self.pool.resident_run(it.ns_id, [it.key]):
                    continue  # gone from L2
            elif self._holds(it):
                self.pool.clear_in_l3(it.ns_id, [it.key])
            else:
                continue
            picked.setdefault((it.ns, it.ns_id, it.page_bytes, it.pinned), []).append(it)
        return sum(
            self._enqueue(
                ns,
                ns_id,
                [it.key for it in group],
                page_bytes,
                pinned=pinned,
                bound=False,
                slots=None if pinned else [it.slot for it in group],
                count_dropped=False,
            )
            for (ns, ns_id, page_bytes, pinned), group in picked.items()
        )

    def forget_namespace(self, ns_id: int) -> None:
        """Namespace id ``ns_id`` changes hands (its pages were dropped): its pages queued,
        retrying or given up are not written (their id would name the new namespace)."""
        mine = [ident for ident in self._queued if ident[0] == ns_id]
        for ident in mine:
            del self._queued[ident]
        if mine:
            self._queue = deque(it for it in self._queue if it.ns_id != ns_id)
            self._retry = [it for it in self._retry if it.ns_id != ns_id]
        for ident in [i for i in self._given_up if i[0] == ns_id]:
            del self._given_up[ident]

    def unsaved(self) -> int:
        """The L2 pages not in L3 yet: those queued, those never queued, and those given
        up while L3 was down (a write-back page is marked in L3 meanwhile, so that it can
        be evicted): what a SYNC answered while L3 is not open leaves behind. Walks the
        pool."""
        given_up = sum(1 for it in self._given_up.values() if not it.pinned and self._holds(it))
        return len(self._queued) + len(self._cold_order()) + given_up

    def back_up_all(self) -> int:
        """Queue every L2 page not in L3 yet, pinned while written (the policy changed
        from write-back to write-through: L2 is backed up as it stands). Walks the whole
        pool on the event loop: for a policy switch, not for a hot path."""
        return self._select_cold(None, pinned=True)

    def _every_chain(self) -> Iterator[int]:
        """Slots to walk up from to reach every READY page: the evictable ones (chain
        tails, coldest first), then every READY page (a chain whose tail is pinned, being
        loaded, or has a child being written or prefetched is reached through them)."""
        yield from self.pool.evictable_slots()
        yield from self.pool.ready_slots()

    def _select_cold(
        self, window: int | None, pinned: bool = False, owner: int | None = None
    ) -> int:
        """Queue pages not in L3, coldest chains first: from each evictable page (a chain's
        tail; ``owner``'s only, when given) up through its ancestors until one is in L3. At
        most ``window`` pages, or all (then every READY page not in L3 is reached:
        :meth:`_every_chain`).

        Write-back queues them tail first, the order eviction takes them in; a back-up
        (``pinned``) queues each chain head first.
        """
        self._last_scan = time.monotonic()
        budget = self.pool.n_slots if window is None else window
        picked: dict[tuple[bytes, int, int], list[tuple[bytes, int]]] = {}
        seen: set[int] = set()
        link, queued = self.pool.chain_link, self._queued
        groups: dict[tuple[int, int], list[tuple[bytes, int]] | None] = {}  # by (ns_id, class)
        cold = self.pool.iter_evictable(owner)  # a generator: walked only with a window
        leaves = self._every_chain() if window is None else islice(cold, 4 * window)
        for leaf in leaves:
            if budget <= 0:
                break
            chain: list[tuple[int, bytes, int, int]] = []  # (slot, key, ns_id, class_id)
            slot = leaf
            while slot >= 0 and slot not in seen and len(chain) < budget:
                seen.add(slot)
                key, ns_id, parent, in_l3, class_id = link(slot)
                if in_l3 or key is None or (ns_id, key) in queued:
                    break
                chain.append((slot, key, ns_id, class_id))
                slot = parent
            budget -= len(chain)
            for slot, key, ns_id, class_id in reversed(chain) if pinned else chain:
                if (ns_id, class_id) not in groups:
                    ns = self.names.namespace_of(ns_id)
                    groups[(ns_id, class_id)] = (
                        None
                        if ns is None
                        else picked.setdefault((ns, ns_id, self.names.page_bytes_of(class_id)), [])
                    )
                group = groups[(ns_id, class_id)]
                if group is None:  # a page no session has named here: it cannot be written
                    self.pool.mark_in_l3([slot])
                    continue
                group.append((key, slot))
        return self._enqueue_picked(picked, pinned=pinned, bound=window is not None)

    def _enqueue_picked(
        self,
        picked: dict[tuple[bytes, int, int], list[tuple[bytes, int]]],
        pinned: bool,
        bound: bool,
    ) -> int:
        """Queue ``picked`` pages, ``(namespace, ns_id, page bytes) -> [(key, slot)]``;
        how many were queued."""
        return sum(
            self._enqueue(
                ns,
                ns_id,
                [k for k, _ in pages],
                pb,
                pinned=pinned,
                bound=bound,
                slots=[s for _, s in pages],
                count_dropped=False,
                backup=pinned,
            )
            for (ns, ns_id, pb), pages in picked.items()
        )

    def _pressure(self) -> bool:
        st = self.pool.stats()
        return st.used_bytes >= WRITE_BACK_HIGH * st.capacity_bytes

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Write queued pages until cancelled (owned by the daemon's task group)."""
        while True:
            timeout = self._next_wakeup()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            self._step()

    def _step(self) -> None:
        now = time.monotonic()
        if self._retry:
            due = [it for it in self._retry if it.due <= now]
            if due:
                self._retry = [it for it in self._retry if it.due > now]
                self._queue.extendleft(reversed(due))
        if (
            self.write_back
            and self.l3.available
            and (self._urgent or now - self._last_scan >= WRITE_BACK_PERIOD_S)
        ):
            self.write_back_checks += 1
            owners, self._short_owners = self._short_owners, set()
            whole = self._short_pool or self._pressure()
            self._urgent = self._short_pool = False
            for owner in sorted(owners):  # their own pages: nobody else's make them room
                self._select_cold(WRITE_BACK_WINDOW, owner=owner)
            if whole:
                self._select_cold(WRITE_BACK_WINDOW)
        while (  # windows that queue nothing (pages written meanwhile) do not stop it
            self._backlog
            and not self.write_back
            and self.l3.available
            and not (self._queue or self._tasks or self._retry)
        ):
            self._catch_up_pass()
        while (
            self._queue
            and len(self._tasks) < WRITE_CONCURRENCY
            and (not self._paused or self._draining)
        ):
            batch = self._take_batch()
            task = asyncio.get_running_loop().create_task(self._write(batch))
            self._tasks[task] = len(batch)
            task.add_done_callback(self._batch_done)

    def _next_wakeup(self) -> float | None:
        waits = []
        if self._retry:
            waits.append(max(0.0, min(it.due for it in self._retry) - time.monotonic()))
        if self.write_back:
            waits.append(WRITE_BACK_PERIOD_S)
        return min(waits) if waits else None

    def _take_batch(self) -> list[_Item]:
        first = self._queue.popleft()
        batch = [first]
        while self._queue and len(batch) < WRITE_BATCH:
            it = self._queue[0]
            if (it.ns, it.ns_id, it.page_bytes, it.pinned, it.backup) != (
                first.ns,
                first.ns_id,
                first.page_bytes,
                first.pinned,
                first.backup,
            ):
                break
            batch.append(self._queue.popleft())
        return batch

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            # its pages were failed already (_write); this is the bug's only trace
            log.error("an L3 write batch failed", exc_info=task.exception())
        self.apply_policy()
        self._wake.set()

    # ------------------------------------------------------------------ one batch
    async def _write(self, batch: list[_Item]) -> None:
        """Write one batch; if it raises, fail every page it had not settled (each is
        retried or given up by :meth:`_failed`), then let the error end the task."""
        try:
            await self._write_batch(batch)
        except Exception:
            for it in batch:
                if self._queued.get((it.ns_id, it.key)) is it and it not in self._retry:
                    self._failed(it, it.slot)
            raise

    async def _write_batch(self, batch: list[_Item]) -> None:
        pool, c = self.pool, self.counters
        if not self.names.before_l3_write(batch[0].ns):  # as in an outage (retry_given_up)
            for it in [it for it in batch if self._queued.get((it.ns_id, it.key)) is it]:
                self._give_up(it, it.slot)
            return
        pins: list[int] = []
        try:
            asked = False
            if batch[0].pinned and batch[0].backup and self.l3.available:
                # a back-up's pages L3 holds already (after a restart, most) are marked
                # without a pin: a pin takes a page off the evictable lists, and putting it
                # back places it by a walk from the hot end, not where an old page was. A
                # STORE's pages (hot: placed right again) are pinned first, so that none is
                # evicted before it is written
                asked = True
                first = batch[0]
                present = await self.l3.exists(first.ns, [it.key for it in batch])
                if present:
                    found = pool.run_slots(first.ns_id, [it.key for it in batch[:present]])
                    pool.mark_in_l3(found)
                    c.l3_write_skipped_pages += present
                    self._settle(batch[:present], written=True)
                    batch = batch[present:]
                    if not batch:
                        return
            items, slots = self._hold(batch, pins)
            if not items:
                return
            ns, length = items[0].ns, items[0].page_bytes
            keys = [it.key for it in items]
            present = await self.l3.exists(ns, keys) if self.l3.available and not asked else 0
            if present:
                pool.mark_in_l3(slots[:present])
                c.l3_write_skipped_pages += present
                self._settle(items[:present], written=True)
            rest, rest_slots = items[present:], slots[present:]
            if not rest:
                return
            flags = await self.l3.put(
                ns, keys[present:], [pool.slot_offset(s) for s in rest_slots], length
            )
            ok = [s for s, f in zip(rest_slots, flags) if f]
            pool.mark_in_l3(ok)
            written = sum(f is not False for f in flags)
            c.l3_write_written_pages += written
            c.bytes_to_l3 += written * length
            self._settle([it for it, f in zip(rest, flags) if f], written=True)
            # written, then dropped by the store to make room for another batch: not in L3
            # (a later write-back or SYNC picks it again), and not a failure to retry
            self._settle([it for it, f in zip(rest, flags) if f is None], written=False)
            for it, slot, f in zip(rest, rest_slots, flags):
                if f is False:
                    self._failed(it, slot)
        finally:
            for it in batch:
                self._writing.pop((it.ns_id, it.key), None)
            if pins:
                pool.unpin(pins)

    def _hold(self, batch: list[_Item], pins: list[int]) -> tuple[list[_Item], list[int]]:
        """Keep the batch's slots from being reused during the write; return the pages
        still in L2 and their slots (the others are dropped). Write-through pages are
        pinned into ``pins`` (for the caller to unpin), the whole batch in one call when
        its pages are READY, as a STORE's are. Write-back pages are not in L3, so not
        evictable; a flush pins them (flush_guard)."""
        items: list[_Item] = []
        slots: list[int] = []
        gone: list[_Item] = []
        if batch[0].pinned:  # a batch shares ns_id and pinned (_take_batch)
            ns_id, keys, i = batch[0].ns_id, [it.key for it in batch], 0
            while i < len(batch):
                # the leading READY run, pinned without a touch: a write to L3 is no use
                got = self.pool.pin(ns_id, keys[i:] if i else keys, touch=False)
                pins += got
                items += batch[i : i + len(got)]
                i += len(got)
                if i < len(batch):  # not READY: gone from L2 (or never committed)
                    gone.append(batch[i])
                    i += 1
            slots = pins  # the same slots, in batch order
        else:
            for it in batch:
                if self._holds(it):
                    self._writing[(it.ns_id, it.key)] = it
                    items.append(it)
                    slots.append(it.slot)
                else:
                    gone.append(it)
            if items:
                self.pool.evict_requires_l3 = True  # until the batch is done (apply_policy)
        if gone:
            self._settle(gone, written=False)
            self.counters.l3_write_dropped_pages += len(gone)
        return items, slots

    def _holds(self, it: _Item) -> bool:
        info = self.pool.describe(it.slot)
        return info.state == PageState.READY and info.key == it.key and info.ns_id == it.ns_id

    def _failed(self, it: _Item, slot: int) -> None:
        it.attempts += 1
        if it.attempts <= MAX_RETRIES and self.l3.healthy:
            it.due = time.monotonic() + RETRY_BACKOFF_S * (2 ** (it.attempts - 1))
            self._retry.append(it)
            self.counters.l3_write_retries += 1
            return
        self._give_up(it, slot, kept=not self.l3.healthy)

    def _give_up(self, it: _Item, slot: int, kept: bool = True) -> None:
        """Stop writing ``it`` (failed); ``kept``: for :meth:`retry_given_up` (an outage)."""
        self._settle([it], written=False)
        self.counters.l3_write_failed_pages += 1
        if kept:
            given_up = self._given_up
            given_up[(it.ns_id, it.key)] = it
            given_up.move_to_end((it.ns_id, it.key))
            while len(given_up) > self.pool.n_slots:  # at most a pool's worth
                given_up.popitem(last=False)
        if not it.pinned and self._holds(it):
            self.pool.mark_in_l3([slot])  # give up the L3 copy, never the L2 slot

    def _settle(self, items: Sequence[_Item], written: bool) -> None:
        """These pages are off the queue for good: written (or found in L3), or given up."""
        queued = self._queued
        idents = [(it.ns_id, it.key) for it in items]
        if written and idents and self.on_written is not None:
            self.on_written(idents)
        for ident, it in zip(idents, items):
            if queued.get(ident) is it:
                del queued[ident]
        for wait in self._syncs:
            pending = wait.pending
            hits = len(pending)
            pending.difference_update(idents)
            hits -= len(pending)
            if written:
                wait.written += hits
            else:
                wait.failed += hits
            if hits and not pending:
                wait.done.set()

    async def sync(self, timeout: float) -> tuple[int, int, int, int]:
        """Queue every L2 page not in L3 (as :meth:`back_up_all`) and wait until those and
        the pages queued before are written or given up, or ``timeout`` seconds pass.

        Returns:
            (pages waited for, written or found in L3, given up, still pending).
        """
        self.retry_given_up()
        self.back_up_all()
        wait = _SyncWait(set(self._queued), asyncio.Event())
        pages = len(wait.pending)
        if not pages:
            return 0, 0, 0, 0
        self._syncs.append(wait)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await wait.done.wait()
        finally:
            self._syncs.remove(wait)
        return pages, wait.written, wait.failed, len(wait.pending)

    # ------------------------------------------------------------------ flush and shutdown
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Start no write batch meanwhile (a FLUSH: a write that started after its pages
        were deleted from L3 would put them back); queued pages wait, then go on."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._wake.set()

    async def settle(self, timeout: float) -> bool:
        """Wait until no write batch is in flight or ``timeout`` seconds have passed;
        whether none is."""
        if self._tasks and timeout > 0:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        return not self._tasks

    @contextlib.contextmanager
    def flush_guard(self) -> Iterator[None]:
        """Pin the unpinned pages being written back for the duration of an L2 flush."""
        held = [(it.ns_id, it.key) for it in self._writing.values()]
        pins = [s for ns_id, key in held for s in self.pool.pin(ns_id, [key], touch=False)]
        try:
            yield
        finally:
            if pins:
                self.pool.unpin(pins)

    async def drain(self, deadline: float) -> None:
        """Write what the policy asks for before a shutdown, until ``deadline`` (monotonic)."""
        if not self.l3.available:
            return
        self._draining = True  # a FLUSH under way (it never ends now) holds nothing back
        if self.write_back:
            self._select_cold(None)
        while (self._queue or self._retry or self._tasks) and time.monotonic() < deadline:
            self._step()
            waits = list(self._tasks)
            timeout = max(0.0, deadline - time.monotonic())
            if waits:
                await asyncio.wait(waits, timeout=min(timeout, 0.1))
            elif self._retry:
                await asyncio.sleep(min(timeout, self._next_wakeup() or 0.0))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - time.monotonic()))
        left = len(self._queue) + len(self._retry)
        abandoned = sum(self._tasks.values())
        if self._tasks:
            # abandoned: cancelled (each unpins its pages) while the pool is still mapped;
            # a batch in a backend's thread is waited for by the backend's close
            for task in list(self._tasks):
                task.cancel()
            await asyncio.wait(set(self._tasks), timeout=CANCEL_WAIT_S)
        if left or abandoned:
            log.warning(
                "shutdown: %d pages were not written to L3 in time, and %d more were in "
                "writes given up at the deadline (some of those may have been written)",
                left,
                abandoned,
            )
