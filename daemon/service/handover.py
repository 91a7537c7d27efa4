"""The memory handover socket: engines pass their KV memory's descriptors (SCM_RIGHTS).

The wire format is in :mod:`kvtier.ipc.fdpass`. This server runs on the daemon's event
loop, non-blocking throughout, so a slow or hostile peer cannot stall it:

- each connection has a deadline (:data:`CONNECTION_DEADLINE_S`) for its one request and
  carries one handover; at most :data:`MAX_CONNECTIONS` are served at once (more are
  closed at once);
- a request is read whole with at most ``MAX_HANDOVER_FDS`` descriptors; one cut short
  (too long, too many descriptors: the kernel closes those beyond the limit) is refused
  and every descriptor received is closed;
- the peer's pid, uid and gid come from the socket (``SO_PEERCRED``);
- an accepted handover waits under its token for REGISTER for :data:`HANDOVER_TTL_S`
  seconds, then its descriptors are closed; at most :data:`MAX_PENDING_PER_UID` wait per
  user and :data:`MAX_PENDING` in all.

For each accepted handover the server creates the session's completion block (a sealed
memfd) and answers with a read-only descriptor of it; REGISTER takes both with
:meth:`HandoverServer.claim`. At stop it stops accepting first, and removes its socket
file only when it is still the one this server bound (same inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config.errors import KvtierError
from kvtier.ipc import fdpass
from kvtier.ipc.completion import CompletionBlock
from kvtier.ipc.fdpass import PeerCred
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, MAX_HANDOVER_FDS

log = logging.getLogger("kvtier.daemon")

COMPLETION_SLOTS = 64
"""Completion slots per session: the transfers one engine may have running at once."""
HANDOVER_TTL_S = 10.0
"""How long a handover waits for its REGISTER before its descriptors are closed."""
CONNECTION_DEADLINE_S = 2.0
"""How long a connection may take to send its request."""
MAX_CONNECTIONS = 32
"""Handover connections served at once."""
MAX_PENDING = 256
"""Handovers waiting for their REGISTER, in all."""
MAX_PENDING_PER_UID = 16
"""Handovers waiting for their REGISTER, per user id."""


class HandoverRefused(KvtierError):
    """A handover or its claim was refused (the message says why)."""


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
    expiry: asyncio.TimerHandle | None = field(default=None)

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
        ttl_s: how long a handover waits for its REGISTER.
    """

    def __init__(self, path: Path, ttl_s: float = HANDOVER_TTL_S) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._sock: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._pending: dict[bytes, Handover] = {}
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Handovers waiting for their REGISTER."""
        return len(self._pending)

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
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
        self._sock = sock

    async def serve(self) -> None:
        """Accept connections until cancelled; each is answered from its own task."""
        loop = asyncio.get_running_loop()
        assert self._sock is not None, "bind() first"
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if len(self._conns) >= MAX_CONNECTIONS:
                conn.close()
                continue
            task = asyncio.create_task(self._serve_one(conn), name="kvtier-handover")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

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
                f"{self.ttl_s:g}s, or used already); hand the memory over on {self.path} first")
        if peer is not None and peer.pid != h.peer.pid:
            raise HandoverNotYours(f"handover: made by process {h.peer.pid}, not by the "
                                  f"sender ({peer.pid})")
        del self._pending[token]
        if h.expiry is not None:
            h.expiry.cancel()
        return h

    def _drop(self, h: Handover) -> None:
        if self._pending.get(h.token) is h:
            del self._pending[h.token]
        if h.expiry is not None:
            h.expiry.cancel()
        h.close()

    def _expire(self, h: Handover) -> None:
        log.info("handover from pid %d expired unclaimed after %gs", h.peer.pid, self.ttl_s)
        self._drop(h)

    # ------------------------------------------------------------------ connections
    async def _serve_one(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            peer = fdpass.peer_credentials(conn)
            try:
                data, fds, truncated = await asyncio.wait_for(self._recv(conn), CONNECTION_DEADLINE_S)
            except TimeoutError:
                log.info("handover from pid %d: no request within %gs", peer.pid,
                         CONNECTION_DEADLINE_S)
                return
            try:
                if truncated:
                    raise HandoverRefused(f"request too long or more than "
                                          f"{MAX_HANDOVER_FDS} descriptors")
                h = self._accept(fdpass.decode_request(data), peer, fds)
            except KvtierError as err:
                log.info("handover from pid %d uid %d refused: %s", peer.pid, peer.uid, err)
                self._send(conn, fdpass.encode_reply(False, str(err)), [])
                return
            fds = []  # the handover owns them now
            try:
                reader = h.completion.reader_fd()
            except OSError:
                self._drop(h)
                raise
            try:
                if not self._send(conn, fdpass.encode_reply(True, "ok"), [reader]):
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
        if len(self._pending) >= MAX_PENDING:
            raise HandoverRefused(f"{MAX_PENDING} handovers are waiting for their REGISTER")
        if sum(h.peer.uid == peer.uid for h in self._pending.values()) >= MAX_PENDING_PER_UID:
            raise HandoverRefused(f"uid {peer.uid} has {MAX_PENDING_PER_UID} handovers waiting "
                                  "for their REGISTER")
        h = Handover(token=token, peer=peer, fds=fds,
                     completion=CompletionBlock.create_memfd(COMPLETION_SLOTS))
        h.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, h)
        self._pending[token] = h
        return h


def _wake(ready: asyncio.Future[None]) -> None:
    """A reader callback: resolve ``ready`` once (it may fire again before it is removed)."""
    if not ready.done():
        ready.set_result(None)
