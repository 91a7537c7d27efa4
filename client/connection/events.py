"""A subscriber to a kvtierd's KV events: what ``kvtier events`` and the bench read with.

A router reads the stream with its own decoder (vLLM's format: :mod:`kvtier.ipc.kv_events`);
this subscriber is the reference reader: it follows the sequence numbers and, when it sees a
gap (its queue overflowed, or it connected late), asks the replay socket for the missing
batches, as vLLM's subscriber does, as many times as the daemon's answers (at most
``kv_events_replay_max`` batches each) take to cover it. A batch numbered below the next
one expected that no replay brought is a new stream (the daemon restarted): it is followed
from there, after the replay of the new stream's earlier batches::

    with EventSubscriber("ipc:///run/kvtier/events.sock",
                         replay="ipc:///run/kvtier/events-replay.sock") as sub:
        for msg in sub.iter(timeout_s=10):
            print(msg.topic, msg.seq, msg.batch.events)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import msgspec
import zmq
from kvtier.config import ConfigError
from kvtier.ipc import kv_events as E
from kvtier.ipc.sockets import poll_ms

__all__ = ["REPLAY_TIMEOUT_S", "EventMessage", "EventSubscriber"]

REPLAY_TIMEOUT_S = 5.0
"""Longest wait for a replay answer: a replay socket that does not answer must not hold up
the live stream, whose batches queue (and, past the high-water mark, drop) meanwhile."""


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One batch as received: its topic, sequence number, decoded events, whether it came by
    replay, and its bytes as published (for another decoder)."""

    topic: str
    seq: int
    batch: E.KVEventBatch
    replayed: bool = False
    payload: bytes = b""


class EventSubscriber:
    """Subscribes to a kvtierd's KV events (see the module docstring).

    Args:
        endpoint: the daemon's ``kv_events_endpoint``.
        replay: its ``kv_events_replay_endpoint`` (None: gaps stay gaps).
        topic: topic prefix to subscribe to (a model's:
            :func:`~kvtier.ipc.kv_events.model_topic`; "" for every topic).
        hwm: the receive high-water mark (batches queued here before ZeroMQ drops; 0: no
            limit).
        rcvbuf: the kernel receive buffer in bytes (-1: the system's default).

    Raises:
        ConfigError: ``endpoint`` or ``replay`` is not an endpoint ZeroMQ can connect to
            (``foo``, ``tcp://host`` without a port, bytes that are not UTF-8), or
            ``topic`` is not UTF-8.
    """

    def __init__(
        self,
        endpoint: str,
        replay: str | None = None,
        topic: str = "",
        hwm: int = 100_000,
        rcvbuf: int = -1,
    ) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.RCVBUF, rcvbuf)
            try:
                self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            except UnicodeEncodeError as err:
                raise ConfigError(
                    f"topic = {topic!r} is not UTF-8 (an undecodable byte at character {err.start})"
                ) from err
            _connect(self._sub, "endpoint", endpoint)
            if replay is not None:
                # each replay request connects a socket of its own: try the endpoint once
                # here, so that a malformed one fails now and not at the first gap
                probe = self._ctx.socket(zmq.DEALER)
                try:
                    _connect(probe, "replay", replay)
                finally:
                    probe.close(linger=0)
        except BaseException:  # closed here: an open socket would keep the context from ending
            self.close()
            raise
        self._replay_endpoint = replay
        self._topic = topic
        self.next_seq: int | None = None  # the sequence number expected next
        self.replayed = 0  # batches recovered by replay
        self.gaps = 0  # gaps seen in the sequence numbers
        self.lost = 0  # batches of gaps the daemon no longer buffered
        self.restarts = 0  # new streams seen (a daemon restarted)
        self.malformed = 0  # messages skipped: not a KV event batch (parts, bytes, topic)
        # what replays brought and the live stream has not passed yet: seq -> payload digest
        self._by_replay: dict[int, bytes] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets."""
        self._sub.close(linger=0)
        self._ctx.term()

    def recv(self, timeout_s: float) -> EventMessage | None:
        """The next batch as published (no gap handling), or None after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while self._sub.poll(poll_ms(max(0.0, end - time.monotonic()))):
            msg = self._parse(self._sub.recv_multipart(), False)
            if msg is not None:
                return msg
        return None

    def _parse(self, parts: list[bytes], replayed: bool) -> EventMessage | None:
        """``[topic, seq, payload]`` as a message; None (counted in :attr:`malformed`) for
        anything else: another number of parts, a sequence frame not of 8 bytes, a topic
        not UTF-8, a payload that is not a batch."""
        if len(parts) != 3 or len(parts[1]) != 8:
            self.malformed += 1
            return None
        topic, seq, payload = parts
        try:
            return EventMessage(
                topic.decode(), E.seq_of(seq), E.decode_batch(payload), replayed, payload
            )
        except (UnicodeDecodeError, msgspec.DecodeError):  # ValidationError is one too
            self.malformed += 1
            return None

    def iter(self, timeout_s: float, start_seq: int | None = None) -> Iterator[EventMessage]:
        """Batches in sequence order, gaps filled by replay, until none came for
        ``timeout_s`` seconds.

        Args:
            timeout_s: how long to wait for the next batch; a replay answer is awaited as
                long, at most :data:`REPLAY_TIMEOUT_S`.
            start_seq: replay from this sequence number first (e.g. 0: everything the
                daemon still buffers), then follow the stream.
        """
        replay_wait = min(timeout_s, REPLAY_TIMEOUT_S)
        if start_seq is not None and self._replay_endpoint is not None:
            self.next_seq = start_seq
            time.sleep(0.05)  # let the subscription reach the publisher before asking
            for old in self.replay(start_seq, timeout_s=replay_wait):
                yield old
                self.next_seq = old.seq + 1
        while True:
            msg = self.recv(timeout_s)
            if msg is None:
                return
            if self.next_seq is not None and msg.seq < self.next_seq:
                if self._by_replay.get(msg.seq) == _digest(msg.payload):
                    continue  # already had it by replay
                self.restarts += 1  # a new stream (its batches differ): its earlier ones first
                self._by_replay.clear()
                self.next_seq = 0
            if self.next_seq is not None and msg.seq > self.next_seq:
                self.gaps += 1
                yield from self.replay(self.next_seq, upto=msg.seq, timeout_s=replay_wait)
            self.next_seq = msg.seq + 1
            # live batches come in order: none at or below this one comes live again
            seen = self._by_replay
            while seen and next(iter(seen)) <= msg.seq:
                del seen[next(iter(seen))]
            yield msg

    def replay(
        self, start_seq: int, upto: int | None = None, timeout_s: float = REPLAY_TIMEOUT_S
    ) -> list[EventMessage]:
        """Ask the replay socket for the batches from ``start_seq`` (below ``upto``), in
        order, keeping this subscriber's topics; [] without a replay endpoint. Asks again
        from past the last batch an answer brought until ``upto`` (or an answer brings
        nothing new); batches the daemon no longer buffers count in :attr:`lost`. Each
        answer is awaited at most ``timeout_s`` seconds per message."""
        if self._replay_endpoint is None:
            return []
        out: list[EventMessage] = []
        start = start_seq
        while upto is None or start < upto:
            brought, got = self._replay_once(start, upto, timeout_s)
            seqs = sorted(brought)
            if not seqs or seqs[-1] < start:
                break  # nothing (more) buffered from ``start``
            if seqs[0] > start:  # left the buffer before this answer reached them
                self.lost += (seqs[0] if upto is None else min(seqs[0], upto)) - start
            out.extend(got)
            for n in seqs:  # ascending, after what is there: the live stream prunes in order
                self._by_replay.pop(n, None)
                self._by_replay[n] = brought[n]
            start = seqs[-1] + 1
        self.replayed += len(out)
        return out

    def _replay_once(
        self, start: int, upto: int | None, timeout_s: float
    ) -> tuple[dict[int, bytes], list[EventMessage]]:
        """One replay request: the sequence number of every batch the answer brought, with
        its payload's digest, and the batches of this subscriber's topics below ``upto``."""
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        seqs: dict[int, bytes] = {}
        out: list[EventMessage] = []
        try:
            req.connect(self._replay_endpoint or "")
            req.send_multipart((b"", E.replay_request(start)))
            while req.poll(poll_ms(timeout_s)):
                parts = req.recv_multipart()
                if len(parts) == 4 and parts[2] == E.END_SEQ:
                    break
                msg = self._parse(parts[1:], True) if len(parts) == 4 else None
                if msg is None:
                    if len(parts) != 4:
                        self.malformed += 1
                    break  # an answer that is not the protocol's: what it brought so far
                seqs[msg.seq] = _digest(msg.payload)
                if (upto is None or msg.seq < upto) and msg.topic.startswith(self._topic):
                    out.append(msg)
        finally:
            req.close(linger=0)
        return seqs, out


def _connect(sock: zmq.Socket[bytes], field: str, endpoint: str) -> None:
    """Connect ``sock`` to ``endpoint``; an endpoint ZeroMQ refuses is a ConfigError that
    names ``field`` and the endpoint."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as err:
        raise ConfigError(f"{field} = {endpoint!r} cannot be connected to: {err}") from err
    except UnicodeEncodeError as err:
        raise ConfigError(
            f"{field} = {endpoint!r} is not UTF-8 (an undecodable byte at character {err.start})"
        ) from err


def _digest(payload: bytes) -> bytes:
    """A batch's fingerprint, to tell a batch replay brought from another stream's batch of
    the same number."""
    return hashlib.blake2b(payload, digest_size=16).digest()
