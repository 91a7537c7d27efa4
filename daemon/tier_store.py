"""The daemon's L3 tier: backend lifecycle, lookups after L2, prefetch and claim, writes.

One :class:`TierStore` per daemon sits between the request handlers and one storage
backend (:mod:`kvtier.daemon.storage`)::

    LOOKUP  ── L2 run (host pool) ──▶ l3_run(): backend.exists on the keys after it
    PREFETCH ─ L3 run ≥ threshold ──▶ Prefetcher: WRITING slots ← backend.get_into
    CLAIM   ── per policy ──────────▶ wait / cancel the fills; answer the L2 run now
    STORE commit ─ write_through ───▶ L3Writer queue ──▶ backend.put_from, mark_in_l3
    L2 nearly full ─ write_back ────▶ L3Writer: coldest pages not in L3

Lifecycle: :meth:`TierStore.open` builds the backend from ``hicache_storage_backend`` and
its extra config (SGLang's ``prefetch_*`` keys in that JSON are taken out first and
override the daemon's own fields) and opens it over the host arena; :meth:`run` keeps its
health (and retries a backend that could not open) and runs the writer;
:meth:`drain` cancels prefetches and writes what the policy asks for before a shutdown;
:meth:`close` closes the backend.

Faults never reach an engine as errors: a backend that raises, times out or is down reads
as a miss (``l3 = 0``, a read that does not verify, a failed write), counts in
``l3_backend_errors`` and in the backend's own stats, and marks the tier unhealthy until
a health check passes again; meanwhile L3 is skipped and L2 keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import ConfigError, DaemonConfig, KvtierError
from kvtier.daemon.host_pool import HostPool
from kvtier.daemon.l3_writer import L3Writer
from kvtier.daemon.prefetch import Prefetcher, PrefetchJob
from kvtier.daemon.rank_groups import RankGroups
from kvtier.daemon.stats import Counters
from kvtier.daemon.storage.base import BackendStats, HostArena, StorageBackend
from kvtier.daemon.storage.factory import EXTRA_CONFIG_FIELD, create_backend, parse_extra_config

if TYPE_CHECKING:
    from kvtier.daemon.sessions import Session

log = logging.getLogger("kvtier.daemon.l3")

PREFETCH_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                 "prefetch_timeout_max")
"""SGLang puts these in the backend's extra config; they override the daemon's fields."""

HEALTH_PERIOD_S = 5.0
"""Health check period while the backend is healthy."""

DOWN_PERIOD_S = 1.0
"""Health check (or open retry) period while it is not."""

MAX_JOBS_PER_SESSION = 1024
"""Prefetches a session may leave unclaimed; the oldest is cancelled beyond it."""

DELETE_BATCH = 1024
"""Keys per backend ``delete`` call of a flush."""


def storage_settings(cfg: DaemonConfig, rdir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Split the backend's extra config into its own keys and the prefetch overrides.

    Args:
        cfg: the daemon's configuration.
        rdir: the runtime directory (the ``file`` backend's default path derives from it).

    Returns:
        ``(backend keys, overrides)``. For ``file`` without a ``path``, the path is
        ``<state_dir or <runtime_dir>/state>/l3``.

    Raises:
        ConfigError: the extra config does not parse, or an override is not a number >= 0.
    """
    extra = parse_extra_config(cfg.hicache_storage_backend_extra_config)
    overrides: dict[str, float] = {}
    for key in PREFETCH_KEYS:
        if key in extra:
            value = extra.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{EXTRA_CONFIG_FIELD}: {key!r} = {value!r} must be a number >= 0")
            if key == "prefetch_timeout_max" and value == 0:
                raise ConfigError(f"{EXTRA_CONFIG_FIELD}: {key!r} = {value!r} must be > 0")
            overrides[key] = value
    if cfg.hicache_storage_backend == "file" and "path" not in extra:
        extra["path"] = str(Path(cfg.state_dir or Path(rdir) / "state") / "l3")
    return extra, overrides


class TierStore:
    """The L3 tier of one daemon (see the module docstring).

    Args:
        cfg: the daemon's configuration (:meth:`reconfigure` swaps it on reload).
        pool: the host pool.
        counters: the daemon's counters.
        rdir: the runtime directory.

    Raises:
        ConfigError: the backend's extra config is invalid.
    """

    def __init__(self, cfg: DaemonConfig, pool: HostPool, counters: Counters, rdir: Path) -> None:
        self.cfg = cfg
        self.pool = pool
        self.counters = counters
        self.name = cfg.hicache_storage_backend
        self.extra, self.overrides = storage_settings(cfg, rdir)
        self.backend: StorageBackend | None = None
        self.healthy = False
        self._arena: HostArena | None = None
        self._faults: tuple[type[BaseException], ...] = (
            (Exception,) if self.name == "dynamic" else (KvtierError, OSError))
        self._check_now = asyncio.Event()
        self._last_check = 0.0
        self._open_failures = 0
        self._ns: dict[int, bytes] = {}
        self._ns_tenant: dict[bytes, str] = {}
        self._class_bytes: dict[int, int] = {}
        self._known: dict[tuple[bytes, bytes], None] = {}  # (ns, key), for backends that cannot list
        self.prefetcher = Prefetcher(pool, counters, self.get, cfg.prefetch_concurrency)
        self.writer = L3Writer(self, pool, counters)
        self.groups = RankGroups(cfg.tp_group_timeout_s, on_round=self._on_round)

    # ------------------------------------------------------------------ lifecycle
    @property
    def available(self) -> bool:
        """Whether a backend is open (it may still be unhealthy)."""
        return self.backend is not None

    def setting(self, name: str) -> float:
        """A prefetch setting: the extra config's override, else the daemon's field."""
        return self.overrides.get(name, getattr(self.cfg, name))

    async def open(self, arena: HostArena) -> None:
        """Build and open the backend; a backend that cannot open now is retried later.

        Raises:
            ConfigError: the backend's name or extra config is invalid (fatal at start).
        """
        self._arena = arena
        if self.name != "none":
            await self._open_backend()
        self.apply_write_policy()

    async def _open_backend(self) -> None:
        assert self._arena is not None
        backend = create_backend(self.name, self.extra)
        try:
            await backend.open(self._arena)
        except ConfigError:
            raise
        except self._faults as err:
            self._open_failures += 1
            if self._open_failures == 1:
                log.error("L3 backend %s could not open (%s); serving L2 only, retrying every "
                          "%.0fs", self.name, err, DOWN_PERIOD_S)
            else:
                log.debug("L3 backend %s still cannot open: %s", self.name, err)
            return
        self.backend, self.healthy = backend, True
        log.info("L3 backend %s open (%s, prefetch policy %s)%s", self.name,
                 self.cfg.hicache_write_policy, self.cfg.hicache_storage_prefetch_policy,
                 f" after {self._open_failures} failed tries" if self._open_failures else "")

    async def run(self) -> None:
        """Keep the backend's health and run the writer until cancelled."""
        if self.name == "none":
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.writer.run(), name="kvtier-l3-writer")
            tg.create_task(self._health_loop(), name="kvtier-l3-health")

    async def drain(self, timeout: float) -> None:
        """Before a shutdown: give prefetches up, write what the policy asks for."""
        deadline = time.monotonic() + timeout
        await self.prefetcher.close(timeout)
        await self.writer.drain(deadline)

    async def close(self) -> None:
        """Close the backend (idempotent)."""
        backend, self.backend, self.healthy = self.backend, None, False
        if backend is not None:
            await backend.close()

    def reconfigure(self, cfg: DaemonConfig) -> None:
        """Apply a reloaded configuration's live fields.

        Switching from ``write_back`` to ``write_through`` queues every L2 page not yet in
        L3, so that L2 is backed up as it stands.
        """
        if cfg.prefetch_concurrency != self.cfg.prefetch_concurrency:
            self.prefetcher.set_concurrency(cfg.prefetch_concurrency)
        to_through = (self.cfg.hicache_write_policy, cfg.hicache_write_policy) == (
            "write_back", "write_through")
        self.cfg = cfg
        if to_through and self.available:
            log.info("write policy now write_through: %d L2 pages queued for L3",
                     self.writer.back_up_all())
        self.groups.timeout_s = cfg.tp_group_timeout_s
        self.apply_write_policy()
        self.writer.poke()

    def apply_write_policy(self) -> None:
        """Make the pool evict only pages in L3 while write-back is in force (and while
        pages written back unpinned are still in flight)."""
        wb = self.writer.write_back and self.available
        self.pool.evict_requires_l3 = wb or self.writer.writing_unpinned

    async def _health_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEALTH_PERIOD_S if self.healthy else DOWN_PERIOD_S):
                    await self._check_now.wait()
            self._check_now.clear()
            await asyncio.sleep(max(0.0, self._last_check + 0.2 - time.monotonic()))
            self._last_check = time.monotonic()
            if self.backend is None:
                await self._open_backend()
                self.apply_write_policy()
                continue
            try:
                async with asyncio.timeout(self.cfg.storage_timeout_s * 4):
                    ok = await self.backend.health()
            except TimeoutError:
                ok = False
            except self._faults as err:
                log.debug("L3 health check: %r", err)
                ok = False
            if ok != self.healthy:
                log.log(logging.INFO if ok else logging.WARNING, "L3 backend %s is %s", self.name,
                        "healthy again" if ok else "down: reads are misses, L2 keeps serving")
            self.healthy = ok

    def _fault(self, what: str, err: BaseException | None = None) -> None:
        self.counters.l3_backend_errors += 1
        if self.healthy:
            log.warning("L3 backend %s: %s%s; skipping it until a health check passes",
                        self.name, what, f" ({err!r})" if err is not None else "")
        self.healthy = False
        self._check_now.set()

    def _watch(self, backend: StorageBackend, errors_before: int) -> None:
        if backend.stats.errors > errors_before:
            self._check_now.set()  # the backend saw a fault: check its health soon

    # ------------------------------------------------------------------ backend calls
    async def l3_run(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` in L3 (0 when down, slow or failing)."""
        backend = self.backend
        if backend is None or not self.healthy or not keys:
            return 0
        before = backend.stats.errors
        try:
            async with asyncio.timeout(self.cfg.storage_timeout_s):
                n = await backend.exists(ns, keys)
        except TimeoutError as err:
            self._fault("exists timed out", err)
            return 0
        except self._faults as err:
            self._fault("exists failed", err)
            return 0
        self._watch(backend, before)
        return n

    async def get(self, ns: bytes, keys: list[bytes], offsets: list[int], length: int) -> list[bool]:
        """Read pages into arena offsets; one flag per page (all False on a fault)."""
        backend = self.backend
        if backend is None or not self.healthy:
            return [False] * len(keys)
        before = backend.stats.errors
        try:
            flags = await backend.get_into(ns, keys, offsets, length)
        except self._faults as err:  # a plug-in that broke the no-raise contract: a miss
            self._fault("get_into failed", err)
            return [False] * len(keys)
        self._watch(backend, before)
        return flags

    async def put(self, ns: bytes, keys: list[bytes], offsets: list[int], length: int) -> list[bool]:
        """Write pages from arena offsets; one flag per page (all False on a fault)."""
        backend = self.backend
        if backend is None or not self.healthy:
            return [False] * len(keys)
        before = backend.stats.errors
        try:
            flags = await backend.put_from(ns, keys, offsets, length)
        except self._faults as err:
            self._fault("put_from failed", err)
            return [False] * len(keys)
        self._watch(backend, before)
        if self.name not in ("file", "redis"):
            self._note_known(ns, [k for k, f in zip(keys, flags) if f])
        return flags

    # ------------------------------------------------------------------ sessions
    def register(self, ns_id: int, fingerprint: bytes, tenant: str, class_id: int,
                 page_bytes: int) -> None:
        """Remember a namespace and page class a session registered with."""
        self._ns[ns_id] = fingerprint
        self._ns_tenant[fingerprint] = tenant
        self._class_bytes[class_id] = page_bytes

    def namespace_of(self, ns_id: int) -> bytes | None:
        """The fingerprint of pool namespace ``ns_id`` (None if nobody named it)."""
        fp = self._ns.get(ns_id)
        if fp is None:  # a page adopted from before a restart: the pool's own table
            fp = next((f for f, i in self.pool.namespaces().items() if i == ns_id), None)
            if fp is not None:
                self._ns[ns_id] = fp
        return fp

    def page_bytes_of(self, class_id: int) -> int:
        """Page bytes of pool page class ``class_id``."""
        pb = self._class_bytes.get(class_id)
        if pb is None:  # a class an adopted pool registered before any session did
            pb = self._class_bytes[class_id] = self.pool.stats().classes[class_id].page_bytes
        return pb

    def tenant_namespaces(self, tenant: str | None) -> list[bytes]:
        """Fingerprints registered here by ``tenant`` (None: by anyone)."""
        return [fp for fp, t in self._ns_tenant.items() if tenant is None or t == tenant]

    def session_closed(self, s: Session) -> None:
        """Cancel the session's prefetches and take it out of its rank group."""
        for job in s.prefetches.values():
            self.prefetcher.cancel(job.fill)
        s.prefetches.clear()
        if s.member is not None:
            self.groups.leave(s.member)
            s.member = None

    def stored(self, s: Session, keys: list[bytes]) -> None:
        """A STORE of ``s`` committed ``keys`` (write-through queues them)."""
        if self.backend is not None:
            self.writer.committed(s.ns_fingerprint, s.ns_id, keys, s.geometry.page_bytes)

    def loaded(self, s: Session, keys: Sequence[bytes]) -> None:
        """An engine of ``s`` loaded these pages (prefetched pages were used)."""
        self.prefetcher.loaded(s.ns_id, keys)

    def allocated(self, wanted: int, got: int) -> None:
        """After an allocation: count evictions of prefetched pages; signal a shortfall."""
        evicted = self.pool.drain_evicted()
        if evicted:
            self.prefetcher.evicted([(e.ns_id, e.key) for e in evicted])
        if got < wanted:
            self.writer.shortfall()

    # ------------------------------------------------------------------ prefetch and claim
    async def prefetch(self, s: Session, keys: list[bytes], request_id: str) -> int:
        """Start fetching the L3 run after the L2-resident run of ``keys``.

        Returns:
            Pages whose reads started (0: L3 holds less than ``prefetch_threshold`` tokens,
            the backend is down, or every page is in L2 or already being fetched).
        """
        self.counters.prefetches += 1
        name: str | bytes = request_id or keys[-1]
        old = s.prefetches.pop(name, None)
        if old is not None:
            self.prefetcher.cancel(old.fill)
        loop = asyncio.get_running_loop()
        start = self.pool.resident_run(s.ns_id, keys)
        job = PrefetchJob(ns_id=s.ns_id, fill=None, started=loop.time())
        job.deps = self.prefetcher.dependencies(s.ns_id, keys[:start])
        n3 = await self.l3_run(s.ns_fingerprint, keys[start:]) if start < len(keys) else 0
        if n3 and n3 * s.geometry.page_size >= self.setting("prefetch_threshold") \
                and s.is_open():
            run = keys[start:start + n3]
            job.fill = self.prefetcher.new_fill(s.ns_fingerprint, s.ns_id, s.geometry.page_bytes)
            job.pages = n3 + sum(f.pages for f in job.deps)
            self._track(s, name, job)  # a claim may come while the slots are allocated
            got = await self.prefetcher.fill(job.fill, s.owner, s.class_id, run,
                                             keys[start - 1] if start else None)
            self.allocated(len(run), got)
            mine = set(job.fill.keys)
            job.deps += [f for f in self.prefetcher.dependencies(
                s.ns_id, [k for k in run if k not in mine]) if f not in job.deps]
        job.pages = sum(f.pages for f in job.fills)
        if job.fill is None and job.pages and s.is_open():  # waits on other prefetches only
            self._track(s, name, job)
        elif not job.pages and s.prefetches.get(name) is job:
            del s.prefetches[name]
        return job.fill.pages if job.fill is not None else 0

    def _track(self, s: Session, name: str | bytes, job: PrefetchJob) -> None:
        s.prefetches[name] = job
        while len(s.prefetches) > MAX_JOBS_PER_SESSION:
            stale = s.prefetches.pop(next(iter(s.prefetches)))
            self.prefetcher.cancel(stale.fill)

    def claim_deadline(self, s: Session, job: PrefetchJob | None, policy: str) -> float:
        """Loop time at which a claim under ``policy`` stops waiting for ``job``.

        ``best_effort``: now. ``timeout``: the prefetch's start plus
        ``min(prefetch_timeout_max, prefetch_timeout_base + prefetch_timeout_per_ki_token
        × tokens / 1024)`` for the tokens it fetches. ``wait_complete``: the prefetch's
        start plus ``prefetch_timeout_max`` (so a stuck backend cannot hang a claim).
        """
        now = asyncio.get_running_loop().time()
        if job is None or policy == "best_effort":
            return now
        cap = self.setting("prefetch_timeout_max")
        if policy == "wait_complete":
            return job.started + cap
        tokens = job.pages * s.geometry.page_size
        return job.started + min(cap, self.setting("prefetch_timeout_base")
                                 + self.setting("prefetch_timeout_per_ki_token") * tokens / 1024)

    async def claim(self, s: Session, keys: list[bytes], request_id: str, policy: str) -> int:
        """End the session's prefetch of ``keys`` per ``policy``; return the L2 run now.

        For a rank of a TP group the answer is the minimum over the group's ranks.
        """
        self.counters.claims += 1
        job = s.prefetches.pop(request_id or keys[-1], None) if keys else None
        loop = asyncio.get_running_loop()
        deadline = self.claim_deadline(s, job, policy or self.cfg.hicache_storage_prefetch_policy)

        async def mine() -> tuple[int]:
            if job is not None:
                await self.prefetcher.wait(job.fills, deadline - loop.time())
                self.prefetcher.cancel(job.fill)
            return (self.pool.lookup(s.ns_id, keys),)

        if s.member is not None:
            (n,) = await self.groups.agree(s.member, "claim", 1, mine,
                                           max(0.0, deadline - loop.time()))
        else:
            (n,) = await mine()
        if job is not None:
            self.prefetcher.cancel(job.fill)
        self.counters.claim_pages += n
        return n

    async def lookup_l3(self, s: Session, keys: list[bytes], l2: int) -> tuple[int, int]:
        """``(l2, l3)`` for a LOOKUP whose L2 run is ``l2``; the group minimum for TP ranks."""

        async def mine() -> tuple[int, int]:
            l3 = await self.l3_run(s.ns_fingerprint, keys[l2:]) if l2 < len(keys) else 0
            if l2 < len(keys) and self.backend is not None:
                c = self.counters
                c.l3_lookups += 1
                c.lookup_l3_keys += l3
                c.lookup_l3_hits += l3 > 0
                c.lookup_l3_tokens += l3 * s.geometry.page_size
            return l2, l2 + l3

        if s.member is not None:
            a, b = await self.groups.agree(s.member, "lookup", 2, mine, self.cfg.storage_timeout_s)
        else:
            a, b = await mine()
        return a, b - a

    def _on_round(self, timed_out: bool) -> None:
        self.counters.tp_rounds += 1
        self.counters.tp_round_timeouts += timed_out

    # ------------------------------------------------------------------ flush
    async def flush(self, namespaces: list[bytes] | None) -> int:
        """Delete from L3 every page of ``namespaces`` (None: of every namespace).

        The ``file`` and ``redis`` backends list their objects; for other backends only
        the pages this daemon wrote are known and deleted.
        """
        backend = self.backend
        if backend is None:
            return 0
        wanted = None if namespaces is None else set(namespaces)
        by_ns: dict[bytes, list[bytes]] = {}
        for ns, key in await self._list(backend, wanted):
            by_ns.setdefault(ns, []).append(key)
        deleted = 0
        for ns, keys in by_ns.items():
            for i in range(0, len(keys), DELETE_BATCH):
                try:
                    deleted += await backend.delete(ns, keys[i:i + DELETE_BATCH])
                except self._faults as err:
                    self._fault("delete failed", err)
                    return deleted
            for k in keys:
                self._known.pop((ns, k), None)
        self.counters.l3_flushed_pages += deleted
        return deleted

    async def _list(self, backend: StorageBackend,
                    wanted: set[bytes] | None) -> list[tuple[bytes, bytes]]:
        entries = getattr(backend, "entries", None)
        if callable(entries):  # the file backend keeps its index in memory
            return [(ns, key) for ns, key, _ in entries() if wanted is None or ns in wanted]
        client = getattr(backend, "client", None)
        options = getattr(backend, "options", None)
        if self.name == "redis" and client is not None and options is not None:
            out = []
            patterns = ([f"{options.prefix}:*"] if wanted is None
                        else [f"{options.prefix}:{ns.hex()}:*" for ns in wanted])
            try:
                for pat in patterns:
                    async for name in client.scan_iter(match=pat, count=1000):
                        parts = name.decode().rsplit(":", 2)
                        out.append((bytes.fromhex(parts[1]), bytes.fromhex(parts[2])))
            except self._faults as err:
                self._fault("listing keys failed", err)
            return out
        return [(ns, key) for ns, key in self._known if wanted is None or ns in wanted]

    def _note_known(self, ns: bytes, keys: list[bytes]) -> None:
        for k in keys:
            self._known[(ns, k)] = None
        while len(self._known) > 1 << 18:
            del self._known[next(iter(self._known))]

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, object]:
        """The ``l3`` section of the daemon's STATS reply (stable keys)."""
        backend = self.backend
        stats = backend.stats if backend is not None else BackendStats()
        return {
            "backend": self.name,
            "healthy": bool(backend is not None and self.healthy),
            "write_policy": self.cfg.hicache_write_policy,
            "prefetch_policy": self.cfg.hicache_storage_prefetch_policy,
            "write_queue": self.writer.queued,
            "prefetching": self.prefetcher.active,
            "tp_groups": len(self.groups),
            **dataclasses.asdict(stats),
        }
