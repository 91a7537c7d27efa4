"""What the service's parts share: configuration, pool, tier, sessions, counters, and the
session lifecycle (close, finalize, reap) that handlers, transfers and the server all drive.

One object is handed to the handlers, the admin requests and the transfers instead of the
whole :class:`~kvtier.daemon.service.server.Daemon`, so none of them imports the server
and the server stays lifecycle and wiring only. Everything here runs on the event loop
thread (transfer completions are delivered there too), so nothing needs a lock.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters, HitWindow
from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.pool.layout import AdoptResult
from kvtier.daemon.service.cuda_sessions import CudaSessions
from kvtier.daemon.service.handover import HandoverServer
from kvtier.daemon.service.quotas import Quotas
from kvtier.daemon.service.sessions import Session, SessionState, SessionTable
from kvtier.daemon.service.connections import ConnectionGuard
from kvtier.daemon.service.strain import Strain
from kvtier.daemon.service.unmaps import Unmaps
from kvtier.daemon.service.validation import RequestError
from kvtier.daemon.tier.tier import TierStore
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.daemon.transfer.prefault import PrefaultQueue
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import handover_path

if TYPE_CHECKING:
    from kvtier.daemon.service.kv_events import KvEventPublisher
    from kvtier.daemon.service.metrics import DaemonMetrics

log = logging.getLogger("kvtier.daemon")


class ServiceContext:
    """The daemon's shared state, and the session lifecycle.

    Args:
        cfg: the configuration (replaced by a SIGHUP reload: read it, do not keep it).
        pool: the L2 host pool.
        tier: the L3 tier.
        counters: the counters STATS reports.
        rdir: the runtime directory (the sockets live there).
        epoch: this daemon's boot epoch, carried by every reply.

    Attributes:
        sessions: the registered engine sessions.
        handovers: the memory handover socket and the handovers waiting for REGISTER.
        strain: shortages of memory, address space or descriptors (HEALTH reports them).
        quotas: what each user and tenant holds, against its bounds.
        prefaults: the threads that build page tables over engines' memory, users taking
            turns.
        cuda: the CUDA sessions' runtime and thread (docs/gpu.md), made on first use.
        metrics: the Prometheus endpoint when ``metrics_port`` is set, else None.
        adopt: what the start made of the pool file it found (set once mapped).
        started: the monotonic clock's time at start (``uptime_s``).
        stopping: set once a stop has begun; only HEALTH, STATS and UNREGISTER are served.
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        pool: HostPool,
        tier: TierStore,
        counters: Counters,
        rdir: Path,
        epoch: int,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.tier = tier
        self.counters = counters
        self.hit_window = HitWindow()  # the L2 page hit rate of the last minute
        self.rdir = rdir
        self.epoch = epoch
        self.sessions = SessionTable()
        self.strain = Strain()
        self.connections = ConnectionGuard(self.strain.note)
        """The connection guard (the server's, from the bind of its socket on)."""
        self.quotas = Quotas(lambda: self.cfg, unmapping=lambda: self.unmaps.pending_bytes)
        self.prefaults = PrefaultQueue(cfg.prefault_threads)
        self.handovers = HandoverServer(handover_path(rdir), lambda: self.cfg, self.strain)
        self.cuda = CudaSessions(lambda: self.cfg.cuda_copy)
        # what is mapped and what waits to be unmapped stay within max_mapped_bytes together
        self.unmaps = Unmaps(self.quotas.unmap_room)
        self.metrics: DaemonMetrics | None = None
        self.events: KvEventPublisher | None = None
        self.adopt: AdoptResult | None = None
        self.started = time.monotonic()  # uptime: a wall clock set back or forth leaves it
        self.stopping = False
        self.pool_unbacked = not cfg.prefault
        """Whether pages of the pool file may lack memory behind them (``prefault`` off, or
        an adopted file that ``pool_dir`` could not back in full)."""

    # ------------------------------------------------------------------ replies
    def error(self, req_id: int, code: P.ErrorCode, message: str) -> P.ErrorReply:
        """Count a refused request and return its error reply.

        Args:
            req_id: the request's id (0 when it could not be read).
            code: why it was refused.
            message: what was wrong, naming the field.

        Returns:
            The reply to send.
        """
        c = self.counters
        c.errors += 1
        c.errors_by_code[code.name] = c.errors_by_code.get(code.name, 0) + 1
        log.debug("request %d refused: %s %s", req_id, code.name, message)
        return P.ErrorReply(req_id=req_id, epoch=self.epoch, code=int(code), message=message)

    def session(self, identity: bytes, session_id: int) -> Session:
        """The open session ``session_id`` of connection ``identity``; its lease is renewed.

        Raises:
            RequestError: UNKNOWN_SESSION (no such session, another connection's, or closing).
        """
        s = self.sessions.get(session_id)
        if s is None or s.identity != identity or s.state is not SessionState.OPEN:
            raise RequestError(
                P.ErrorCode.UNKNOWN_SESSION,
                f"session_id = {session_id!r} is not an open session of this "
                f"connection (daemon epoch {self.epoch:x})",
            )
        s.renew(time.monotonic())
        return s

    # ------------------------------------------------------------------ session lifecycle
    def close_session(self, s: Session, reason: str) -> None:
        """Begin closing ``s``: no more requests, transfers cancelled, prefetches given up.

        It is finalized at once when no transfer runs, else when its last one finishes.
        """
        if s.state is not SessionState.OPEN:
            return
        s.transition(SessionState.CLOSING)
        log.info("session %d closing: %s", s.session_id, reason)
        self.tier.session_closed(s)
        for t in s.transfers.values():
            self.cancel_transfer(t)
        if not s.transfers:
            self.finalize_session(s)

    def cancel_transfer(self, t: Transfer) -> None:
        """Cancel ``t`` (RELEASE, or its session closing). A STORE's keys leave the pool's
        index of pages being written at once (:meth:`HostPool.detach`): its pages will be
        aborted, so another session's STORE of the same keys must write them itself. A
        STORE copied whole whose commit runs in slices is left to end it: its pages are
        READY the moment it does."""
        t.cancel()
        if t.direction is Direction.STORE and t.host_slots and not t.detached and not t.committing:
            self.pool.detach(t.host_slots)
            t.detached = True

    def finalize_session(self, s: Session) -> None:
        """Forget ``s``, unmap its engine memory and remove its completion block.

        Call it only once no copy thread can touch the session's memory any more.
        """
        if s.state is SessionState.CLOSED:
            return
        if s.state is SessionState.OPEN:
            s.transition(SessionState.CLOSING)
        self.sessions.remove(s)
        self.tier.session_closed(s)
        self.quotas.remove(s.session_id)
        if s.cuda is not None:  # its events and stream go before its memory, off the loop
            self.cuda.close_session(s.cuda, s.memory)
        else:  # off the loop (its munmap takes long for a large memory); never an unlink:
            self.unmaps.close(s.memory)  # the engine's memory has no name the daemon knows
        s.completion.close()
        s.transition(SessionState.CLOSED)
        self.counters.sessions_closed += 1

    def reap_sessions(self, now: float | None = None) -> None:
        """Close the sessions whose engine process is gone and, given ``now``, those whose
        lease ran out by then.

        Only the lease loop passes ``now``: it alone knows whether kvtierd itself did not
        run for a while (its engines' heartbeats then wait unread, and the leases get that
        time back first). A check at another moment (after a peer's disconnect) looks at
        the processes only, since it may be the first thing kvtierd runs after a pause.

        One session's failure is logged and closes that session only: the reaper runs
        for the daemon's lifetime, and an error escaping it would stop the daemon.
        """
        for s in self.sessions:
            if s.state is not SessionState.OPEN:
                continue
            try:
                if not s.engine_alive():
                    self.close_session(s, f"engine process {s.pid} is gone")
                elif now is not None and s.expired(now):
                    self.counters.sessions_expired += 1
                    self.close_session(s, "lease expired")
            except Exception:  # reaper boundary: this session only, keep reaping the others
                log.exception("reaper: checking session %d failed; closing it", s.session_id)
                self._close_broken(s)

    def extend_leases(self, seconds: float) -> None:
        """Give every session's lease ``seconds`` more: the daemon did not run for that
        long, so its engines' heartbeats could not be read."""
        for s in self.sessions:
            s.deadline += seconds

    def _close_broken(self, s: Session) -> None:
        """Close a session the reaper could not check; a second failure is logged only."""
        try:
            self.close_session(s, "the reaper could not check it")
        except Exception:  # reaper boundary: the daemon outlives one broken session
            log.exception("reaper: closing session %d failed", s.session_id)
