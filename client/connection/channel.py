"""A connection's request/reply channel to kvtierd: one DEALER socket, and the daemon's liveness.

:class:`DaemonChannel` sends one request and waits for its reply, under the connection's lock
(the connection's session state and the socket change together). It knows nothing of
sessions: :class:`~kvtier.client.connection.connection.Connection` registers, re-registers and
checks what a reply is. What it does keep:

- the daemon's process id, once the connection has registered: while a request waits, the
  process is checked every :data:`LIVENESS_POLL_S`, so a dead daemon costs milliseconds, not
  ``request_timeout_s``;
- a short *down window*: after a request found no daemon, later requests fail at once for up
  to a second instead of each waiting ``request_timeout_s`` (registrations still try);
- the request ids: a late reply to a request that timed out earlier is dropped, an
  undecodable reply is logged and ignored.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import msgspec
import zmq
from kvtier.client.connection.replies import DaemonError, DaemonUnavailable, rep_is_late
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import (
    HandoverBusy,
    HandoverError,
    HandoverUnavailable,
    PeerCred,
    hand_over,
)
from kvtier.ipc.sockets import make_zmq_socket, poll_ms

__all__ = ["LIVENESS_POLL_S", "DaemonChannel"]

log = logging.getLogger("kvtier.client")

LIVENESS_POLL_S = 0.02
"""How often a request waiting for its reply checks that the daemon's process still exists."""

PAUSE_SLACK_S = 0.1
"""A look at the socket that returns this much later than it was to wait, with nothing come,
means this process did not run meanwhile (stopped, starved): the wait for the reply gets
that time back, at most once its own length, since a reply that came meanwhile waits for
ZeroMQ's I/O thread of this process too."""


class DaemonChannel:
    """The socket a connection sends its requests on, and what it knows of the daemon's life.

    Args:
        endpoint: the daemon's control endpoint (``ipc://...`` or ``tcp://...``).
        request_timeout_s: the default wait for a reply, and the longest wait to connect.
        lock: the connection's lock; every request is sent and answered under it.
    """

    def __init__(self, endpoint: str, request_timeout_s: float, lock: threading.RLock) -> None:
        self.endpoint = endpoint
        self.request_timeout_s = request_timeout_s
        self.context = zmq.Context()
        self.daemon_pid = 0
        """The registered daemon's process id as this process sees it; 0 before a
        registration, or when it is not visible from here (never watched then)."""
        self.pid = os.getpid()  # the process the socket belongs to (ZeroMQ is not fork-safe)
        self.closing = threading.Event()  # set by close() first: a reply awaited is given up
        # the daemon's pid as the last handover's socket showed it (None: no handover yet)
        self._handover_pid: int | None = None
        self._lock = lock
        self._sock: zmq.Socket | None = None
        self._req_ids = itertools.count(1)
        self._down_until = 0.0

    @property
    def connected(self) -> bool:
        """Whether the socket exists (made by :meth:`connect`, gone after :meth:`close`)."""
        return self._sock is not None

    def check_socket_file(self) -> None:
        """Fail fast, with a hint, when the endpoint is a socket file that does not exist.

        Raises:
            DaemonUnavailable: no file at the ``ipc://`` endpoint's path.
        """
        if not self.endpoint.startswith("ipc://"):
            return
        path = self.endpoint[len("ipc://") :]
        if not os.path.exists(path):
            raise DaemonUnavailable(
                f"kvtierd is not running: no socket at {path}; start one with `kvtier serve` "
                "(or `make serve`), or point runtime_dir / endpoint ($KVTIER_RUNTIME_DIR, "
                "$KVTIER_ENDPOINT) at a running one"
            )

    def connect(self) -> None:
        """Make the socket, under an identity of this process, unless it exists already."""
        with self._lock:
            if self._sock is not None:
                return
            if self.closing.is_set() or self.context.closed:
                raise DaemonUnavailable("connection is closed")
            identity = f"{os.getpid()}-{secrets.token_hex(6)}".encode()
            self._sock = make_zmq_socket(
                self.context, self.endpoint, zmq.DEALER, bind=False, identity=identity
            )
            self._sock.setsockopt(zmq.RCVTIMEO, max(1, poll_ms(self.request_timeout_s)))

    def pid_to_watch(self, reported: int) -> int:
        """The daemon pid to watch after a registration whose reply reported ``reported``:
        the pid its handover socket showed, which the kernel gives as this process's pid
        namespace sees it (0: the daemon is not visible from here, as from a container with
        its own pid namespace: nothing to watch, timeouts tell); ``reported`` (the pid in
        the daemon's own namespace) when no handover showed one."""
        return reported if self._handover_pid is None else max(0, self._handover_pid)

    @property
    def handover_pid(self) -> int:
        """The pid of the daemon the last handover reached, as this process sees it (0:
        none reached, or not visible from here)."""
        return max(0, self._handover_pid or 0)

    def daemon_alive(self, pid: int | None = None) -> bool:
        """False when the daemon's process (or process ``pid``, one that was a daemon) is
        known to be gone."""
        pid = self.daemon_pid if pid is None else pid
        if pid <= 0:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def mark_down(self) -> None:
        """No daemon answered: fail the requests of the next moment at once."""
        self._down_until = time.monotonic() + min(1.0, self.request_timeout_s)

    def mark_up(self) -> None:
        """A daemon answered a registration: end the down window."""
        self._down_until = 0.0

    def call(
        self,
        msg: P.Request,
        raw: bool = False,
        timeout: float | None = None,
        interruptible: bool = True,
    ) -> P.Reply:
        """Send ``msg`` and wait for its reply.

        Args:
            msg: the request; its ``req_id`` is set here.
            raw: a registration's call: sent even in the down window, and the daemon's process
                is not watched (the one known may be a predecessor).
            timeout: the longest wait for the reply (default ``request_timeout_s``).
            interruptible: give the reply up once :meth:`close` has begun (False: the
                closing connection's own last request).

        Raises:
            DaemonUnavailable: the channel is closed, the daemon is known gone, in the down
                window, cannot be reached, or did not answer in time.
        """
        wait_s = self.request_timeout_s if timeout is None else timeout
        with self._lock:
            if self._sock is None:
                raise DaemonUnavailable("connection is closed")
            if time.monotonic() < self._down_until and not raw:
                raise DaemonUnavailable("daemon recently unreachable")
            if not raw and not self.daemon_alive():
                raise DaemonUnavailable(f"kvtierd (pid {self.daemon_pid}) has exited")
            req_id = next(self._req_ids)
            msg.req_id = req_id
            body = P.encode(msg)
            try:
                try:
                    self._sock.send(body, flags=zmq.NOBLOCK)
                except zmq.Again:
                    # not connected (yet, or any more): wait for the connection up to the timeout
                    if not self._sock.poll(poll_ms(self.request_timeout_s), zmq.POLLOUT):
                        raise
                    self._sock.send(body, flags=zmq.NOBLOCK)
            except zmq.Again as err:
                self.mark_down()
                raise DaemonUnavailable(f"cannot reach kvtierd at {self.endpoint}") from err
            # [when, what this process's own pauses may still move it on by]
            deadline = [time.monotonic() + wait_s, wait_s]
            while True:
                data = self._recv_until(self._sock, deadline, not raw, interruptible)
                if data is None and interruptible and self.closing.is_set():
                    raise DaemonUnavailable("connection is closed")
                if data is None or (time.monotonic() > deadline[0] and rep_is_late(data, req_id)):
                    if wait_s >= self.request_timeout_s:  # a caller's shorter wait tells nothing
                        self.mark_down()
                    if not self.daemon_alive():
                        raise DaemonUnavailable(f"kvtierd (pid {self.daemon_pid}) has exited")
                    raise DaemonUnavailable(f"kvtierd did not answer within {wait_s}s")
                try:
                    rep = P.decode_reply(data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("undecodable reply from kvtierd ignored")
                    continue
                if rep.req_id == req_id:
                    return rep
                # a late reply to a request that timed out earlier: drop it

    def _recv_until(
        self, sock: zmq.Socket, deadline: list[float], watch_pid: bool, interruptible: bool = True
    ) -> bytes | None:
        """The next reply frame, or None at ``deadline[0]``, with ``interruptible`` once
        :meth:`close` has begun, or, with ``watch_pid``, as soon as the daemon's process is
        seen gone (each checked every :data:`LIVENESS_POLL_S`). A look that returns
        :data:`PAUSE_SLACK_S` or more late with nothing come moves ``deadline[0]`` on by as
        much, out of ``deadline[1]`` (the wait's own length: a thread starved for good still
        gives up): this process did not run, and the daemon's answer is not late for it."""
        while True:
            before = time.monotonic()
            left = deadline[0] - before
            if left <= 0 or (interruptible and self.closing.is_set()):
                return None
            wait = min(left, LIVENESS_POLL_S)
            ready = sock.poll(max(1, int(wait * 1000)), zmq.POLLIN)
            late = time.monotonic() - before - wait
            if late > PAUSE_SLACK_S and not ready and deadline[1] > 0:
                deadline[0] += min(late, deadline[1])
                deadline[1] -= late
            if ready:
                try:
                    return sock.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
            if watch_pid and not self.daemon_alive():
                return None

    def hand_over(self, path: str | Path, token: bytes, fds: list[int]) -> int:
        """Hand ``fds`` (a pool's descriptors) to the daemon under ``token``; the completion
        block's descriptor.

        Raises:
            DaemonUnavailable: no daemon answers on the handover socket.
            DaemonError: BAD_MEMORY, the daemon refused the handover (its reason); BUSY,
                it stayed at a limit until ``request_timeout_s`` (the limit's name);
                PROTOCOL_VERSION, no handover socket answers but a daemon of another
                protocol answers the control socket.
        """

        def seen(cred: PeerCred) -> None:
            self._handover_pid = cred.pid

        self._handover_pid = None
        try:
            return hand_over(path, token, fds, self.request_timeout_s, seen)
        except HandoverUnavailable as err:
            if not os.path.exists(path):  # no such socket: a daemon of another protocol?
                self._check_version()
            self.mark_down()
            raise DaemonUnavailable(str(err)) from err
        except HandoverBusy as err:
            raise DaemonError(P.ErrorCode.BUSY, str(err)) from err
        except HandoverError as err:
            raise DaemonError(P.ErrorCode.BAD_MEMORY, str(err)) from err

    def _check_version(self) -> None:
        """Ask the control socket's daemon (if one answers, within ``request_timeout_s``)
        which protocol it speaks.

        Raises:
            DaemonError: PROTOCOL_VERSION, naming both versions, when it speaks another
                one: it is running, and this client cannot register with it (engines take
                :class:`DaemonUnavailable` for a daemon that is away, to try again later).
        """
        try:
            rep = self.call(P.Health(req_id=0), raw=True)
        except DaemonUnavailable:
            return
        if isinstance(rep, P.HealthReply) and rep.protocol_version != P.PROTOCOL_VERSION:
            raise DaemonError(
                P.ErrorCode.PROTOCOL_VERSION,
                f"kvtierd at {self.endpoint} speaks protocol {rep.protocol_version}; this "
                f"client speaks {P.PROTOCOL_VERSION}: upgrade kvtierd (it registers clients "
                "of older versions too)",
            )

    def close(self) -> None:
        """Close the socket (unsent requests dropped) and end the ZeroMQ context. Idempotent.
        In a process forked from the one that made it, nothing is touched (the parent's
        socket is not this process's to close)."""
        self.closing.set()
        if os.getpid() != self.pid:
            return
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            if not self.context.closed:
                self.context.term()
