"""Memory handover: an engine passes its KV memory to kvtierd as descriptors, never names.

Beside its ZeroMQ control socket the daemon listens on a local ``AF_UNIX`` /
``SOCK_SEQPACKET`` socket, ``<runtime_dir>/kvtierd-mem.sock`` (mode 0660, like the control
socket). One connection carries one handover, one message each way::

    engine → daemon:  "KVH1" | token (16 random bytes)      SCM_RIGHTS: the memory's fds
    daemon → engine:  0x00 | "ok"                           SCM_RIGHTS: the completion block
                      0x01 | why it was refused (UTF-8)      (no descriptor)
                      0x02 | which limit was reached (UTF-8; busy: try again later)

The daemon reads the engine's pid, uid and gid from the socket (``SO_PEERCRED``), never
from a message, and keeps the descriptors under the token for a few seconds. The engine
then sends REGISTER on the ZeroMQ socket with ``memory.kind = "fd"`` and
``handover = token``; the daemon takes the descriptors of that token (once), checks each
(a memfd sealed against shrinking, of exactly the declared size), maps it and closes it.
The completion block in the reply is a read-only descriptor of a sealed memfd the engine
maps read-only (:mod:`kvtier.ipc.completion`).

A connection the daemon cannot take now (its user holds ``max_handover_connections_per_user``
connections, or has ``max_handovers_waiting_per_user`` handovers waiting) is answered
``0x02`` (busy) and closed, possibly before its request was read. :func:`hand_over` tries
again, with backoff, until its deadline, as it does when the socket's backlog is full
(``EAGAIN``) or the daemon closed the connection before replying; only then does it fail,
with the daemon's last reason.

A token is a bearer secret between one engine process and the daemon: it never leaves the
two, and where the ZeroMQ transport is ``ipc://`` the daemon also checks that the REGISTER
comes from the process that made the handover.

This module holds the wire format, the engine's side (:func:`hand_over`) and the peer
credential helpers; the daemon's server is :mod:`kvtier.daemon.service.handover`.
"""

from __future__ import annotations

import array
import errno
import os
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.config.errors import KvtierError
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, MAX_HANDOVER_FDS

HANDOVER_SOCKET = "kvtierd-mem.sock"
"""The handover socket's file name in the runtime directory."""
MAGIC = b"KVH1"
"""First bytes of a handover request (and its version)."""
REQUEST_BYTES = len(MAGIC) + HANDOVER_TOKEN_BYTES
"""A handover request is exactly this long."""
MAX_REPLY_BYTES = 512
"""Longest handover reply (a status byte and a short text)."""
OK, REFUSED, BUSY = 0, 1, 2
"""Handover reply status bytes (BUSY: a limit was reached for now; try again)."""
RETRY_FIRST_S = 0.005
"""First pause before :func:`hand_over` tries again; it doubles up to :data:`RETRY_MAX_S`."""
RETRY_MAX_S = 0.25
"""Longest pause between two tries of :func:`hand_over`."""
TRANSIENT = frozenset({errno.EAGAIN, errno.ECONNRESET, errno.EPIPE, errno.ENOBUFS})
"""Connection errors :func:`hand_over` tries again: a full backlog (Linux answers a
non-blocking ``connect`` to a full ``AF_UNIX`` backlog with ``EAGAIN``) and a connection
the daemon closed before replying (busy). ``ECONNREFUSED`` (nobody listens: the daemon is
gone) fails at once, as a missing socket file does."""

_UCRED = struct.Struct("3i")


class HandoverError(KvtierError):
    """The daemon refused a handover, or it could not be made (the message says why)."""


class HandoverUnavailable(HandoverError):
    """No daemon listens on the handover socket (or it did not answer in time)."""


class HandoverBusy(HandoverError):
    """The daemon was at a limit (or its backlog full) until the deadline (the message
    names the limit when the daemon said which)."""


@dataclass(frozen=True, slots=True)
class PeerCred:
    """A local peer's process id, user id and group id, as the kernel reports them."""

    pid: int
    uid: int
    gid: int


def handover_path(rdir: str | Path) -> Path:
    """The handover socket of the daemon whose runtime directory is ``rdir``."""
    return Path(rdir) / HANDOVER_SOCKET


def handover_path_for(endpoint: str, rdir: str | Path) -> Path:
    """The handover socket beside an ``ipc://`` control endpoint, else in ``rdir``.

    Args:
        endpoint: the control endpoint a client connects to.
        rdir: the runtime directory (used for a ``tcp://`` endpoint).
    """
    if endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://") :]).parent / HANDOVER_SOCKET
    return handover_path(rdir)


def peer_credentials(sock: socket.socket) -> PeerCred:
    """The connected peer of a local socket, from ``SO_PEERCRED``."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return PeerCred(pid=pid, uid=uid, gid=gid)


def zmq_peer(address: str | None) -> PeerCred | None:
    """The peer of a ZeroMQ ``ipc://`` message, from its ``Peer-Address`` property.

    libzmq appends ``:uid:gid:pid`` (SO_PEERCRED) to the address of an ipc connection;
    a tcp connection has none (None then).
    """
    if not address:
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    return PeerCred(pid=pid, uid=uid, gid=gid)


def encode_request(token: bytes) -> bytes:
    """The request bytes of a handover under ``token``."""
    if len(token) != HANDOVER_TOKEN_BYTES:
        raise HandoverError(f"a handover token has {HANDOVER_TOKEN_BYTES} bytes, not {len(token)}")
    return MAGIC + token


def decode_request(data: bytes) -> bytes:
    """The token of a handover request.

    Raises:
        HandoverError: not a handover request (wrong length or magic).
    """
    if len(data) != REQUEST_BYTES or not data.startswith(MAGIC):
        raise HandoverError(
            f"not a handover request ({len(data)} bytes; expected {REQUEST_BYTES} "
            f"starting {MAGIC!r})"
        )
    return data[len(MAGIC) :]


def encode_reply(status: int, text: str) -> bytes:
    """A handover reply: status byte (:data:`OK`, :data:`REFUSED`, :data:`BUSY`) and
    text, cut to :data:`MAX_REPLY_BYTES`."""
    return bytes([status]) + text.encode()[: MAX_REPLY_BYTES - 1]


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` (one already closed is skipped)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # already closed: nothing else to release


def hand_over(
    path: str | Path,
    token: bytes,
    fds: list[int],
    timeout: float,
    seen: Callable[[PeerCred], None] | None = None,
) -> int:
    """Hand ``fds`` over to the daemon under ``token``; return the completion block's fd.

    A busy daemon (a ``BUSY`` reply, a full backlog, a connection closed before its
    reply) is tried again with backoff (:data:`RETRY_FIRST_S` doubling up to
    :data:`RETRY_MAX_S`, with jitter) until ``timeout`` has passed in all.

    Args:
        path: the daemon's handover socket.
        token: 16 random bytes; REGISTER names them as ``handover``.
        fds: the memory's descriptors, in segment order (at most ``MAX_HANDOVER_FDS``).
        timeout: seconds for the whole handover, tries again included.
        seen: told the daemon's credentials (``SO_PEERCRED`` of the socket it listens on)
            once connected: its pid as this process's pid namespace sees it (0: not
            visible here, e.g. from a container's own namespace).

    Returns:
        A read-only descriptor of the session's completion block (the caller closes it).

    Raises:
        HandoverUnavailable: nothing listens at ``path``, or no reply in time.
        HandoverBusy: the daemon stayed busy until the deadline (its last reason).
        HandoverError: the daemon refused (the message is its reason).
    """
    if len(fds) > MAX_HANDOVER_FDS:
        raise HandoverError(f"{len(fds)} descriptors exceed the {MAX_HANDOVER_FDS} of one handover")
    request = encode_request(token)
    deadline = time.monotonic() + timeout
    pause = RETRY_FIRST_S
    tries = 0
    while True:
        tries += 1
        try:
            return _try_once(path, request, fds, max(deadline - time.monotonic(), 0.001), seen)
        except _Again as again:
            left = deadline - time.monotonic()
            if left <= RETRY_FIRST_S:
                raise HandoverBusy(
                    f"kvtierd's handover socket at {path} stayed busy for "
                    f"{timeout:g}s ({tries} tries): {again}"
                ) from None
            time.sleep(min(left - RETRY_FIRST_S, pause * random.uniform(0.5, 1.0)))
            pause = min(RETRY_MAX_S, pause * 2)


class _Again(Exception):
    """One try of :func:`hand_over` met a busy daemon (the message says how)."""


def _try_once(
    path: str | Path,
    request: bytes,
    fds: list[int],
    timeout: float,
    seen: Callable[[PeerCred], None] | None,
) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError) as err:
            raise HandoverUnavailable(
                f"no kvtierd handover socket answers at {path}: {err}"
            ) from err
        except OSError as err:
            if err.errno in TRANSIENT:
                raise _Again(f"connect: {err.strerror} (backlog full)") from None
            raise HandoverError(f"memory handover at {path} failed: {err}") from err
        if seen is not None:
            seen(peer_credentials(sock))
        try:
            socket.send_fds(sock, [request], fds)
            data, got, flags, _ = socket.recv_fds(sock, MAX_REPLY_BYTES, 1)
        except TimeoutError as err:
            raise HandoverUnavailable(
                f"no kvtierd handover socket answers at {path}: {err}"
            ) from err
        except OSError as err:
            if err.errno in TRANSIENT:
                raise _Again(f"the daemon closed the connection: {err.strerror}") from None
            raise HandoverError(f"memory handover at {path} failed: {err}") from err
    if not data:
        close_fds(got)
        raise _Again("the daemon closed the connection without a reply")
    if data[0] == BUSY:
        close_fds(got)
        raise _Again(data[1:].decode(errors="replace"))
    if data[0] != OK:
        close_fds(got)
        raise HandoverError(data[1:].decode(errors="replace"))
    if len(got) != 1 or flags & socket.MSG_CTRUNC:
        close_fds(got)
        raise HandoverError("kvtierd's handover reply carried no completion block descriptor")
    return got[0]


def recv_request(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """Receive one handover request without waiting (the daemon's side).

    At most :data:`MAX_HANDOVER_FDS` descriptors are taken; the kernel closes any beyond
    them and flags the message (``MSG_CTRUNC``), as it flags an oversized one
    (``MSG_TRUNC``).

    Returns:
        (data, fds, truncated): the bytes, the descriptors received (the caller owns and
        must close them) and whether either part was cut.

    Raises:
        BlockingIOError: nothing to read yet.
        OSError: the connection failed.
    """
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(
        REQUEST_BYTES + 1,
        socket.CMSG_SPACE(MAX_HANDOVER_FDS * fds.itemsize),
        socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT,
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    truncated = bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))
    return data, list(fds), truncated
