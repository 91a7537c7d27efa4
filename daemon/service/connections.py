"""Bounds on the connections kvtierd's ZeroMQ sockets accept (the control socket, the KV
event sockets), per user and in all.

Each connection holds one of the daemon's descriptors while it is open, and ZeroMQ accepts
every connection it is offered. It does not refuse one at the descriptor limit
(``RLIMIT_NOFILE``): its ``ipc://`` listener aborts the whole process when ``accept``
fails with ``EMFILE``. A client that leaks connections (a new socket per request, never
closed) would take the daemon, and every engine's L2, down with it. So the daemon keeps its
connections well below the limit:

- each listening socket's monitor reports the connections accepted and closed, read by a
  reader callback as the control socket is; the peer's uid comes from the accepted socket
  (``SO_PEERCRED``; the peers of a ``tcp://`` endpoint count as one user, :data:`TCP_PEERS`);
- a connection is shut down at once (``shutdown(2)``: ZeroMQ then closes it itself) when
  its user then holds more than 1/:data:`USER_SHARE` of the bound, when the daemon holds
  more than the bound in all (1/:data:`TOTAL_SHARE` of its descriptor limit, at least
  :data:`MIN_BOUND`), or when fewer than :data:`RESERVE` descriptors are free; a client's
  ZeroMQ socket tries again after its reconnect interval and is refused again while its
  user holds as many;
- each refusal is counted (``limits.refusals``: ``connections_per_user``, ``connections``,
  ``descriptors``) and logged at most once a minute per user; a shortage of descriptors is
  also noted for HEALTH (``degraded`` for a minute after), one user's bound is not.

The socket is checked and shut down through a duplicate of the accepted descriptor, and
only when it is a connection of the same listening address (ZeroMQ may have closed the
number meanwhile, and the process reused it). What is not bounded: a flood of connections
faster than the event loop reads the monitor is accepted before it is counted; the
descriptors kept free are what it may take meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import zmq
from kvtier.daemon.service.refusal_log import RefusalLog
from kvtier.daemon.service.strain import descriptor_limit

__all__ = [
    "MIN_BOUND",
    "MONITOR_BURST",
    "RESERVE",
    "TCP_PEERS",
    "TOTAL_SHARE",
    "USER_SHARE",
    "ConnectionGuard",
]

log = logging.getLogger("kvtier.daemon")

TOTAL_SHARE = 8
"""Connections in all: at most 1/this of the descriptor limit (at least :data:`MIN_BOUND`)."""
USER_SHARE = 2
"""One user's connections: at most 1/this of the bound in all."""
RESERVE = 16
"""Descriptors kept free: a connection accepted while fewer are free is shut down (the
shares of the limit that sessions, waiting handovers, the ``file`` store's segments and
connections each have can together exceed it)."""
MIN_BOUND = 64
"""The bound in all, however low the descriptor limit."""
TCP_PEERS = -1
"""The user every peer of a ``tcp://`` endpoint counts as (TCP tells no uid)."""
MONITOR_BURST = 256
"""Monitor events read in a row before the event loop gets a turn (a client that connects
and disconnects in a loop makes them as fast as it can)."""
RECOUNT_S = 0.05
"""The open descriptors are counted (``/proc/self/fd``) at most this often while the last
count, adjusted by the connections accepted and closed since, leaves enough free; a
connection that would be refused for want of descriptors is refused on a count made then."""

_EVENTS = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
_ACCEPTED, _DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)
_ZMQ_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: the count is not known (taken as none open)
        return 0


class ConnectionGuard:
    """Counts each listening socket's connections and refuses those past the bounds (see
    the module docstring).

    Args:
        note: where a shortage of descriptors is noted (for HEALTH); a refusal by a bound
            is logged instead, at most once a minute per user.
        limit: the descriptor limit now (read at each connection: an operator may change
            it while the daemon runs).
        open_descriptors: the descriptors open now.

    Attributes:
        refusals: connections shut down, by the bound they met.
    """

    def __init__(
        self,
        note: Callable[[str], None],
        limit: Callable[[], int] = descriptor_limit,
        open_descriptors: Callable[[], int] = _open_descriptors,
    ) -> None:
        self._note = note
        self._limit = limit
        self._count_open = open_descriptors
        self._total = 0
        self._per_user: Counter[int] = Counter()
        self._opened = 0  # connections accepted minus closed since the last count
        self._open_at = -1.0  # when the open descriptors were last counted
        self._open = 0
        self._refusal_log = RefusalLog(log)
        self.refusals: Counter[str] = Counter()

    @property
    def connections(self) -> int:
        """Connections open now (those shut down count until ZeroMQ has closed them)."""
        return self._total

    def use(self) -> dict[int, int]:
        """Each user's open connections (:data:`TCP_PEERS`: a ``tcp://`` endpoint's)."""
        return {uid: n for uid, n in self._per_user.items() if n}

    def bounds(self) -> tuple[int, int]:
        """``(in all, per user)`` under the descriptor limit now."""
        total = max(MIN_BOUND, self._limit() // TOTAL_SHARE)
        return total, max(1, total // USER_SHARE)

    def watch(
        self, sock: zmq.Socket[Any], on_disconnect: Callable[[], None] | None = None
    ) -> Callable[[], None]:
        """Read ``sock``'s monitor from the running loop: count its connections, refuse
        those past the bounds, and call ``on_disconnect`` after each read that saw a
        connection close. Returns the function that stops watching (idempotent; the
        socket's connections then no longer count).

        A monitor read slowly lets its queue fill, and then libzmq blocks the socket's I/O
        thread (libzmq#3575): every pending event is read without waiting,
        :data:`MONITOR_BURST` at a time.
        """
        loop = asyncio.get_running_loop()
        mon = sock.get_monitor_socket(_EVENTS)
        fd = cast(int, mon.getsockopt(zmq.FD))
        address = _bound_address(sock)
        if address is None:
            log.warning(
                "connections to %r cannot be told from other sockets: counted, never refused",
                sock.getsockopt(zmq.LAST_ENDPOINT),
            )
        conns: dict[int, int] = {}  # this socket's connections: descriptor -> uid

        def read_events() -> None:
            seen, closed = 0, False
            while (
                seen < MONITOR_BURST
                and not mon.closed
                and cast(int, mon.getsockopt(_ZMQ_EVENTS)) & _POLLIN
            ):
                frames = mon.recv_multipart(zmq.NOBLOCK)
                seen += 1
                if len(frames) < 2 or len(frames[0]) < 6:
                    continue
                event, value = struct.unpack_from("=Hi", frames[0])
                if event == _ACCEPTED:
                    self._accepted(conns, value, address)
                elif event == _DISCONNECTED:
                    self._closed(conns, value)
                    closed = True
            if seen == MONITOR_BURST:
                loop.call_soon(read_events)
            if closed and on_disconnect is not None:
                on_disconnect()

        loop.add_reader(fd, read_events)
        read_events()  # those that came before the reader was registered
        stopped = False

        def stop() -> None:
            nonlocal stopped
            if stopped:
                return
            stopped = True
            loop.remove_reader(fd)
            if not sock.closed:
                sock.disable_monitor()
            mon.close(linger=0)
            for fd_ in list(conns):
                self._closed(conns, fd_)

        return stop

    # ------------------------------------------------------------------ the bounds
    def _accepted(self, conns: dict[int, int], fd: int, address: object) -> None:
        if fd in conns:  # its close was not seen: the number names a new connection now
            self._closed(conns, fd)
        try:  # a duplicate: the checks and the shutdown act on one socket, whatever
            dup = os.dup(fd)  # ZeroMQ does with the number meanwhile
        except OSError as err:
            if err.errno == errno.EMFILE:
                self._note("no descriptor free to check a new connection")
            return  # closed already (its DISCONNECTED follows)
        with socket.socket(fileno=dup) as sock:
            try:
                if sock.family == socket.AF_UNIX:
                    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
                    uid = _CRED.unpack(cred)[1]
                else:
                    uid = TCP_PEERS
                ours = _same_listener(sock, address)
            except OSError as err:  # not a socket any more: its DISCONNECTED follows
                log.debug("connection %d: %s", fd, err)
                return
            conns[fd] = uid
            self._per_user[uid] += 1
            self._total += 1
            self._opened += 1
            why = self._refusal(uid)
            if why is None or not ours:
                return
            self.refusals[why] += 1
            if why == "descriptors":
                self._note(
                    f"{self._open + self._opened} of {self._limit()} descriptors open "
                    "(RLIMIT_NOFILE): new connections are shut down"
                )
            else:
                total, per_user = self.bounds()
                who = "tcp peers" if uid == TCP_PEERS else f"uid {uid}"
                self._refusal_log.log(
                    logging.WARNING,
                    (why, uid),
                    "connection of %s shut down: %s (1/%d of the descriptor limit, "
                    "RLIMIT_NOFILE) reached",
                    who,
                    f"{per_user} per user" if why == "connections_per_user" else f"{total} in all",
                    TOTAL_SHARE * (USER_SHARE if why == "connections_per_user" else 1),
                )
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _closed(self, conns: dict[int, int], fd: int) -> None:
        uid = conns.pop(fd, None)
        if uid is None:
            return
        self._per_user[uid] -= 1
        if not self._per_user[uid]:
            del self._per_user[uid]
        self._total -= 1
        self._opened -= 1

    def _refusal(self, uid: int) -> str | None:
        """The bound the connection just counted is past (None: within them)."""
        total, per_user = self.bounds()
        if self._per_user[uid] > per_user:
            return "connections_per_user"
        if self._total > total:
            return "connections"
        limit, now = self._limit(), time.monotonic()
        short = limit - (self._open + self._opened) < RESERVE
        if short or now - self._open_at >= RECOUNT_S:  # a refusal only on a count of now
            self._open, self._opened, self._open_at = self._count_open(), 0, now
            short = limit - self._open < RESERVE
        return "descriptors" if short else None


def _bound_address(sock: zmq.Socket[Any]) -> object:
    """The address ``sock`` is bound to, as ``getsockname`` names its accepted sockets'
    side (None: not known, nothing is shut down then)."""
    try:
        endpoint = cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
    except (zmq.ZMQError, UnicodeDecodeError):
        return None
    kind, _, rest = endpoint.partition("://")
    if kind == "ipc":
        return "\0" + rest[1:] if rest.startswith("@") else rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return (host.strip("[]"), int(port)) if port.isdigit() else None
    return None


def _same_listener(sock: socket.socket, address: object) -> bool:
    """Whether ``sock`` is a connection of the listener bound at ``address``."""
    if address is None:
        return False
    name: object = sock.getsockname()
    if isinstance(address, tuple):  # a wildcard address: any local address of the port
        host, port = address
        return bool(
            isinstance(name, tuple)
            and name[1] == port
            and (host in ("0.0.0.0", "::") or name[0] == host)
        )
    if isinstance(name, bytes):
        name = name.decode(errors="surrogateescape")
    return name == address
