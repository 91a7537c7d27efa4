"""Prefetch: L3 → L2 fills into WRITING slots, with bounded concurrency.

A PREFETCH allocates host slots for the run of a chain that L3 holds (WRITING: invisible
to lookups, never evicted) and reads the pages into them in batches (:func:`read_batch`
pages: 16 to 64), at most ``prefetch_concurrency`` batches in flight daemon-wide.
Slots are allocated batch by batch and each batch's read starts as soon as its slots
exist, so the first reads overlap the allocation of the rest. Pages become READY in chain
order, as soon as every page before them has verified::

    fill   k3  k4  k5  k6  k7  k8  k9  k10        (WRITING slots, one chain)
    fate   C   C   C   V   R   R   P   P          C committed (READY)  V verified
                       ▲ waits for k7             R reading  P pending  X aborted

A read that does not verify (missing, corrupt, backend down) is a miss: that page and
every page after it are aborted (freed), since a page is useless without its prefix;
the verified leading run stays committed. A cancelled fill (its CLAIM ended it, or its
session closed) commits the verified leading run it has and aborts the rest.

A slot is never freed while a backend read may still write into it: pages being read
are aborted only when their read returns (a backend's worker thread finishes its batch
even when the caller gives up). So "abort" waits, but never blocks the event loop.

Accounting (:class:`~kvtier.daemon.counters.Counters`): every started page ends exactly once,
as completed, cancelled or failed. Pages read but never loaded (evicted or flushed first,
or read and then discarded by a cancellation) also count as unused.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.daemon.counters import Counters
from kvtier.daemon.pauses import WATCH
from kvtier.daemon.pool.host_pool import HostPool

log = logging.getLogger("kvtier.daemon.tier.prefetch")

MIN_READ_BATCH = 16
"""Fewest pages per backend ``get_into`` call (pages become READY a batch at a time)."""

MAX_READ_BATCH = 64
"""Most pages per backend ``get_into`` call (fewer, larger calls cost less per page)."""


class ReadLimit:
    """At most :attr:`limit` holders at once, first come first served; the limit may change
    while reads hold it (a lower one admits nobody until enough of them end, a higher one
    admits waiters at once), so a reload never lets the old and the new limit's reads run
    side by side.

    Args:
        limit: holders at once (at least 1).
    """

    __slots__ = ("_waiters", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def resize(self, limit: int) -> None:
        """Hold at most ``limit`` from now on."""
        self.limit = limit
        self._admit()

    async def __aenter__(self) -> None:
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # admitted as the cancellation came: pass the turn on
            else:  # still waiting (a turn cancelled and then popped is gone already)
                with contextlib.suppress(ValueError):
                    self._waiters.remove(turn)
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        self.held -= 1
        self._admit()

    def _admit(self) -> None:
        waiters = self._waiters
        while waiters and self.held < self.limit:
            turn = waiters.popleft()
            if not turn.done():
                self.held += 1
                turn.set_result(None)


def read_batch(pages: int, concurrency: int) -> int:
    """Pages per backend read of a fill of ``pages`` pages.

    Large enough that per-call costs do not dominate, small enough that the fill makes
    about two batches per read slot (so ``concurrency`` reads overlap), within
    [:data:`MIN_READ_BATCH`, :data:`MAX_READ_BATCH`].
    """
    return max(MIN_READ_BATCH, min(MAX_READ_BATCH, -(-pages // (2 * max(1, concurrency)))))


MAX_TRACKED = 1 << 18
"""Prefetched pages remembered until their first load (to count the unused ones)."""

NO_CUT = 1 << 62
"""``Fill.cut`` while no page has been given up."""

ReadFn = Callable[[bytes, list[bytes], list[int], int], Awaitable[list[bool]]]


class Fate(enum.IntEnum):
    """Where one page of a fill stands."""

    PENDING = 0  # allocated, not read yet
    READING = 1  # a backend read into its slot is in flight
    VERIFIED = 2  # read and verified, waiting for the pages before it
    BAD = 3  # the read did not verify
    COMMITTED = 4  # READY in L2
    ABORTED = 5  # slot freed


_OPEN = (Fate.PENDING, Fate.VERIFIED, Fate.BAD)  # abortable now (not READING, not ended)


@dataclass(eq=False, slots=True)
class Fill:
    """The L3 → L2 reads of one chain run of one namespace.

    Attributes:
        ns / ns_id: namespace fingerprint (names objects in L3) and pool namespace id.
        page_bytes: bytes per page.
        keys / slots / offsets: the pages, their WRITING slots and arena offsets, in
            chain order.
        parents: each page's parent key (the page before it in the chain, which is not
            the fill's previous page where the fill skipped a page already in L2).
        fate: per page, a :class:`Fate`.
        committed: leading pages committed so far.
        cut: pages at and after ``cut`` are given up (a failed read, a cancellation);
            :data:`NO_CUT` while none is.
        cancelled: ended by a claim or its session rather than by a failed read.
        allocating: more pages may still be added (the fill is not done before).
        parent_key: the key the chain run extends (None: a chain start).
        users: prefetches that wait for it (the one that started it, and those that found
            some of their pages in it): it is cut only when none of them wants it any more.
        done: resolved once allocation is over and every page is committed or aborted.
        at: each key's index in ``keys``.
        progress: resolved (and replaced) each time pages end or allocation stops: what a
            claim waiting for some of its pages only waits on.
    """

    ns: bytes
    ns_id: int
    page_bytes: int
    keys: list[bytes]
    slots: list[int]
    offsets: list[int]
    fate: list[Fate]
    done: asyncio.Future[None]
    committed: int = 0
    cut: int = 0
    cancelled: bool = False
    allocating: bool = False
    ended: int = 0
    parent_key: bytes | None = None  # the key before keys[0] in its chain
    users: int = 1
    parents: list[bytes | None] = field(default_factory=list)
    at: dict[bytes, int] = field(default_factory=dict)
    progress: asyncio.Future[None] | None = None

    @property
    def pages(self) -> int:
        """Pages in the fill."""
        return len(self.keys)

    def giving_up(self, key: bytes) -> bool:
        """Whether ``key``'s page is past the cut: given up, its slot aborted once its read
        (if one is in flight) has returned, never committed."""
        i = self.at.get(key)
        return i is not None and i >= self.cut


@dataclass(eq=False, slots=True)
class PrefetchJob:
    """One PREFETCH of one session, until its CLAIM.

    Attributes:
        ns_id: the session's namespace.
        fill: the fill this prefetch started (None when L3 had too little, or when every
            page was already being filled by another prefetch).
        deps: fills of other prefetches that hold pages of this chain.
        pages: pages the claim may wait for (own and dependencies').
        started: loop time of the PREFETCH (the ``timeout`` policy counts from it).
        paused: :data:`~kvtier.daemon.pauses.WATCH`'s total then (the pauses since are
            not counted against its budget).
        released: its claim, its session's end or a newer prefetch of the same name let
            its fills go (:meth:`Prefetcher.release`).
    """

    ns_id: int
    fill: Fill | None
    deps: list[Fill] = field(default_factory=list)
    pages: int = 0
    started: float = 0.0
    paused: float = 0.0
    released: bool = False

    @property
    def fills(self) -> list[Fill]:
        """Every fill the claim waits for."""
        return self.deps + ([self.fill] if self.fill is not None else [])


class Prefetcher:
    """Runs fills and remembers prefetched pages until they are loaded.

    Args:
        pool: the host pool (slots are allocated, committed and aborted here).
        counters: the daemon's counters.
        read: reads pages from L3 into arena offsets, one flag per page; never raises for
            a miss or a backend fault.
        concurrency: backend reads in flight at once, across every fill.
    """

    def __init__(self, pool: HostPool, counters: Counters, read: ReadFn, concurrency: int) -> None:
        self.pool = pool
        self.counters = counters
        self._read_fn = read
        self._limit = ReadLimit(concurrency)
        self._filling: dict[tuple[int, bytes], Fill] = {}  # (ns_id, key) -> its fill
        self._fills: set[Fill] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._fetched: OrderedDict[tuple[int, bytes], None] = OrderedDict()  # not loaded yet
        self.on_allocated: Callable[[int, int], None] | None = None
        """Told ``(pages asked, pages allocated)`` after each batch's allocation, so that
        what it evicted is announced before anything else is committed."""
        self.on_committed: Callable[[int, list[bytes], bytes | None], None] | None = None
        """Told ``(ns_id, keys, parent key)`` of each chain run of pages a fill committed
        to L2."""

    @property
    def active(self) -> int:
        """Fills not finished yet."""
        return len(self._fills)

    def set_concurrency(self, n: int) -> None:
        """Change the read concurrency: reads in flight count against the new one."""
        self._limit.resize(n)

    def dependencies(
        self, ns_id: int, keys: Sequence[bytes], known: Sequence[Fill] = ()
    ) -> list[Fill]:
        """Return the running fills that hold any of ``keys`` of ``ns_id``, each once and
        none of ``known`` (those the caller found before). The caller waits for them: it
        counts as one more user of each (:meth:`release`)."""
        if not self._filling:
            return []
        get = self._filling.get
        found = {id(f): f for k in keys if (f := get((ns_id, k))) is not None}
        for f in known:
            found.pop(id(f), None)
        for f in found.values():
            f.users += 1
        return list(found.values())

    def release(self, job: PrefetchJob) -> None:
        """``job`` no longer waits for its fills (claimed, its session closed, replaced):
        each fill no other prefetch waits for is cancelled (:meth:`cancel`). Idempotent."""
        if job.released:
            return
        job.released = True
        self.drop(job.fills)

    def drop(self, fills: Sequence[Fill]) -> None:
        """One user of each of ``fills`` no longer waits for it (one that :meth:`dependencies`
        counted); a fill nobody waits for is cancelled."""
        for f in fills:
            f.users -= 1
            if f.users <= 0:
                self.cancel(f)

    def new_fill(self, ns: bytes, ns_id: int, page_bytes: int) -> Fill:
        """An empty fill for :meth:`fill` to allocate into (tracked from now on)."""
        fill = Fill(
            ns=ns,
            ns_id=ns_id,
            page_bytes=page_bytes,
            keys=[],
            slots=[],
            offsets=[],
            fate=[],
            done=asyncio.get_running_loop().create_future(),
            cut=NO_CUT,
            allocating=True,
        )
        self._fills.add(fill)
        return fill

    async def fill(
        self, fill: Fill, owner: int, class_id: int, keys: Sequence[bytes], parent_key: bytes | None
    ) -> int:
        """Allocate WRITING slots for the keys L2 lacks, batch by batch, reading each batch
        as soon as its slots exist.

        Stops early at a shortfall (the pool is full), at a key another namespace holds,
        or when the fill is cancelled meanwhile.

        Args:
            fill: from :meth:`new_fill`.
            owner / class_id: tenant charged and page class.
            keys: the chain run to fetch (L3 holds it).
            parent_key: the key before ``keys[0]``, if any.

        Returns:
            Pages allocated (and being read).
        """
        loop = asyncio.get_running_loop()
        parent = fill.parent_key = parent_key
        size = read_batch(len(keys), self._limit.limit)
        try:
            for a in range(0, len(keys), size):
                if fill.cut != NO_CUT:
                    break
                batch = keys[a : a + size]
                pairs = self.pool.allocate(fill.ns_id, owner, class_id, batch, parent)
                if self.on_allocated is not None:
                    self.on_allocated(len(batch), len(pairs))
                first = fill.pages
                for i, slot in pairs:
                    fill.at[batch[i]] = len(fill.keys)
                    fill.parents.append(batch[i - 1] if i else parent)
                    fill.keys.append(batch[i])
                    fill.slots.append(slot)
                    fill.offsets.append(self.pool.slot_offset(slot))
                    fill.fate.append(Fate.PENDING)
                    self._filling[(fill.ns_id, batch[i])] = fill
                self.counters.l3_prefetch_started_pages += len(pairs)
                if pairs:
                    task = loop.create_task(self._read(fill, first, fill.pages))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                if not self.pool.resident_run(fill.ns_id, batch[-1:]):
                    break  # the allocation fell short: the rest would have no prefix
                parent = batch[-1]
                await asyncio.sleep(0)  # let the batch's read start before the next allocation
        finally:
            fill.allocating = False
            self._settle(fill)
        return fill.pages

    def cancel(self, fill: Fill | None) -> None:
        """Keep the verified leading run of ``fill``; give up the rest (idempotent), whoever
        waits for it (at shutdown; otherwise :meth:`release`)."""
        if fill is None or fill.done.done():
            return
        fill.cancelled = True
        self._settle(fill)  # commit what verified, so the cut keeps it
        fill.cut = min(fill.cut, fill.committed)
        self._settle(fill)

    def cancel_namespaces(self, namespaces: set[bytes] | None) -> None:
        """Cancel every fill of ``namespaces`` (None: of every namespace), whoever waits for
        it: their L3 objects are about to be deleted (a FLUSH), and a read that lands after
        that must not make a page READY as held by L3."""
        for fill in list(self._fills):
            if namespaces is None or fill.ns in namespaces:
                self.cancel(fill)

    def fills_of(self, namespaces: set[bytes] | None) -> list[Fill]:
        """The fills not done of ``namespaces`` (None: of every namespace)."""
        return [f for f in self._fills if namespaces is None or f.ns in namespaces]

    async def wait(self, fills: Sequence[Fill], timeout: float) -> None:
        """Wait until every fill is done or ``timeout`` seconds have passed."""
        pending = [f.done for f in fills if not f.done.done()]
        if pending and timeout > 0:
            await asyncio.wait(pending, timeout=timeout)

    async def wait_keys(self, keys: Sequence[bytes], fills: Sequence[Fill], timeout: float) -> None:
        """Wait until every page of ``keys`` that ``fills`` hold has ended (committed or
        given up) and none of them is still allocating, or ``timeout`` seconds have passed.
        A claim of a short prefix of a long fill waits for its own pages only. Time
        kvtierd did not run (:mod:`~kvtier.daemon.pauses`) does not count."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        paused = WATCH.catch_up()
        ended = (Fate.COMMITTED, Fate.ABORTED)
        while True:
            waits = []
            for f in fills:
                if f.done.done():
                    continue
                at, fate = f.at, f.fate
                cut = f.cut
                if f.allocating or any(
                    (i := at.get(k)) is not None and i < cut and fate[i] not in ended for k in keys
                ):
                    waits.append(f)
            left = deadline + WATCH.catch_up() - paused - loop.time()
            if not waits or left <= 0:
                return
            await asyncio.wait([self._progress(f) for f in waits], timeout=left)

    @staticmethod
    def _progress(fill: Fill) -> asyncio.Future[None]:
        if fill.progress is None or fill.progress.done():
            fill.progress = asyncio.get_running_loop().create_future()
        return fill.progress

    def giving_up(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int | None, list[Fill]]:
        """The index of the first of ``keys`` whose page a fill has given up (past its cut,
        its slot still WRITING until its read returns; None: none), and the fills giving
        up pages of ``keys``."""
        first: int | None = None
        fills: list[Fill] = []
        if not self._filling:
            return first, fills
        get = self._filling.get
        for i, k in enumerate(keys):
            f = get((ns_id, k))
            if f is not None and f.giving_up(k):
                if first is None:
                    first = i
                if f not in fills:
                    fills.append(f)
        return first, fills

    async def close(self, timeout: float) -> None:
        """Give every fill up and wait (at most ``timeout``) for the reads in flight."""
        for fill in list(self._fills):
            self.cancel(fill)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            if pending:
                log.warning("%d L3 reads still running at shutdown; abandoning them", len(pending))

    # ------------------------------------------------------------------ loads and evictions
    def loaded(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """Pages of ``keys`` (namespace ``ns_id``) were loaded by an engine: they were used."""
        if self._fetched:
            pop = self._fetched.pop
            for k in keys:
                pop((ns_id, k), 0)

    def evicted(self, pages: Iterable[tuple[int, bytes]]) -> None:
        """Pages ``(ns_id, key)`` left L2: those prefetched and never loaded count as unused."""
        if self._fetched:
            pop, missing = self._fetched.pop, object()
            self.counters.l3_prefetch_unused_pages += sum(
                pop(p, missing) is not missing for p in pages
            )

    def sweep(self) -> None:
        """Count prefetched pages no longer in L2 (after a flush) as unused."""
        self.evicted(
            [(ns_id, k) for ns_id, k in self._fetched if not self.pool.resident_run(ns_id, [k])]
        )

    # ------------------------------------------------------------------ fills
    async def _read(self, fill: Fill, a: int, b: int) -> None:
        async with self._limit:
            b = min(b, fill.cut)
            if a < b:
                for i in range(a, b):
                    fill.fate[i] = Fate.READING
                # Cancelled (only at shutdown): the pages stay READING, so nothing frees a
                # slot a backend thread may still be writing into.
                flags = await self._read_fn(
                    fill.ns, fill.keys[a:b], fill.offsets[a:b], fill.page_bytes
                )
                for i, ok in enumerate(flags, a):
                    fill.fate[i] = Fate.VERIFIED if ok else Fate.BAD
                    if not ok:
                        fill.cut = min(fill.cut, i)
        self._settle(fill)

    def _settle(self, fill: Fill) -> None:
        """Commit the verified leading run; abort what lies past the cut and is not being
        read; resolve ``done`` when every page has ended."""
        fate, c = fill.fate, fill.committed
        cut = min(fill.cut, fill.pages)
        j = c
        while j < cut and fate[j] is Fate.VERIFIED:
            j += 1
        if j > c:
            slots = fill.slots[c:j]
            self.pool.commit(slots)
            self.pool.mark_in_l3(slots)
            if self.on_committed is not None:  # one call per chain run (a skipped page splits)
                keys, parents, a = fill.keys, fill.parents, c
                for k in range(c + 1, j + 1):
                    if k == j or parents[k] != keys[k - 1]:
                        self.on_committed(fill.ns_id, keys[a:k], parents[a])
                        a = k
            for i in range(c, j):
                fate[i] = Fate.COMMITTED
                self._release_key(fill, i)
                self._remember((fill.ns_id, fill.keys[i]))
            fill.committed = j
            fill.ended += j - c
            self.counters.l3_prefetch_completed_pages += j - c
            self.counters.bytes_from_l3 += (j - c) * fill.page_bytes
        if cut < fill.pages:
            gone = [i for i in range(cut, fill.pages) if fate[i] in _OPEN]
            if gone:
                self.pool.abort([fill.slots[i] for i in gone])
                counters = self.counters
                for i in gone:
                    if fate[i] is Fate.VERIFIED:
                        counters.l3_prefetch_unused_pages += 1  # read, then discarded
                    if fill.cancelled and fate[i] is not Fate.BAD:
                        counters.l3_prefetch_cancelled_pages += 1
                    else:
                        counters.l3_prefetch_failed_pages += 1
                    fate[i] = Fate.ABORTED
                    self._release_key(fill, i)
                fill.ended += len(gone)
        if fill.progress is not None and not fill.progress.done():
            fill.progress.set_result(None)  # a claim waiting on some pages looks again
        if fill.ended == fill.pages and not fill.allocating and not fill.done.done():
            fill.done.set_result(None)
            self._fills.discard(fill)

    def _release_key(self, fill: Fill, i: int) -> None:
        if self._filling.get((fill.ns_id, fill.keys[i])) is fill:
            del self._filling[(fill.ns_id, fill.keys[i])]

    def _remember(self, page: tuple[int, bytes]) -> None:
        self._fetched[page] = None
        if len(self._fetched) > MAX_TRACKED:
            self._fetched.popitem(last=False)
