"""The engine's synchronous connection to kvtierd.

Engines are mostly synchronous, so this API is too: ``lookup``, ``store`` and ``load``
return at once (a load returns a handle whose ``wait_layer(i)`` the forward pass calls
before layer ``i``). Page bytes never cross the socket: the daemon copies them through
shared memory and signals each layer in the session's completion block.

Registration is two steps: the pool's descriptors go to the daemon on its handover socket
under a fresh random token (:func:`kvtier.ipc.fdpass.hand_over`; the reply carries the
completion block's descriptor), then REGISTER names the token. Every (re-)registration
makes a new handover.

Pages in L3 come back in two steps, as in SGLang HiCache: ``prefetch`` (when a request
arrives) starts filling L2 from L3 in the daemon; ``claim`` (when the scheduler is about
to run the request) ends it per the prefetch policy and answers how many leading pages
are in L2 now; the engine then ``load``s them as usual. The ranks of a tensor-parallel
engine get the same ``lookup`` and ``claim`` answers (the minimum over the ranks), so each
rank must issue the same sequence of those calls.

Failure is never fatal for the engine: when the daemon is gone or late past
``request_timeout_s``, lookups report 0, loads report a miss and stores are dropped; the
engine recomputes. A reply from a new daemon epoch (a restarted daemon) makes the
connection re-register by itself.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq
from kvtier.client.connection import replies
from kvtier.client.connection.channel import DaemonChannel
from kvtier.client.connection.replies import (
    DaemonError,
    DaemonUnavailable,
    LookupReply,
    rep_is_late,
)
from kvtier.client.connection.request_codec import key_list, lookup_request, transfer_request
from kvtier.client.connection.slots import CompletionSlots
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.client.page_keys import page_keys
from kvtier.config import ClientConfig, client_config, runtime_dir, socket_path
from kvtier.config.models import PrefetchPolicy
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import CompletionBlock, TransferStatus, check_timeout
from kvtier.ipc.fdpass import handover_path_for
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, KEY_BYTES
from kvtier.ipc.sockets import ipc_endpoint

if TYPE_CHECKING:
    from typing import Self

    import numpy as np
    from kvtier.client.connection.cuda_wait import CudaLayerWaiter
    from kvtier.client.kv_pool.cuda import CudaKVPool
    from kvtier.client.kv_pool.cuda_regions import CudaRegionMemory

__all__ = [
    "Connection",
    "DaemonError",
    "DaemonUnavailable",
    "LookupReply",
    "TransferHandle",
    "rep_is_late",
]

log = logging.getLogger("kvtier.client")


UNANSWERED_POLL_S = 0.001
"""How often a transfer whose reply never came is looked at in its slot while it runs."""

REFUSED_RETRY_S = 1.0
"""After the daemon refused a re-registration (a token no longer valid, a bound reached),
requests fail with that refusal for this long before the next try: each try hands memory
over and takes the daemon's time."""


class _Unanswered(Exception):
    """A STORE or LOAD got no reply in time (the daemon may have started it): ``slot``,
    ``seq``."""

    def __init__(self, slot: int, seq: int) -> None:
        super().__init__(slot, seq)
        self.slot, self.seq = slot, seq


class Connection:
    """A registered engine (one TP rank) talking to kvtierd.

    Args:
        pool: the engine's KV pool: in shared memory (handed over at each registration), or
            on a GPU (a :class:`~kvtier.client.kv_pool.cuda.CudaKVPool`, or an engine's own
            tensors as a :class:`~kvtier.client.kv_pool.cuda_regions.CudaRegionMemory`,
            exported by CUDA IPC; each registration then opens that daemon's events, and the
            events of an earlier registration are dropped first: docs/gpu.md).
        model_id / revision: identify the model; with the geometry they form the namespace.
        config: client settings (timeouts, tenant); default: the ``KVTIER_*`` environment
            over the defaults (:func:`~kvtier.config.client_config`).
        tp_rank / tp_size: tensor-parallel position.
        register: connect and register now (else call :meth:`register`).
    """

    def __init__(
        self,
        pool: SharedKVPool | CudaKVPool | CudaRegionMemory,
        model_id: str,
        revision: str = "",
        config: ClientConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        register: bool = True,
    ) -> None:  # tp_group comes from config.tp_group
        self.config = config or client_config()
        self.pool = pool
        self.geometry = pool.geometry
        self.namespace = P.NamespaceSpec(
            model_id=model_id, revision=revision, cache_salt=self.config.cache_salt
        )
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # a TP rank counts its LOOKUPs and CLAIMs, those it could not send included, so the
        # daemon pairs them with the other ranks' by count (rank_groups)
        self._rounds = {"lookup": 0, "claim": 0}
        self.endpoint = self.config.endpoint or ipc_endpoint(
            socket_path(runtime_dir(self.config.runtime_dir))
        )
        self._lock = threading.RLock()
        self._channel = DaemonChannel(self.endpoint, self.config.request_timeout_s, self._lock)
        self._seqs = itertools.count(1)
        self._slots = CompletionSlots()
        self.session_id = 0
        self.epoch = 0
        self.ns_fingerprint = b""
        self._packed_lookup = False
        self._packed_transfers = False
        self._kv_events = False
        self._block: CompletionBlock | None = None
        self._cuda: CudaLayerWaiter | None = None
        self._closed = False
        # (until, why, the refusing daemon's pid): see _reregister
        self._refused: tuple[float, DaemonError, int] | None = None
        self._hb_stop = threading.Event()
        self._hb_wake = threading.Event()  # stop, or abandoned slots to release
        self._hb: threading.Thread | None = None
        # (block, slot) of transfers given up on, whose RELEASE the heartbeat thread sends
        self._to_release: list[tuple[CompletionBlock, int, int]] = []  # block, slot, seq
        self._release_lock = threading.Lock()
        self._finalizer = weakref.finalize(
            self, _leaked, self._channel.context, self.endpoint, self._hb_stop, self._hb_wake
        )
        if register:
            try:
                self.register()
            except BaseException:  # a refused REGISTER leaves no socket for the GC to find
                self.close()
                raise

    # ------------------------------------------------------------------ session
    def register(self) -> None:
        """Connect (if needed), register with the daemon and start heartbeats.

        Raises:
            DaemonError: the daemon refused the registration (bad token, geometry, ...).
            DaemonUnavailable: at once when the daemon's ``ipc://`` socket file does not
                exist (no kvtierd is running there); else when no daemon answered within
                ``request_timeout_s``.
            UnexpectedReply: the daemon answered with another reply than REGISTERED.
        """
        self._check_usable()
        with self._lock:
            self._drop_cuda()  # the events of the daemon registered with before: never again
            self._channel.check_socket_file()
            self._channel.connect()
            token = self.config.token.get_secret_value() if self.config.token else ""
            handover = secrets.token_bytes(HANDOVER_TOKEN_BYTES)
            memory_fds = getattr(self.pool, "memory_fds", None)
            completion_fd = self._channel.hand_over(
                handover_path_for(self.endpoint, runtime_dir(self.config.runtime_dir)),
                handover,
                memory_fds() if memory_fds is not None else [],
            )
            try:
                msg = P.Register(
                    req_id=0,
                    protocol_version=P.PROTOCOL_VERSION,
                    namespace=self.namespace,
                    geometry=self.geometry,
                    memory=self.pool.export(),
                    tp_rank=self.tp_rank,
                    tp_size=self.tp_size,
                    pid=os.getpid(),
                    tenant=self.config.tenant,
                    token=token,
                    tp_group=self.config.tp_group,
                    handover=handover,
                    counts_continue=any(self._rounds.values()),
                )
                rep = replies.expect(msg, self._call(msg, raw=True), P.Registered)
                block = CompletionBlock.from_fd(completion_fd, rep.completion_slots)
            finally:
                os.close(completion_fd)
            self._cuda = self._open_cuda(rep)
            if self._block is not None:
                self._block.close()
            self._block = block
            self.session_id, self.epoch = rep.session_id, rep.epoch
            self.ns_fingerprint = rep.ns_fingerprint
            self._channel.daemon_pid = self._channel.pid_to_watch(rep.daemon_pid)
            self._packed_lookup = rep.packed_lookup
            self._packed_transfers = rep.packed_transfers
            self._kv_events = rep.kv_events
            self._slots.reset(rep.completion_slots)
            self._channel.mark_up()
        if self._hb is None:  # it holds no reference to this connection while it sleeps
            self._hb = threading.Thread(
                target=_heartbeats,
                args=(weakref.ref(self), self._hb_stop, self._hb_wake),
                name="kvtier-heartbeat",
                daemon=True,
            )
            self._hb.start()

    def _check_usable(self) -> None:
        """Raise DaemonUnavailable when this connection is closed (or closing), or was made
        by another process (a forked worker: ZeroMQ sockets and the lock of the parent are
        not its to use)."""
        if self._closed or self._channel.closing.is_set():
            raise DaemonUnavailable("connection is closed")
        if os.getpid() != self._channel.pid:
            raise DaemonUnavailable(
                f"this connection belongs to process {self._channel.pid}: a forked process "
                f"(here {os.getpid()}) makes a Connection of its own"
            )

    def _open_cuda(self, rep: P.Registered) -> CudaLayerWaiter | None:
        """A GPU pool's waiter over the events of ``rep`` (None for a shared-memory pool);
        DaemonError (BAD_MEMORY) when they cannot be opened."""
        if getattr(self.pool, "cuda_backend", None) is None:
            return None
        from kvtier.client.connection.cuda_wait import waiter_for  # torch: for GPU pools only

        return waiter_for(self.pool, rep, self.geometry.num_layers)

    def _drop_cuda(self) -> None:
        """Close the events of the current registration (its daemon may be gone)."""
        waiter, self._cuda = self._cuda, None
        if waiter is not None:
            waiter.close()

    def _beat(self, due: bool) -> None:
        """One turn of the heartbeat thread: the RELEASE of transfers given up on
        (:meth:`_abandon`), and a HEARTBEAT when ``due``."""
        try:
            self._release_abandoned()
            if due:
                self._session_call(lambda sid: P.Heartbeat(req_id=0, session_id=sid), P.Ack)
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("heartbeat: %s", err)

    @property
    def daemon_pid(self) -> int:
        """The registered daemon's process id (0 before the first registration)."""
        return self._channel.daemon_pid

    def daemon_alive(self) -> bool:
        """False when the daemon's process is known to be gone."""
        return self._channel.daemon_alive()

    def serving(self) -> bool:
        """False once :meth:`close` has begun or the daemon's process is known to be gone:
        a wait for a transfer gives up (a miss)."""
        return not self._channel.closing.is_set() and self._channel.daemon_alive()

    @property
    def store_room(self) -> tuple[int, int]:
        """``(stores, pages)`` a caller may keep in flight as STOREs: half the completion
        slots (the other half is for loads), pages unbounded. A STORE or LOAD that finds
        every slot busy is dropped or missed, not queued."""
        return max(1, self._slots.count // 2), sys.maxsize

    @property
    def load_room(self) -> tuple[int, int]:
        """``(loads, pages)`` a caller may keep in flight as LOADs: the completion slots
        :attr:`store_room` leaves, pages unbounded. Loads past them would take the slots a
        write-back STORE needs (and it would be dropped)."""
        return max(1, self._slots.count - self._slots.count // 2), sys.maxsize

    # ------------------------------------------------------------------ requests
    def _call(self, msg: P.Request, raw: bool = False, timeout: float | None = None) -> P.Reply:
        """Send ``msg`` and wait for its reply (:meth:`DaemonChannel.call
        <kvtier.client.connection.channel.DaemonChannel.call>`); ``timeout`` defaults to
        ``request_timeout_s``."""
        self._check_usable()
        return self._channel.call(msg, raw=raw, timeout=timeout)

    def _session_call(
        self,
        make: Callable[[int], P.Request],
        kind: type[replies.ReplyT],
        timeout: float | None = None,
    ) -> replies.ReplyT:
        """Call with the current session id; re-register once if the daemon forgot us. The
        reply is checked to be a ``kind`` (else :class:`~.replies.UnexpectedReply`)."""
        self._check_usable()
        with self._lock:
            if self.session_id != 0 and not self.daemon_alive():
                self.session_id = 0  # that daemon is gone: register with its successor, if any
            if self.session_id == 0:
                self._reregister()
            msg = make(self.session_id)
            rep = self._call(msg, timeout=timeout)
            if isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNKNOWN_SESSION:
                log.info(
                    "kvtierd epoch %x does not know session %d; re-registering",
                    rep.epoch,
                    self.session_id,
                )
                self.session_id = 0
                self._reregister()
                msg = make(self.session_id)
                rep = self._call(msg, timeout=timeout)
            return replies.expect(msg, rep, kind)

    def _reregister(self) -> None:
        """:meth:`register` for a request; a refusal is repeated without asking the daemon
        again for :data:`REFUSED_RETRY_S` (an engine whose token the daemon no longer takes
        would otherwise hand its memory over on every request), unless the daemon that
        refused is gone (its successor may take it: asked at once)."""
        refused = self._refused
        if (
            refused is not None
            and time.monotonic() < refused[0]
            and self._channel.daemon_alive(refused[2])
        ):
            raise refused[1].with_traceback(None)
        try:
            self.register()
        except DaemonError as err:
            if err.code != P.ErrorCode.SHUTTING_DOWN:  # its successor may be up at once
                until = time.monotonic() + REFUSED_RETRY_S
                self._refused = (until, err, self._channel.handover_pid)
            raise
        self._refused = None

    def _count(self, op: str) -> int:
        """A TP rank's count of its ``op`` requests, this one included (0 for one rank:
        nothing to pair)."""
        if self.tp_size <= 1 or os.getpid() != self._channel.pid:
            return 0  # a forked process's request fails before it is sent (_check_usable)
        with self._lock:
            self._rounds[op] += 1
            return self._rounds[op]

    def page_keys(
        self, tokens: Sequence[int] | np.ndarray, parent: bytes | None = None
    ) -> list[bytes]:
        """Keys of the full pages of ``tokens`` (a chain from ``parent``, the key of the page
        before ``tokens[0]``, or from the namespace when None).

        Raises:
            ValueError: ``parent`` is not a page key (32 bytes), or the tokens are not
                integer token ids in ``[0, 2**32)``.
        """
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
            raise ValueError(f"parent = {parent!r:.80}: must be a page key of {KEY_BYTES} bytes")
        return page_keys(parent or self.ns_fingerprint, tokens, self.geometry.page_size)

    def lookup(self, keys: Sequence[bytes]) -> LookupReply:
        """Leading run of ``keys`` in L2 (and L3); ``LookupReply(0, 0)`` if the daemon is away."""
        keys = key_list(keys)
        if not keys:
            return LookupReply(0, 0)
        n = self._count("lookup")
        try:
            rep = self._session_call(
                lambda sid: lookup_request(sid, keys, self._packed_lookup, n), P.LookupResult
            )
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("lookup treated as a miss: %s", err)
            return LookupReply(0, 0)
        return LookupReply(rep.l2, rep.l3)

    def prefetch(self, keys: Sequence[bytes], skip: int = 0, request_id: str = "") -> int:
        """Start filling L2 from L3 with the run of ``keys`` that follows the L2 run.

        Call when a request arrives (after :meth:`lookup` reported ``l3`` pages); the
        daemon reads only when L3 holds at least its ``prefetch_threshold`` tokens there.

        Args:
            keys: the request's page keys in chain order (the L1 hits may be left out).
            skip: how many leading keys the caller knows to be in L2 already.
            request_id: names the prefetch for :meth:`claim` (default: the chain's last
                key names it, so claim with the same keys).

        Returns:
            Pages whose reads started (0 if none, or if the daemon is away).
        """
        rep = self._prefetch(keys, skip, request_id)
        return rep.started if rep is not None else 0

    def prefetch_coming(self, keys: Sequence[bytes], skip: int = 0, request_id: str = "") -> int:
        """:meth:`prefetch`, answered with the leading run of ``keys[skip:]`` in L2 now or on
        its way there: pages whose reads it started, those of prefetches already running
        (another request's, another rank's) or being stored. 0: nothing comes (L3 holds too
        little there, is unreachable, or the daemon is away)."""
        rep = self._prefetch(keys, skip, request_id)
        return rep.coming if rep is not None else 0

    def _prefetch(
        self, keys: Sequence[bytes], skip: int, request_id: str
    ) -> P.PrefetchReply | None:
        keys = key_list(keys)
        if not keys:
            return None
        try:
            return self._session_call(
                lambda sid: P.Prefetch(
                    req_id=0, session_id=sid, keys=list(keys), skip=skip, request_id=request_id
                ),
                P.PrefetchReply,
            )
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("prefetch not started: %s", err)
            return None

    def claim(
        self,
        keys: Sequence[bytes],
        policy: PrefetchPolicy | None = None,
        request_id: str = "",
        timeout: float | None = None,
    ) -> int:
        """End the prefetch of ``keys`` and return the leading run now in L2.

        ``best_effort`` answers with what is ready now, ``wait_complete`` waits for the
        whole prefetch, ``timeout`` waits up to the daemon's prefetch deadline; the rest is
        cancelled. Then :meth:`load` the run. Without a prefetch this is the L2 run.

        Args:
            keys: the same keys as the prefetch (or name it with ``request_id``).
            policy: one of the three, or None for this client's
                ``hicache_storage_prefetch_policy`` (when that is None too, the daemon's).
            request_id: the prefetch's request id, if it was given one.
            timeout: longest wait for the reply (default ``claim_timeout_s``); a shorter
                wait than the reply takes is a miss for this claim only.

        Returns:
            Leading keys in L2 (0 when the daemon is away: recompute).

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds, 0 or more.
        """
        wait_s = self.config.claim_timeout_s if timeout is None else check_timeout(timeout)
        keys = key_list(keys)
        if not keys:
            return 0
        n = self._count("claim")
        try:
            rep = self._session_call(
                lambda sid: P.Claim(
                    req_id=0,
                    session_id=sid,
                    keys=list(keys),
                    request_id=request_id,
                    policy=policy or self.config.hicache_storage_prefetch_policy or "",
                    round=n,
                ),
                P.ClaimReply,
                timeout=wait_s,
            )
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("claim treated as a miss: %s", err)
            return 0
        return rep.l2

    def store(
        self,
        keys: Sequence[bytes],
        pages: Sequence[int],
        parent_key: bytes | None = None,
        engine: P.EngineBlocks | None = None,
    ) -> TransferHandle:
        """Copy engine pages into L2 under ``keys`` (those L2 lacks).

        Reuse ``pages`` only after ``handle.wait()`` returned. If the daemon is away the
        store is dropped (``count == 0``). ``engine``: the engine's own hashes of the pages,
        for the daemon's KV events (sent only when the daemon publishes them).
        """
        return self._transfer(P.Store, keys, pages, parent_key, engine if self._kv_events else None)

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> TransferHandle:
        """Load the leading L2 run of ``keys`` into engine ``pages`` layer by layer.

        ``handle.count`` pages are being loaded (0: a miss). Call ``wait_layer(i)`` before
        layer ``i`` reads them; a False result means recompute.
        """
        return self._transfer(P.Load, keys, pages, None)

    def _transfer(
        self,
        kind: type[P.Store | P.Load],
        keys: Sequence[bytes],
        pages: Sequence[int],
        parent_key: bytes | None,
        engine: P.EngineBlocks | None = None,
    ) -> TransferHandle:
        n_layers = self.geometry.num_layers
        keys = key_list(keys)
        if not keys:
            return TransferHandle(None, None, -1, 0, 0, 0, n_layers)
        try:  # before the lock: a forked process's copy of it may be held for good
            self._check_usable()
        except DaemonUnavailable as err:
            log.debug("%s treated as a miss: %s", kind.__name__, err)
            return TransferHandle(None, None, -1, 0, 0, 0, n_layers)
        try:
            with self._lock:
                return self._transfer_locked(kind, keys, pages, parent_key, engine)
        except _Unanswered as u:  # a miss, once no copy of it can run any more
            self._settle_unanswered(u.slot, u.seq)
        return TransferHandle(None, None, -1, 0, 0, 0, n_layers)

    def _transfer_locked(
        self,
        kind: type[P.Store | P.Load],
        keys: Sequence[bytes],
        pages: Sequence[int],
        parent_key: bytes | None,
        engine: P.EngineBlocks | None,
    ) -> TransferHandle:
        n_layers = self.geometry.num_layers
        if self._block is None:  # never registered (register=False): first, or a miss
            try:
                self._check_usable()
                self._reregister()
            except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
                log.debug("%s treated as a miss: %s", kind.__name__, err)
                return TransferHandle(None, None, -1, 0, 0, 0, n_layers)
        seq = next(self._seqs)
        slot = self._slots.take(self._block, seq)
        if slot is None:
            return TransferHandle(None, None, -1, 0, 0, 0, n_layers)

        def make(sid: int) -> P.Request:  # called once registered (again, maybe)
            if self._cuda is not None:  # the daemon's copies wait for the engine's work
                self._cuda.record_ready()
            # no copy starts once this call stops waiting for the reply (at least this
            # long after the request is sent): see _settle_unanswered
            deadline = time.monotonic_ns() + int(self.config.request_timeout_s * 1e9)
            return transfer_request(
                kind,
                sid,
                keys,
                pages,
                slot,
                seq,
                self._packed_transfers,
                parent_key,
                engine,
                deadline,
            )

        block = self._block  # a re-registration (even with the same daemon) makes a new one
        accepted: type[P.StoreAccepted | P.LoadAccepted] = (
            P.StoreAccepted if kind is P.Store else P.LoadAccepted
        )
        try:
            rep = self._session_call(make, accepted)
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("%s treated as a miss: %s", kind.__name__, err)
            if self._block is not block:  # registered again meanwhile: the request went to
                self._slots.keep(slot, seq)  # the new session, in this slot of its table
            self._slots.abandon(slot, seq)  # the daemon may still run it
            if isinstance(err, DaemonUnavailable):
                raise _Unanswered(slot, seq) from err
            return TransferHandle(None, None, -1, 0, 0, 0, n_layers)
        except BaseException:  # anything else (a bad page value, an interrupt): the slot
            if self._block is not block:  # is not lost, whether the request went or not
                self._slots.keep(slot, seq)
            self._slots.abandon(slot, seq)
            raise
        if self._block is not block:  # re-registered: slots were reset
            self._slots.keep(slot, seq)
        if isinstance(rep, P.LoadAccepted):
            count, writing = rep.count, rep.count
        else:
            count, writing = rep.count, rep.writing
        if writing == 0:
            self._slots.give_back(slot, seq)
            return TransferHandle(None, None, -1, 0, count, 0, n_layers)
        cuda = self._cuda if kind is P.Load else None
        return TransferHandle(self, self._block, slot, seq, count, writing, n_layers, cuda)

    def _settle_unanswered(self, slot: int, seq: int) -> None:
        """A STORE or LOAD got no reply in time: make sure no copy of it runs when the
        caller, told it is a miss, uses its pages again.

        Its ``deadline_ns`` has passed, so the daemon starts no copy of it any more (it begins
        the slot before it reads the clock). Whether it started one before: the slot shows
        ``seq`` running. Such a copy is waited for, without the connection's lock, until it
        ended or the daemon is gone, at most ``load_timeout_s``; past that it is logged, and
        the pages may still be written (a daemon stalled that long in the middle of a copy).
        """
        block = self._block
        if block is None:
            return

        def running() -> bool:  # a closed block (re-registered): not
            return block.runs(slot, seq) and self.daemon_alive()

        end = time.monotonic() + self.config.load_timeout_s
        while running():
            if time.monotonic() > end:
                log.error(
                    "kvtierd started a transfer (slot %d) whose reply never came and has not "
                    "ended it in %.1f s; its pages may still be written",
                    slot,
                    self.config.load_timeout_s,
                )
                return
            time.sleep(UNANSWERED_POLL_S)

    def _slot_done(
        self, block: CompletionBlock | None, slot: int, seq: int, status: TransferStatus
    ) -> None:
        """A handle's transfer ended: its slot may be reused. A handle of an earlier
        registration changes nothing: a re-registration reset the table, so ``seq`` owns no
        slot of it (sequence numbers are never reused). Without the connection's lock, which
        a request to a daemon that does not answer may hold: an engine's forward pass
        records the end of its LOAD without waiting for that."""
        self._slots.done(slot, seq, status)

    def _abandon(self, h: TransferHandle) -> None:
        """A transfer timed out: its slot waits in limbo at once, and the heartbeat thread
        asks the daemon to cancel it (RELEASE), so the caller (an engine's forward pass)
        never waits for it: a daemon that let the wait time out may not answer that either,
        and the connection's lock may be held by a request to it meanwhile. A handle of an
        earlier registration is left alone: cancelling its slot number now would cancel
        whatever transfer of the new session uses it."""
        block = h.block
        if block is None or block is not self._block:
            return
        self._slots.abandon(h.slot, h.seq)
        with self._release_lock:
            self._to_release.append((block, h.slot, h.seq))
        self._hb_wake.set()

    def _release_abandoned(self) -> None:
        """Send the RELEASE of the transfers :meth:`_abandon` gave up on that still run:
        those of the current registration (after a re-registration there is nothing to
        cancel) whose slot still shows them running. One that ended meanwhile may have
        given its slot to a new transfer, which a RELEASE of the slot would cancel; none
        starts while the connection's lock is held, so the check made under it holds
        until the daemon has the RELEASE."""
        with self._release_lock:
            pending, self._to_release = self._to_release, []
        if not pending:
            return

        def running() -> list[int]:
            return [s for b, s, seq in pending if b is self._block and b.runs(s, seq)]

        def make(sid: int) -> P.Request:  # after a re-registration, if one happens first
            return P.Release(req_id=0, session_id=sid, slots=running())

        with self._lock:
            if running():
                self._session_call(make, P.Ack)

    def release(self, handles: Sequence[TransferHandle]) -> None:
        """Cancel transfers that are still running (their pins drop when they stop)."""
        if not any(not h.done and h.slot >= 0 for h in handles):
            return

        def running(h: TransferHandle) -> bool:
            """``h`` still runs in its slot: of this registration (an earlier one's has
            nothing to cancel in it), and the block shows it (a transfer given up on may
            have ended, and another one taken its slot, which a RELEASE would cancel; none
            starts while the connection's lock, held here, is)."""
            b = h.block
            return not h.done and b is not None and b is self._block and b.runs(h.slot, h.seq)

        def make(sid: int) -> P.Request:  # after a re-registration, if one happens first
            return P.Release(
                req_id=0, session_id=sid, slots=[h.slot for h in handles if running(h)]
            )

        try:
            self._session_call(make, P.Ack)
        except (DaemonUnavailable, DaemonError, replies.UnexpectedReply) as err:
            log.debug("release: %s", err)

    def stats(self) -> dict[str, object]:
        """The daemon's STATS reply (DaemonError when refused, UnexpectedReply when it
        answers with another reply)."""
        msg = P.Stats(req_id=0)
        return replies.expect(msg, self._call(msg), P.StatsReply).stats

    def close(self) -> None:
        """Unregister (best effort), stop heartbeats, close the socket. Idempotent.

        A thread waiting for a reply or a transfer of this connection gives up at once (a
        miss). In a process forked from the one that made the connection, it only marks it
        closed: the parent's session, socket and memory are left alone."""
        if self._closed:
            return
        self._channel.closing.set()  # waiters give up and let go of the lock
        self._hb_stop.set()
        self._hb_wake.set()
        if os.getpid() != self._channel.pid:
            self._closed = True
            self._finalizer.detach()
            return
        if self._hb is not None and self._hb is not threading.current_thread():
            self._hb.join(timeout=self.config.request_timeout_s + 1)
        with self._lock:
            if self._cuda is not None:  # no stream may still wait on the events UNREGISTER ends
                try:
                    self._cuda.drain()
                except Exception as err:  # a GPU fault: the daemon's events go anyway
                    log.warning("close: waiting for the GPU failed: %s", err)
            if self.session_id and self._channel.connected and not self._channel.context.closed:
                try:  # its own reply is waited for: a socket closed at once drops it unsent
                    self._channel.call(
                        P.Unregister(req_id=0, session_id=self.session_id), interruptible=False
                    )
                except (DaemonUnavailable, DaemonError, zmq.ZMQError):
                    pass  # at interpreter exit the context may be gone already: nothing to tell
            self._closed = True
            self._drop_cuda()
            if self._block is not None:
                self._block.close()
                self._block = None
            self._finalizer.detach()
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _heartbeats(
    ref: weakref.ReferenceType[Connection], stop: threading.Event, wake: threading.Event
) -> None:
    """The heartbeat thread of the connection ``ref`` names: a HEARTBEAT every
    ``heartbeat_interval_s`` and the RELEASE of transfers given up on as soon as there are
    some (:meth:`Connection._beat`), until ``stop`` or the connection is collected. Between
    turns it holds no reference to the connection, so an engine that drops one without
    closing it lets it go (its session then ends with its lease)."""
    conn = ref()
    if conn is None:
        return
    interval = conn.config.heartbeat_interval_s
    del conn
    beat = time.monotonic() + interval
    while not stop.is_set():
        wake.wait(max(0.0, beat - time.monotonic()))
        wake.clear()
        conn = ref()
        if stop.is_set() or conn is None:
            return
        due = time.monotonic() >= beat
        if due:
            beat = time.monotonic() + interval
        try:
            conn._beat(due)
        except zmq.ZMQError as err:  # the context was destroyed under us (interpreter exit)
            log.debug("heartbeat stopped: %s", err)
            return
        finally:
            del conn


def _leaked(ctx: zmq.Context, endpoint: str, stop: threading.Event, wake: threading.Event) -> None:
    warnings.warn(f"kvtier Connection to {endpoint} was not closed", ResourceWarning, stacklevel=1)
    stop.set()
    wake.set()
    ctx.destroy(linger=0)
