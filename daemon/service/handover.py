"""The memory handover socket: engines pass their KV memory's descriptors (SCM_RIGHTS).

The wire format is in :mod:`kvtier.ipc.fdpass`. This server runs on the daemon's event
loop, non-blocking throughout, so a slow or hostile peer cannot stall it:

- every connection is accepted (the backlog never fills with connections the daemon will
  not read) and served fairly per user: the peer's uid comes first (``SO_PEERCRED``), and
  a user holding ``max_handover_connections_per_user`` connections has its next one
  answered busy and closed, so silent connections cost their owner's share, nobody
  else's; past ``max_handover_connections`` in all, the user holding the most gives up its
  oldest connection;
- each connection has a deadline (:data:`CONNECTION_DEADLINE_S`) for its one request and
  carries one handover;
- a request is read whole with at most ``MAX_HANDOVER_FDS`` descriptors; one cut short
  (too long, too many descriptors: the kernel closes those beyond the limit) is refused
  and every descriptor received is closed;
- the peer's pid, uid and gid come from the socket (``SO_PEERCRED``);
- an accepted handover waits under its token for REGISTER for :data:`HANDOVER_TTL_S`
  seconds, then its descriptors are closed; at most ``max_handovers_waiting_per_user``
  wait per user and ``max_handovers_waiting`` in all, holding at most
  ``max_handover_descriptors_per_user`` descriptors per user and half the daemon's
  descriptor limit in all (past them: busy);
- running out of descriptors or memory (``accept`` fails with ``EMFILE``, the kernel
  cannot install the descriptors an engine sent, a completion block cannot be made)
  answers that connection busy and is noted for HEALTH.

A busy answer is status ``BUSY`` naming the setting; the client tries again until its
deadline (:func:`kvtier.ipc.fdpass.hand_over`).

For each accepted handover the server creates the session's completion block (a sealed
memfd) and answers with a read-only descriptor of it; REGISTER takes both with
:meth:`HandoverServer.claim`. At stop it stops accepting first, and removes its socket
file only when it is still the one this server bound (same inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier.config.errors import KvtierError
from kvtier.daemon.pauses import RunningTimer
from kvtier.daemon.service.refusal_log import RefusalLog
from kvtier.daemon.service.strain import Strain, descriptor_limit
from kvtier.ipc import fdpass
from kvtier.ipc.completion import CompletionBlock
from kvtier.ipc.fdpass import REQUEST_BYTES, PeerCred
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, MAX_HANDOVER_FDS
from kvtier.ipc.shm import SharedMemoryError

log = logging.getLogger("kvtier.daemon")

COMPLETION_SLOTS = 64
"""Completion slots per session: the transfers one engine may have running at once."""
COMPLETION_FDS = 2
"""Descriptors a waiting handover's completion block holds: its memfd, and the duplicate
Python's ``mmap`` keeps of it while it is mapped."""
HANDOVER_TTL_S = 10.0
"""How long a handover waits for its REGISTER before its descriptors are closed."""
CONNECTION_DEADLINE_S = 2.0
"""How long a connection may take to send its request."""
BACKLOG = 1024
"""The listen backlog (the kernel caps it at ``net.core.somaxconn``)."""
ACCEPT_PAUSE_S = 0.05
"""Pause after ``accept`` failed for want of descriptors or memory."""
NO_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
"""``accept`` / ``memfd_create`` errors that mean the daemon is short of a resource."""


class Bounds(Protocol):
    """What the server reads of the configuration (:class:`~kvtier.config.DaemonConfig`)."""

    max_handover_connections_per_user: int
    max_handover_connections: int
    max_handovers_waiting_per_user: int
    max_handovers_waiting: int
    max_handover_descriptors_per_user: int


class HandoverRefused(KvtierError):
    """A handover or its claim was refused (the message says why)."""


class HandoverBusy(HandoverRefused):
    """A per-user or total bound was reached (the client may try again later).

    Attributes:
        setting: the bound's setting name.
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


class HandoverNotYours(HandoverRefused):
    """A REGISTER named a handover another process made."""


@dataclass(slots=True, eq=False)
class Handover:
    """Descriptors handed over under a token, waiting for (or taken by) a REGISTER.

    Attributes:
        token: the engine's token.
        peer: the engine process (SO_PEERCRED of its handover connection).
        fds: the memory's descriptors, in segment order (owned until :meth:`close_fds`).
        completion: the session's completion block (owned until a session takes it).
    """

    token: bytes
    peer: PeerCred
    fds: list[int]
    completion: CompletionBlock
    expiry: RunningTimer | None = field(default=None)

    def close_fds(self) -> None:
        """Close the memory's descriptors (the daemon's mappings stay valid)."""
        fds, self.fds = self.fds, []
        fdpass.close_fds(fds)

    def close(self) -> None:
        """Close the descriptors and the completion block (the handover was not used)."""
        self.close_fds()
        self.completion.close()


class HandoverServer:
    """The handover socket and the handovers waiting for their REGISTER.

    Args:
        path: the socket file (``<runtime_dir>/kvtierd-mem.sock``).
        bounds: returns the bounds in force (the daemon's configuration; a reload may
            change them).
        strain: where shortages of descriptors or memory are noted (for HEALTH).
        ttl_s: how long a handover waits for its REGISTER.

    Attributes:
        refusals: connections answered busy, per setting.
    """

    def __init__(
        self,
        path: Path,
        bounds: Callable[[], Bounds],
        strain: Strain | None = None,
        ttl_s: float = HANDOVER_TTL_S,
    ) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._bounds = bounds
        self._strain = strain if strain is not None else Strain()
        self._sock: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._pending: dict[bytes, Handover] = {}
        self._waiting: dict[int, int] = {}  # handovers waiting, per uid
        self._held: dict[int, int] = {}  # descriptors of waiting handovers, per uid
        self._held_total = 0
        self._conns: dict[asyncio.Task[None], int] = {}  # connection → its uid (in accept order)
        self._open: dict[int, int] = {}  # connections open, per uid
        self.refusals: dict[str, int] = {}
        self._refusals = RefusalLog(log)  # a refused connection's line, once per minute

    @property
    def pending(self) -> int:
        """Handovers waiting for their REGISTER."""
        return len(self._pending)

    def use(self) -> dict[int, tuple[int, int]]:
        """Per uid: (connections open, handovers waiting)."""
        return {
            uid: (self._open.get(uid, 0), self._waiting.get(uid, 0))
            for uid in sorted(set(self._open) | set(self._waiting))
        }

    def bind(self) -> None:
        """Bind and listen (mode 0660: engine users in the daemon's group may connect)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o117)
        try:
            sock.bind(str(self.path))
        except OSError as err:
            sock.close()
            raise KvtierError(f"cannot bind the handover socket {self.path}: {err}") from err
        finally:
            os.umask(old)
        os.chmod(self.path, 0o660)
        st = os.stat(self.path)
        self._ident = (st.st_dev, st.st_ino)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self._sock = sock

    async def serve(self) -> None:
        """Accept connections until cancelled; each is answered from its own task.

        ``accept`` failing for want of descriptors or memory drops the user holding the
        most connections' oldest one, notes the shortage and pauses briefly: the loop
        keeps serving.
        """
        loop = asyncio.get_running_loop()
        assert self._sock is not None, "bind() first"
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as err:
                if err.errno not in NO_ROOM:
                    raise
                self._strain.note(f"handover socket: accept failed: {err.strerror}")
                self._drop_oldest_of_busiest()
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` from a task of its own, or answer it busy at once."""
        try:
            uid = fdpass.peer_credentials(conn).uid
        except OSError as err:  # the peer is gone already
            log.debug("handover connection gone before it was served: %s", err)
            conn.close()
            return
        b = self._bounds()
        mine = self._open.get(uid, 0)
        if mine >= b.max_handover_connections_per_user:
            self._busy(
                conn,
                "max_handover_connections_per_user",
                f"max_handover_connections_per_user = {b.max_handover_connections_per_user}"
                f" reached: uid {uid} has {mine} handover connections open",
            )
            return
        if len(self._conns) >= b.max_handover_connections and not self._drop_oldest_of_busiest(
            mine
        ):
            self._busy(
                conn,
                "max_handover_connections",
                f"max_handover_connections = {b.max_handover_connections} reached",
            )
            return
        task = asyncio.create_task(self._serve_one(conn), name="kvtier-handover")
        self._conns[task] = uid
        self._open[uid] = mine + 1
        task.add_done_callback(self._conn_done)

    def _conn_done(self, task: asyncio.Task[None]) -> None:
        uid = self._conns.pop(task)
        left = self._open[uid] - 1
        if left:
            self._open[uid] = left
        else:
            del self._open[uid]

    def _drop_oldest_of_busiest(self, than: int = 0) -> bool:
        """Cancel the oldest connection of the user holding the most, if that is more than
        ``than``; whether one was cancelled."""
        if not self._open:
            return False
        uid = max(self._open, key=self._open.__getitem__)
        if self._open[uid] <= than:
            return False
        for task, owner in self._conns.items():  # in accept order
            if owner == uid and not task.cancelling():
                task.cancel()
                return True
        return False

    def _busy(self, conn: socket.socket, setting: str, why: str) -> None:
        """Answer ``conn`` busy and close it (a request already queued is read and its
        descriptors closed first, so the peer reads the reason)."""
        self.refusals[setting] = self.refusals.get(setting, 0) + 1
        log.debug("handover connection refused: %s", why)
        try:
            _, fds, _ = fdpass.recv_request(conn)
            fdpass.close_fds(fds)
        except OSError:  # nothing sent yet (BlockingIOError), or the peer is gone
            pass
        self._send(conn, fdpass.encode_reply(fdpass.BUSY, why), [])
        conn.close()

    def stop_accepting(self) -> None:
        """Close the listening socket and remove its file if it is still ours. Idempotent."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._ident:
            self.path.unlink()
        else:
            log.warning("handover socket %s was replaced by another; leaving it", self.path)

    def close(self) -> None:
        """Stop accepting, drop the connections and every handover still waiting."""
        self.stop_accepting()
        for task in list(self._conns):
            task.cancel()
        for h in list(self._pending.values()):
            self._drop(h)

    # ------------------------------------------------------------------ claims
    def claim(self, token: bytes, peer: PeerCred | None) -> Handover:
        """Take the handover of ``token`` for a REGISTER (once).

        Args:
            token: the REGISTER's ``handover``.
            peer: the REGISTER's sender when the transport tells it (ipc), else None.

        Returns:
            The handover; the caller owns its descriptors and completion block.

        Raises:
            HandoverRefused: no handover waits under ``token`` (never made, expired or
                used already).
            HandoverNotYours: another process made it (it keeps waiting for its own).
        """
        h = self._pending.get(token) if len(token) == HANDOVER_TOKEN_BYTES else None
        if h is None:
            raise HandoverRefused(
                "handover: no memory waits under this token (never handed over, expired after "
                f"{self.ttl_s:g}s, or used already); hand the memory over on {self.path} first"
            )
        if peer is not None and peer.pid != h.peer.pid:
            raise HandoverNotYours(
                f"handover: made by process {h.peer.pid}, not by the sender ({peer.pid})"
            )
        self._forget(h)
        return h

    def discard(self, token: bytes, peer: PeerCred | None) -> None:
        """Close the handover of ``token``, whose REGISTER was refused, as :meth:`claim`
        would take it: when ``peer`` made it, or the transport tells no sender (the token
        alone names it). Nothing when none waits under it or another process made it."""
        h = self._pending.get(token) if len(token) == HANDOVER_TOKEN_BYTES else None
        if h is not None and (peer is None or peer.pid == h.peer.pid):
            self._drop(h)

    def _forget(self, h: Handover) -> None:
        """Stop ``h`` waiting (its descriptors stay open)."""
        if self._pending.get(h.token) is h:
            del self._pending[h.token]
            uid, n = h.peer.uid, len(h.fds) + COMPLETION_FDS
            self._held_total -= n
            if self._waiting[uid] > 1:
                self._waiting[uid] -= 1
                self._held[uid] -= n
            else:
                del self._waiting[uid], self._held[uid]
        if h.expiry is not None:
            h.expiry.cancel()

    def _drop(self, h: Handover) -> None:
        self._forget(h)
        h.close()

    def _expire(self, h: Handover) -> None:
        self._refusals.log(
            logging.INFO,
            ("expired", h.peer.uid),
            "handover from pid %d uid %d expired unclaimed after %gs",
            h.peer.pid,
            h.peer.uid,
            self.ttl_s,
        )
        self._drop(h)

    # ------------------------------------------------------------------ connections
    async def _serve_one(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            peer = fdpass.peer_credentials(conn)
            try:
                data, fds, truncated = await asyncio.wait_for(
                    self._recv(conn), CONNECTION_DEADLINE_S
                )
            except TimeoutError:
                self._refusals.log(
                    logging.INFO,
                    ("silent", peer.uid),
                    "handover from pid %d uid %d: no request within %gs",
                    peer.pid,
                    peer.uid,
                    CONNECTION_DEADLINE_S,
                )
                return
            try:
                if truncated and len(data) <= REQUEST_BYTES and _short_of_descriptors():
                    # the kernel could not install the descriptors sent: this process is
                    # at its limit (EMFILE), not the engine at fault
                    self._strain.note("handover socket: no descriptor for an engine's memory")
                    raise HandoverBusy(
                        "descriptors",
                        "the daemon is out of descriptors (RLIMIT_NOFILE): the engine's "
                        "memory could not be received",
                    )
                if truncated:
                    raise HandoverRefused(
                        f"request too long or more than {MAX_HANDOVER_FDS} descriptors"
                    )
                h = self._accept(fdpass.decode_request(data), peer, fds)
            except HandoverBusy as err:
                self.refusals[err.setting] = self.refusals.get(err.setting, 0) + 1
                log.debug("handover from pid %d uid %d busy: %s", peer.pid, peer.uid, err)
                self._send(conn, fdpass.encode_reply(fdpass.BUSY, str(err)), [])
                return
            except KvtierError as err:
                self._refusals.log(
                    logging.INFO,
                    ("refused", peer.uid),
                    "handover from pid %d uid %d refused: %s",
                    peer.pid,
                    peer.uid,
                    err,
                )
                self._send(conn, fdpass.encode_reply(fdpass.REFUSED, str(err)), [])
                return
            fds = []  # the handover owns them now
            try:
                reader = h.completion.reader_fd()
            except OSError:
                self._drop(h)
                raise
            try:
                if not self._send(conn, fdpass.encode_reply(fdpass.OK, "ok"), [reader]):
                    self._drop(h)
            finally:
                os.close(reader)
        except OSError as err:
            log.info("handover connection failed: %s", err)
        finally:
            fdpass.close_fds(fds)
            conn.close()

    @staticmethod
    async def _recv(conn: socket.socket) -> tuple[bytes, list[int], bool]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                return fdpass.recv_request(conn)
            except BlockingIOError:
                pass
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(conn.fileno(), _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(conn.fileno())

    @staticmethod
    def _send(conn: socket.socket, data: bytes, fds: list[int]) -> bool:
        """Send the one reply without waiting; False if it could not go out whole."""
        try:
            return socket.send_fds(conn, [data], fds, socket.MSG_DONTWAIT) == len(data)
        except OSError as err:  # BlockingIOError, a peer gone: its handover is dropped
            log.info("handover reply not sent: %s", err)
            return False

    def _accept(self, token: bytes, peer: PeerCred, fds: list[int]) -> Handover:
        if token in self._pending:
            raise HandoverRefused("a handover under this token is already waiting")
        b = self._bounds()
        mine = self._waiting.get(peer.uid, 0)
        if mine >= b.max_handovers_waiting_per_user:
            raise HandoverBusy(
                "max_handovers_waiting_per_user",
                f"max_handovers_waiting_per_user = "
                f"{b.max_handovers_waiting_per_user} reached: uid {peer.uid} has "
                f"{mine} handovers waiting for their REGISTER",
            )
        if len(self._pending) >= b.max_handovers_waiting:
            raise HandoverBusy(
                "max_handovers_waiting",
                f"max_handovers_waiting = {b.max_handovers_waiting} reached: "
                f"{len(self._pending)} handovers are waiting for their REGISTER",
            )
        held = self._held.get(peer.uid, 0) + len(fds) + COMPLETION_FDS
        if held > b.max_handover_descriptors_per_user:
            raise HandoverBusy(
                "max_handover_descriptors_per_user",
                f"max_handover_descriptors_per_user = "
                f"{b.max_handover_descriptors_per_user} reached: uid {peer.uid}'s "
                f"waiting handovers would hold {held} descriptors",
            )
        budget = descriptor_limit() // 2
        if self._held_total + len(fds) + COMPLETION_FDS > budget:
            raise HandoverBusy(
                "descriptors",
                f"waiting handovers hold {self._held_total} descriptors, half the "
                f"daemon's limit ({budget * 2}, RLIMIT_NOFILE)",
            )
        try:
            block = CompletionBlock.create_memfd(COMPLETION_SLOTS)
        except (OSError, MemoryError, SharedMemoryError) as err:
            if isinstance(err, SharedMemoryError) and _root_errno(err) not in NO_ROOM:
                raise  # not a shortage: refused, naming what failed
            self._strain.note(f"handover socket: no completion block: {err}")
            raise HandoverBusy(
                "memory", f"the daemon is short of memory or descriptors: {err}"
            ) from err
        h = Handover(token=token, peer=peer, fds=fds, completion=block)
        h.expiry = RunningTimer(self.ttl_s, self._expire, h)  # of time kvtierd ran
        self._pending[token] = h
        self._waiting[peer.uid] = mine + 1
        self._held[peer.uid] = held
        self._held_total += len(fds) + COMPLETION_FDS
        return h


def _root_errno(err: BaseException) -> int | None:
    """The errno of the OSError that caused ``err`` (through its causes), if any."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None or isinstance(seen, OSError):
            break
        seen = seen.__cause__
    return seen.errno if isinstance(seen, OSError) else None


def _short_of_descriptors() -> bool:
    """Whether this process has fewer descriptors free than one handover may carry (a
    request whose descriptors the kernel could not install met that, not a bad client)."""
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return False
    return descriptor_limit() - used <= MAX_HANDOVER_FDS


def _wake(ready: asyncio.Future[None]) -> None:
    """A reader callback: resolve ``ready`` once (it may fire again before it is removed)."""
    if not ready.done():
        ready.set_result(None)
