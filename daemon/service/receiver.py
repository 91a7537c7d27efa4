"""kvtierd's control socket: requests read from a reader callback, replies sent at once.

Requests are read by a callback of the event loop on the ROUTER's descriptor (no future,
no task per request): it reads what is queued, answering each request in turn, and gives
the loop a turn every :data:`RECV_BURST` requests. A message is read frame by frame: a
request is the connection's identity and one body frame (each at most ``MAXMSGSIZE``); the
frames of a message with more are read and dropped one at a time, never collected, and it
is answered BAD_MESSAGE. Replies are sent directly (a ROUTER never waits to send); one that
must wait (L3 I/O, a prefetch claim) is sent from a task of its own.

ZeroMQ's descriptor only signals a change, and any read or send may consume the signal of a
request that arrived meanwhile. So the reader asks whether a message is queued
(``EVENTS``) before each read and returns only once the queue is empty, and a reply sent
from a task is followed by the same question (:meth:`Receiver.reply_later`). pyzmq's
asyncio socket would spend a future, several callbacks and a raised ``zmq.Again`` per
request: a large share of the daemon's CPU time under a stream of small requests, and of a
LOOKUP's round trip.

The socket monitor (connections accepted and closed) is read the same way
(:meth:`~kvtier.daemon.service.connections.ConnectionGuard.watch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq
from kvtier.daemon.service.answers import Answer, Deferred
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import zmq_peer

if TYPE_CHECKING:
    from kvtier.daemon.service.dispatch import Dispatcher
    from kvtier.daemon.service.startgate import StartGate

__all__ = ["RECV_BURST", "Receiver", "queued"]

log = logging.getLogger("kvtier.daemon")

_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)  # flags as plain ints: or-ing pyzmq's enums costs per reply
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
RECV_BURST = 64
"""Requests read in a row from a non-empty queue before the event loop gets a turn (copy
completions, handovers, the lease loop)."""


class Receiver:
    """Reads requests off the daemon's ROUTER and sends the replies.

    Args:
        sock: the bound ROUTER (a plain, blocking-API socket; every call here is NOBLOCK).
        dispatcher: returns what answers requests now (the start gate, then the service's
            dispatcher).
    """

    def __init__(
        self, sock: zmq.Socket[Any], dispatcher: Callable[[], Dispatcher | StartGate]
    ) -> None:
        self.sock = sock
        self._dispatcher = dispatcher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_pending = False  # a read of the socket is scheduled (call_soon)
        self._failed: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Answer requests from a reader callback on the socket's descriptor until
        cancelled (or until the receive path fails: a bug, raised here)."""
        loop = self._loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        fd = cast(int, self.sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._read_requests)
        try:
            self._read_requests()  # what came before the reader was registered signalled no one
            await self._failed
        finally:
            loop.remove_reader(fd)
            self._loop = None  # no read scheduled from here on runs

    def _read_requests(self) -> None:
        """Read and answer what is queued (the reader callback): at most ``RECV_BURST``
        requests, then the loop gets a turn and the reading goes on after it."""
        self._read_pending = False
        sock = self.sock
        if sock.closed or self._loop is None:
            return
        try:
            for _ in range(RECV_BURST):
                if not queued(sock):
                    return
                identity, reply = self._answer_one(sock.recv(zmq.NOBLOCK, copy=False))
                if isinstance(reply, Deferred):
                    self.answer(identity, reply)  # a handler that waits (L3 I/O, a claim)
                elif reply is not None:
                    self._send(identity, P.encode(reply))
            self._read_soon()  # more may be queued: read it after the loop's other callbacks
        except Exception as err:  # a bug in the receive path: it ends the daemon's loops
            log.exception("the receive path failed")
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(err)

    def waiting(self) -> bool:
        """Whether a request is queued on the socket, not read yet."""
        return not self.sock.closed and queued(self.sock)

    def _read_soon(self) -> None:
        if not self._read_pending and self._loop is not None:
            self._read_pending = True
            self._loop.call_soon(self._read_requests)

    def _send(self, identity: bytes, body: bytes) -> None:
        """Send a reply at once. A ROUTER never waits to send: a reply to a peer that is
        gone, or whose queue is full, is dropped by ZeroMQ (the client's request times out
        and it asks again), so no future is needed. The caller checks the queue afterwards
        (the reader does before each read)."""
        sock = self.sock
        if not sock.closed:
            sock.send(identity, _MORE)
            sock.send(body, _LAST)

    def answer(self, identity: bytes, reply: Answer | None) -> None:
        """Send ``reply`` (or, for a deferred one, what it makes) from a task of its own."""
        if reply is None:
            return
        task = asyncio.create_task(self.reply_later(identity, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reply_later(self, identity: bytes, pending: Answer) -> None:
        """Send ``pending`` (a reply, or what a deferred one makes), then read what the send
        may have hidden from the reader: a request that arrived meanwhile."""
        reply = await pending.pending if isinstance(pending, Deferred) else pending
        self._send(identity, P.encode(reply))
        if not self.sock.closed and queued(self.sock):
            self._read_soon()

    def _answer_one(self, first: zmq.Frame) -> tuple[bytes, Answer | None]:
        """Read the rest of the message whose first frame is ``first`` and answer it (or
        refuse its frame count)."""
        identity, more = first.bytes, first.more
        frames = 1
        body: zmq.Frame | None = None
        sock = self.sock
        while more:  # a request has one body frame; the frames past it are dropped as read
            # a message arrives whole: once its first frame is read the rest are there, so
            # they are read without waiting (and without a future per frame)
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            frames += 1
            more = frame.more
            if frames == 2:
                body = frame
        dispatcher = self._dispatcher()
        if frames != 2 or body is None:
            return identity, dispatcher.refuse_frames(frames)
        frame = body
        # decoded from the frame's own memory, not a copy: a long LOOKUP's keys are read
        # where ZeroMQ put them (a field kept as a view, packed keys, keeps the frame alive)
        return identity, dispatcher.handle(
            identity, frame.buffer, lambda: zmq_peer(cast(str, frame.get("Peer-Address")))
        )


def queued(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (ZeroMQ's ``EVENTS`` has ``POLLIN``). Asking
    costs less than a read that fails (a raised ``zmq.Again``)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)
