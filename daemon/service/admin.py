"""Operator requests: HEALTH, STATS (the snapshot), FLUSH, SYNC, the admin token, and
SIGHUP reload.

These are what ``kvtier health|stats|sessions|flush|sync`` and the metrics endpoint use.

Who sees what (the admin token is compared in constant time):

- No tenants configured: as the admin token says. None set: everyone sees and flushes
  everything; one set: STATS, SYNC and FLUSH must present it. Either way a FLUSH that
  names a session (no token needed) drops that session's own namespace's pages only.
- Tenants configured: the admin token, when one is set, sees and flushes everything. Any
  other STATS or FLUSH is scoped to one caller's tenants: the tenant of the session a FLUSH
  names, else the tenants of the sessions registered over the requesting connection, else
  the tenant whose token the request carries (in its ``admin_token`` field). A scoped STATS
  shows only those tenants' sessions and page counts (no daemon-wide pool, counters or L3
  numbers: they would tell one tenant about another's traffic); a scoped FLUSH drops only
  their pages. A request with none of these is refused UNAUTHORIZED, naming
  ``admin_token``: with tenants, nobody sees every tenant's data without it. SYNC is
  admin-only: with tenants and no admin token set, nobody may SYNC.

HEALTH is ``ok``, ``stopping``, or ``degraded: <what>`` while L3 is configured but not
serving (the guard's cause: not open, or down, and why; L2 keeps serving then), or for a
minute after the daemon ran short of address space, memory or descriptors
(:mod:`~kvtier.daemon.service.strain`; only the requests that needed more were refused).

A reload applies only the fields that can change while running; any other change refuses
the whole reload, so a configuration is never half applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.config import DaemonConfig, KvtierError
from kvtier.daemon.service.answers import Answer, Deferred, Handler
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.sdnotify import SystemdNotifier
from kvtier.daemon.service.sessions import Session
from kvtier.daemon.service.validation import RequestError
from kvtier.daemon.service.refusal_log import RefusalLog
from kvtier.daemon.storage.options import EXTRA_CONFIG_FIELD, parse_extra_config
from kvtier.ipc import protocol as P

log = logging.getLogger("kvtier.daemon")


def _unauthorized(has_admin: bool) -> str:
    """An UNAUTHORIZED refusal's message when tenants are configured and the request
    carried neither the admin token nor a tenant's: what would be accepted."""
    if has_admin:
        return (
            "admin_token missing or wrong: pass the admin token for the whole view, or a "
            "tenant's token for that tenant's"
        )
    return (
        "no tenant token: pass a tenant's token for that tenant's view (admin_token is not "
        "set on kvtierd: set it there for the whole view)"
    )


RELOAD_READ_S = 10.0
"""The longest a reload waits for the configuration to be read (a file on a stuck mount, a
FIFO): past it the reload is refused and the configuration in force stays."""

LIVE_FIELDS = frozenset(
    {
        "max_sessions_per_user",
        "max_handover_connections_per_user",
        "max_handover_connections",
        "max_handovers_waiting_per_user",
        "max_handovers_waiting",
        "max_handover_descriptors_per_user",
        "max_mapped_bytes_per_user",
        "max_mapped_bytes",
        "max_mapped_segments_per_user",
        "log_level",
        "lease_s",
        "shutdown_timeout_s",
        "max_keys_per_request",
        "max_message_bytes",
        "hicache_storage_prefetch_policy",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "prefetch_timeout_max",
        "prefetch_concurrency",
        "write_back_queue",
        "hicache_write_policy",
        "storage_timeout_s",
        "tp_group_timeout_s",
    }
)
"""Fields SIGHUP may change without a restart; anything else is refused with a log line."""
FLUSH_TIERS = ("l2", "l3", "all")
"""Tiers a FLUSH may name."""

MAX_NAMESPACES_LISTED = 4096
"""The most namespaces a STATS that asks for them lists (those holding the most pages)."""

FLUSH_WAIT_S = 30.0
"""Longest a FLUSH waits for the prefetch reads and L3 writes in flight before it drops
pages (a page one of them still holds then stays: see docs/protocol.md)."""


class Admin:
    """The operator requests and the live reload.

    Args:
        ctx: the daemon's shared state.
        notifier: tells systemd about a reload (RELOADING=1, then READY=1).
        reload_source: re-reads the configuration; None when there is nothing to re-read.
    """

    def __init__(
        self,
        ctx: ServiceContext,
        notifier: SystemdNotifier,
        reload_source: Callable[[], DaemonConfig] | None = None,
    ) -> None:
        self.ctx = ctx
        self.notifier = notifier
        self._refusals = RefusalLog(log)  # a wrong admin token's line, once per minute
        self.reload_source = reload_source
        self._reloading: asyncio.Task[None] | None = None
        self._reload_again = False
        self._reader: threading.Thread | None = None  # the last reload's read
        try:  # the L3 backend's settings, as it read them at its open
            self._extra_in_force = parse_extra_config(getattr(ctx.cfg, EXTRA_CONFIG_FIELD))
        except KvtierError:  # none such opened; any setting read at a reload then differs
            self._extra_in_force = {}

    def table(self) -> dict[type, Handler]:
        """The handler of each operator request type."""
        return {P.Health: self.health, P.Stats: self.stats, P.Flush: self.flush, P.Sync: self.sync}

    def is_admin(self, token: str) -> bool:
        """Whether ``token`` is the configured admin token (False when none is set)."""
        want = self.ctx.cfg.admin_token
        return want is not None and hmac.compare_digest(
            want.get_secret_value().encode(), token.encode()
        )

    def scope(self, identity: bytes, token: str) -> frozenset[str] | None:
        """The tenants a STATS or an admin FLUSH may see (None: every tenant).

        Args:
            identity: the requesting connection.
            token: the request's ``admin_token`` field.

        Returns:
            None for the admin (or anyone, when no tenants are configured and no admin
            token is set); else the caller's tenants (see the module docstring).

        Raises:
            RequestError: UNAUTHORIZED: a wrong admin token without tenants, or no scope
                with tenants.
        """
        tenants = self.ctx.cfg.tenants
        if not tenants or self.is_admin(token):
            self.check_admin(token)
            return None
        mine = frozenset(s.tenant for s in self.ctx.sessions.of_identity(identity) if s.is_open())
        if not mine and token:
            mine = frozenset(
                name
                for name, t in tenants.items()
                if hmac.compare_digest(t.token.get_secret_value().encode(), token.encode())
            )
        if mine:
            return mine
        has_admin = self.ctx.cfg.admin_token is not None
        self._refusals.log(
            logging.WARNING,
            "admin",
            "admin request refused: %s",
            "missing or wrong admin token"
            if has_admin
            else "tenants are configured, no admin_token is set, no tenant credential",
        )
        raise RequestError(P.ErrorCode.UNAUTHORIZED, _unauthorized(has_admin))

    def check_admin(self, token: str) -> None:
        """Check an operator request's admin token (anything passes when none is set).

        Raises:
            RequestError: UNAUTHORIZED.
        """
        want = self.ctx.cfg.admin_token
        if want is not None and not hmac.compare_digest(
            want.get_secret_value().encode(), token.encode()
        ):
            self._refusals.log(
                logging.WARNING,
                "admin",
                "admin request refused: %s admin token",
                "missing" if not token else "wrong",
            )
            raise RequestError(P.ErrorCode.UNAUTHORIZED, "admin_token: missing or wrong")

    # ------------------------------------------------------------------ HEALTH
    def health(self, identity: bytes, m: P.Health) -> P.Reply:
        """HEALTH: ``ok``, ``stopping`` or ``degraded: <why>``, and the session count (no
        session or token needed)."""
        ctx = self.ctx
        problems = []
        short = ctx.strain.problem()
        if short is not None:
            problems.append(f"{short} (requests that need more are refused; others are served)")
        l3 = ctx.tier.l3.problem()
        if l3 is not None:
            problems.append(f"{l3}; L2 keeps serving")
        state = ctx.tier.state_problem()
        if state is not None:
            problems.append(f"{state} (state_dir); new namespaces wait for L3, L2 keeps serving")
        status = (
            "stopping"
            if ctx.stopping
            else "ok"
            if not problems
            else "degraded: " + "; ".join(problems)
        )
        return P.HealthReply(
            req_id=m.req_id,
            epoch=ctx.epoch,
            status=status,
            sessions=len(ctx.sessions),
            protocol_version=P.PROTOCOL_VERSION,
        )

    # ------------------------------------------------------------------ STATS
    def stats(self, identity: bytes, m: P.Stats) -> P.Reply:
        """STATS: the snapshot (scoped to the caller's tenants unless admin)."""
        scope = self.scope(identity, m.admin_token)
        snap = self.snapshot() if scope is None else self.tenant_snapshot(scope)
        if m.namespaces:
            snap["namespaces"], snap["namespaces_total"] = self._namespaces(scope)
        return P.StatsReply(req_id=m.req_id, epoch=self.ctx.epoch, stats=snap)

    def _namespaces(self, scope: frozenset[str] | None) -> tuple[list[dict[str, object]], int]:
        """L2's namespaces that hold pages or have a session (of ``scope``'s tenants only,
        when scoped), most pages first, at most :data:`MAX_NAMESPACES_LISTED`: each one's
        ``namespace`` (64 hex digits, as FLUSH takes it), ``pages`` (READY in L2),
        ``sessions``, ``tenant`` (``default`` without tenants; with tenants, "" when not
        known: adopted, neither saved nor told by the pool's owners, and not registered
        since) and ``models`` (its sessions' model ids, else the one it was last registered
        with, since the start or, with KV events, before it); and how many there are in
        all."""
        ctx = self.ctx
        counts = ctx.pool.ready_counts()
        live: dict[bytes, list[Session]] = {}
        for s in ctx.sessions:
            live.setdefault(s.ns_fingerprint, []).append(s)
        rows: list[tuple[int, str, dict[str, object]]] = []
        for fp, ns_id in ctx.pool.namespaces().items():
            pages, sessions = counts.get(ns_id, 0), live.get(fp, [])
            if not pages and not sessions:
                continue
            tenant = ctx.tier.tenant_of(fp) or min((s.tenant for s in sessions), default="")
            if scope is not None and tenant not in scope:
                continue
            models = {s.model_id for s in sessions} or {ctx.tier.model_of(ns_id, fp)}
            if not models - {""} and ctx.events is not None:  # named before a restart
                models = {ctx.events.model_of(fp)}
            models.discard("")
            row = {
                "namespace": fp.hex(),
                "pages": pages,
                "sessions": len(sessions),
                "tenant": tenant,
                "models": sorted(models),
            }
            rows.append((-pages, fp.hex(), row))
        rows.sort(key=lambda r: r[:2])
        return [row for _, _, row in rows[:MAX_NAMESPACES_LISTED]], len(rows)

    def tenant_snapshot(self, tenants: frozenset[str]) -> dict[str, object]:
        """The STATS reply of a caller scoped to ``tenants``.

        Returns:
            ``epoch``, ``uptime_s``, ``scope`` (``{"tenants": [...]}``), ``tenants`` (per
            tenant: ``pages`` held in L2 and ``quota_pages``) and that tenant's
            ``sessions``; nothing daemon-wide.
        """
        ctx = self.ctx
        quotas = ctx.cfg.tenants
        return {
            "epoch": f"{ctx.epoch:x}",
            "uptime_s": round(time.monotonic() - ctx.started, 3),
            "scope": {"tenants": sorted(tenants)},
            "tenants": {
                t: {
                    "pages": ctx.pool.owned_pages(ctx.pool.owner_id(t)),
                    "quota_pages": quotas[t].quota_pages if t in quotas else None,
                }
                for t in sorted(tenants)
            },
            "sessions": [row for row in self._sessions() if row["tenant"] in tenants],
        }

    def _sessions(self) -> list[dict[str, object]]:
        return [
            {
                "session_id": s.session_id,
                "tenant": s.tenant,
                "model_id": s.model_id,
                "namespace": s.ns_fingerprint.hex(),
                "pid": s.pid,
                "tp_rank": s.tp_rank,
                "tp_size": s.tp_size,
                "state": s.state.value,
                "page_bytes": s.geometry.page_bytes,
                "num_pages": s.memory.num_pages,
                "transfers": len(s.transfers),
            }
            for s in self.ctx.sessions
        ]

    def snapshot(self) -> dict[str, object]:
        """Return counters, pool use and sessions as a plain dict (the STATS reply).

        Returns:
            ``epoch``, ``uptime_s``, ``pool``, ``counters``, ``window`` (the last
            minute's L2 page hit rate), ``l3``, ``adopt``, ``sessions`` and ``limits`` (the
            per-user bounds, each user's use of them, the refusals); the metrics endpoint
            turns the same dict into its series.
        """
        ctx = self.ctx
        ps = ctx.pool.stats()
        return {
            "epoch": f"{ctx.epoch:x}",
            "uptime_s": round(time.monotonic() - ctx.started, 3),
            "pool": dataclasses.asdict(ps),
            "counters": ctx.counters.as_dict(),
            "window": ctx.hit_window.as_dict(),
            "l3": ctx.tier.snapshot(),
            "adopt": dataclasses.asdict(ctx.adopt) if ctx.adopt is not None else {},
            "sessions": self._sessions(),
            "limits": self._limits(),
        }

    def _limits(self) -> dict[str, object]:
        """The per-user bounds in force, each user's use of them, and the refusals."""
        ctx = self.ctx
        users: dict[int, dict[str, int]] = {}
        for uid, (conns, waiting) in ctx.handovers.use().items():
            users[uid] = {"handover_connections": conns, "handovers_waiting": waiting}
        for uid, use in ctx.quotas.users.items():
            users.setdefault(uid, {}).update(
                sessions=use.sessions,
                mapped_bytes=use.mapped_bytes,
                mapped_segments=use.mapped_segments,
            )
        for uid, queued in ctx.prefaults.queued().items():
            users.setdefault(uid, {})["prefaults_queued"] = queued
        for uid, conns in ctx.connections.use().items():  # uid -1: tcp peers
            users.setdefault(uid, {})["connections"] = conns
        total, per_user = ctx.connections.bounds()
        refusals = ctx.connections.refusals
        return {
            "bounds": {
                **ctx.quotas.limits(),
                "connections": total,
                "connections_per_user": per_user,
            },
            "users": {str(uid): use for uid, use in sorted(users.items())},
            "tenants": {t: dataclasses.asdict(u) for t, u in sorted(ctx.quotas.tenants.items())},
            "mapped_bytes": ctx.quotas.mapped_bytes,
            "unmap_pending_bytes": ctx.unmaps.pending_bytes,
            "unmaps": {"thread": ctx.unmaps.unmapped, "at_once": ctx.unmaps.inline},
            "refusals": {  # a setting several refuse by (descriptors) counts them all
                k: ctx.handovers.refusals.get(k, 0)
                + ctx.quotas.refusals.get(k, 0)
                + refusals.get(k, 0)
                for k in ctx.handovers.refusals.keys()
                | ctx.quotas.refusals.keys()
                | refusals.keys()
            },
            "shortages": ctx.strain.count,
        }

    # ------------------------------------------------------------------ FLUSH
    def flush(self, identity: bytes, m: P.Flush) -> Answer:
        """FLUSH: drop pages from L2, L3 or both (a session: its own tenant's only; see the
        module docstring for who may flush what)."""
        ctx = self.ctx
        if m.tier not in FLUSH_TIERS:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"tier = {m.tier!r} is not l2, l3 or all")
        ns_id = None
        scope: frozenset[str] | None = None
        own: bytes | None = None
        if m.session_id and ctx.cfg.tenants:  # a session may flush its own tenant's pages
            scope = frozenset((ctx.session(identity, m.session_id).tenant,))
        elif m.session_id:  # one tenant for all: the session's own namespace only
            own = ctx.session(identity, m.session_id).ns_fingerprint
        else:
            scope = self.scope(identity, m.admin_token)
        fps: list[bytes] | None = None
        owners: list[int | None] = [None]
        if scope is not None:
            fps = [fp for t in sorted(scope) for fp in ctx.tier.tenant_namespaces(t)]
            owners = [ctx.pool.owner_id(t) for t in sorted(scope)]
        if own is not None:
            fps = [own] if not m.namespace or bytes.fromhex(m.namespace) == own else []
            ns_id = ctx.pool.namespaces().get(own, -1) if fps else -1
        elif m.namespace:
            fp = bytes.fromhex(m.namespace)  # 64 hex digits: checked at decode
            ns_id = ctx.pool.namespaces().get(fp, -1)
            fps = [fp] if fps is None or fp in fps else []
        if ctx.tier.l3.name == "none":  # no read nor write of L3 to wait for; L3 is empty
            l2 = self._flush_l2(m, ns_id, owners, scope) if m.tier in ("l2", "all") else 0
            return P.FlushReply(
                req_id=m.req_id, epoch=ctx.epoch, l2_pages=l2, tenants=_names(scope)
            )
        one = fps[0] if ns_id is not None and fps else None
        return Deferred(self._flush_tiers(m, ns_id, one, owners, scope, fps))

    async def _flush_tiers(
        self,
        m: P.Flush,
        ns_id: int | None,
        one: bytes | None,
        owners: list[int | None],
        scope: frozenset[str] | None,
        fps: list[bytes] | None,
    ) -> P.Reply:
        """FLUSH with an L3 configured: no L3 write nor prefetch of the scope starts
        meanwhile; the scope's prefetches are cancelled and their reads, and the writes in
        flight, waited for (at most :data:`FLUSH_WAIT_S`), so that no page they hold is left
        behind; then L2, then L3. ``one``: the fingerprint of the one namespace flushed,
        whose id is looked up again after the waits (it may have changed hands)."""
        tier = self.ctx.tier
        with tier.writer.paused(), tier.flushing(fps):
            await tier.quiesce(fps, FLUSH_WAIT_S)
            if one is not None:
                ns_id = self.ctx.pool.namespaces().get(one, -1)
            l2 = self._flush_l2(m, ns_id, owners, scope) if m.tier in ("l2", "all") else 0
            if m.tier == "l2":
                return P.FlushReply(
                    req_id=m.req_id, epoch=self.ctx.epoch, l2_pages=l2, tenants=_names(scope)
                )
            l3, problem = await tier.flush(fps, reclaim=m.reclaim)
        events, pool = self.ctx.events, self.ctx.pool
        if events is not None and (problem is None or l3):
            # AllBlocksCleared per namespace, then what L2 still holds (nothing deleted for
            # a fault, L3 down or not listed: it holds what it held)
            ids = pool.namespaces()
            for fp in sorted(ids) if fps is None else fps:
                if fp in ids:
                    events.l3_cleared(ids[fp], pool.ready_pages(ids[fp]))
        if problem is None:
            log.info(
                "flush tier=%s namespace=%s: %d L3 pages deleted", m.tier, m.namespace or "*", l3
            )
        else:
            log.warning(
                "flush tier=%s namespace=%s: %d L3 pages deleted, not all: %s",
                m.tier,
                m.namespace or "*",
                l3,
                problem,
            )
        return P.FlushReply(
            req_id=m.req_id,
            epoch=self.ctx.epoch,
            l2_pages=l2,
            l3_pages=l3,
            l3_error=problem or "",
            tenants=_names(scope),
        )

    def _flush_l2(
        self,
        m: P.Flush,
        ns_id: int | None,
        owners: list[int | None],
        scope: frozenset[str] | None,
    ) -> int:
        """FLUSH's L2 part (on the loop, in one go): drop the scope's evictable pages and
        announce them removed; the pages dropped."""
        ctx = self.ctx
        before = self._l2_keys(ns_id) if ctx.events is not None else {}
        with ctx.tier.writer.flush_guard():
            l2 = sum(ctx.pool.flush(ns_id=ns_id, owner=owner) for owner in owners)
        ctx.tier.prefetcher.sweep()
        for ns, keys in before.items():  # BlockRemoved of what the flush dropped
            assert ctx.events is not None
            left = {k for k, _ in ctx.pool.ready_pages(ns)}
            ctx.events.l2_dropped(ns, [k for k in keys if k not in left])
        log.info(
            "flush tier=%s namespace=%s tenants=%s: %d L2 pages dropped",
            m.tier,
            m.namespace or "*",
            ",".join(sorted(scope)) if scope is not None else "*",
            l2,
        )
        return l2

    def _l2_keys(self, ns_id: int | None) -> dict[int, list[bytes]]:
        """The READY keys of ``ns_id`` (None: of every namespace), per namespace."""
        pool = self.ctx.pool
        ids = [ns_id] if ns_id is not None else sorted(set(pool.namespaces().values()))
        return {i: [k for k, _ in pool.ready_pages(i)] for i in ids if i >= 0}

    # ------------------------------------------------------------------ SYNC
    def sync(self, identity: bytes, m: P.Sync) -> Answer:
        """SYNC: wait until the pages queued for L3 are written (or ``timeout_s`` passes)."""
        ctx = self.ctx
        if ctx.cfg.tenants and not self.is_admin(m.admin_token):
            log.warning("SYNC refused: tenants are configured and it has no admin token")
            raise RequestError(
                P.ErrorCode.UNAUTHORIZED,
                "admin_token: "
                + ("missing or wrong" if ctx.cfg.admin_token is not None else "not set")
                + "; with tenants configured SYNC needs the admin token (its reply counts "
                "every tenant's pages)",
            )
        self.check_admin(m.admin_token)
        if ctx.tier.l3.name == "none":
            raise RequestError(
                P.ErrorCode.BAD_MESSAGE, "sync: no L3 backend (hicache_storage_backend = 'none')"
            )
        if not ctx.tier.available:  # not open: nothing can be written now; say how much waits
            unsaved = ctx.tier.writer.unsaved()
            return P.SyncReply(
                req_id=m.req_id,
                epoch=ctx.epoch,
                pages=unsaved,
                written=0,
                failed=0,
                left=unsaved,
                l3_error=ctx.tier.l3.problem() or "",
            )
        return Deferred(self._sync_async(m))

    async def _sync_async(self, m: P.Sync) -> P.Reply:
        start = time.perf_counter()
        # a health check first: a store found replaced (a restarted Redis) loses its
        # in-L3 marks before the pages to write are chosen
        await self.ctx.tier.l3.check()
        pages, written, failed, left = await self.ctx.tier.writer.sync(m.timeout_s)
        log.info(
            "sync: %d pages, %d written, %d not written, %d left, in %.3f s",
            pages,
            written,
            failed,
            left,
            time.perf_counter() - start,
        )
        l3 = self.ctx.tier.l3
        return P.SyncReply(
            req_id=m.req_id,
            epoch=self.ctx.epoch,
            pages=pages,
            written=written,
            failed=failed,
            left=left,
            l3_error=l3.problem() or "",
        )

    # ------------------------------------------------------------------ RELOAD
    def reload(self) -> None:
        """Re-read the configuration (SIGHUP) and apply the fields that can change live.

        The file is read and checked on a thread (a slow or stuck file system never holds
        the event loop, at most :data:`RELOAD_READ_S`), the result applied on the loop. One
        reload at a time: a SIGHUP during one makes another run after it."""
        if self.reload_source is None:
            log.warning("reload: no configuration source to re-read")
            return
        if self._reloading is not None:
            self._reload_again = True
            return
        self._reloading = asyncio.get_running_loop().create_task(self._reloads())

    def stop_reloading(self) -> None:
        """A stop has begun: a reload running ends where it is, none applies or is told."""
        if self._reloading is not None:
            self._reloading.cancel()

    async def _reloads(self) -> None:
        try:
            again = True
            while again and not self.ctx.stopping:
                self._reload_again = False
                self.notifier.reloading()
                try:
                    await self._reload()
                finally:  # systemd waits for READY=1 after RELOADING=1, whatever happened
                    if not self.ctx.stopping:
                        self.notifier.ready()
                again = self._reload_again
        finally:
            self._reloading = None

    async def _reload(self) -> None:
        assert self.reload_source is not None
        if self._reader is not None and self._reader.is_alive():
            log.error(
                "reload rejected, configuration unchanged: the last read of it has not "
                "returned (a file on a stuck mount, a FIFO?)"
            )
            return
        loop = asyncio.get_running_loop()
        read: asyncio.Future[tuple[DaemonConfig, dict[str, Any]]] = loop.create_future()

        def work() -> None:  # a thread of its own: one stuck for good never holds the exit
            try:
                result = self._read()
            except BaseException as err:  # handed to the loop, which logs it
                _settle(loop, read, error=err)
            else:
                _settle(loop, read, result=result)

        self._reader = threading.Thread(target=work, name="kvtier-reload", daemon=True)
        self._reader.start()
        try:
            new, extra = await asyncio.wait_for(asyncio.shield(read), RELOAD_READ_S)
        except TimeoutError:
            log.error(
                "reload rejected, configuration unchanged: reading it took more than %g s",
                RELOAD_READ_S,
            )
            return
        except KvtierError as err:
            log.error("reload rejected, configuration unchanged: %s", err)
            return
        except Exception as err:  # a bug: still one line, and the daemon goes on
            log.exception("reload rejected, configuration unchanged: %s", err)
            return
        if not self.ctx.stopping:
            self._apply(new, extra)

    def _read(self) -> tuple[DaemonConfig, dict[str, Any]]:
        """The configuration as its sources say now, and the L3 backend's settings it names
        (an ``@file`` read too: its contents may have changed under the same name)."""
        assert self.reload_source is not None
        new = self.reload_source()
        return new, parse_extra_config(getattr(new, EXTRA_CONFIG_FIELD))

    def _apply(self, new: DaemonConfig, extra: dict[str, Any]) -> None:
        """Apply ``new`` if every field that differs can change live, else nothing;
        ``extra`` is its L3 backend settings, set against those the backend runs with."""
        old = self.ctx.cfg
        changed = {k for k in DaemonConfig.model_fields if getattr(new, k) != getattr(old, k)}
        changed.discard(EXTRA_CONFIG_FIELD)  # its settings count, not how they are written
        if extra != self._extra_in_force:
            changed.add(EXTRA_CONFIG_FIELD)
        fixed = sorted(changed - LIVE_FIELDS)
        overrides = self.ctx.tier.l3.overrides
        shadowed = sorted(k for k in changed if k in overrides)
        if fixed:
            log.error(
                "reload: %s cannot change while running (restart kvtierd to apply); "
                "nothing was changed",
                ", ".join(fixed),
            )
        elif shadowed:  # the change would be logged as applied and have no effect
            log.error(
                "reload: %s set in %s overrides %s; nothing was changed (change it there "
                "and restart kvtierd, or remove it there to use the setting)",
                ", ".join(f"{k} = {overrides[k]:g}" for k in shadowed),
                EXTRA_CONFIG_FIELD,
                ", ".join(shadowed),
            )
        else:
            self.ctx.cfg = new
            self.ctx.tier.reconfigure(new)
            if "lease_s" in changed:  # each session renews by the lease it was given
                for sess in self.ctx.sessions:
                    sess.lease_s = new.lease_s
            # the operator's confirmation that the reload was read: at WARNING, or at the
            # level set before or after it when that is higher (log_level "error")
            kvtier_log = logging.getLogger("kvtier")
            shown = max(
                logging.WARNING,
                kvtier_log.getEffectiveLevel(),
                logging.getLevelName(new.log_level.upper()),
            )
            log.log(shown, "reload: applied %s", ", ".join(sorted(changed)) or "no changes")
            kvtier_log.setLevel(new.log_level.upper())


def _settle(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """From another thread: give ``fut`` its result or error on ``loop`` (unless it was
    given up on, or the loop has closed)."""

    def give() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(give)
    except RuntimeError:  # the loop has closed: nobody waits any more
        pass


def _names(scope: frozenset[str] | None) -> tuple[str, ...]:
    """A FLUSH's tenants for its reply (empty: not limited by tenant)."""
    return () if scope is None else tuple(sorted(scope))
