"""From a request's body to its reply: size check, decoding, the stop gate, the handler.

Every failure becomes an error reply naming the problem, never an exception in the receive
loop: a refused request (:class:`~kvtier.daemon.service.validation.RequestError`) keeps its
code, and a bug in a handler is logged with its traceback and answered INTERNAL, so one bad
request cannot stop the daemon serving everyone else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from kvtier.daemon.service.answers import Answer, Deferred, Handler
from kvtier.daemon.service.context import ServiceContext
from kvtier.daemon.service.validation import RequestError
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import PeerCred

log = logging.getLogger("kvtier.daemon")

SERVED_WHILE_STOPPING = (P.Health, P.Stats, P.Unregister)
"""Requests still answered once a stop has begun (the rest get SHUTTING_DOWN)."""


class Dispatcher:
    """Routes each request to its handler and turns failures into error replies.

    Args:
        ctx: the daemon's shared state.
        handlers: the handler of each request type (identity, request) → reply, or a
            :class:`~kvtier.daemon.service.answers.Deferred` one.
    """

    def __init__(self, ctx: ServiceContext, handlers: dict[type, Handler]) -> None:
        self.ctx = ctx
        self.handlers = handlers

    def refuse_frames(self, frames: int) -> P.ErrorReply:
        """The reply to a message of ``frames`` frames (a request is one, after the identity).

        The receive loop drops such a message frame by frame and answers this.
        """
        self.ctx.counters.requests += 1
        return self.ctx.error(
            0, P.ErrorCode.BAD_MESSAGE, f"expected 2 frames (identity and request), got {frames}"
        )

    def handle(
        self,
        identity: bytes,
        body: bytes | memoryview,
        peer: Callable[[], PeerCred | None] | None = None,
    ) -> Answer:
        """Answer one request.

        Args:
            identity: the connection's ROUTER identity.
            body: the request frame.
            peer: tells the sender's process (``ipc://`` transports know it); asked for
                REGISTER only, so other requests do not pay for it.

        Returns:
            The reply, or a :class:`~kvtier.daemon.service.answers.Deferred` one when the
            handler must wait (its failure becomes an error reply too). Never raises.
        """
        ctx = self.ctx
        ctx.counters.requests += 1
        limit = ctx.cfg.max_message_bytes
        if len(body) > limit:
            return ctx.error(
                P.peek_req_id(body),
                P.ErrorCode.BAD_MESSAGE,
                f"message of {len(body)} bytes exceeds max_message_bytes ({limit})",
            )
        try:
            msg = P.decode_request(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return ctx.error(P.peek_req_id(body), P.ErrorCode.BAD_MESSAGE, f"bad message: {err}")
        if ctx.stopping and not isinstance(msg, SERVED_WHILE_STOPPING):
            return ctx.error(msg.req_id, P.ErrorCode.SHUTTING_DOWN, "kvtierd is stopping")
        try:
            if isinstance(msg, P.Register):  # the one request that needs its sender
                reply = self.handlers[P.Register](
                    identity, msg, peer() if peer is not None else None
                )
            else:
                reply = self.handlers[type(msg)](identity, msg)
            if isinstance(reply, Deferred):
                return Deferred(self._guard(msg.req_id, reply.pending))
            return reply
        except RequestError as err:
            return ctx.error(msg.req_id, err.code, str(err))
        except Exception as err:  # request boundary: report, keep serving everyone else
            log.exception("internal error handling %s", type(msg).__name__)
            return ctx.error(msg.req_id, P.ErrorCode.INTERNAL, f"internal error: {err!r}")

    async def _guard(self, req_id: int, pending: Coroutine[Any, Any, P.Reply]) -> P.Reply:
        """Await a deferred reply; a failure becomes an error reply, as in :meth:`handle`."""
        try:
            return await pending
        except RequestError as err:
            return self.ctx.error(req_id, err.code, str(err))
        except Exception as err:  # request boundary: report, keep serving everyone else
            log.exception("internal error in a deferred reply")
            return self.ctx.error(req_id, P.ErrorCode.INTERNAL, f"internal error: {err!r}")
