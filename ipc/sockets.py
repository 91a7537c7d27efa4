"""The one place ZeroMQ sockets are made, so every socket gets the same options."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import zmq
from kvtier.ipc.limits import MAX_MESSAGE_BYTES

_Socket = TypeVar("_Socket", bound="zmq.Socket[Any]")

POLL_MAX_MS = (1 << 31) - 1
"""The longest wait ``zmq.Socket.poll`` takes (a C int of milliseconds: about 24.8 days)."""


def poll_ms(seconds: float) -> int:
    """``seconds`` as a ``poll`` timeout: whole milliseconds in ``[0, POLL_MAX_MS]`` (a longer
    wait is as good as endless; a longer value would overflow the C int)."""
    return max(0, min(int(min(seconds, POLL_MAX_MS / 1000) * 1000), POLL_MAX_MS))


def make_zmq_socket(
    ctx: zmq.Context[_Socket],
    endpoint: str,
    socket_type: int,
    bind: bool,
    identity: bytes | None = None,
    hwm: int = 0,
    max_msg_bytes: int | None = None,
) -> _Socket:
    """Create, configure and bind or connect a socket.

    Args:
        ctx: a ``zmq.Context`` or ``zmq.asyncio.Context``.
        endpoint: ``ipc://path`` (default deployment) or ``tcp://127.0.0.1:port``.
        socket_type: ``zmq.ROUTER`` (daemon) or ``zmq.DEALER`` (client).
        bind: bind (daemon) or connect (client).
        identity: routing id for a DEALER (unique per connection).
        hwm: send/receive high-water marks (0: unlimited).
        max_msg_bytes: largest frame the socket accepts (ZeroMQ ``MAXMSGSIZE``); a peer
            that sends a bigger one is disconnected before the frame is buffered. Default:
            :data:`~kvtier.ipc.limits.MAX_MESSAGE_BYTES` for a ROUTER (the daemon's socket,
            which any local process can reach), no limit otherwise (a client's replies
            come from the daemon).

    Returns:
        The socket (an asyncio one from an asyncio context), with linger 0 (closing never blocks on unsent messages). A bound ipc
        socket's file gets mode 0660 so engine users in the daemon's group can connect.
    """
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if max_msg_bytes is None:
        max_msg_bytes = MAX_MESSAGE_BYTES if socket_type == zmq.ROUTER else -1
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    if socket_type == zmq.DEALER:
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.IMMEDIATE, 1)
    try:
        if bind:
            if endpoint.startswith("ipc://"):
                path = Path(endpoint[len("ipc://") :])
                if path.exists() or path.is_symlink():
                    path.unlink()
                old = os.umask(0o117)
                try:
                    sock.bind(endpoint)
                finally:
                    os.umask(old)
                os.chmod(path, 0o660)
            else:
                sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:  # closed here: an open socket would keep its context from ending
        sock.close(linger=0)
        raise
    return sock


def ipc_endpoint(path: str | Path) -> str:
    """Return the ``ipc://`` endpoint of a socket file path."""
    return f"ipc://{path}"
