"""Operator requests: STATS (the snapshot), FLUSH, SYNC, the admin token, and SIGHUP reload.

These are what ``kvtier stats|flush|sync`` and the metrics endpoint use. When ``admin_token``
is set, STATS, SYNC and an admin FLUSH must present it (compared in constant time); a
session may FLUSH its own tenant's pages without it. A reload applies only the fields that
can change while running; any other change refuses the whole reload, so a configuration
is never half applied.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from collections.abc import Callable

from kvtier.config import DaemonConfig, KvtierError
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.sdnotify import SystemdNotifier
from kvtier.daemon.service.validation import RequestError, check_sync_timeout, parse_namespace
from kvtier.ipc import protocol as P

log = logging.getLogger("kvtier.daemon")

LIVE_FIELDS = frozenset({
    "log_level", "lease_s", "shutdown_timeout_s", "max_keys_per_request", "max_message_bytes",
    "hicache_storage_prefetch_policy", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max", "prefetch_concurrency",
    "write_back_queue", "hicache_write_policy", "storage_timeout_s", "tp_group_timeout_s",
})
"""Fields SIGHUP may change without a restart; anything else is refused with a log line."""
FLUSH_TIERS = ("l2", "l3", "all")
"""Tiers a FLUSH may name."""


class Admin:
    """The operator requests and the live reload.

    Args:
        ctx: the daemon's shared state.
        notifier: tells systemd about a reload (RELOADING=1, then READY=1).
        reload_source: re-reads the configuration; None when there is nothing to re-read.
    """

    def __init__(self, ctx: ServiceContext, notifier: SystemdNotifier,
                 reload_source: Callable[[], DaemonConfig] | None = None) -> None:
        self.ctx = ctx
        self.notifier = notifier
        self.reload_source = reload_source

    def table(self) -> dict[type, Callable]:
        """The handler of each operator request type."""
        return {P.Stats: self.stats, P.Flush: self.flush, P.Sync: self.sync}

    def check_admin(self, token: str) -> None:
        """Check an operator request's admin token (anything passes when none is set).

        Raises:
            RequestError: UNAUTHORIZED.
        """
        want = self.ctx.cfg.admin_token
        if want is not None and not hmac.compare_digest(want.get_secret_value().encode(),
                                                        token.encode()):
            log.warning("admin request refused: %s admin token", "missing" if not token else "wrong")
            raise RequestError(P.ErrorCode.UNAUTHORIZED, "admin_token: missing or wrong")

    # ------------------------------------------------------------------ STATS
    def stats(self, identity: bytes, m: P.Stats) -> P.Reply:
        """STATS: the snapshot."""
        self.check_admin(m.admin_token)
        return P.StatsReply(req_id=m.req_id, epoch=self.ctx.epoch, stats=self.snapshot())

    def snapshot(self) -> dict[str, object]:
        """Return counters, pool use and sessions as a plain dict (the STATS reply).

        Returns:
            ``epoch``, ``uptime_s``, ``pool``, ``counters``, ``l3``, ``adopt`` and
            ``sessions``; the metrics endpoint turns the same dict into its series.
        """
        ctx = self.ctx
        ps = ctx.pool.stats()
        return {
            "epoch": f"{ctx.epoch:x}",
            "uptime_s": round(time.time() - ctx.started, 3),
            "pool": dataclasses.asdict(ps),
            "counters": ctx.counters.as_dict(),
            "l3": ctx.tier.snapshot(),
            "adopt": dataclasses.asdict(ctx.adopt) if ctx.adopt is not None else {},
            "sessions": [
                {"session_id": s.session_id, "tenant": s.tenant, "pid": s.pid,
                 "tp_rank": s.tp_rank, "tp_size": s.tp_size, "state": s.state.value,
                 "page_bytes": s.geometry.page_bytes, "num_pages": s.memory.num_pages,
                 "transfers": len(s.transfers)}
                for s in ctx.sessions
            ],
        }

    # ------------------------------------------------------------------ FLUSH
    def flush(self, identity: bytes, m: P.Flush) -> P.Reply:
        """FLUSH: drop pages from L2, L3 or both (a session: its own tenant's only)."""
        ctx = self.ctx
        if m.tier not in FLUSH_TIERS:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"tier = {m.tier!r} is not l2, l3 or all")
        ns_id = owner = None
        tenant: str | None = None
        if m.session_id:  # a session may flush only its own tenant's pages
            s = ctx.session(identity, m.session_id)
            owner, tenant = s.owner, s.tenant
        else:
            self.check_admin(m.admin_token)
        fps: list[bytes] | None = None if tenant is None else ctx.tier.tenant_namespaces(tenant)
        if m.namespace:
            fp = parse_namespace(m.namespace)
            ns_id = ctx.pool.namespaces().get(fp, -1)
            fps = [fp] if fps is None or fp in fps else []
        l2 = 0
        if m.tier in ("l2", "all"):
            with ctx.tier.writer.flush_guard():
                l2 = ctx.pool.flush(ns_id=ns_id, owner=owner)
            ctx.tier.prefetcher.sweep()
        log.info("flush tier=%s namespace=%s owner=%s: %d L2 pages dropped", m.tier,
                 m.namespace or "*", owner if owner is not None else "*", l2)
        if m.tier == "l2" or not ctx.tier.available:
            return P.FlushReply(req_id=m.req_id, epoch=ctx.epoch, l2_pages=l2, l3_pages=0)
        return self._flush_l3(m, l2, fps)

    async def _flush_l3(self, m: P.Flush, l2: int, fps: list[bytes] | None) -> P.Reply:
        l3 = await self.ctx.tier.flush(fps)
        log.info("flush tier=%s namespace=%s: %d L3 pages deleted", m.tier, m.namespace or "*", l3)
        return P.FlushReply(req_id=m.req_id, epoch=self.ctx.epoch, l2_pages=l2, l3_pages=l3)

    # ------------------------------------------------------------------ SYNC
    def sync(self, identity: bytes, m: P.Sync) -> P.Reply:
        """SYNC: wait until the pages queued for L3 are written (or ``timeout_s`` passes)."""
        ctx = self.ctx
        self.check_admin(m.admin_token)
        check_sync_timeout(m.timeout_s)
        if ctx.tier.l3.name == "none":
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               "sync: no L3 backend (hicache_storage_backend = 'none')")
        if not ctx.tier.available:  # down: nothing can be written now; say how much waits
            queued = ctx.tier.writer.queued
            return P.SyncReply(req_id=m.req_id, epoch=ctx.epoch, pages=queued, written=0,
                               failed=0, left=queued)
        return self._sync_async(m)

    async def _sync_async(self, m: P.Sync) -> P.Reply:
        start = time.perf_counter()
        pages, written, failed, left = await self.ctx.tier.writer.sync(m.timeout_s)
        log.info("sync: %d pages, %d written, %d not written, %d left, in %.3f s", pages, written,
                 failed, left, time.perf_counter() - start)
        return P.SyncReply(req_id=m.req_id, epoch=self.ctx.epoch, pages=pages, written=written,
                           failed=failed, left=left)

    # ------------------------------------------------------------------ RELOAD
    def reload(self) -> None:
        """Re-read the configuration (SIGHUP) and apply the fields that can change live."""
        if self.reload_source is None:
            log.warning("reload: no configuration source to re-read")
            return
        self.notifier.reloading()
        try:
            new = self.reload_source()
        except KvtierError as err:
            log.error("reload rejected, configuration unchanged: %s", err)
            self.notifier.ready()
            return
        old = self.ctx.cfg
        changed = {k for k in DaemonConfig.model_fields if getattr(new, k) != getattr(old, k)}
        fixed = sorted(changed - LIVE_FIELDS)
        if fixed:
            log.error("reload: %s cannot change while running (restart kvtierd to apply); "
                      "nothing was changed", ", ".join(fixed))
        else:
            self.ctx.cfg = new
            self.ctx.tier.reconfigure(new)
            logging.getLogger("kvtier").setLevel(new.log_level.upper())
            log.info("reload: applied %s", ", ".join(sorted(changed)) or "no changes")
        self.notifier.ready()
