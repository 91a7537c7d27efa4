"""The daemon's L3 tier: lookups after L2, prefetch and claim, writes to L3, rank groups.

One :class:`TierStore` per daemon sits between the request handlers and the storage
backend (:class:`~kvtier.daemon.tier.guard.L3Backend`, which never raises)::

    LOOKUP  ── L2 run (host pool) ──▶ lookup_l3(): exists on the keys after it
    PREFETCH ─ L3 run ≥ threshold ──▶ Prefetcher: WRITING slots ← get_into
    CLAIM   ── per policy ──────────▶ wait / cancel the fills; answer the L2 run now
    STORE commit ─ write_through ───▶ L3Writer queue ──▶ put_from, mark_in_l3
    L2 nearly full ─ write_back ────▶ L3Writer: coldest pages not in L3

For a rank of a tensor-parallel engine, LOOKUP and CLAIM answer the minimum over its
group's ranks (:class:`~kvtier.daemon.tier.rank_groups.RankGroups`).

Lifecycle: :meth:`TierStore.open` opens the backend over the host arena; :meth:`run`
keeps its health and runs the writer; :meth:`drain` gives prefetches up and writes what
the write policy asks for before a shutdown; :meth:`close` closes the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvtier.config import DaemonConfig
from kvtier.config.loader import state_dir
from kvtier.daemon.counters import Counters
from kvtier.daemon.pauses import WATCH
from kvtier.daemon.pool.host_pool import EvictedPage, HostPool
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.tier.guard import L3Backend
from kvtier.daemon.tier.prefetch import Fill, Prefetcher, PrefetchJob
from kvtier.daemon.tier.rank_groups import RankGroups
from kvtier.daemon.tier import tenant_namespaces
from kvtier.daemon.tier.session import TierSession
from kvtier.daemon.tier.tenant_namespaces import DEFAULT_TENANT, TenantNamespaces
from kvtier.daemon.tier.writer import L3Writer

log = logging.getLogger("kvtier.daemon.l3")

MAX_JOBS_PER_SESSION = 1024
"""Prefetches a session may leave unclaimed; the oldest is cancelled beyond it."""


class TierStore:
    """The L3 tier of one daemon (see the module docstring).

    Args:
        cfg: the daemon's configuration (:meth:`reconfigure` swaps it on reload).
        pool: the host pool.
        counters: the daemon's counters.
        rdir: the runtime directory.

    Attributes:
        l3: the guarded backend.
        prefetcher / writer / groups: fills, writes to L3, rank groups.

    Raises:
        ConfigError: the backend's extra config is invalid.
    """

    def __init__(self, cfg: DaemonConfig, pool: HostPool, counters: Counters, rdir: Path) -> None:
        self.cfg = cfg
        self.pool = pool
        self.counters = counters
        self.l3 = L3Backend(cfg, counters, rdir)
        self.l3.on_open = self._l3_opened
        self.l3.on_dropped = self._l3_dropped
        self.l3.on_replaced = self._l3_replaced
        self.l3.on_recovered = self._l3_recovered
        self._ns: dict[int, bytes] = {}
        self._models: dict[int, tuple[bytes, str]] = {}  # by namespace id: bounded
        # kept across restarts for a tenant's FLUSH of L3 (only with tenants configured)
        self._tenant_ns = TenantNamespaces(
            state_dir(cfg.state_dir) / tenant_namespaces.FILE_NAME if cfg.tenants else None
        )
        self._tenant_ns.on_saved = self._names_saved
        self._class_bytes: dict[int, int] = {}
        self.prefetcher = Prefetcher(pool, counters, self.l3.get, cfg.prefetch_concurrency)
        self.prefetcher.on_allocated = self.allocated
        self.writer = L3Writer(cfg, self.l3, self, pool, counters)
        self.groups = RankGroups(cfg.tp_group_timeout_s, on_round=self._on_round)
        # the scopes of the FLUSHes under way (None: every namespace): no fill starts there
        self._flushes: list[frozenset[bytes] | None] = []
        self.on_evicted: Callable[[list[EvictedPage]], None] | None = None
        """Told the pool's evictions after each allocation (the KV event publisher)."""
        self.on_l3_dropped: Callable[[list[tuple[bytes, bytes]]], None] | None = None
        """Told ``(namespace, key)`` of the objects the backend dropped on its own."""
        self.on_l3_replaced: Callable[[], None] | None = None
        """Told when the store may have lost everything (after the in-L3 marks were
        cleared)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def available(self) -> bool:
        """Whether a backend is open (it may still be unhealthy)."""
        return self.l3.available

    @property
    def healthy(self) -> bool:
        """Whether calls go to the backend (False while it is down)."""
        return self.l3.healthy

    async def l3_run(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` in L3 (0 when down, slow or failing)."""
        return await self.l3.exists(ns, keys)

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        """Write pages from arena offsets to L3; one flag per page (True: in L3 now)."""
        return [f is True for f in await self.l3.put(ns, keys, offsets, length)]

    def setting(self, name: str) -> float:
        """A prefetch setting: the extra config's override, else the daemon's field."""
        return self.l3.overrides.get(name, getattr(self.cfg, name))

    async def open(self, arena: HostArena) -> None:
        """Build and open the backend; a backend that cannot open now is retried later.

        Raises:
            ConfigError: the backend's name or extra config is invalid (fatal at start).
        """
        if self.cfg.tenants:  # whose each adopted namespace is, before any back-up of it
            self._tenant_ns.learn(self.pool.namespace_tenants(self.cfg.tenants))
        await self.l3.open(arena)
        self.apply_write_policy()
        if self.available:
            self.writer.catch_up()  # pages adopted with the pool are in no tier but L2

    def _l3_opened(self) -> None:
        """A backend that could not open at start opened: back up what L2 took meanwhile."""
        self.apply_write_policy()
        self.writer.catch_up()

    async def run(self) -> None:
        """Keep the backend's health and run the writer until cancelled."""
        if self.l3.name == "none":
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.writer.run(), name="kvtier-l3-writer")
            tg.create_task(self.l3.run(), name="kvtier-l3-health")

    async def drain(self, timeout: float) -> None:
        """Before a shutdown: give prefetches up, write what the policy asks for."""
        deadline = time.monotonic() + timeout
        await self.prefetcher.close(timeout)
        await self.writer.drain(deadline)

    async def close(self) -> None:
        """Close the backend and save the tenants' namespaces (idempotent)."""
        self._tenant_ns.on_saved = None  # nothing is written from now on
        self._tenant_ns.save(retry=False)
        await self.l3.close()

    def reconfigure(self, cfg: DaemonConfig) -> None:
        """Apply a reloaded configuration's live fields.

        Switching from ``write_back`` to ``write_through`` queues every L2 page not yet in
        L3 (:meth:`L3Writer.catch_up`), so that L2 is backed up as it stands.
        """
        if cfg.prefetch_concurrency != self.cfg.prefetch_concurrency:
            self.prefetcher.set_concurrency(cfg.prefetch_concurrency)
        to_through = (self.cfg.hicache_write_policy, cfg.hicache_write_policy) == (
            "write_back",
            "write_through",
        )
        self.cfg = self.l3.cfg = self.writer.cfg = cfg
        if to_through and self.available:
            log.info("write policy now write_through: the L2 pages not in L3 are queued for it")
            self.writer.catch_up()
        self.groups.timeout_s = cfg.tp_group_timeout_s
        self.apply_write_policy()
        self.writer.poke()

    def apply_write_policy(self) -> None:
        """Make the pool evict only pages in L3 while write-back is in force (and while
        pages written back unpinned are still in flight)."""
        self.writer.apply_policy()

    # ------------------------------------------------------------------ sessions
    def register(
        self,
        ns_id: int,
        fingerprint: bytes,
        tenant: str,
        class_id: int,
        page_bytes: int,
        model_id: str = "",
    ) -> None:
        """Remember a namespace (and the model id it was registered with) and page class a
        session registered with."""
        self._ns[ns_id] = fingerprint
        self._models[ns_id] = (fingerprint, model_id)
        self._tenant_ns.note(fingerprint, tenant)
        self._class_bytes[class_id] = page_bytes

    def namespace_of(self, ns_id: int) -> bytes | None:
        """The fingerprint of pool namespace ``ns_id`` (None if nobody named it)."""
        fp = self._ns.get(ns_id)
        if fp is None:  # a page adopted from before a restart: the pool's own table
            fp = next((f for f, i in self.pool.namespaces().items() if i == ns_id), None)
            if fp is not None:
                self._ns[ns_id] = fp
        return fp

    def before_l3_write(self, ns: bytes) -> bool:
        """Before an L3 write of namespace ``ns``: the tenants' namespaces saved if one is
        new (a tenant's FLUSH of L3 after a crash must reach every object written). False:
        the file cannot be saved and does not name ``ns``'s tenant yet, so ``ns`` must not
        be written now (its pages are given up until a save succeeds: :meth:`_names_saved`)."""
        return self._tenant_ns.on_disk(ns)

    def _names_saved(self) -> None:
        """The tenants' namespaces were saved after a failure: queue again the pages given
        up meanwhile (on the loop's next turn, never inside a write batch)."""
        if not self.l3.healthy:  # L3 coming back queues them (_l3_recovered)
            return
        try:
            asyncio.get_running_loop().call_soon(self.writer.retry_given_up)
        except RuntimeError:  # no loop (a test driving the tier directly)
            self.writer.retry_given_up()

    def state_problem(self) -> str | None:
        """What keeps the daemon's state files from being saved (HEALTH), or None."""
        return self._tenant_ns.error

    def page_bytes_of(self, class_id: int) -> int:
        """Page bytes of pool page class ``class_id``."""
        pb = self._class_bytes.get(class_id)
        if pb is None:  # a class an adopted pool registered before any session did
            pb = self._class_bytes[class_id] = self.pool.stats().classes[class_id].page_bytes
        return pb

    def model_of(self, ns_id: int, fingerprint: bytes) -> str:
        """The model id namespace ``fingerprint`` (pool namespace ``ns_id``) was last
        registered with since the daemon started ("" when none registered it)."""
        fp, model = self._models.get(ns_id, (b"", ""))
        return model if fp == fingerprint else ""

    def tenant_of(self, fingerprint: bytes) -> str | None:
        """The tenant that registered namespace ``fingerprint`` (``default`` without
        tenants configured; None: not known since the start, nor saved, nor told by an
        adopted pool's owners)."""
        if not self.cfg.tenants:  # every namespace is the default tenant's, adopted ones too
            return DEFAULT_TENANT
        return self._tenant_ns.tenant_of(fingerprint)

    def tenant_namespaces(self, tenant: str | None) -> list[bytes]:
        """Fingerprints registered by ``tenant`` (None: by anyone), also before a restart
        when tenants are configured (:mod:`~kvtier.daemon.tier.tenant_namespaces`)."""
        return self._tenant_ns.of(tenant)

    def session_closed(self, s: TierSession) -> None:
        """Cancel the session's prefetches and take it out of its rank group."""
        for job in s.prefetches.values():
            self.prefetcher.release(job)
        s.prefetches.clear()
        if s.member is not None:
            self.groups.leave(s.member)
            s.member = None

    def stored(
        self, s: TierSession, keys: Sequence[bytes], slots: Sequence[int] | None = None
    ) -> None:
        """A STORE of ``s`` committed ``keys`` into ``slots`` (write-through queues them)."""
        if self.available:
            self.writer.committed(s.ns_fingerprint, s.ns_id, keys, s.geometry.page_bytes, slots)

    def loaded(self, s: TierSession, keys: Sequence[bytes]) -> None:
        """An engine of ``s`` loaded these pages (prefetched pages were used)."""
        self.prefetcher.loaded(s.ns_id, keys)

    def allocated(self, wanted: int, got: int, owner: int | None = None) -> None:
        """After an allocation (by ``owner``'s session): count evictions of prefetched
        pages; signal a shortfall (the owner's, when it is at its quota: only its own pages
        make room for it)."""
        evicted = self.pool.drain_evicted()
        if evicted:
            self.prefetcher.evicted((e.ns_id, e.key) for e in evicted)  # read only if it prefetched
            if self.on_evicted is not None:
                self.on_evicted(evicted)
        if got < wanted:
            at_quota = owner is not None and self.pool.at_quota(owner)
            self.writer.shortfall(owner if at_quota else None)

    # ------------------------------------------------------------------ prefetch and claim
    async def prefetch(
        self, s: TierSession, keys: list[bytes], request_id: str, skip: int = 0
    ) -> int:
        """Start fetching the L3 run after the L2-resident run of ``keys[skip:]``.

        Args:
            s: the asking session.
            keys: the request's page keys in chain order.
            request_id: names the prefetch for its claim (empty: the chain's last key).
            skip: leading keys the caller knows to be in L2 (``PREFETCH.skip``, checked by
                the service to lie in ``[0, len(keys)]``): neither looked up in L2 nor
                fetched, even if they have left L2 meanwhile.

        Returns:
            Pages whose reads started (0: L3 holds less than ``prefetch_threshold`` tokens,
            the backend is down, or every page is in L2 or already being fetched).
        """
        self.counters.prefetches += 1
        name: str | bytes = request_id or keys[-1]
        old = s.prefetches.pop(name, None)
        loop = asyncio.get_running_loop()
        assert 0 <= skip <= len(keys), "the service checks PREFETCH.skip"
        start = skip + self.pool.resident_run(s.ns_id, keys[skip:])
        # pages a cancelled fill has given up stay WRITING until their reads return, then are
        # aborted: nothing from them on is promised or read now (a later prefetch reads them)
        given_up, _ = self.prefetcher.giving_up(s.ns_id, keys[skip:start])
        fetch = given_up is None
        if given_up is not None:
            start = skip + given_up
        job = PrefetchJob(ns_id=s.ns_id, fill=None, started=loop.time(), paused=WATCH.catch_up())
        job.deps = self.prefetcher.dependencies(s.ns_id, keys[:start])
        if old is not None:  # after the new job took its fills: those it shares go on
            self.prefetcher.release(old)
        try:
            if fetch:
                await self._fetch(s, name, job, keys, start)
        except BaseException:  # cancelled (the daemon stops): no fill waits for it any more
            self.prefetcher.release(job)
            raise
        job.pages = _held(keys, job.fills)
        if job.fill is None and job.pages and s.is_open():  # waits on other prefetches only
            self._track(s, name, job)
        elif not job.pages and s.prefetches.get(name) is job:
            del s.prefetches[name]
        if s.prefetches.get(name) is not job:  # no claim will come for it
            self.prefetcher.release(job)
        return job.fill.pages if job.fill is not None else 0

    def coming(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """The leading run of ``keys`` in L2 now or on its way there (WRITING: a prefetch's
        pages, a STORE's), short of the first page a cancelled fill has given up."""
        n = self.pool.resident_run(ns_id, keys)
        first, _ = self.prefetcher.giving_up(ns_id, keys[:n])
        return n if first is None else first

    async def _fetch(
        self, s: TierSession, name: str | bytes, job: PrefetchJob, keys: list[bytes], start: int
    ) -> None:
        """:meth:`prefetch`'s reads: the L3 run after ``keys[:start]`` into a fill of
        ``job``'s (when L3 holds enough), then the fills of other prefetches that hold pages
        of the run this fill skipped."""
        n3 = await self.l3_run(s.ns_fingerprint, keys[start:]) if start < len(keys) else 0
        # a TP rank reads what its group's LOOKUP agreed on (the threshold applied to the
        # agreed run there), however little of it this rank's L2 lacks
        if not n3 or (
            s.member is None and n3 * s.geometry.page_size < self.setting("prefetch_threshold")
        ):
            return
        if not s.is_open() or job.released or self._flushing(s.ns_fingerprint):
            return
        run = keys[start : start + n3]
        job.fill = self.prefetcher.new_fill(s.ns_fingerprint, s.ns_id, s.geometry.page_bytes)
        job.pages = n3 + _held(keys[:start], job.deps)
        self._track(s, name, job)  # a claim may come while the slots are allocated
        await self.prefetcher.fill(  # each batch's evictions announced at once
            job.fill, s.owner, s.class_id, run, keys[start - 1] if start else None
        )
        mine = set(job.fill.keys)
        more = self.prefetcher.dependencies(
            s.ns_id, [k for k in run if k not in mine], known=[*job.deps, job.fill]
        )
        if job.released:  # claimed, replaced or its session closed during the allocation
            self.prefetcher.drop(more)
        else:
            job.deps += more

    def _track(self, s: TierSession, name: str | bytes, job: PrefetchJob) -> None:
        s.prefetches[name] = job
        while len(s.prefetches) > MAX_JOBS_PER_SESSION:
            stale = s.prefetches.pop(next(iter(s.prefetches)))
            self.prefetcher.release(stale)

    def claim_deadline(self, s: TierSession, job: PrefetchJob | None, policy: str) -> float:
        """Loop time at which a claim under ``policy`` stops waiting for ``job``.

        ``best_effort``: now. ``timeout``: the prefetch's start plus
        ``min(prefetch_timeout_max, prefetch_timeout_base + prefetch_timeout_per_ki_token
        × tokens / 1024)`` for the tokens it fetches. ``wait_complete``: the prefetch's
        start plus ``prefetch_timeout_max`` (so a stuck backend cannot hang a claim). The
        time kvtierd did not run since the prefetch (:mod:`~kvtier.daemon.pauses`) is not
        counted.
        """
        now = asyncio.get_running_loop().time()
        if job is None or policy == "best_effort":
            return now
        start = job.started + WATCH.catch_up() - job.paused  # kvtierd's pauses not counted
        cap = self.setting("prefetch_timeout_max")
        if policy == "wait_complete":
            return start + cap
        tokens = job.pages * s.geometry.page_size
        return start + min(
            cap,
            self.setting("prefetch_timeout_base")
            + self.setting("prefetch_timeout_per_ki_token") * tokens / 1024,
        )

    async def claim(
        self, s: TierSession, keys: list[bytes], request_id: str, policy: str, count: int = 0
    ) -> int:
        """End the session's prefetch of ``keys`` per ``policy``; return the L2 run now.

        For a rank of a TP group the answer is the minimum over the group's ranks (``count``:
        the rank's own count of its CLAIMs, :meth:`RankGroups.agree`).
        """
        self.counters.claims += 1
        job = s.prefetches.pop(request_id or keys[-1], None) if keys else None
        loop = asyncio.get_running_loop()
        deadline = self.claim_deadline(s, job, policy or self.cfg.hicache_storage_prefetch_policy)

        async def mine() -> tuple[int]:
            if job is not None:  # until its own pages have ended, not every page of a fill
                await self.prefetcher.wait_keys(keys, job.fills, deadline - loop.time())
                self.prefetcher.release(job)
            return (self.pool.lookup(s.ns_id, keys),)

        if s.member is not None:
            (n,) = await self.groups.agree(
                s.member, "claim", 1, mine, max(0.0, deadline - loop.time()), count
            )
        else:
            (n,) = await mine()
        if job is not None:
            self.prefetcher.release(job)
        self.counters.claim_pages += n
        return n

    async def lookup_l3(
        self, s: TierSession, keys: list[bytes], l2: int, count: int = 0
    ) -> tuple[int, int]:
        """``(l2, l3)`` for a LOOKUP whose L2 run is ``l2``; the group minimum for TP ranks
        (``count``: the rank's own count of its LOOKUPs, :meth:`RankGroups.agree`), whose L3
        run is 0 below ``prefetch_threshold`` tokens (no prefetch would bring it)."""

        async def mine() -> tuple[int, int]:
            l3 = await self.l3_run(s.ns_fingerprint, keys[l2:]) if l2 < len(keys) else 0
            if s.member is not None and l3 * s.geometry.page_size < self.setting(
                "prefetch_threshold"
            ):
                # a TP rank's answer must be what its prefetch brings, the same on every
                # rank: a run below the threshold is never read (prefetch), so never offered
                l3 = 0
            return l2, l2 + l3

        if s.member is not None:
            a, b = await self.groups.agree(
                s.member, "lookup", 2, mine, self.cfg.storage_timeout_s, count
            )
            if (b - a) * s.geometry.page_size < self.setting("prefetch_threshold"):
                b = a  # the agreed run is shorter than each rank's: below it, offered to none
        else:
            a, b = await mine()
        if a < len(keys) and self.available:  # counted as answered (a TP group's minimum)
            c = self.counters
            c.l3_lookups += 1
            c.lookup_l3_keys += b - a
            c.lookup_l3_hits += b > a
            c.lookup_l3_tokens += (b - a) * s.geometry.page_size
        return a, b - a

    def _on_round(self, timed_out: bool) -> None:
        self.counters.tp_rounds += 1
        self.counters.tp_round_timeouts += timed_out

    @contextlib.contextmanager
    def flushing(self, namespaces: list[bytes] | None) -> Iterator[None]:
        """A FLUSH of ``namespaces`` (None: of every one) is under way: no prefetch of them
        starts a fill meanwhile (its pages would be marked in L3 after L3's were deleted)."""
        scope = None if namespaces is None else frozenset(namespaces)
        self._flushes.append(scope)
        try:
            yield
        finally:
            self._flushes.remove(scope)

    def _flushing(self, fingerprint: bytes) -> bool:
        return any(f is None or fingerprint in f for f in self._flushes)

    async def quiesce(self, namespaces: list[bytes] | None, timeout: float) -> None:
        """Before a FLUSH: cancel the prefetches of ``namespaces`` (None: of every one) and
        wait, at most ``timeout`` seconds, until their reads in flight have ended (a
        cancelled fill commits what it verified: the flush then drops it) and no L3 write
        batch is in flight (its pages are pinned until it ends; a write that landed after
        the flush would put its pages back in L3). The caller holds the writer
        :meth:`~kvtier.daemon.tier.writer.L3Writer.paused` meanwhile."""
        wanted = None if namespaces is None else set(namespaces)
        self.prefetcher.cancel_namespaces(wanted)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self.prefetcher.wait(self.prefetcher.fills_of(wanted), timeout)
        await self.writer.settle(deadline - loop.time())

    async def flush(
        self, namespaces: list[bytes] | None, reclaim: bool = True
    ) -> tuple[int, str | None]:
        """Delete from L3 every page of ``namespaces`` (None: of every namespace); with
        ``reclaim``, the store then gives the freed disk space back. The L2 pages of those
        namespaces are no longer in L3 (unless a fault left L3 untouched: down, its listing
        failed): write-back writes each again before evicting it, write-through does not
        (L3 stays as flushed), and a SYNC writes them all.

        Returns:
            ``(pages deleted, why not every page was or None)``
            (:meth:`~kvtier.daemon.tier.guard.L3Backend.flush`).
        """
        self.prefetcher.cancel_namespaces(None if namespaces is None else set(namespaces))
        deleted, problem = await self.l3.flush(namespaces, reclaim=reclaim)
        if problem is None or deleted:  # untouched (down, not listed): its marks hold
            ids = self.pool.namespaces()
            for fp in ids if namespaces is None else namespaces:
                if fp in ids:
                    self.pool.clear_in_l3(ids[fp])
        return deleted, problem

    def _l3_recovered(self) -> None:
        """L3 answers again after calls were skipped: the pages given up meanwhile are
        written now."""
        self.writer.retry_given_up()

    def _l3_replaced(self) -> None:
        """The store may have lost everything it held (its server restarted): no L2 page is
        taken as in L3 any more, so write-back writes each again before evicting it (the
        writer asks the store first), write-through backs L2 up again
        (:meth:`~kvtier.daemon.tier.writer.L3Writer.catch_up`) and a SYNC writes them all."""
        for ns_id in sorted(set(self.pool.namespaces().values())):
            self.pool.clear_in_l3(ns_id)
        self.writer.catch_up()
        if self.on_l3_replaced is not None:
            self.on_l3_replaced()

    def _l3_dropped(self, dropped: list[tuple[bytes, bytes]]) -> None:
        """The backend dropped objects on its own (its capacity, damaged objects): their
        L2 pages, if any, are no longer in L3."""
        ids = self.pool.namespaces()
        by_ns: dict[int, list[bytes]] = {}
        for fp, key in dropped:
            if fp in ids:
                by_ns.setdefault(ids[fp], []).append(key)
        for ns_id, keys in by_ns.items():
            self.pool.clear_in_l3(ns_id, keys)
        if self.on_l3_dropped is not None:
            self.on_l3_dropped(dropped)

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, object]:
        """The ``l3`` section of the daemon's STATS reply (stable keys): ``backend``,
        ``healthy``, the policies, ``write_queue``, ``write_back_checks`` (how often
        write-back looked at the pool's fill), ``prefetching``, ``tp_groups`` and the
        backend's own counters (``puts``, ``gets``, ``misses``, ``corrupt``, ``errors``, ...)."""
        out = self.l3.snapshot()
        out.update(
            write_policy=self.cfg.hicache_write_policy,
            prefetch_policy=self.cfg.hicache_storage_prefetch_policy,
            write_queue=self.writer.queued,
            write_back_checks=self.writer.write_back_checks,
            prefetching=self.prefetcher.active,
            tp_groups=len(self.groups),
        )
        return out


def _held(keys: Sequence[bytes], fills: Sequence[Fill]) -> int:
    """How many of ``keys`` the ``fills`` hold (what a claim of them may wait for)."""
    return sum(1 for k in keys if any(k in f.at for f in fills))
