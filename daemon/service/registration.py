"""REGISTER: check and authenticate a registration, map or open its memory, open its session.

Shared-memory engines hand their memory over by descriptor and it is mapped on the spot; CUDA
engines (``memory.kind = "cuda_ipc"``) send IPC handles, opened on the ``kvtier-cuda`` thread
(:mod:`~kvtier.daemon.service.cuda_sessions`) while the loop serves others, the reply deferred
until then; their reply carries the session's interprocess event handles (docs/gpu.md).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import TYPE_CHECKING

from kvtier.config import format_size
from kvtier.daemon.pool.host_pool import HostPoolError
from kvtier.daemon.pool.slots import MAX_NEW_CLASSES
from kvtier.daemon.service.answers import Answer, Deferred
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.handover import Handover, HandoverNotYours, HandoverRefused
from kvtier.daemon.service.quotas import LimitExceeded
from kvtier.daemon.service.sessions import Session
from kvtier.daemon.service.validation import RequestError
from kvtier.daemon.service.refusal_log import RefusalLog
from kvtier.daemon.tier.rank_groups import GroupKey
from kvtier.daemon.tier.tenant_namespaces import DEFAULT_TENANT
from kvtier.daemon.transfer.engine_memory import (
    NAMES_REFUSED,
    EngineMemory,
    EngineMemoryError,
    EngineMemoryExhausted,
    NoMemory,
)
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import PeerCred
from kvtier.ipc.namespace import namespace_fingerprint

if TYPE_CHECKING:
    from kvtier.daemon.transfer.cuda.executor import CudaSessionCopier
    from kvtier.daemon.transfer.cuda.memory import CudaEngineMemory

log = logging.getLogger("kvtier.daemon")


class Registration:
    """REGISTER's handler and its parts.

    Args:
        ctx: the daemon's shared state.
    """

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self._refusals = RefusalLog(log)  # a wrong token's line, once per minute a tenant

    def register(self, identity: bytes, m: P.Register, peer: PeerCred | None = None) -> Answer:
        """REGISTER: check, authenticate, map the handed-over memory, open a session.

        CUDA memory (``kind = "cuda_ipc"``) is opened on the ``kvtier-cuda`` thread, the
        reply deferred until then (:mod:`~kvtier.daemon.service.cuda_sessions`).

        Args:
            identity: the connection's ZeroMQ identity.
            m: the request.
            peer: the sender's credentials when the transport tells them (``ipc://``);
                the handover must then come from the same process.

        Returns:
            :class:`~kvtier.ipc.protocol.Registered`.

        Raises:
            RequestError: refused. The request's own fields are checked before its
                handover is claimed; a refusal then closes the handover if the sender made
                it (another process's keeps waiting for its own REGISTER). Once claimed,
                the handover is spent either way: the daemon keeps no descriptor of a
                refused registration.
        """
        try:
            tenant = self._check_register(m, peer)
        except RequestError:
            self.ctx.handovers.discard(m.handover, peer)
            raise
        try:
            h = self.ctx.handovers.claim(m.handover, peer)
        except HandoverNotYours as err:
            raise RequestError(P.ErrorCode.UNAUTHORIZED, str(err)) from err
        except HandoverRefused as err:
            raise RequestError(P.ErrorCode.BAD_MEMORY, str(err)) from err
        if m.pid and m.pid != h.peer.pid:
            self._refusals.log(
                logging.INFO,
                ("pid", h.peer.uid),
                "REGISTER says pid %d; the handover's process is %d uid %d (used)",
                m.pid,
                h.peer.pid,
                h.peer.uid,
            )
        if m.memory.kind == "cuda_ipc":
            return Deferred(self._register_cuda(identity, m, h, tenant))
        try:
            return self._open_session(identity, m, h, tenant)
        except BaseException:
            h.completion.close()
            raise
        finally:
            h.close_fds()  # mapped, or refused

    async def _register_cuda(
        self, identity: bytes, m: P.Register, h: Handover, tenant: str
    ) -> P.Reply:
        """Open CUDA memory off the event loop, then the session (errors: BAD_MEMORY)."""
        try:
            try:
                self.ctx.quotas.check_session(h.peer.uid, tenant)
                if h.fds:
                    raise EngineMemoryError(
                        f"memory.kind = 'cuda_ipc' but the handover passed {len(h.fds)} "
                        "descriptors (CUDA memory travels as IPC handles)"
                    )
                memory, copier = await self.ctx.cuda.open(m.geometry, m.memory)
            except LimitExceeded as err:
                raise RequestError(P.ErrorCode.BUSY, str(err)) from err
            except EngineMemoryError as err:
                raise RequestError(P.ErrorCode.BAD_MEMORY, str(err)) from err
            try:
                if self.ctx.stopping:
                    raise RequestError(P.ErrorCode.SHUTTING_DOWN, "kvtierd is stopping")
                # the bounds again: other REGISTERs may have opened sessions meanwhile
                cfg = self.ctx.cfg
                if len(self.ctx.sessions) >= cfg.max_sessions:
                    raise RequestError(
                        P.ErrorCode.BUSY, f"max_sessions ({cfg.max_sessions}) reached"
                    )
                try:
                    self.ctx.quotas.check_session(h.peer.uid, tenant)
                except LimitExceeded as err:
                    raise RequestError(P.ErrorCode.BUSY, str(err)) from err
                return self._start_session(identity, m, h, tenant, memory, copier)
            except BaseException:
                self.ctx.cuda.close_session(copier, memory)
                raise
        except BaseException:
            h.completion.close()
            raise
        finally:
            h.close_fds()

    def _check_register(self, m: P.Register, peer: PeerCred | None = None) -> str:
        """A REGISTER's fields (not yet its memory); returns the tenant it authenticated as
        (``peer``: the sender's credentials, for the log of a refusal)."""
        ctx, cfg = self.ctx, self.ctx.cfg
        if m.protocol_version not in P.SERVED_PROTOCOL_VERSIONS:
            raise RequestError(
                P.ErrorCode.PROTOCOL_VERSION,
                f"protocol_version = {m.protocol_version!r}; this daemon speaks "
                f"{P.PROTOCOL_VERSION} and registers clients of versions "
                f"{', '.join(map(str, sorted(P.SERVED_PROTOCOL_VERSIONS)))}",
            )
        if m.memory.kind == "shm":
            raise RequestError(P.ErrorCode.BAD_MEMORY, NAMES_REFUSED)
        if len(ctx.sessions) >= cfg.max_sessions:
            raise RequestError(P.ErrorCode.BUSY, f"max_sessions ({cfg.max_sessions}) reached")
        tenant = self._authenticate(m, peer)
        g = m.geometry
        try:
            g.validate()
        except ValueError as err:
            raise RequestError(P.ErrorCode.GEOMETRY_MISMATCH, str(err)) from err
        if m.tp_rank >= m.tp_size:  # each within its wire bounds (checked at decode)
            raise RequestError(
                P.ErrorCode.GEOMETRY_MISMATCH,
                f"tp_rank = {m.tp_rank!r} / tp_size = {m.tp_size!r} are inconsistent",
            )
        if g.page_bytes > cfg.extent_size:
            raise RequestError(
                P.ErrorCode.GEOMETRY_MISMATCH,
                f"a page of {g.page_bytes} bytes does not fit the pool's "
                f"extent_size ({cfg.extent_size})",
            )
        return tenant

    def _open_session(self, identity: bytes, m: P.Register, h: Handover, tenant: str) -> P.Reply:
        """Map the handover's memory and open the session (taking its completion block)."""
        ctx, g = self.ctx, m.geometry
        control = m.memory.kind == "none"
        uid = h.peer.uid
        try:
            ctx.quotas.check_session(uid, tenant)
            if control:
                NoMemory.check(m.memory, h.fds)
                memory: EngineMemory | NoMemory = NoMemory()
            else:
                memory = EngineMemory(g, m.memory, h.fds, ctx.quotas.admitter(uid, tenant))
        except LimitExceeded as err:
            self._refusals.log(
                logging.INFO,
                ("limit", uid),
                "registration of pid %d uid %d refused: %s",
                h.peer.pid,
                uid,
                err,
            )
            raise RequestError(P.ErrorCode.BUSY, str(err)) from err
        except (EngineMemoryExhausted, MemoryError) as err:
            ctx.strain.note(f"REGISTER from uid {uid}: cannot map its memory: {err}")
            raise RequestError(
                P.ErrorCode.BUSY,
                f"the daemon is short of address space or memory to map this memory: {err}",
            ) from err
        except EngineMemoryError as err:
            raise RequestError(P.ErrorCode.BAD_MEMORY, str(err)) from err
        try:
            return self._start_session(identity, m, h, tenant, memory)
        except BaseException:
            memory.close()
            raise

    def _reclaimed(self, dropped: dict[int, list[bytes]]) -> None:
        """A namespace or page class nobody uses gave its cached pages up for a new
        registration (its table was full): they are removed in KV events, published before
        the id changes hands, and no longer counted as prefetched."""
        ctx = self.ctx
        pages = [(ns, k) for ns, keys in dropped.items() for k in keys]
        if ctx.events is not None:
            for ns, keys in dropped.items():
                ctx.events.l2_dropped(ns, keys)
            ctx.events.publish_now()
        ctx.tier.prefetcher.evicted(pages)
        log.info(
            "REGISTER: %d cached pages of %d namespaces nobody uses dropped to free an id "
            "of a full table",
            len(pages),
            len(dropped),
        )

    def _namespace_reclaimed(self, dropped: dict[int, list[bytes]]) -> None:
        """:meth:`_reclaimed`, for a namespace whose id changes hands: what the L3 writer
        holds of it is forgotten too."""
        self._reclaimed(dropped)
        for ns_id in dropped:
            self.ctx.tier.writer.forget_namespace(ns_id)

    def _start_session(
        self,
        identity: bytes,
        m: P.Register,
        h: Handover,
        tenant: str,
        memory: EngineMemory | NoMemory | CudaEngineMemory,
        cuda: CudaSessionCopier | None = None,
    ) -> P.Reply:
        """Open the session over ``memory`` (the caller closes it if this raises)."""
        ctx, cfg, g = self.ctx, self.ctx.cfg, m.geometry
        control = m.memory.kind == "none"
        uid = h.peer.uid
        fp = namespace_fingerprint(m.namespace, g, m.tp_rank, m.tp_size, tenant)
        try:
            # pages being written back to L3 are pinned meanwhile: never dropped for an id
            with ctx.tier.writer.flush_guard():
                in_use = (s.ns_id for s in ctx.sessions)
                ns_id = ctx.pool.namespace_id(fp, in_use, self._namespace_reclaimed)
                owner = ctx.pool.owner_id(tenant)
                classes = (s.class_id for s in ctx.sessions)
                class_id = ctx.pool.register_class(
                    g.page_bytes, MAX_NEW_CLASSES, classes, self._reclaimed
                )
        except HostPoolError as err:
            raise RequestError(P.ErrorCode.BUSY, str(err)) from err
        sid = ctx.sessions.new_id()
        block = h.completion
        s = Session(
            session_id=sid,
            identity=identity,
            tenant=tenant,
            owner=owner,
            ns_id=ns_id,
            ns_fingerprint=fp,
            geometry=g,
            class_id=class_id,
            memory=memory,
            completion=block,
            pid=h.peer.pid,
            uid=h.peer.uid,
            tp_rank=m.tp_rank,
            tp_size=m.tp_size,
            lease_s=cfg.lease_s,
            model_id=m.namespace.model_id,
            cuda=cuda,
        )
        s.renew(time.monotonic())
        ctx.tier.register(ns_id, fp, tenant, s.class_id, g.page_bytes, m.namespace.model_id)
        if ctx.events is not None:
            ctx.events.name(ns_id, m.namespace.model_id, fp, g.page_size)
        if control:  # no rank group: a scheduler asks for itself, one session per rank
            s.control_only = True
        else:
            s.member = ctx.tier.groups.join(
                GroupKey(
                    uid=uid,
                    tenant=tenant,
                    model_id=m.namespace.model_id,
                    revision=m.namespace.revision,
                    cache_salt=m.namespace.cache_salt,
                    attention=g.attention,
                    tp_size=m.tp_size,
                    tp_group=m.tp_group,
                ),
                m.tp_rank,
                sid,
                m.counts_continue,
                s.pid,
            )
        ctx.sessions.add(s)
        ctx.quotas.add(
            sid,
            uid,
            tenant,
            getattr(memory, "mapped_bytes", 0),
            getattr(memory, "descriptors", 0),
        )
        ctx.counters.sessions_opened += 1
        if isinstance(memory, EngineMemory):
            memory.start_prefault(f"session {sid}", ctx.prefaults, uid)
        log.info(
            "session %d registered: tenant %s, model %s, pid %d uid %d, rank %d/%d, %s of %s",
            sid,
            tenant,
            m.namespace.model_id,
            s.pid,
            s.uid,
            m.tp_rank,
            m.tp_size,
            "control only, no pages"
            if control
            else f"{m.memory.num_pages} pages"
            f"{'' if getattr(memory, 'mapped', True) else ' (unmapped, by I/O)'}"
            f"{' on a GPU' if cuda is not None else ''}",
            format_size(g.page_bytes),
        )
        return P.Registered(
            req_id=m.req_id,
            epoch=ctx.epoch,
            session_id=sid,
            lease_s=cfg.lease_s,
            ns_fingerprint=fp,
            completion_name=f"memfd:completion-{ctx.epoch:x}-{sid}",
            completion_slots=block.slots,
            daemon_pid=os.getpid(),
            packed_lookup=True,
            packed_transfers=True,
            kv_events=ctx.events is not None,
            event_handles=list(cuda.event_handles) if cuda is not None else [],
            ready_event=cuda.ready_handle if cuda is not None else b"",
        )

    def _authenticate(self, m: P.Register, peer: PeerCred | None = None) -> str:
        """The tenant a REGISTER may act as (the default one when none are configured). A
        refusal's log names the sender by ``peer``, the credentials the transport tells,
        never by the pid the request claims."""
        tenants = self.ctx.cfg.tenants
        if not tenants:
            return DEFAULT_TENANT
        t = tenants.get(m.tenant)
        ok = t is not None and hmac.compare_digest(
            t.token.get_secret_value().encode(), m.token.encode()
        )
        if not ok:
            self._refusals.log(
                logging.WARNING,
                ("token", m.tenant if m.tenant in tenants else None),  # a name it chose: one
                "registration refused: tenant %r from %s %s",
                m.tenant,
                f"pid {peer.pid} uid {peer.uid}" if peer is not None else "an unknown process",
                "is not configured"
                if t is None
                else f"presented a {'missing' if not m.token else 'wrong'} token",
            )
            raise RequestError(
                P.ErrorCode.UNAUTHORIZED, f"tenant = {m.tenant!r}: missing or wrong token"
            )
        return m.tenant
