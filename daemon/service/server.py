"""kvtierd's server: the ZeroMQ ROUTER loop, request dispatch, sessions and transfers.

The L3 tier (backend, prefetch and claim, writes to L3, tensor-parallel rank groups) is
:class:`~kvtier.daemon.tier.tier.TierStore`; the handlers here validate requests and call
into it. A handler that must wait (L3 I/O, a claim, the other ranks of a group) returns a
coroutine, answered from its own task while the loop keeps serving everyone else.

Shutdown order (as uvicorn does it): stop accepting → cancel running transfers and wait
for them with a deadline → close sessions → give prefetches up and write to L3 what the
write policy asks for (same deadline) → close the L3 backend → close the socket → unmap
the pool. Resources live in an ``AsyncExitStack``, entered in order and closed in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from kvtier.config import DaemonConfig, KvtierError, format_size, runtime_dir, socket_path
from kvtier.config.loader import pool_path
from kvtier.daemon.counters import Counters
from kvtier.daemon.pool.index import HostPool, HostPoolError
from kvtier.daemon.pool.layout import (
    AdoptResult,
    map_pool_file,
)
from kvtier.daemon.service.sdnotify import SystemdNotifier, watchdog_loop
from kvtier.daemon.service.sessions import Session, SessionState, SessionTable
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.registry import slot_headroom
from kvtier.daemon.tier.rank_groups import GroupKey
from kvtier.daemon.tier.tier import TierStore
from kvtier.daemon.transfer.engine_memory import EngineMemory, EngineMemoryError
from kvtier.daemon.transfer.transfer import Direction, Transfer, run_transfer
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.ipc.namespace import namespace_fingerprint
from kvtier.ipc.shm import SharedMemorySegment
from kvtier.ipc.sockets import ipc_endpoint, make_zmq_socket

if TYPE_CHECKING:
    from kvtier.daemon.service.metrics import DaemonMetrics

log = logging.getLogger("kvtier.daemon")
COMPLETION_SLOTS = 64
# Fields SIGHUP may change without a restart; anything else is refused with a log line.
LIVE_FIELDS = frozenset({
    "log_level", "lease_s", "shutdown_timeout_s", "max_keys_per_request", "max_message_bytes",
    "hicache_storage_prefetch_policy", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max", "prefetch_concurrency",
    "write_back_queue", "hicache_write_policy", "storage_timeout_s", "tp_group_timeout_s",
})
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MAX_SYNC_TIMEOUT_S = 3600.0
"""Longest a SYNC may ask the daemon to wait."""
DEFAULT_TENANT = "default"


class RequestError(KvtierError):
    """A request refused with an error code; nothing was changed."""

    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Daemon:
    """One kvtierd instance. ``await run()`` serves until :meth:`request_stop`."""

    def __init__(self, cfg: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None,
                 notifier: SystemdNotifier | None = None) -> None:
        self.cfg = cfg
        self._reload_source = reload
        self.notifier = notifier or SystemdNotifier()
        self.metrics: DaemonMetrics | None = None  # set when metrics_port is
        self.rdir = runtime_dir(cfg.runtime_dir)
        self.endpoint = ipc_endpoint(socket_path(self.rdir))
        self.epoch = secrets.randbits(62) | 1
        self.sessions = SessionTable()
        self.pool = HostPool.from_config(cfg, slot_headroom(cfg.hicache_storage_backend))
        self.counters = Counters()
        self.tier = TierStore(cfg, self.pool, self.counters, self.rdir)
        self.started = time.time()
        self._stop = asyncio.Event()
        self._stopping = False
        self.adopt: AdoptResult | None = None  # what the start made of the pool file it found
        self._inflight: set[asyncio.Future] = set()
        self._tasks: set[asyncio.Task] = set()
        self._arena_seg: SharedMemorySegment | None = None
        self._arena = None
        self._executor: ThreadPoolExecutor | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._handlers: dict[type, Callable] = {
            P.Register: self._register, P.Heartbeat: self._heartbeat, P.Lookup: self._lookup,
            P.Store: self._store, P.Load: self._load, P.Release: self._release,
            P.Unregister: self._unregister, P.Stats: self._stats, P.Health: self._health,
            P.Flush: self._flush, P.Prefetch: self._prefetch, P.Claim: self._claim,
            P.Sync: self._sync,
        }

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        """Begin a graceful stop (safe to call from a signal handler)."""
        self._stop.set()

    async def run(self, on_ready: Callable[[Daemon], None] | None = None) -> None:
        """Set everything up, serve until stopped, then shut down in order."""
        async with contextlib.AsyncExitStack() as stack:
            self.rdir.mkdir(parents=True, exist_ok=True, mode=0o750)
            ppath = pool_path(self.cfg.pool_dir, self.rdir)
            arena_view = self._open_pool(ppath, stack)
            layout = self.pool.layout
            assert self._arena_seg is not None
            seg = self._arena_seg
            self._arena = seg.tensor(layout.arena_offset, layout.capacity_bytes)
            stack.callback(setattr, self, "_arena", None)
            await self.tier.open(HostArena(view=arena_view, size=layout.capacity_bytes,
                                           address=seg.address + layout.arena_offset,
                                           headroom=layout.headroom))
            stack.push_async_callback(self.tier.close)
            self._executor = ThreadPoolExecutor(self.cfg.copy_threads, thread_name_prefix="kvtier-copy")
            stack.callback(self._finalize_remaining)  # runs once the copy threads have ended
            # waited for off the loop, so a second SIGTERM can still end the process at once
            stack.push_async_callback(asyncio.to_thread, self._executor.shutdown, wait=True,
                                      cancel_futures=True)
            ctx = zmq.asyncio.Context()
            stack.callback(ctx.term)
            self._sock = make_zmq_socket(ctx, self.endpoint, zmq.ROUTER, bind=True)
            stack.callback(self._close_socket)
            if self.cfg.metrics_port is not None:
                from kvtier.daemon.service.metrics import DaemonMetrics

                self.metrics = DaemonMetrics(self.snapshot)
                self.metrics.start(self.cfg.metrics_host, self.cfg.metrics_port)
                stack.callback(self.metrics.close)
            log.info("kvtierd ready: %s, pool %s at %s, epoch %x, pid %d", self.endpoint,
                     format_size(self.cfg.hicache_size), ppath, self.epoch, os.getpid())
            self.notifier.ready()
            self._update_status()
            if on_ready is not None:
                on_ready(self)
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self._recv_loop(), name="kvtier-recv"),
                         tg.create_task(self._lease_loop(), name="kvtier-lease"),
                         tg.create_task(self._monitor_loop(), name="kvtier-monitor"),
                         tg.create_task(self.tier.run(), name="kvtier-l3")]
                interval = self.notifier.watchdog_interval()
                if interval is not None:
                    loops.append(tg.create_task(watchdog_loop(self.notifier, interval),
                                                name="kvtier-watchdog"))
                await self._stop.wait()
                self._stopping = True
                self.notifier.stopping()
                log.info("stopping: %d sessions, %d transfers in flight", len(self.sessions),
                         len(self._inflight))
                for task in loops:
                    task.cancel()
            await self._drain()

    def _open_pool(self, ppath: Path, stack: contextlib.AsyncExitStack) -> memoryview:
        """Map the pool file and adopt the pages a previous kvtierd left in it (unless it
        does not fit this configuration, or ``cold_start``); return the arena's view.

        The file outlives the daemon unless ``keep_pool_on_stop`` is off.
        """
        layout = self.pool.layout
        seg, why_new = map_pool_file(ppath, layout, prefault=self.cfg.prefault)
        self._arena_seg = seg
        stack.callback(lambda: seg.close(unlink=not self.cfg.keep_pool_on_stop))
        arena_view = seg.view[layout.arena_offset:layout.arena_offset + layout.capacity_bytes]
        stack.callback(arena_view.release)
        cold = "cold start requested (cold_start)" if self.cfg.cold_start else why_new
        self.adopt = self.pool.adopt(seg.view[:layout.meta_bytes], cold_start=cold,
                                     arena=arena_view if self.cfg.verify_on_adopt else None)
        stack.callback(self.pool.close)  # its views of the metadata go before the mapping
        log.info("%s", self.adopt.summary)
        for name, t in self.cfg.tenants.items():  # owner ids come from the adopted table
            if t.quota_pages is not None:
                self.pool.set_quota(self.pool.owner_id(name), t.quota_pages)
        return arena_view

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            socket_path(self.rdir).unlink()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        for s in self.sessions:
            self._close_session(s, "daemon stopping")
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=self.cfg.shutdown_timeout_s)
            if pending:
                log.warning("%d transfers still running after %.1fs; abandoning them",
                            len(pending), self.cfg.shutdown_timeout_s)
        await self.tier.drain(max(0.0, deadline - time.monotonic()))
        for s in self.sessions:
            if not s.transfers:  # else a copy thread may still touch its memory: see below
                self._finalize_session(s)

    def _finalize_remaining(self) -> None:
        """Finalize the sessions whose transfers outlived the drain, after the copy threads
        are gone (unmapping an engine's memory under a running copy would crash the daemon)."""
        for s in self.sessions:
            self._finalize_session(s)

    # ------------------------------------------------------------------ loops
    async def _recv_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            frames = await sock.recv_multipart(copy=True)
            reply = self._handle(frames)
            if asyncio.iscoroutine(reply):
                # a handler that waits (L3 I/O, a claim): answer from its own task
                task = asyncio.create_task(self._reply_later(frames[0], reply))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif reply is not None:
                await sock.send_multipart([frames[0], P.encode(reply)])

    async def _reply_later(self, identity: bytes, pending) -> None:
        reply = await pending
        if self._sock is not None:
            await self._sock.send_multipart([identity, P.encode(reply)])

    async def _lease_loop(self) -> None:
        period = min(1.0, self.cfg.lease_s / 4)
        ticks = 0
        while True:
            await asyncio.sleep(period)
            self._reap_sessions()
            ticks += 1
            if ticks % max(1, int(5 / period)) == 0:
                self._update_status()

    def _update_status(self) -> None:
        ps = self.pool.stats()
        self.notifier.status(f"{len(self.sessions)} sessions, pool {format_size(ps.used_bytes)} of "
                             f"{format_size(ps.capacity_bytes)} used, {ps.pages_ready} pages")

    def reload(self) -> None:
        """Re-read the configuration (SIGHUP) and apply the fields that can change live."""
        if self._reload_source is None:
            log.warning("reload: no configuration source to re-read")
            return
        self.notifier.reloading()
        try:
            new = self._reload_source()
        except KvtierError as err:
            log.error("reload rejected, configuration unchanged: %s", err)
            self.notifier.ready()
            return
        changed = {k for k in DaemonConfig.model_fields if getattr(new, k) != getattr(self.cfg, k)}
        fixed = sorted(changed - LIVE_FIELDS)
        if fixed:
            log.error("reload: %s cannot change while running (restart kvtierd to apply); "
                      "nothing was changed", ", ".join(fixed))
        else:
            self.cfg = new
            self.tier.reconfigure(new)
            logging.getLogger("kvtier").setLevel(new.log_level.upper())
            log.info("reload: applied %s", ", ".join(sorted(changed)) or "no changes")
        self.notifier.ready()

    async def _monitor_loop(self) -> None:
        """React to a peer disconnecting at once instead of at the next lease check.

        ZeroMQ's monitor names the connection, not the routing identity, so a disconnect
        triggers a liveness check of every session's engine process.
        """
        from zmq.utils.monitor import recv_monitor_message

        assert self._sock is not None
        mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await recv_monitor_message(mon)
                await asyncio.sleep(0.01)  # let the dead process finish exiting
                self._reap_sessions()
        finally:
            self._sock.disable_monitor()
            mon.close(linger=0)

    def _reap_sessions(self) -> None:
        now = time.monotonic()
        for s in self.sessions:
            if s.state is not SessionState.OPEN:
                continue
            if not s.engine_alive():
                self._close_session(s, f"engine process {s.pid} is gone")
            elif s.expired(now):
                self.counters.sessions_expired += 1
                self._close_session(s, "lease expired")

    # ------------------------------------------------------------------ dispatch
    def _handle(self, frames: list[bytes]) -> P.Reply | None:
        self.counters.requests += 1
        if len(frames) != 2:
            return self._error(0, P.ErrorCode.BAD_MESSAGE, f"expected 2 frames, got {len(frames)}")
        body = frames[1]
        if len(body) > self.cfg.max_message_bytes:
            return self._error(P.peek_req_id(body), P.ErrorCode.BAD_MESSAGE,
                               f"message of {len(body)} bytes exceeds max_message_bytes "
                               f"({self.cfg.max_message_bytes})")
        try:
            msg = P.decode_request(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return self._error(P.peek_req_id(body), P.ErrorCode.BAD_MESSAGE, f"bad message: {err}")
        if self._stopping and not isinstance(msg, (P.Health, P.Stats, P.Unregister)):
            return self._error(msg.req_id, P.ErrorCode.SHUTTING_DOWN, "kvtierd is stopping")
        try:
            reply = self._handlers[type(msg)](frames[0], msg)
            if asyncio.iscoroutine(reply):
                return self._guard(msg.req_id, reply)
            return reply
        except RequestError as err:
            return self._error(msg.req_id, err.code, str(err))
        except Exception as err:  # request boundary: report, keep serving everyone else
            log.exception("internal error handling %s", type(msg).__name__)
            return self._error(msg.req_id, P.ErrorCode.INTERNAL, f"internal error: {err!r}")

    async def _guard(self, req_id: int, pending) -> P.Reply:
        try:
            return await pending
        except RequestError as err:
            return self._error(req_id, err.code, str(err))
        except Exception as err:  # request boundary: report, keep serving everyone else
            log.exception("internal error in a deferred reply")
            return self._error(req_id, P.ErrorCode.INTERNAL, f"internal error: {err!r}")

    def _error(self, req_id: int, code: P.ErrorCode, message: str) -> P.ErrorReply:
        self.counters.errors += 1
        self.counters.errors_by_code[code.name] = self.counters.errors_by_code.get(code.name, 0) + 1
        log.debug("request %d refused: %s %s", req_id, code.name, message)
        return P.ErrorReply(req_id=req_id, epoch=self.epoch, code=int(code), message=message)

    def _session(self, identity: bytes, session_id: int) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.identity != identity or s.state is not SessionState.OPEN:
            raise RequestError(P.ErrorCode.UNKNOWN_SESSION,
                               f"session_id = {session_id!r} is not an open session of this "
                               f"connection (daemon epoch {self.epoch:x})")
        s.renew(time.monotonic())
        return s

    def _check_keys(self, keys: list[bytes], pages: list[int] | None = None,
                    num_pages: int = 0) -> None:
        if len(keys) > self.cfg.max_keys_per_request:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"{len(keys)} keys exceed "
                               f"max_keys_per_request ({self.cfg.max_keys_per_request})")
        if keys and (min(map(len, keys)) != P.KEY_BYTES or max(map(len, keys)) != P.KEY_BYTES):
            i = next(i for i, k in enumerate(keys) if len(k) != P.KEY_BYTES)
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               f"keys[{i}] has {len(keys[i])} bytes, expected {P.KEY_BYTES}")
        if pages is None:
            return
        if len(pages) != len(keys):
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               f"{len(keys)} keys but {len(pages)} pages")
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            i, p = next((i, p) for i, p in enumerate(pages) if not 0 <= p < num_pages)
            raise RequestError(P.ErrorCode.OUT_OF_RANGE,
                               f"pages[{i}] = {p!r} is outside the engine's {num_pages} pages")
        if len(set(pages)) != len(pages):
            raise RequestError(P.ErrorCode.BAD_MESSAGE, "pages contains the same page twice")

    def _check_slot(self, s: Session, slot: int) -> None:
        if not 0 <= slot < s.completion.slots:
            raise RequestError(P.ErrorCode.OUT_OF_RANGE,
                               f"slot = {slot!r} is outside [0, {s.completion.slots})")
        if slot in s.transfers:
            raise RequestError(P.ErrorCode.BUSY, f"slot = {slot!r} has a transfer running")

    # ------------------------------------------------------------------ handlers
    def _register(self, identity: bytes, m: P.Register) -> P.Reply:
        if m.protocol_version != P.PROTOCOL_VERSION:
            raise RequestError(P.ErrorCode.PROTOCOL_VERSION,
                               f"protocol_version = {m.protocol_version!r}; this daemon speaks "
                               f"{P.PROTOCOL_VERSION}")
        if len(self.sessions) >= self.cfg.max_sessions:
            raise RequestError(P.ErrorCode.BUSY, f"max_sessions ({self.cfg.max_sessions}) reached")
        tenant = self._authenticate(m)
        g = m.geometry
        try:
            g.validate()
        except ValueError as err:
            raise RequestError(P.ErrorCode.GEOMETRY_MISMATCH, str(err)) from err
        if not (1 <= m.tp_size <= 1024 and 0 <= m.tp_rank < m.tp_size):
            raise RequestError(P.ErrorCode.GEOMETRY_MISMATCH,
                               f"tp_rank = {m.tp_rank!r} / tp_size = {m.tp_size!r} are inconsistent")
        if g.page_bytes > self.cfg.extent_size:
            raise RequestError(P.ErrorCode.GEOMETRY_MISMATCH,
                               f"a page of {g.page_bytes} bytes does not fit the pool's "
                               f"extent_size ({self.cfg.extent_size})")
        try:
            memory = EngineMemory(g, m.memory)
        except EngineMemoryError as err:
            raise RequestError(P.ErrorCode.BAD_MEMORY, str(err)) from err
        try:
            fp = namespace_fingerprint(m.namespace, g, m.tp_rank, m.tp_size, tenant)
            try:
                ns_id, owner = self.pool.namespace_id(fp), self.pool.owner_id(tenant)
            except HostPoolError as err:
                raise RequestError(P.ErrorCode.BUSY, str(err)) from err
            sid = self.sessions.new_id()
            block = CompletionBlock.create(self.rdir / f"completion-{self.epoch:x}-{sid}",
                                           COMPLETION_SLOTS)
        except BaseException:
            memory.close()
            raise
        s = Session(session_id=sid, identity=identity, tenant=tenant, owner=owner,
                    ns_id=ns_id, ns_fingerprint=fp, geometry=g,
                    class_id=self.pool.register_class(g.page_bytes), memory=memory,
                    completion=block, pid=m.pid, tp_rank=m.tp_rank, tp_size=m.tp_size,
                    lease_s=self.cfg.lease_s)
        s.renew(time.monotonic())
        self.tier.register(ns_id, fp, tenant, s.class_id, g.page_bytes)
        s.member = self.tier.groups.join(GroupKey(
            tenant=tenant, model_id=m.namespace.model_id, revision=m.namespace.revision,
            cache_salt=m.namespace.cache_salt, attention=g.attention, tp_size=m.tp_size,
            tp_group=m.tp_group), m.tp_rank, sid)
        self.sessions.add(s)
        self.counters.sessions_opened += 1
        log.info("session %d registered: tenant %s, model %s, pid %d, rank %d/%d, %d pages of %s",
                 sid, tenant, m.namespace.model_id, m.pid, m.tp_rank, m.tp_size,
                 m.memory.num_pages, format_size(g.page_bytes))
        return P.Registered(req_id=m.req_id, epoch=self.epoch, session_id=sid,
                            lease_s=self.cfg.lease_s, ns_fingerprint=fp,
                            completion_name=str(block.segment.path),
                            completion_slots=block.slots, daemon_pid=os.getpid())

    def _authenticate(self, m: P.Register) -> str:
        if not self.cfg.tenants:
            return DEFAULT_TENANT
        t = self.cfg.tenants.get(m.tenant)
        ok = t is not None and hmac.compare_digest(
            t.token.get_secret_value().encode(), m.token.encode())
        if not ok:
            log.warning("registration refused: tenant %r from pid %d presented a %s token",
                        m.tenant, m.pid, "missing" if not m.token else "wrong")
            raise RequestError(P.ErrorCode.UNAUTHORIZED,
                               f"tenant = {m.tenant!r}: missing or wrong token")
        return m.tenant

    def _heartbeat(self, identity: bytes, m: P.Heartbeat) -> P.Reply:
        self._session(identity, m.session_id)
        return P.Ack(req_id=m.req_id, epoch=self.epoch)

    def _lookup(self, identity: bytes, m: P.Lookup) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._check_keys(m.keys)
        n = self.pool.lookup(s.ns_id, m.keys)
        c = self.counters
        c.lookup_tokens += len(m.keys) * s.geometry.page_size
        c.lookup_hit_tokens += n * s.geometry.page_size
        c.lookups += 1
        c.lookup_keys += len(m.keys)
        c.lookup_hit_keys += n
        c.lookup_hits += n > 0
        if s.member is None and (n == len(m.keys) or not self.tier.available):
            return P.LookupResult(req_id=m.req_id, epoch=self.epoch, l2=n, l3=0)
        return self._later(s, self._lookup_more(s, m, n))

    async def _lookup_more(self, s: Session, m: P.Lookup, n: int) -> P.Reply:
        l2, l3 = await self.tier.lookup_l3(s, m.keys, n)
        return P.LookupResult(req_id=m.req_id, epoch=self.epoch, l2=l2, l3=l3)

    async def _later(self, s: Session, pending: Coroutine[Any, Any, P.Reply]) -> P.Reply:
        """Answer ``pending`` for ``s``; its lease does not run out meanwhile."""
        s.waiting += 1
        try:
            return await pending
        finally:
            s.waiting -= 1
            s.renew(time.monotonic())

    def _store(self, identity: bytes, m: P.Store) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._check_keys(m.keys, m.pages, s.memory.num_pages)
        self._check_slot(s, m.slot)
        if m.parent_key is not None and len(m.parent_key) != P.KEY_BYTES:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"parent_key has {len(m.parent_key)} bytes")
        self.counters.stores += 1
        if s.geometry.attention == "mla" and s.tp_rank > 0:
            # MLA pages are the same on every rank: rank 0 stores them for all
            return P.StoreAccepted(req_id=m.req_id, epoch=self.epoch, count=len(m.keys), writing=0)
        allocated = self.pool.allocate(s.ns_id, s.owner, s.class_id, m.keys, m.parent_key)
        count = self.pool.resident_run(s.ns_id, m.keys)
        self.counters.store_skipped_pages += count - len(allocated)
        self.counters.store_failed_pages += len(m.keys) - count
        self.tier.allocated(len(m.keys), count)
        if not allocated:
            return P.StoreAccepted(req_id=m.req_id, epoch=self.epoch, count=count, writing=0)
        idx = [i for i, _ in allocated]
        host = [slot for _, slot in allocated]
        self._start(s, Direction.STORE, m.slot, m.seq, host, [m.pages[i] for i in idx],
                    [m.keys[i] for i in idx])
        return P.StoreAccepted(req_id=m.req_id, epoch=self.epoch, count=count, writing=len(host))

    def _load(self, identity: bytes, m: P.Load) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._check_keys(m.keys, m.pages, s.memory.num_pages)
        self._check_slot(s, m.slot)
        self.counters.loads += 1
        host = self.pool.pin(s.ns_id, m.keys)
        if host:
            self._start(s, Direction.LOAD, m.slot, m.seq, host, m.pages[: len(host)],
                        m.keys[: len(host)])
        return P.LoadAccepted(req_id=m.req_id, epoch=self.epoch, count=len(host))

    def _release(self, identity: bytes, m: P.Release) -> P.Reply:
        s = self._session(identity, m.session_id)
        for slot in m.slots:
            t = s.transfers.get(slot)
            if t is not None:
                t.cancelled = True
        return P.Ack(req_id=m.req_id, epoch=self.epoch)

    def _unregister(self, identity: bytes, m: P.Unregister) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._close_session(s, "unregistered")
        return P.Ack(req_id=m.req_id, epoch=self.epoch)

    def _check_admin(self, token: str) -> None:
        want = self.cfg.admin_token
        if want is not None and not hmac.compare_digest(want.get_secret_value().encode(),
                                                        token.encode()):
            log.warning("admin request refused: %s admin token", "missing" if not token else "wrong")
            raise RequestError(P.ErrorCode.UNAUTHORIZED, "admin_token: missing or wrong")

    def _stats(self, identity: bytes, m: P.Stats) -> P.Reply:
        self._check_admin(m.admin_token)
        return P.StatsReply(req_id=m.req_id, epoch=self.epoch, stats=self.snapshot())

    def _flush(self, identity: bytes, m: P.Flush) -> P.Reply:
        if m.tier not in ("l2", "l3", "all"):
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"tier = {m.tier!r} is not l2, l3 or all")
        ns_id = owner = None
        tenant: str | None = None
        if m.session_id:  # a session may flush only its own tenant's pages
            s = self._session(identity, m.session_id)
            owner, tenant = s.owner, s.tenant
        else:
            self._check_admin(m.admin_token)
        fps: list[bytes] | None = None if tenant is None else self.tier.tenant_namespaces(tenant)
        if m.namespace:
            try:
                fp = bytes.fromhex(m.namespace)
            except ValueError as err:
                raise RequestError(P.ErrorCode.BAD_MESSAGE,
                                   f"namespace = {m.namespace!r} is not hex") from err
            ns_id = self.pool.namespaces().get(fp, -1)
            fps = [fp] if fps is None or fp in fps else []
        l2 = 0
        if m.tier in ("l2", "all"):
            with self.tier.writer.flush_guard():
                l2 = self.pool.flush(ns_id=ns_id, owner=owner)
            self.tier.prefetcher.sweep()
        log.info("flush tier=%s namespace=%s owner=%s: %d L2 pages dropped", m.tier,
                 m.namespace or "*", owner if owner is not None else "*", l2)
        if m.tier == "l2" or not self.tier.available:
            return P.FlushReply(req_id=m.req_id, epoch=self.epoch, l2_pages=l2, l3_pages=0)
        return self._flush_l3(m, l2, fps)

    async def _flush_l3(self, m: P.Flush, l2: int, fps: list[bytes] | None) -> P.Reply:
        l3 = await self.tier.flush(fps)
        log.info("flush tier=%s namespace=%s: %d L3 pages deleted", m.tier, m.namespace or "*", l3)
        return P.FlushReply(req_id=m.req_id, epoch=self.epoch, l2_pages=l2, l3_pages=l3)

    def _sync(self, identity: bytes, m: P.Sync) -> P.Reply:
        self._check_admin(m.admin_token)
        if not (0 < m.timeout_s <= MAX_SYNC_TIMEOUT_S):
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"timeout_s = {m.timeout_s!r} is not in "
                               f"(0, {MAX_SYNC_TIMEOUT_S:g}] seconds")
        if self.tier.l3.name == "none":
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               "sync: no L3 backend (hicache_storage_backend = 'none')")
        if not self.tier.available:  # down: nothing can be written now; say how much waits
            return P.SyncReply(req_id=m.req_id, epoch=self.epoch, pages=self.tier.writer.queued,
                               written=0, failed=0, left=self.tier.writer.queued)
        return self._sync_async(m)

    async def _sync_async(self, m: P.Sync) -> P.Reply:
        start = time.perf_counter()
        pages, written, failed, left = await self.tier.writer.sync(m.timeout_s)
        log.info("sync: %d pages, %d written, %d not written, %d left, in %.3f s", pages, written,
                 failed, left, time.perf_counter() - start)
        return P.SyncReply(req_id=m.req_id, epoch=self.epoch, pages=pages, written=written,
                           failed=failed, left=left)

    def _prefetch(self, identity: bytes, m: P.Prefetch) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._check_keys(m.keys)
        if not 0 <= m.skip <= len(m.keys):
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               f"skip = {m.skip!r} is outside [0, {len(m.keys)}]")
        if not m.keys or not self.tier.available:
            self.counters.prefetches += 1
            return P.PrefetchReply(req_id=m.req_id, epoch=self.epoch, started=0)
        return self._later(s, self._prefetch_async(s, m))

    async def _prefetch_async(self, s: Session, m: P.Prefetch) -> P.Reply:
        started = await self.tier.prefetch(s, m.keys, m.request_id)
        return P.PrefetchReply(req_id=m.req_id, epoch=self.epoch, started=started)

    def _claim(self, identity: bytes, m: P.Claim) -> P.Reply:
        s = self._session(identity, m.session_id)
        self._check_keys(m.keys)
        if m.policy and m.policy not in PREFETCH_POLICIES:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, f"policy = {m.policy!r} is not one of "
                               f"{', '.join(PREFETCH_POLICIES)} (or empty for the daemon's)")
        if s.member is None and not s.prefetches:  # nothing to wait for: answer now
            n = self.pool.lookup(s.ns_id, m.keys)
            self.counters.claims += 1
            self.counters.claim_pages += n
            return P.ClaimReply(req_id=m.req_id, epoch=self.epoch, l2=n)
        return self._later(s, self._claim_async(s, m))

    async def _claim_async(self, s: Session, m: P.Claim) -> P.Reply:
        n = await self.tier.claim(s, m.keys, m.request_id, m.policy)
        return P.ClaimReply(req_id=m.req_id, epoch=self.epoch, l2=n)

    def _health(self, identity: bytes, m: P.Health) -> P.Reply:
        status = "stopping" if self._stopping else "ok"
        return P.HealthReply(req_id=m.req_id, epoch=self.epoch, status=status,
                             sessions=len(self.sessions))

    def snapshot(self) -> dict[str, object]:
        """Return counters, pool use and sessions as a plain dict (the STATS reply)."""
        ps = self.pool.stats()
        return {
            "epoch": f"{self.epoch:x}",
            "uptime_s": round(time.time() - self.started, 3),
            "pool": dataclasses.asdict(ps),
            "counters": self.counters.as_dict(),
            "l3": self.tier.snapshot(),
            "adopt": dataclasses.asdict(self.adopt) if self.adopt is not None else {},
            "sessions": [
                {"session_id": s.session_id, "tenant": s.tenant, "pid": s.pid,
                 "tp_rank": s.tp_rank, "tp_size": s.tp_size, "state": s.state.value,
                 "page_bytes": s.geometry.page_bytes, "num_pages": s.memory.num_pages,
                 "transfers": len(s.transfers)}
                for s in self.sessions
            ],
        }

    # ------------------------------------------------------------------ transfers
    def _start(self, s: Session, direction: Direction, slot: int, seq: int, host: list[int],
               pages: list[int], keys: list[bytes]) -> None:
        offsets = np.fromiter((self.pool.slot_offset(h) for h in host), dtype=np.int64, count=len(host))
        t = Transfer(direction=direction, session_id=s.session_id, slot=slot, seq=seq,
                     host_slots=host, page_ids=np.asarray(pages, dtype=np.int64), offsets=offsets,
                     nbytes=len(host) * s.geometry.page_bytes, started=time.monotonic(),
                     keys=keys,
                     checksum=direction is Direction.STORE and self.cfg.verify_on_adopt)
        s.completion.begin(slot, seq, s.geometry.num_layers)
        s.transfers[slot] = t
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, run_transfer, t, self._arena, s.memory.buffers,
                                   s.geometry.chunk_bytes, s.completion)
        self._inflight.add(fut)
        fut.add_done_callback(lambda f: self._finish(s, t, f))

    def _finish(self, s: Session, t: Transfer, fut: asyncio.Future) -> None:
        self._inflight.discard(fut)
        ok = not fut.cancelled() and fut.exception() is None and t.status is TransferStatus.DONE
        n = len(t.host_slots)
        c = self.counters
        if t.direction is Direction.STORE:
            if ok and s.state is SessionState.OPEN:
                self.pool.commit(t.host_slots, checksums=t.checksums)
                c.store_pages += n
                c.bytes_to_host += t.nbytes
                self.tier.stored(s, t.keys)
            else:
                self.pool.abort(t.host_slots)
                c.store_failed_pages += n
        else:
            self.pool.unpin(t.host_slots)
            if ok:
                c.load_pages += n
                c.loaded_tokens += n * s.geometry.page_size
                self.tier.loaded(s, t.keys)
                c.bytes_to_engine += t.nbytes
                if self.metrics is not None:
                    self.metrics.observe_load(time.monotonic() - t.started)
            else:
                c.load_failed_pages += n
        if s.state is not SessionState.CLOSED:
            s.completion.finish(t.slot, TransferStatus.DONE if ok else (
                t.status if t.status is not TransferStatus.RUNNING else TransferStatus.FAILED))
        s.transfers.pop(t.slot, None)
        if s.state is SessionState.CLOSING and not s.transfers:
            self._finalize_session(s)

    # ------------------------------------------------------------------ sessions
    def _close_session(self, s: Session, reason: str) -> None:
        if s.state is not SessionState.OPEN:
            return
        s.transition(SessionState.CLOSING)
        log.info("session %d closing: %s", s.session_id, reason)
        self.tier.session_closed(s)
        for t in s.transfers.values():
            t.cancelled = True
        if not s.transfers:
            self._finalize_session(s)

    def _finalize_session(self, s: Session) -> None:
        if s.state is SessionState.CLOSED:
            return
        if s.state is SessionState.OPEN:
            s.transition(SessionState.CLOSING)
        self.sessions.remove(s)
        self.tier.session_closed(s)
        alive = s.engine_alive()
        s.memory.close()
        if not alive:
            s.memory.unlink_segments()  # the engine died without removing its KV segments
        s.completion.close()
        s.transition(SessionState.CLOSED)
        self.counters.sessions_closed += 1


def install_signal_handlers(daemon: Daemon) -> None:
    """SIGTERM/SIGINT stop gracefully; a second one exits at once."""
    loop = asyncio.get_running_loop()
    state = {"count": 0}

    def on_signal(signum: int) -> None:
        state["count"] += 1
        if state["count"] > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: stopping", signal.Signals(signum).name)
        daemon.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
