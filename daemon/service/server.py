"""kvtierd's server: lifecycle and wiring; the requests themselves are answered elsewhere.

The parts, each in its own module:

- :mod:`~kvtier.daemon.service.boot`: the service (pool, tier, handlers, copy threads),
  built on a worker thread while the socket already answers;
- :mod:`~kvtier.daemon.service.startgate`: what the socket answers until then (HEALTH
  ``starting``; every other request held, then answered in order);
- :mod:`~kvtier.daemon.service.dispatch`: frames → decoded request → handler → reply;
- :mod:`~kvtier.daemon.service.handlers`: the engines' requests, one method per type;
- :mod:`~kvtier.daemon.service.admin`: STATS (snapshot), FLUSH, SYNC, admin token, reload;
- :mod:`~kvtier.daemon.service.transfers`: LOAD/STORE copies on the copy threads;
- :mod:`~kvtier.daemon.service.context`: the state they share and the session lifecycle;
- the L3 tier is :class:`~kvtier.daemon.tier.tier.TierStore`.

Start order: lock the runtime directory → bind the control socket and start receiving
(only the configuration, ZeroMQ and the wire format are imported by then) → build the
service on a worker thread (its modules imported, the pool mapped and adopted) → open the
L3 tier, the copy threads and the handover socket → answer the held requests → READY=1
(and the ``kvtierd ready`` log line): HEALTH says ``ok`` from here on, and that is what
"ready" means to systemd and to ``DaemonProcess``. Then the loops run: receive (each
request answered in turn; one that must wait is answered from its own task), memory
handover (:mod:`~kvtier.daemon.service.handover`), lease (reaps dead and expired
sessions), monitor (a disconnect triggers a prompt reap), the systemd watchdog, and the
page tables of an adopted pool are built on a thread (``prefault``).

Requests are read by a reader callback on the socket's descriptor and answered in turn,
replies sent at once (:mod:`~kvtier.daemon.service.receiver`).

Both sockets (control and handover, mode 0660) take the runtime directory's group when it
differs from the daemon's, as a set-group-ID directory would give them, so engine users of
that group can connect (a daemon run as root, or in several groups).

Shutdown order (as uvicorn does it): stop accepting (handovers first) → cancel running transfers and wait
for them with a deadline → close sessions → give prefetches up and write to L3 what the
write policy asks for (same deadline) → close the L3 backend → unmap the pool → close the
socket. Resources live in an ``AsyncExitStack``, entered in order and closed in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from kvtier.config import ConfigError, DaemonConfig, format_size, runtime_dir, socket_path
from kvtier.config.loader import pool_path
from kvtier.daemon.pauses import WATCH
from kvtier.daemon.service.connections import ConnectionGuard
from kvtier.daemon.service.receiver import Receiver
from kvtier.daemon.service.runtime import SocketFile, claim_runtime_dir
from kvtier.daemon.service.sdnotify import (
    STOP_SLACK_S,
    SystemdNotifier,
    start_allowance,
    watchdog_loop,
)
from kvtier.daemon.service.startgate import StartGate
from kvtier.ipc.sockets import ipc_endpoint, make_zmq_socket

if TYPE_CHECKING:
    from kvtier.daemon.pool.layout import AdoptResult
    from kvtier.daemon.service.boot import Service
    from kvtier.daemon.service.dispatch import Dispatcher
    from kvtier.daemon.service.metrics import DaemonMetrics
    from kvtier.daemon.service.sessions import SessionTable
    from kvtier.ipc.fdpass import PeerCred

__all__ = ["Daemon", "install_signal_handlers"]

log = logging.getLogger("kvtier.daemon")
REAP_DELAY_S = 0.01
"""After a disconnect, how long the reaper waits for the engine's process to finish exiting."""


class Daemon:
    """One kvtierd instance. ``await run()`` serves until :meth:`request_stop`.

    Args:
        cfg: the configuration.
        reload: re-reads the configuration (SIGHUP); None when there is nothing to re-read.
        notifier: where systemd notifications go (from ``NOTIFY_SOCKET`` by default).

    Attributes:
        service: the parts that answer requests; None until the start has built them.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        reload: Callable[[], DaemonConfig] | None = None,
        notifier: SystemdNotifier | None = None,
    ) -> None:
        self.notifier = notifier or SystemdNotifier()
        self.rdir = runtime_dir(cfg.runtime_dir)
        self.endpoint = ipc_endpoint(socket_path(self.rdir))
        self._cfg = cfg
        self._reload = reload
        self._epoch = secrets.randbits(62) | 1
        self.service: Service | None = None
        self.dispatcher: Dispatcher | StartGate = StartGate(self._epoch)
        self._stop = asyncio.Event()
        self.connections = ConnectionGuard(self._note_shortage)
        """Bounds the connections of the control socket and the KV-event sockets."""
        self._sock: zmq.Socket[Any] | None = None
        self._zctx: zmq.Context[Any] | None = None
        self._sock_file: SocketFile | None = None
        self.receiver: Receiver | None = None
        self._reap_later: asyncio.TimerHandle | None = None
        self._reload_pending = False  # a SIGHUP came before the service was up

    # ------------------------------------------------------------------ state
    @property
    def cfg(self) -> DaemonConfig:
        """The configuration in force (a SIGHUP reload may replace it)."""
        return self.service.ctx.cfg if self.service is not None else self._cfg

    @property
    def epoch(self) -> int:
        """This daemon's boot epoch, carried by every reply."""
        return self._epoch

    @property
    def svc(self) -> Service:
        """The service; only once it is built (an assertion otherwise)."""
        assert self.service is not None, "the service is built during run()"
        return self.service

    @property
    def sessions(self) -> SessionTable:
        """The registered engine sessions."""
        return self.svc.ctx.sessions

    @property
    def metrics(self) -> DaemonMetrics | None:
        """The Prometheus endpoint, when ``metrics_port`` is set."""
        return self.svc.ctx.metrics

    @property
    def adopt(self) -> AdoptResult | None:
        """What the start made of the pool file it found (None before it is mapped)."""
        return self.service.ctx.adopt if self.service is not None else None

    def snapshot(self) -> dict[str, object]:
        """Return counters, pool use and sessions as a plain dict (the STATS reply)."""
        return self.svc.admin.snapshot()

    def reload(self) -> None:
        """Re-read the configuration (SIGHUP) and apply the fields that can change live
        (while starting, once the service is up: the file may have changed since the start
        read it; once a stop has begun, nothing is applied or announced)."""
        if self.service is None:
            log.info("reload: still starting; it runs once kvtierd is ready")
            self._reload_pending = True
            return
        if self._stop.is_set():  # systemd has been told STOPPING=1: no RELOADING/READY now
            log.info("reload ignored: stopping")
            return
        self.service.admin.reload()

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        """Begin a graceful stop (safe to call from a signal handler)."""
        self._stop.set()

    async def run(self, on_ready: Callable[[Daemon], None] | None = None) -> None:
        """Set everything up, serve until stopped, then shut down in order.

        Args:
            on_ready: called once the service is up and READY=1 was sent.

        Raises:
            KvtierError: a resource could not be set up (the pool file, the L3 backend,
                the metrics port); whatever was set up is closed again.
        """
        async with contextlib.AsyncExitStack() as stack:
            # first of all: no other daemon on this runtime dir (before the pool and socket)
            stack.enter_context(claim_runtime_dir(self.rdir))
            zctx = self._zctx = zmq.Context()
            stack.callback(zctx.destroy, linger=0)  # whatever socket is still open
            try:
                self._sock = make_zmq_socket(zctx, self.endpoint, zmq.ROUTER, bind=True)
            except zmq.ZMQError as err:
                raise ConfigError(
                    f"runtime_dir {str(self.rdir)!r}: cannot bind the control socket "
                    f"{self.endpoint}: {err}"
                ) from err
            stack.callback(self._close_socket)
            stack.callback(self.connections.watch(self._sock, self._disconnected))  # first
            self._sock_file = SocketFile.record(socket_path(self.rdir))
            self._share_with_group([socket_path(self.rdir)])
            self.receiver = Receiver(self._sock, lambda: self.dispatcher)
            recv = asyncio.create_task(self.receiver.run(), name="kvtier-recv")
            try:
                ppath = await self._start(stack)
            except BaseException:
                recv.cancel()
                await asyncio.wait([recv])
                raise
            log.info(
                "kvtierd ready: %s, pool %s at %s, epoch %x, pid %d",
                self.endpoint,
                format_size(self.cfg.hicache_size),
                ppath,
                self.epoch,
                os.getpid(),
            )
            self.notifier.ready()
            self._update_status()
            if self._reload_pending:  # a SIGHUP came while starting
                self._reload_pending = False
                self.reload()
            if on_ready is not None:
                on_ready(self)
            try:
                await self._serve(recv)
                await self._drain()  # HEALTH, STATS and UNREGISTER still answered meanwhile
            finally:
                recv.cancel()
                await asyncio.wait([recv])
                if not recv.cancelled() and recv.exception() is not None:
                    log.error("the receive loop failed", exc_info=recv.exception())

    async def _start(self, stack: contextlib.AsyncExitStack) -> Path:
        """Build the service off the loop, open it, then answer the held requests.

        Returns:
            The pool file's path.
        """
        t0 = time.perf_counter()
        ppath = pool_path(self._cfg.pool_dir, self.rdir)
        # reserving and pre-faulting (or adopting) a large pool may take longer than the
        # unit's TimeoutStartSec: ask for the time it needs (never less than the unit's)
        self.notifier.extend_timeout(start_allowance(self._cfg.hicache_size))
        self.notifier.status(f"mapping the host pool ({format_size(self._cfg.hicache_size)})")
        service, unmap = await asyncio.to_thread(self._build, ppath)
        stack.enter_context(unmap)
        await service.open(stack, self._finalize_remaining)
        assert self.receiver is not None, "run() starts it before the service"
        service.transfers.requests_waiting = self.receiver.waiting
        self._share_with_group([service.ctx.handovers.path])
        self.service = service
        service.ctx.connections = self.connections
        if self.cfg.kv_events_endpoint is not None:
            from kvtier.daemon.service.kv_events import open_publisher

            assert self._zctx is not None, "run() makes it first"
            service.ctx.events = open_publisher(
                self.cfg, service.ctx.counters, service.tier, self._zctx, service.ctx.connections
            )
            stack.callback(service.ctx.events.close)
        if self.cfg.metrics_port is not None:
            from kvtier.daemon.service.metrics import DaemonMetrics

            service.ctx.metrics = DaemonMetrics(self.snapshot)
            service.ctx.metrics.start(self.cfg.metrics_host, self.cfg.metrics_port)
            stack.callback(service.ctx.metrics.close)
        gate = self.dispatcher
        assert isinstance(gate, StartGate)
        self.dispatcher = service.dispatcher
        service.start_serving()  # from here on pages may be stored: the pool file stays
        held = gate.release()
        assert self.receiver is not None, "run() starts it before the service"
        for h in held:  # in arrival order, before anything received from now on
            self.receiver.answer(
                h.identity,
                service.dispatcher.handle(h.identity, h.body, functools.partial(_given, h.peer)),
            )
        log.debug(
            "service up %.3fs after the socket was bound; %d requests were held",
            time.perf_counter() - t0,
            len(held),
        )
        return ppath

    def _build(self, ppath: Path) -> tuple[Service, contextlib.ExitStack]:
        """Import the service's modules and build it (on a worker thread)."""
        from kvtier.daemon.service.boot import build_service

        return build_service(self._cfg, self.rdir, ppath, self._epoch, self.notifier, self._reload)

    def _share_with_group(self, paths: list[Path]) -> None:
        """Give the sockets the runtime directory's group when it is not the daemon's own.

        Only where the daemon may (root, or a member of that group); otherwise they keep
        the daemon's group, as before.
        """
        gid = self.rdir.stat().st_gid
        if gid == os.getegid() or not (os.geteuid() == 0 or gid in os.getgroups()):
            return
        for path in paths:
            os.chown(path, -1, gid, follow_symlinks=False)

    async def _serve(self, recv: asyncio.Task[None]) -> None:
        """Run the loops until a stop is requested, then stop accepting requests.

        Args:
            recv: the receive loop, running since the socket was bound.
        """
        ctx = self.svc.ctx
        async with asyncio.TaskGroup() as tg:
            accept = tg.create_task(ctx.handovers.serve(), name="kvtier-handover")
            loops = [
                tg.create_task(_follow(recv), name="kvtier-recv-follow"),
                tg.create_task(self._lease_loop(), name="kvtier-lease"),
                tg.create_task(WATCH.run(), name="kvtier-pauses"),
                tg.create_task(self.svc.tier.run(), name="kvtier-l3"),
                tg.create_task(self.svc.prefault(), name="kvtier-prefault"),
            ]
            interval = self.notifier.watchdog_interval()
            if interval is not None:
                loops.append(
                    tg.create_task(watchdog_loop(self.notifier, interval), name="kvtier-watchdog")
                )
            await self._stop.wait()
            accept.cancel()  # first: no new memory handovers (the socket goes once it ends)
            await asyncio.wait([accept])
            ctx.handovers.stop_accepting()
            ctx.stopping = True
            self.svc.admin.stop_reloading()
            self.notifier.stopping()
            # the drain may wait shutdown_timeout_s: longer than the unit's TimeoutStopSec
            self.notifier.extend_timeout(self.cfg.shutdown_timeout_s + STOP_SLACK_S)
            log.info(
                "stopping: %d sessions, %d transfers in flight",
                len(self.sessions),
                self.svc.transfers.copies,
            )
            for task in loops:
                task.cancel()
        if self._reap_later is not None:
            self._reap_later.cancel()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self.remove_socket_file()

    def remove_socket_file(self) -> None:
        """Unlink the control socket's path, if it still names the socket this daemon bound
        (never another's): clients then find no daemon rather than a socket nobody reads."""
        if self._sock_file is not None:
            self._sock_file.remove()
            self._sock_file = None

    async def _drain(self) -> None:
        """Close every session, wait for its transfers and for L3 (one deadline for both)."""
        svc = self.svc
        timeout = self.cfg.shutdown_timeout_s
        deadline = time.monotonic() + timeout
        for s in self.sessions:
            svc.ctx.close_session(s, "daemon stopping")
        if svc.transfers.copies:
            left = await svc.transfers.wait_copies(timeout)
            if left:
                log.warning(
                    "%d transfers still running after %.1fs; abandoning them", left, timeout
                )
        if svc.transfers.pending:  # long requests settling in slices (or stopping: cancelled)
            await asyncio.wait(
                set(svc.transfers.pending), timeout=max(0.0, deadline - time.monotonic())
            )
        await svc.tier.drain(max(0.0, deadline - time.monotonic()))
        for s in self.sessions:
            if not s.transfers:  # else a copy thread may still touch its memory: see below
                svc.ctx.finalize_session(s)

    def _finalize_remaining(self) -> None:
        """Finalize the sessions whose transfers outlived the drain, after the copy threads
        are gone (unmapping an engine's memory under a running copy would crash the daemon)."""
        for s in self.sessions:
            self.svc.ctx.finalize_session(s)

    # ------------------------------------------------------------------ loops
    async def _lease_loop(self) -> None:
        """Reap sessions every quarter lease (at most a second). The time kvtierd itself
        did not run (stopped, starved, its loop held: :mod:`~kvtier.daemon.pauses`) is
        given back to every lease first, since the heartbeats its engines sent meanwhile
        wait unread in its socket."""
        ticks = 0
        undo = WATCH.listen(self.svc.ctx.extend_leases)
        try:
            while True:
                period = min(1.0, self.cfg.lease_s / 4)  # lease_s may change by a reload
                await asyncio.sleep(period)
                WATCH.catch_up()  # whoever looks first after a pause records it
                self.svc.ctx.reap_sessions(time.monotonic())
                ticks += 1
                if ticks % max(1, int(5 / period)) == 0:
                    self._update_status()
        finally:
            undo()

    def _update_status(self) -> None:
        ps = self.svc.pool.stats()
        self.notifier.status(
            f"{len(self.sessions)} sessions, pool {format_size(ps.used_bytes)} of "
            f"{format_size(ps.capacity_bytes)} used, {ps.pages_ready} pages"
        )

    def _disconnected(self) -> None:
        """React to a peer disconnecting at once instead of at the next lease check.

        ZeroMQ's monitor names the connection, not the routing identity, so a disconnect
        triggers a liveness check of every session's engine process, shortly after (the
        process may still be exiting), at most one scheduled at a time, while serving. The
        same monitor counts the connections from the bind to the close, and refuses those
        past the bounds (:class:`~kvtier.daemon.service.connections.ConnectionGuard`).
        """
        if self.service is None or self._stop.is_set() or self._reap_later is not None:
            return
        loop = asyncio.get_running_loop()
        self._reap_later = loop.call_later(REAP_DELAY_S, self._reap_after_disconnect)

    def _note_shortage(self, what: str) -> None:
        """A shortage the connection guard met: HEALTH's once the service is built."""
        if self.service is not None:
            self.service.ctx.strain.note(what)
        else:
            log.warning("short of resources: %s", what)

    def _reap_after_disconnect(self) -> None:
        self._reap_later = None
        self.svc.ctx.reap_sessions()


def _given(peer: PeerCred | None) -> PeerCred | None:
    """``peer`` (a held request's sender, as the dispatcher asks for it)."""
    return peer


async def _follow(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` (started before the task group): its failure fails the group;
    cancelling this leaves it running (the receive loop answers through the stop's drain)."""
    await asyncio.shield(task)


def install_signal_handlers(daemon: Daemon) -> None:
    """SIGTERM/SIGINT stop gracefully; a second one exits at once; SIGHUP reloads."""
    loop = asyncio.get_running_loop()
    state = {"count": 0}

    def on_signal(signum: int) -> None:
        state["count"] += 1
        if state["count"] > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            try:
                daemon.remove_socket_file()
            finally:
                os._exit(1)
        log.info("%s: stopping", signal.Signals(signum).name)
        daemon.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
