"""What the control socket answers while kvtierd is starting: HEALTH at once, the rest later.

kvtierd binds its control socket before it builds its service
(:mod:`~kvtier.daemon.service.boot`: the service's modules imported, the pool mapped and
adopted). Until the service is up, :class:`StartGate` stands in for the
:class:`~kvtier.daemon.service.dispatch.Dispatcher`:

- HEALTH is answered at once, ``starting`` (not serving yet: ``kvtier health`` exits 1 and
  ``DaemonProcess`` keeps waiting), with the daemon's epoch and no sessions;
- every other request is held, in arrival order, and handed to the real dispatcher when
  the service is up (:meth:`StartGate.release`), before any request that arrives later:
  no request is answered from a pool that is not adopted yet, and none is lost;
- past ``MAX_HELD`` requests or ``MAX_HELD_BYTES`` bytes held, a request is refused BUSY
  (the client treats it as a miss and asks again).

Only the wire format is imported here, so the socket can answer before numpy and the
copy path are loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import PeerCred

__all__ = ["MAX_HELD", "MAX_HELD_BYTES", "STARTING", "HeldRequest", "StartGate"]

STARTING = "starting"
"""HEALTH's status while the service is being built."""
MAX_HELD = 4096
"""Requests held at most while starting."""
MAX_HELD_BYTES = 64 << 20
"""Request bytes held at most while starting."""


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request that arrived while starting.

    Attributes:
        identity: the connection's ROUTER identity.
        body: the request frame.
        peer: the sender's process (read when the request arrived; REGISTER only).
    """

    identity: bytes
    body: bytes
    peer: PeerCred | None


class StartGate:
    """Answers HEALTH and holds the rest until the service is up (module docstring).

    Args:
        epoch: the daemon's boot epoch, carried by every reply.
    """

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.held: list[HeldRequest] = []
        self.held_bytes = 0

    def handle(
        self,
        identity: bytes,
        body: bytes | memoryview,
        peer: Callable[[], PeerCred | None] | None = None,
    ) -> P.Reply | None:
        """Answer a HEALTH; hold anything else.

        Args:
            identity: the connection's ROUTER identity.
            body: the request frame.
            peer: tells the sender's process (asked for a REGISTER only).

        Returns:
            The reply, or None when the request is held (it is answered by
            :meth:`release`'s caller).
        """
        try:
            msg: Any = P.decode_request(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg = None  # the dispatcher answers it (BAD_MESSAGE) and counts it
        if isinstance(msg, P.Health):
            return P.HealthReply(
                req_id=msg.req_id,
                epoch=self.epoch,
                status=STARTING,
                sessions=0,
                protocol_version=P.PROTOCOL_VERSION,
            )
        if len(self.held) >= MAX_HELD or self.held_bytes + len(body) > MAX_HELD_BYTES:
            return P.ErrorReply(
                req_id=P.peek_req_id(body),
                epoch=self.epoch,
                code=int(P.ErrorCode.BUSY),
                message="kvtierd is starting and holds too many requests; ask again",
            )
        who = peer() if peer is not None and isinstance(msg, P.Register) else None
        self.held.append(HeldRequest(identity, bytes(body), who))
        self.held_bytes += len(body)
        return None

    def refuse_frames(self, frames: int) -> P.ErrorReply:
        """The reply to a message of ``frames`` frames (a request is one, after the identity)."""
        return P.ErrorReply(
            req_id=0,
            epoch=self.epoch,
            code=int(P.ErrorCode.BAD_MESSAGE),
            message=f"expected 2 frames (identity and request), got {frames}",
        )

    def release(self) -> list[HeldRequest]:
        """Return the held requests, oldest first, and hold no more."""
        held, self.held, self.held_bytes = self.held, [], 0
        return held
