"""The daemon's L3 backend: its lifecycle and health, and calls that never fail.

:class:`L3Backend` builds the storage backend named by ``hicache_storage_backend`` from its
extra config (SGLang's ``prefetch_*`` keys in that JSON are taken out first: they override
the daemon's own fields), opens it over the host arena, and retries one that could not
open at start, so a daemon whose L3 is away still serves L2 and picks L3 up later.

Its :meth:`~L3Backend.exists`, :meth:`~L3Backend.get` and :meth:`~L3Backend.put` never
raise: a backend that raises (a third-party plug-in may), times out (an existence check
is bounded by ``storage_timeout_s``) or is down reads as a miss, counts in
``l3_backend_errors`` and marks L3 unhealthy until a health check passes; meanwhile
calls answer at once (``0``, all ``False``) and L2 keeps serving.

A failing spell is logged once with its real cause (:mod:`.fault_log`: connection refused
is not a timeout), then at most once a minute with the count of failures in between, and
once when the backend is healthy again; :meth:`L3Backend.problem` names it for HEALTH.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, DaemonConfig, KvtierError
from kvtier.config.loader import state_dir
from kvtier.daemon.counters import Counters
from kvtier.daemon.pauses import running_timeout
from kvtier.daemon.storage.base import BackendStats, HostArena, StorageBackend
from kvtier.daemon.storage.registry import EXTRA_CONFIG_FIELD, create_backend, parse_extra_config
from kvtier.daemon.tier.fault_log import FaultLog, describe_fault

log = logging.getLogger("kvtier.daemon.l3")

PREFETCH_KEYS = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
)
"""SGLang puts these in the backend's extra config; they override the daemon's fields."""

HEALTH_PERIOD_S = 5.0
"""Health check period while the backend is healthy."""

DROP_DELAY_S = 0.05
"""How long drops a backend learned of outside a batch gather before they are taken."""

DOWN_PERIOD_S = 1.0
"""Health check (or open retry) period while it is not."""

DELETE_BATCH = 1024
"""Keys per backend ``delete`` call of a flush."""


def storage_settings(cfg: DaemonConfig, rdir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Split the backend's extra config into its own keys and the prefetch overrides.

    Args:
        cfg: the daemon's configuration.
        rdir: the runtime directory (unused: the store is kept out of it, as it is usually a
            tmpfs; kept for the callers' signature).

    Returns:
        ``(backend keys, overrides)``. For ``file`` without a ``path``, the path is
        ``<state_dir>/l3``, the state directory resolved by
        :func:`kvtier.config.loader.state_dir` (persistent, never the runtime directory).

    Raises:
        ConfigError: the extra config does not parse, an override is not a number >= 0, or
            no state directory can be found.
    """
    extra = parse_extra_config(cfg.hicache_storage_backend_extra_config)
    overrides: dict[str, float] = {}
    for key in PREFETCH_KEYS:
        if key in extra:
            value = extra.pop(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(
                    f"{EXTRA_CONFIG_FIELD}: {key!r} = {value!r} must be a number >= 0"
                )
            if key == "prefetch_timeout_max" and value == 0:
                raise ConfigError(f"{EXTRA_CONFIG_FIELD}: {key!r} = {value!r} must be > 0")
            overrides[key] = value
            if key in cfg.model_fields_set and getattr(cfg, key) != value:
                log.warning(
                    "%s = %s set in %s overrides %s = %s",
                    key,
                    value,
                    EXTRA_CONFIG_FIELD,
                    key,
                    getattr(cfg, key),
                )
    if cfg.hicache_storage_backend == "file" and "path" not in extra:
        extra["path"] = str(state_dir(cfg.state_dir) / "l3")
        log.info("file L3 store in %s (the default under the state directory)", extra["path"])
    return extra, overrides


MAX_KNOWN = 1 << 18
"""Keys remembered per daemon for a FLUSH of a backend that cannot list its objects."""


class L3Backend:
    """One daemon's storage backend, guarded (see the module docstring).

    Args:
        cfg: the daemon's configuration (``cfg`` is swapped on reload).
        counters: the daemon's counters.
        rdir: the runtime directory (passed to :func:`storage_settings`).
        clock: monotonic seconds, for the rate limit of the fault log (tests pass their own).

    Attributes:
        name: the backend's name (``none`` when L3 is off).
        backend: the open backend, None before it opened (or when L3 is off).
        healthy: whether calls go to the backend (False while it is down).
        on_open: called when a backend that could not open at start opens later.
        on_dropped: called with ``(namespace, key)`` of the objects the backend dropped on
            its own (:meth:`~kvtier.daemon.storage.base.StorageBackend.dropped`), after
            the read or write batch that saw them go.
        on_replaced: called when a health check finds the store may have lost everything
            it held (:meth:`~kvtier.daemon.storage.base.StorageBackend.replaced`).
        faults: the current failing spell (its cause), logged once and then rarely.

    Raises:
        ConfigError: the backend's extra config is invalid.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        counters: Counters,
        rdir: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.name = cfg.hicache_storage_backend
        self.extra, self.overrides = storage_settings(cfg, rdir)
        self.backend: StorageBackend | None = None
        self.healthy = False
        self.on_open: Callable[[], None] | None = None
        self.on_dropped: Callable[[list[tuple[bytes, bytes]]], None] | None = None
        self.on_replaced: Callable[[], None] | None = None
        self.on_recovered: Callable[[], None] | None = None
        """Told when a health check passes after calls were skipped as unhealthy."""
        self.faults = FaultLog(log, f"L3 backend {self.name}", clock=clock)
        self._arena: HostArena | None = None
        self._faults: tuple[type[BaseException], ...] = (
            (Exception,) if self.name == "dynamic" else (KvtierError, OSError)
        )
        self._check_now = asyncio.Event()
        self._last_check = 0.0
        self._known: dict[tuple[bytes, bytes], None] = {}  # (ns, key) written, if unlistable
        self._lists = False  # whether the open backend implements list_keys
        self._drop_pending = False
        self._drops_seen = 0  # drops handed on so far
        self._dropped_at: dict[tuple[bytes, bytes], int] = {}  # recent drops: their number
        self._putting: dict[tuple[bytes, bytes], int] = {}  # pages of puts in flight

    @property
    def available(self) -> bool:
        """Whether a backend is open (it may still be unhealthy)."""
        return self.backend is not None

    async def open(self, arena: HostArena) -> None:
        """Build and open the backend; one that cannot open now is retried by :meth:`run`.

        Raises:
            ConfigError: the backend's name or extra config is invalid (fatal at start).
        """
        self._arena = arena
        if self.name != "none":
            await self._open_backend()

    async def _open_backend(self) -> None:
        assert self._arena is not None
        backend = create_backend(self.name, self.extra)
        try:
            await backend.open(self._arena)
        except ConfigError:
            raise
        except self._faults as err:
            self.faults.failed(
                f"could not open: {describe_fault(err)}",
                f"serving L2 only, retrying every {DOWN_PERIOD_S:.0f}s",
                level=logging.ERROR,
            )
            return
        self.backend, self.healthy = backend, True
        backend.on_drop = self._drop_soon
        backend.on_suspect = self._check_now.set
        self._lists = type(backend).list_keys is not StorageBackend.list_keys
        self.faults.recovered("open")
        log.info(
            "L3 backend %s open (%s, prefetch policy %s)",
            self.name,
            self.cfg.hicache_write_policy,
            self.cfg.hicache_storage_prefetch_policy,
        )

    async def close(self) -> None:
        """Close the backend (idempotent)."""
        backend, self.backend, self.healthy = self.backend, None, False
        if backend is not None:
            await backend.close()

    async def run(self) -> None:
        """Check the backend's health (and open one that could not open at start) until
        cancelled: every :data:`HEALTH_PERIOD_S` while healthy, every :data:`DOWN_PERIOD_S`
        while not, and soon after a fault."""
        if self.name == "none":
            return
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEALTH_PERIOD_S if self.healthy else DOWN_PERIOD_S):
                    await self._check_now.wait()
            self._check_now.clear()
            await asyncio.sleep(max(0.0, self._last_check + 0.2 - time.monotonic()))
            self._last_check = time.monotonic()
            await self.check()

    async def check(self) -> bool:
        """Check the backend's health now (or try to open one that could not open yet).

        A failure is recorded in :attr:`faults` (logged once per spell, then rarely); a
        pass ends the spell.

        Returns:
            Whether the backend is open and healthy afterwards.
        """
        if self.name == "none":
            return False
        if self.backend is None:
            await self._open_backend()
            if self.backend is not None and self.on_open is not None:
                self.on_open()
            return self.backend is not None
        limit = self.cfg.storage_timeout_s * 4
        cause = None
        try:
            async with running_timeout(limit):
                ok = await self.backend.health()
        except TimeoutError:
            ok, cause = False, f"health check timed out after {limit:g} s"
        except self._faults as err:
            ok, cause = False, f"health check failed: {describe_fault(err)}"
        was_down = not self.healthy
        if ok:
            self.healthy = True
            self.faults.recovered()
            if self.backend is not None and self.backend.replaced():
                self._known.clear()
                if self.on_replaced is not None:
                    self.on_replaced()
            if was_down and self.on_recovered is not None:
                self.on_recovered()
        else:
            told = getattr(self.backend, "health_cause", None)
            self.faults.failed(
                cause
                or (f"health check failed: {told}" if told else None)
                or "health check failed (the backend's log says why)",
                "reads are misses, L2 keeps serving",
            )
        self.healthy = ok
        return ok

    def problem(self) -> str | None:
        """What is wrong with L3, for HEALTH; None when it is off or healthy."""
        if self.name == "none" or (self.backend is not None and self.healthy):
            return None
        state = "not open" if self.backend is None else "down"
        return f"L3 backend {self.name} {state}: {self.faults.cause or 'not checked yet'}"

    def _fault(self, what: str, err: BaseException | None = None) -> None:
        self.counters.l3_backend_errors += 1
        self.faults.failed(
            f"{what}: {describe_fault(err)}" if err is not None else what,
            "skipping it until a health check passes",
        )
        self.healthy = False
        self._check_now.set()

    def _watch(self, backend: StorageBackend, errors_before: int) -> None:
        if backend.stats.errors > errors_before:
            self._check_now.set()  # the backend saw a fault: check its health soon

    def _drop_soon(self) -> None:
        """The backend learned of drops outside a batch: take them shortly, once for a
        whole storm of notifications."""
        if not self._drop_pending:
            self._drop_pending = True
            asyncio.get_running_loop().call_later(DROP_DELAY_S, self._drops_due)

    def _drops_due(self) -> None:
        self._drop_pending = False
        if self.backend is not None:
            self._take_dropped(self.backend)

    def _take_dropped(self, backend: StorageBackend) -> None:
        """Hand what the backend dropped on its own to :attr:`on_dropped`."""
        try:
            dropped = backend.dropped()
        except self._faults as err:
            self._fault("listing dropped objects failed", err)
            return
        if not dropped:
            return
        at = self._dropped_at
        for ident in dropped:
            self._known.pop(ident, None)
            self._drops_seen += 1
            at.pop(ident, None)
            at[ident] = self._drops_seen
        while len(at) > MAX_KNOWN:
            del at[next(iter(at))]
        # a page whose own put is still in flight was never told as stored: its put reads
        # as not written (None), so nothing is told of it either way
        told = [i for i in dropped if i not in self._putting] if self._putting else dropped
        if told and self.on_dropped is not None:
            self.on_dropped(told)

    # ------------------------------------------------------------------ backend calls
    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` in L3 (0 when down, slow or failing)."""
        backend = self.backend
        if backend is None or not self.healthy or not keys:
            return 0
        before = backend.stats.errors
        try:
            async with running_timeout(self.cfg.storage_timeout_s):
                n = await backend.exists(ns, keys)
        except TimeoutError:
            self._fault(
                f"exists timed out after {self.cfg.storage_timeout_s:g} s (storage_timeout_s)"
            )
            return 0
        except self._faults as err:
            self._fault("exists failed", err)
            return 0
        self._watch(backend, before)
        return n

    async def get(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
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
        self._take_dropped(backend)
        return flags

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool | None]:
        """Write pages from arena offsets; one flag per page: True written, False not
        (all False on a fault), None written and dropped by the store before this returned
        (another batch written meanwhile made room): its drop was handed on already, so it
        must not be taken as in L3."""
        backend = self.backend
        if backend is None or not self.healthy:
            return [False] * len(keys)
        before = backend.stats.errors
        drops_before = self._drops_seen
        putting = self._putting
        idents = [(ns, k) for k in keys]
        for i in idents:
            putting[i] = putting.get(i, 0) + 1
        try:
            flags: list[bool | None] = list(await backend.put_from(ns, keys, offsets, length))
            self._take_dropped(backend)  # still in flight: its own pages' drops go untold
        except self._faults as err:
            self._fault("put_from failed", err)
            return [False] * len(keys)
        finally:
            for i in idents:
                if putting[i] > 1:
                    putting[i] -= 1
                else:
                    del putting[i]
        self._watch(backend, before)
        if self._drops_seen > drops_before:
            at = self._dropped_at
            flags = [
                None if f and at.get((ns, k), 0) > drops_before else f for k, f in zip(keys, flags)
            ]
        if not self._lists:
            self._note_known(ns, [k for k, f in zip(keys, flags) if f])
        return flags

    # ------------------------------------------------------------------ flush
    async def flush(
        self, namespaces: list[bytes] | None, reclaim: bool = True
    ) -> tuple[int, str | None]:
        """Delete from L3 every page of ``namespaces`` (None: of every namespace); with
        ``reclaim``, then ask the backend to give the freed space back
        (:meth:`~kvtier.daemon.storage.base.StorageBackend.release_space`).

        A backend that implements :meth:`~kvtier.daemon.storage.base.StorageBackend.list_keys`
        (``file``, ``redis``) lists its objects; for the others only the pages this daemon
        wrote are known and deleted (the last :data:`MAX_KNOWN`).

        Returns:
            ``(pages deleted, why not every page was)``: the second is None when the store
            was listed and every listed page deleted, else what failed (L3 not open or
            down, the listing, a delete), for the FLUSH reply to say.
        """
        backend = self.backend
        if backend is None or not self.healthy:
            state = "not open" if backend is None else "down"
            return 0, f"L3 backend {self.name} {state}: {self.faults.cause or 'not checked yet'}"
        wanted = None if namespaces is None else set(namespaces)
        listed, problem = await self._list(backend, wanted)
        by_ns: dict[bytes, list[bytes]] = {}
        for ns, key in listed:
            by_ns.setdefault(ns, []).append(key)
        deleted = 0
        batches = [
            (ns, keys[i : i + DELETE_BATCH])
            for ns, keys in by_ns.items()
            for i in range(0, len(keys), DELETE_BATCH)
        ]
        for ns, keys in batches:
            before, failed = backend.stats.errors, backend.delete_faults
            try:
                deleted += await backend.delete(ns, keys)
            except self._faults as err:
                self._fault("delete failed", err)
                problem = f"deleting pages failed: {describe_fault(err)}"
                break
            self._watch(backend, before)
            if backend.delete_faults > failed:
                problem = "deleting pages failed (the backend's log says why)"
                break
            for k in keys:
                self._known.pop((ns, k), None)
        self.counters.l3_flushed_pages += deleted
        if reclaim and problem is None:
            try:
                await backend.release_space()
            except self._faults as err:
                self._fault("releasing disk space failed", err)
        return deleted, problem

    async def _list(
        self, backend: StorageBackend, wanted: set[bytes] | None
    ) -> tuple[list[tuple[bytes, bytes]], str | None]:
        """``(ns, key)`` of the store's pages of ``wanted`` (None: all): the store's own
        listing, else the keys this daemon wrote (remembered only for a backend without
        ``list_keys``); and why the listing failed (None: it did not)."""
        before = backend.stats.errors
        try:
            listed = await backend.list_keys(wanted)
        except self._faults as err:
            self._fault("listing keys failed", err)
            return [], f"listing pages failed: {describe_fault(err)}"
        self._watch(backend, before)
        if listed is not None:
            return listed, None
        if self._lists:  # a store that lists answers None on a fault
            return [], "listing pages failed (the backend's log says why)"
        return [(ns, key) for ns, key in self._known if wanted is None or ns in wanted], None

    def _note_known(self, ns: bytes, keys: list[bytes]) -> None:
        for k in keys:
            self._known[(ns, k)] = None
        while len(self._known) > MAX_KNOWN:
            del self._known[next(iter(self._known))]

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, object]:
        """``backend``, ``healthy`` and the backend's own counters (stable keys)."""
        backend = self.backend
        stats = backend.stats if backend is not None else BackendStats()
        return {
            "backend": self.name,
            "healthy": bool(backend is not None and self.healthy),
            **dataclasses.asdict(stats),
        }
