"""A small synchronous client for the daemon's unauthenticated-or-admin requests:
HEALTH and STATS (and, with the admin credential, the admin operations)."""

from __future__ import annotations

import itertools
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq
from kvtier.client.connection.replies import ReplyT, UnexpectedReply
from kvtier.config import KvtierError
from kvtier.ipc import protocol as P
from kvtier.ipc.sockets import ipc_endpoint, make_zmq_socket, poll_ms

if TYPE_CHECKING:
    from typing import Self


class AdminError(KvtierError):
    """The daemon refused an admin request or did not answer."""


class UnexpectedAdminReply(AdminError, UnexpectedReply):
    """The daemon answered an admin request with a reply of another type (an
    :class:`AdminError`, as every failure of an admin call is; its attributes name both
    types)."""


def _checked(request: P.Request, rep: P.Reply, kind: type[ReplyT]) -> ReplyT:
    """``rep`` as the ``kind`` of reply that answers ``request``.

    Raises:
        AdminError: an error reply (its message).
        UnexpectedAdminReply: a reply of another type.
    """
    if isinstance(rep, kind):
        return rep
    if isinstance(rep, P.ErrorReply):
        raise AdminError(rep.message)
    raise UnexpectedAdminReply(type(request).__name__, kind, type(rep))


class AdminClient:
    """Talks to kvtierd over its control socket without registering an engine.

    Args:
        endpoint: ``ipc://...`` endpoint, or a socket file path.
        timeout_s: how long to wait for each reply.
        admin_token: the admin credential, for requests that need it.
    """

    def __init__(self, endpoint: str | Path, timeout_s: float = 2.0, admin_token: str = "") -> None:
        ep = str(endpoint)
        self.endpoint = ep if "://" in ep else ipc_endpoint(ep)
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        self._ctx = zmq.Context()
        self._sock = make_zmq_socket(
            self._ctx,
            self.endpoint,
            zmq.DEALER,
            bind=False,
            identity=b"admin-" + secrets.token_hex(6).encode(),
        )
        self._ids = itertools.count(1)

    def call(self, msg: P.Request, wait_s: float | None = None) -> P.Reply:
        """Send one request and return its reply.

        Args:
            msg: the request (its ``req_id`` is set here).
            wait_s: how long to wait for the reply (default: ``timeout_s``).

        Raises:
            AdminError: no reply in time, or this client is closed.
        """
        if self._sock.closed:
            raise AdminError("this AdminClient is closed")
        msg.req_id = next(self._ids)
        try:
            if not self._sock.poll(poll_ms(self.timeout_s), zmq.POLLOUT):
                raise zmq.Again()
            self._sock.send(P.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again as err:
            raise AdminError(f"kvtierd is not reachable at {self.endpoint}") from err
        wait = self.timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait
        while self._sock.poll(poll_ms(deadline - time.monotonic())):
            try:
                rep = P.decode_reply(self._sock.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if rep.req_id == msg.req_id:
                return rep
        raise AdminError(f"kvtierd at {self.endpoint} did not answer within {wait:g}s")

    def health(self) -> P.HealthReply:
        """Return the HEALTH reply (raises AdminError when the daemon does not answer)."""
        msg = P.Health(req_id=0)
        return _checked(msg, self.call(msg), P.HealthReply)

    def stats(self) -> dict[str, object]:
        """Return the daemon's STATS dict.

        Raises:
            AdminError: no answer, or refused (e.g. a wrong admin token); an
                :class:`UnexpectedAdminReply` for a reply of another type.
        """
        msg = P.Stats(req_id=0, admin_token=self.admin_token)
        return _checked(msg, self.call(msg), P.StatsReply).stats

    def sync(self, timeout_s: float = 60.0) -> P.SyncReply:
        """Write every L2 page not in L3 yet to L3; return when done or after ``timeout_s``.

        Raises:
            AdminError: the daemon refused (no L3 backend, wrong admin token) or did not
                answer within ``timeout_s`` plus this client's ``timeout_s``.
        """
        msg = P.Sync(req_id=0, admin_token=self.admin_token, timeout_s=timeout_s)
        return _checked(msg, self.call(msg, wait_s=timeout_s + self.timeout_s), P.SyncReply)

    def close(self) -> None:
        """Close the socket; idempotent."""
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
