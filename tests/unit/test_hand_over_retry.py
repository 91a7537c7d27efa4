"""The client side of the memory handover against a busy daemon: real AF_UNIX sockets, with
this test playing the daemon's part (a full backlog, a busy reply, nobody listening)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvtier.ipc import fdpass

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def listener(short_tmp: Path) -> Iterator[tuple[socket.socket, Path]]:
    """A SEQPACKET socket listening with a backlog of one connection, not accepting yet."""
    path = short_tmp / fdpass.HANDOVER_SOCKET
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(path))
    sock.listen(0)
    yield sock, path
    sock.close()


def answer(sock: socket.socket, replies: list[int], served: list[bytes]) -> None:
    """Accept one connection per reply status; OK carries a memfd, as the daemon's does."""
    for status in replies:
        conn, _ = sock.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 64, 8)
            fdpass.close_fds(fds)
            served.append(data)
            if status == fdpass.OK:
                fd = os.memfd_create("completion")
                socket.send_fds(conn, [fdpass.encode_reply(fdpass.OK, "ok")], [fd])
                os.close(fd)
            else:
                conn.send(fdpass.encode_reply(status, "max_handovers_waiting_per_user = 1 reached"))


def test_a_full_backlog_is_tried_again_until_the_daemon_accepts(listener):
    sock, path = listener
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    filler.connect(str(path))  # the backlog's one place
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    probe.setblocking(False)
    with pytest.raises(BlockingIOError):  # what a connect to a full backlog meets at once
        probe.connect(str(path))
    probe.close()

    def daemon() -> None:
        time.sleep(0.3)
        conn, _ = sock.accept()  # the filler: the backlog has room again
        conn.close()
        answer(sock, [fdpass.OK], served)

    served: list[bytes] = []
    t = threading.Thread(target=daemon)
    t.start()
    token = secrets.token_bytes(16)
    fd = fdpass.hand_over(path, token, [], timeout=10.0)
    os.close(fd)
    t.join(10)
    filler.close()
    assert served == [fdpass.encode_request(token)]


def test_a_busy_reply_is_tried_again_and_then_served(listener):
    sock, path = listener
    served: list[bytes] = []
    t = threading.Thread(target=answer, args=(sock, [fdpass.BUSY, fdpass.BUSY, fdpass.OK], served))
    t.start()
    os.close(fdpass.hand_over(path, secrets.token_bytes(16), [], timeout=10.0))
    t.join(10)
    assert len(served) == 3


def test_busy_until_the_deadline_fails_naming_the_bound(listener):
    sock, path = listener
    stop = threading.Event()

    def always_busy() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                answer(sock, [fdpass.BUSY], [])
            except TimeoutError:
                continue

    t = threading.Thread(target=always_busy)
    t.start()
    try:
        with pytest.raises(fdpass.HandoverBusy, match="max_handovers_waiting_per_user = 1"):
            fdpass.hand_over(path, secrets.token_bytes(16), [], timeout=0.5)
    finally:
        stop.set()
        t.join(10)


def test_a_refusal_is_not_tried_again(listener):
    sock, path = listener
    served: list[bytes] = []
    t = threading.Thread(target=answer, args=(sock, [fdpass.REFUSED], served))
    t.start()
    with pytest.raises(fdpass.HandoverError) as err:
        fdpass.hand_over(path, secrets.token_bytes(16), [], timeout=10.0)
    t.join(10)
    assert not isinstance(err.value, fdpass.HandoverBusy) and len(served) == 1


def test_nobody_listening_fails_at_once(short_tmp, monkeypatch):
    path = short_tmp / fdpass.HANDOVER_SOCKET
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(path))  # a socket file whose daemon is gone: ECONNREFUSED
    tries: list[float] = []
    try_once = fdpass._try_once

    def counted(*args: object) -> int:
        tries.append(1.0)
        return try_once(*args)  # type: ignore[arg-type]

    def no_backoff(seconds: float) -> None:
        raise AssertionError(f"a refused connection was tried again after {seconds:g}s")

    monkeypatch.setattr(fdpass, "_try_once", counted)
    monkeypatch.setattr(fdpass, "time", SimpleNamespace(monotonic=time.monotonic, sleep=no_backoff))
    try:
        with pytest.raises(fdpass.HandoverUnavailable):
            fdpass.hand_over(path, secrets.token_bytes(16), [], timeout=30.0)
        assert len(tries) == 1  # not tried again until the deadline
    finally:
        dead.close()
