"""The KV event stream's transport: the PUB socket, sequence numbers, the replay buffer and
the replay socket (what the batches say is :mod:`~kvtier.daemon.service.kv_events`'s).

Every send is NOBLOCK on an XPUB socket: a subscriber whose queue holds ``kv_events_hwm``
batches misses the next ones (ZeroMQ drops them for it alone; the others get them), and
every batch stays in the replay buffer (the last ``kv_events_buffer_steps`` batches), so a
subscriber that sees a gap in the sequence numbers asks the replay socket for it. (With
``XPUB_NODROP`` one stalled subscriber would hold every batch back from all of them.) The replay socket reads requests from a
reader callback and answers each with at most ``kv_events_replay_max`` batches, then the end
marker: :data:`REPLAY_CHUNK` batches per event-loop turn across the answers under way, an
answer whose requester's queue is full waiting (polled every :data:`REPLAY_RETRY_S`) until it
reads, and dropped after :data:`REPLAY_STALL_S` without progress. Queued answers share the
buffer's bytes (sent without a copy), so a requester that never reads holds its queue's
message envelopes, not copies of the batches; at most :data:`MAX_ANSWERS` answers are under
way, a requester's in the order it asked, at most :data:`MAX_ANSWERS_PER_REQUESTER` of
them. A request that is not exactly
``[b"", 8-byte start]`` (or a frame over 64 bytes, which ZeroMQ refuses with the connection)
gets no answer. Subscription messages the XPUB hands up are read and dropped as they come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import zmq
from kvtier.config import ConfigError, DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.daemon.pauses import WATCH
from kvtier.ipc import kv_events as E
from kvtier.ipc.sockets import make_zmq_socket

if TYPE_CHECKING:
    from kvtier.daemon.service.connections import ConnectionGuard

__all__ = [
    "MAX_ANSWERS",
    "MAX_ANSWERS_PER_REQUESTER",
    "REPLAY_BURST",
    "REPLAY_CHUNK",
    "REPLAY_MAX_FRAME",
    "REPLAY_RETRY_MAX_S",
    "REPLAY_RETRY_S",
    "REPLAY_STALL_S",
    "SUBSCRIPTION_BURST",
    "SUBSCRIPTION_MAX_FRAME",
    "EventStream",
]

log = logging.getLogger("kvtier.daemon.events")

REPLAY_BURST = 16
"""Replay requests read in a row before the event loop gets a turn."""
REPLAY_CHUNK = 256
"""Batches of replay answers sent in one event-loop turn, across the answers under way."""
REPLAY_RETRY_S = 0.005
"""How soon answers whose requesters' queues are all full are tried again."""
REPLAY_RETRY_MAX_S = 0.1
"""The longest wait before an answer whose requester's queue stays full is tried again."""
REPLAY_STALL_S = 30.0
"""An answer that sent nothing for this long (its requester reads nothing) is dropped."""
MAX_ANSWERS = 1024
"""Replay answers under way at most; a request past them is refused (counted)."""
MAX_ANSWERS_PER_REQUESTER = 16
"""Replay answers under way for one requester at most (sent in the order it asked)."""
SUBSCRIPTION_MAX_FRAME = 8192
"""Largest frame the PUB socket takes from a subscriber: a (un)subscription of a topic
(``kvtier/<model id>/<fingerprint>``; a model id has at most 4,096 characters)."""
SUBSCRIPTION_BURST = 256
"""Subscription messages read (and dropped) in a row before the event loop gets a turn."""
REPLAY_MAX_FRAME = 64
"""Largest frame the replay socket takes (a request is 8 bytes): ZeroMQ drops a bigger one,
and its connection, before buffering it."""

_NB = int(zmq.NOBLOCK)


@dataclass(slots=True)
class _Answer:
    """A replay answer under way: the next sequence number to send, the batches it may
    still send, whether it sent one, since when its requester's queue has been full (None:
    it is not; monotonic time less kvtierd's pauses, :mod:`~kvtier.daemon.pauses`), and
    when to try it again then (the wait doubling up to :data:`REPLAY_RETRY_MAX_S`)."""

    seq: int
    left: int
    started: bool = False
    stalled: float | None = None
    next_try: float = 0.0
    wait: float = 0.0


_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class EventStream:
    """The bound sockets of one daemon's event stream and its replay buffer.

    Args:
        cfg: the daemon's configuration (``kv_events_endpoint``, ``kv_events_replay_endpoint``,
            ``kv_events_hwm``, ``kv_events_buffer_steps``, ``kv_events_replay_max``).
        counters: the daemon's counters (``kv_events_*``).
        zctx: the daemon's ZeroMQ context.

    Raises:
        ConfigError: an endpoint cannot be bound (in use, bad address), naming its setting.
    """

    def __init__(self, cfg: DaemonConfig, counters: Counters, zctx: zmq.Context[Any]) -> None:
        assert cfg.kv_events_endpoint is not None
        self.counters = counters
        self._replay_max = cfg.kv_events_replay_max
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=cfg.kv_events_buffer_steps)
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        # by requester, each's in the order it asked; the first is the one being sent
        self._answers: OrderedDict[bytes, deque[_Answer]] = OrderedDict()
        self._under_way = 0
        self._pump: asyncio.Handle | None = None
        self._read_pending = False  # a read of the replay socket is scheduled
        self._unwatch: list[Callable[[], None]] = []  # stop watching the connections
        try:
            self._pub = make_zmq_socket(
                zctx,
                cfg.kv_events_endpoint,
                zmq.XPUB,
                bind=True,
                hwm=cfg.kv_events_hwm,
                max_msg_bytes=SUBSCRIPTION_MAX_FRAME,
            )
        except zmq.ZMQError as err:
            raise ConfigError(
                f"kv_events_endpoint = {cfg.kv_events_endpoint!r} cannot be bound: {err}"
            ) from err
        self._replay: zmq.Socket[Any] | None = None
        try:
            if cfg.kv_events_replay_endpoint is not None:
                self._replay = make_zmq_socket(
                    zctx,
                    cfg.kv_events_replay_endpoint,
                    zmq.ROUTER,
                    bind=True,
                    hwm=1000,
                    max_msg_bytes=REPLAY_MAX_FRAME,
                )
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # every payload sent without a copy (pyzmq copies those under 64 KiB by
                # default): queued answers share the buffer's bytes, whatever their size
                self._replay.copy_threshold = 0
        except BaseException as err:
            self._pub.close(linger=0)
            if isinstance(err, zmq.ZMQError):
                raise ConfigError(
                    f"kv_events_replay_endpoint = {cfg.kv_events_replay_endpoint!r} cannot be "
                    f"bound: {err}"
                ) from err
            raise

    def start(self, guard: ConnectionGuard | None = None) -> None:
        """Begin reading subscriptions and answering replay requests (from the event loop);
        ``guard`` counts and bounds the sockets' connections."""
        self._loop = asyncio.get_running_loop()
        if guard is not None:
            self._unwatch = [guard.watch(s) for s in (self._pub, self._replay) if s is not None]
        self._loop.add_reader(cast(int, self._pub.getsockopt(zmq.FD)), self._drop_subscriptions)
        self._drop_subscriptions()
        if self._replay is not None:
            fd = cast(int, self._replay.getsockopt(zmq.FD))
            self._loop.add_reader(fd, self._read_replays)
            self._read_replays()  # what came before the reader was registered signalled no one

    def close(self) -> None:
        """Stop the readers and close the sockets (idempotent)."""
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self._answers.clear()
        self._under_way = 0
        for stop in self._unwatch:
            stop()
        self._unwatch = []
        if self._replay is not None:
            if self._loop is not None and not self._replay.closed:
                self._loop.remove_reader(cast(int, self._replay.getsockopt(zmq.FD)))
            self._replay.close(linger=0)
        if self._loop is not None and not self._pub.closed:
            self._loop.remove_reader(cast(int, self._pub.getsockopt(zmq.FD)))
        self._pub.close(linger=0)
        self._loop = None

    def publish(self, topic: bytes, payload: bytes) -> None:
        """Send one batch on ``topic`` with the next sequence number, and keep it for
        replay (a subscriber whose queue is full misses it, and replays it)."""
        seq = next(self._seq)
        self._buffer.append((seq, topic, payload))
        if self._pub.closed:
            return
        pub = self._pub
        # frame by frame with int flags (pyzmq's enum or-ing costs per call); a message is
        # atomic: a full queue drops it whole, for its subscriber alone
        pub.send(topic, _MORE)
        pub.send(seq.to_bytes(8, "big"), _MORE)
        pub.send(payload, _NB)
        self.counters.kv_events_batches += 1
        if self._loop is not None and cast(int, pub.getsockopt(_EVENTS)) & _POLLIN:
            # a send may take the socket's edge of readiness: read what came meanwhile
            self._loop.call_soon(self._drop_subscriptions)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._buffer[-1][0] + 1 if self._buffer else 0

    def _drop_subscriptions(self) -> None:
        """Read and drop the subscription messages the XPUB hands up (ZeroMQ filters by
        them itself; unread, a subscriber sending many distinct topics would grow them)."""
        pub = self._pub
        if pub.closed or self._loop is None:
            return
        for _ in range(SUBSCRIPTION_BURST):
            if not cast(int, pub.getsockopt(_EVENTS)) & _POLLIN:
                return
            pub.recv(_NB)
        self._loop.call_soon(self._drop_subscriptions)

    # ------------------------------------------------------------------ replay
    def _read_soon(self) -> None:
        if not self._read_pending and self._loop is not None:
            self._read_pending = True
            self._loop.call_soon(self._read_replays)

    def _read_replays(self) -> None:
        """Answer queued replay requests (the reader callback), a burst at a time."""
        self._read_pending = False
        sock = self._replay
        if sock is None or sock.closed or self._loop is None:
            return
        for _ in range(REPLAY_BURST):
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            frames = _read_request(sock)
            if frames is None or frames[1] != b"" or len(frames[2]) != 8:
                self.counters.kv_events_replays_refused += 1
                continue  # garbage gets nothing
            try:  # one request's failure (a bug) leaves the ones behind it answered
                self._answer(sock, frames[0], int.from_bytes(frames[2], "big"))
            except Exception:
                log.exception("answering a replay request failed")
        self._read_soon()  # more may be queued: after the others

    def _answer(self, sock: zmq.Socket[Any], peer: bytes, start: int) -> None:
        """Begin the answer to ``peer``: the buffered batches from ``start`` on (at most
        ``replay_max``), then the end marker, sent by :meth:`_send_answers`."""
        queue = self._answers.get(peer)
        if self._under_way >= MAX_ANSWERS or (
            queue is not None and len(queue) >= MAX_ANSWERS_PER_REQUESTER
        ):
            self.counters.kv_events_replays_refused += 1
            return
        self.counters.kv_events_replays += 1
        if queue is None:
            queue = self._answers[peer] = deque()
        queue.append(_Answer(start, self._replay_max))
        self._under_way += 1
        self._pump_soon(0.0)

    def _pump_soon(self, delay: float) -> None:
        if self._pump is None and self._loop is not None:
            self._pump = (
                self._loop.call_soon(self._send_answers)
                if delay <= 0
                else self._loop.call_later(delay, self._send_answers)
            )

    def _send_answers(self) -> None:
        """Send up to :data:`REPLAY_CHUNK` batches of the answers under way, in turn."""
        self._pump = None
        sock = self._replay
        if sock is None or sock.closed or self._loop is None:
            self._answers.clear()
            self._under_way = 0
            return
        budget, now, moved = REPLAY_CHUNK, time.monotonic(), False
        for peer in list(self._answers):
            queue = self._answers[peer]
            while queue and budget > 0:  # its answers in order, while it takes them
                a = queue[0]
                if a.next_try > now:  # its queue was full a moment ago
                    break
                try:
                    sent, done = self._send_some(sock, peer, a, budget)
                except zmq.ZMQError as err:  # gone (unroutable): it may ask again
                    log.debug("replay to a subscriber cut short: %s", err)
                    self._drop(peer)
                    break
                budget -= sent
                moved = moved or sent > 0 or done
                if done:
                    queue.popleft()
                    self._under_way -= 1
                    continue
                ran = now - WATCH.catch_up()  # kvtierd's own pauses are not the requester's
                if sent:
                    a.stalled, a.wait = None, 0.0
                elif a.stalled is None:
                    a.stalled = ran
                elif ran - a.stalled > REPLAY_STALL_S:
                    log.debug(
                        "replay to a subscriber dropped: it read nothing for %.0f s",
                        ran - a.stalled,
                    )
                    self._drop(peer)
                    break
                if not sent:
                    a.wait = min(REPLAY_RETRY_MAX_S, max(REPLAY_RETRY_S, 2 * a.wait))
                    a.next_try = now + a.wait
                break  # its queue is full (or this turn's budget spent)
            if peer in self._answers:
                if not self._answers[peer]:
                    del self._answers[peer]
                else:
                    self._answers.move_to_end(peer)  # the others' turn first
            if budget <= 0:
                break
        if self._answers:
            soonest = min(q[0].next_try for q in self._answers.values())
            self._pump_soon(0.0 if moved else max(REPLAY_RETRY_S, soonest - now))
        if cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            # a send may take the socket's edge of readiness: read what came meanwhile
            self._read_soon()

    def _drop(self, peer: bytes) -> None:
        """Forget every answer to ``peer``."""
        self._under_way -= len(self._answers.pop(peer, ()))

    def _send_some(
        self, sock: zmq.Socket[Any], peer: bytes, a: _Answer, budget: int
    ) -> tuple[int, bool]:
        """Send ``a``'s next batches (at most ``budget``), then its end marker once it has
        none left; how many batches were sent, and whether the end marker was. Stops at
        the first the requester's queue cannot take (a message is refused whole, at its
        first frame).

        Raises:
            zmq.ZMQError: the requester is gone.
        """
        buf, sent = self._buffer, 0
        # a.seq is any 64-bit number: past the newest batch there is nothing to send
        first = min(max(0, a.seq - buf[0][0]), len(buf)) if buf else 0
        if a.started and buf and a.seq < buf[0][0]:
            # what it was to send next left the buffer while it waited: end here, and a
            # request from past its last batch finds the hole at the start of its answer
            a.left = 0
        try:
            for seq, topic, payload in itertools.islice(buf, first, first + min(a.left, budget)):
                sock.send(peer, _MORE)
                sock.send(b"", _MORE)
                sock.send(topic, _MORE)
                sock.send(seq.to_bytes(8, "big"), _MORE)
                sock.send(payload, _NB, copy=False)  # queued answers share the buffer's bytes
                a.seq, a.left, sent, a.started = seq + 1, a.left - 1, sent + 1, True
            if sent < budget and (a.left == 0 or first + sent >= len(buf)):
                sock.send_multipart((peer, b"", b"", E.END_SEQ, b""), _NB)
                return sent, True
        except zmq.Again:  # its queue is full: the rest when it reads
            pass
        return sent, False


def _read_request(sock: zmq.Socket[Any]) -> list[bytes] | None:
    """Read one message off the replay socket frame by frame: its three frames, or None
    for any other count (the frames past the third are read and dropped one at a time,
    never collected)."""
    frames = [sock.recv(_NB)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(_NB)
        if len(frames) < 4:
            frames.append(frame)
    return frames if len(frames) == 3 else None
