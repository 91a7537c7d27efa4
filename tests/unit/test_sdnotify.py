"""Tests of the sd_notify client against real AF_UNIX datagram sockets.

Each test binds the socket systemd would own, points a notifier at it and reads
back the exact datagrams. The watchdog tests block the event loop on purpose and
check, without looking at clocks, that no ping was sent while it was blocked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvtier.daemon.service.sdnotify import SystemdNotifier, watchdog_loop

pytestmark = pytest.mark.timeout(30)

LOGGER = "kvtier.daemon.service.sdnotify"


@dataclass
class Receiver:
    """A bound datagram socket standing in for systemd's notification socket.

    Attributes:
        sock: the bound socket.
        name: its address as NOTIFY_SOCKET spells it (``/path`` or ``@name``).
    """

    sock: socket.socket
    name: str

    def recv(self, timeout: float = 2.0) -> bytes:
        """Return the next datagram, waiting up to ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        return self.sock.recv(4096)

    def drain(self) -> list[bytes]:
        """Return every datagram queued now, without waiting."""
        self.sock.setblocking(False)
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096))
            except BlockingIOError:
                return out


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A temp directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def path_receiver(short_tmpdir: Path) -> Iterator[Receiver]:
    """A notification socket bound to a file-system path."""
    path = str(short_tmpdir / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sock:
        sock.bind(path)
        yield Receiver(sock, path)


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    """A notification socket bound in the abstract namespace."""
    name = f"kvtier-test-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sock:
        sock.bind("\0" + name)
        yield Receiver(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    """Each kind of notification socket in turn."""
    fixture = "path_receiver" if request.param == "path" else "abstract_receiver"
    found: Receiver = request.getfixturevalue(fixture)
    return found


# ---- datagrams --------------------------------------------------------------


def test_state_notifications_are_exact_datagrams(receiver: Receiver) -> None:
    notifier = SystemdNotifier(receiver.name, environ={})
    assert notifier.enabled
    assert notifier.socket_path == receiver.name

    assert notifier.ready() is True
    assert receiver.recv() == b"READY=1"
    assert notifier.status("serving 3 engines") is True
    assert receiver.recv() == b"STATUS=serving 3 engines"
    assert notifier.watchdog() is True
    assert receiver.recv() == b"WATCHDOG=1"
    assert notifier.stopping() is True
    assert receiver.recv() == b"STOPPING=1"
    assert receiver.drain() == []


def test_reloading_carries_the_monotonic_clock(receiver: Receiver) -> None:
    notifier = SystemdNotifier(receiver.name, environ={})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000

    lines = receiver.recv().decode().split("\n")
    assert lines[0] == "RELOADING=1"
    assert len(lines) == 2
    name, _, value = lines[1].partition("=")
    assert name == "MONOTONIC_USEC"
    assert value.isdigit()
    assert before <= int(value) <= after


def test_notify_sends_fields_in_order(path_receiver: Receiver) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={})
    assert notifier.notify(STATUS="pre-faulting pool", EXTEND_TIMEOUT_USEC=5_000_000)
    assert path_receiver.recv() == b"STATUS=pre-faulting pool\nEXTEND_TIMEOUT_USEC=5000000"
    assert notifier.extend_timeout(2.5)
    assert path_receiver.recv() == b"EXTEND_TIMEOUT_USEC=2500000"


def test_status_folds_line_breaks(path_receiver: Receiver) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={})
    notifier.status("first line\nsecond line\r\nthird")
    assert path_receiver.recv() == b"STATUS=first line second line third"


@pytest.mark.parametrize(
    "fields",
    [{}, {"ready": 1}, {"Status": "x"}, {"STATUS": "two\nlines"}],
    ids=["no-fields", "lower-case", "mixed-case", "line-break"],
)
def test_notify_rejects_malformed_fields(fields: dict[str, str | int]) -> None:
    # Rejected even when disabled, so the mistake shows up outside systemd too.
    with pytest.raises(ValueError):
        SystemdNotifier(environ={}).notify(**fields)


def test_extend_timeout_rejects_non_positive_time() -> None:
    with pytest.raises(ValueError):
        SystemdNotifier(environ={}).extend_timeout(0)


def test_socket_comes_from_the_environment(path_receiver: Receiver) -> None:
    notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": path_receiver.name})
    assert notifier.enabled
    notifier.ready()
    assert path_receiver.recv() == b"READY=1"


def test_explicit_socket_wins_over_the_environment(
    path_receiver: Receiver, abstract_receiver: Receiver
) -> None:
    notifier = SystemdNotifier(
        abstract_receiver.name, environ={"NOTIFY_SOCKET": path_receiver.name}
    )
    notifier.ready()
    assert abstract_receiver.recv() == b"READY=1"
    assert path_receiver.drain() == []


# ---- no socket, bad socket ----------------------------------------------------


@pytest.mark.parametrize("socket_path", [None, ""], ids=["env-unset", "explicit-empty"])
def test_without_a_socket_every_call_is_a_no_op(socket_path: str | None) -> None:
    notifier = SystemdNotifier(socket_path, environ={})
    assert not notifier.enabled
    assert notifier.socket_path == ""
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.reloading() is False
    assert notifier.notify(STATUS="x") is False


def test_unsupported_address_disables_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "vsock:2:1234" in caplog.records[0].getMessage()


def test_send_failures_warn_once_per_outage(
    short_tmpdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(short_tmpdir / "gone")
    notifier = SystemdNotifier(path, environ={})

    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        # Nobody listens: every send fails, only the first one warns.
        assert [notifier.watchdog() for _ in range(3)] == [False, False, False]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert path in warnings[0].getMessage()

        # systemd is back: sends work again.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            assert notifier.watchdog() is True
            assert sock.recv(4096) == b"WATCHDOG=1"
        os.unlink(path)

        # A new outage warns once more.
        caplog.clear()
        assert notifier.ready() is False
        assert notifier.ready() is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1


# ---- systemd not reading: a full queue ---------------------------------------


def _fill(notifier: SystemdNotifier) -> int:
    """Send pings until the receiver's queue is full; return how many fit."""
    for sent in range(10_000):
        if not notifier.watchdog():
            return sent
    raise AssertionError("the receive queue never filled up")


def test_watchdog_ping_never_waits_for_a_full_queue(
    path_receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    # A long send_timeout: if pings waited for room, this test would hang.
    notifier = SystemdNotifier(path_receiver.name, environ={}, send_timeout=3600.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        queued = _fill(notifier)
        assert notifier.watchdog() is False
    assert queued >= 1
    assert len(caplog.records) == 1
    assert path_receiver.drain() == [b"WATCHDOG=1"] * queued


def test_state_change_waits_for_room_in_the_queue(path_receiver: Receiver) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={}, send_timeout=20.0)
    queued = _fill(notifier)
    received: list[bytes] = []

    def systemd_catches_up() -> None:
        time.sleep(0.2)
        received.extend(path_receiver.drain())

    reader = threading.Thread(target=systemd_catches_up)
    reader.start()
    try:
        assert notifier.ready() is True  # waits until the reader has made room
    finally:
        reader.join()
    received.extend(path_receiver.drain())
    assert received == [b"WATCHDOG=1"] * queued + [b"READY=1"]


def test_state_change_gives_up_after_send_timeout(
    path_receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={}, send_timeout=0.05)
    queued = _fill(notifier)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert notifier.stopping() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert path_receiver.drain() == [b"WATCHDOG=1"] * queued


def test_negative_send_timeout_is_rejected() -> None:
    with pytest.raises(ValueError):
        SystemdNotifier(environ={}, send_timeout=-1.0)


# ---- watchdog interval --------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "<self>"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "<other>"}, None),
        ({"WATCHDOG_USEC": "500000"}, 0.25),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_PID": "<self>"}, None),
    ],
    ids=[
        "unset",
        "usec-only",
        "pid-matches",
        "pid-differs",
        "sub-second",
        "zero",
        "negative",
        "not-a-number",
        "pid-only",
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    pids = {"<self>": str(os.getpid()), "<other>": str(os.getpid() + 1)}
    env = {k: pids.get(v, v) for k, v in environ.items()}
    assert SystemdNotifier(environ=env).watchdog_interval() == expected


def test_watchdog_interval_needs_no_socket() -> None:
    notifier = SystemdNotifier("", environ={"WATCHDOG_USEC": "2000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval() == 1.0


# ---- watchdog loop ------------------------------------------------------------

INTERVAL = 0.05


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a watchdog loop and wait until it has finished."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Let the event loop run until ``pred`` holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(INTERVAL / 5)


async def pings(receiver: Receiver, at_least: int, timeout: float = 10.0) -> list[bytes]:
    """Let the event loop run, draining ``receiver`` (so its queue of about 10 datagrams
    never fills), until ``at_least`` datagrams came; return them."""
    got: list[bytes] = []

    def enough() -> bool:
        got.extend(receiver.drain())
        return len(got) >= at_least

    await until(enough, f"{at_least} datagrams", timeout)
    return got


async def test_watchdog_loop_pings_only_while_the_event_loop_runs(
    path_receiver: Receiver,
) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={})
    task = asyncio.create_task(watchdog_loop(notifier, INTERVAL))

    running = await pings(path_receiver, 3)
    # Block the event loop for 12 intervals. No await between the last drain of pings()
    # and the drain below, so any ping in between would come from outside the loop.
    time.sleep(12 * INTERVAL)
    blocked = path_receiver.drain()
    resumed = await pings(path_receiver, 3)
    await _stop(task)

    assert set(running) == {b"WATCHDOG=1"}
    assert blocked == []
    assert set(resumed) == {b"WATCHDOG=1"}


async def test_watchdog_loop_pings_at_once(path_receiver: Receiver) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={})
    task = asyncio.create_task(watchdog_loop(notifier, 3600.0))
    first = await pings(path_receiver, 1)  # the next ping would be an hour later
    await _stop(task)
    assert first == [b"WATCHDOG=1"]


async def test_watchdog_loop_withholds_pings_while_unhealthy(
    path_receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = SystemdNotifier(path_receiver.name, environ={})
    healthy = False
    calls = 0

    def health() -> bool:
        nonlocal calls
        calls += 1
        return healthy

    with caplog.at_level(logging.INFO, logger=LOGGER):
        task = asyncio.create_task(watchdog_loop(notifier, INTERVAL, health))
        await until(lambda: calls >= 3, "3 health checks")  # asked on every tick
        unhealthy = path_receiver.drain()

        healthy = True
        recovered = await pings(path_receiver, 3)

        healthy = False  # no await since the last drain: no ping came in between
        asked = calls
        await until(lambda: calls >= asked + 3, "3 more health checks")
        sick_again = path_receiver.drain()
        await _stop(task)

    assert unhealthy == []
    assert set(recovered) == {b"WATCHDOG=1"}
    assert sick_again == []
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.WARNING) == 2  # one per unhealthy spell, not per tick


async def test_watchdog_loop_lets_health_errors_propagate() -> None:
    def health() -> bool:
        raise RuntimeError("health check bug")

    with pytest.raises(RuntimeError, match="health check bug"):
        await watchdog_loop(SystemdNotifier(environ={}), INTERVAL, health)


async def test_watchdog_loop_with_a_disabled_notifier_just_runs() -> None:
    ticks = 0

    def health() -> bool:
        nonlocal ticks
        ticks += 1
        return True

    task = asyncio.create_task(watchdog_loop(SystemdNotifier(environ={}), INTERVAL, health))
    await until(lambda: ticks >= 3 or task.done(), "3 ticks")
    assert not task.done()
    await _stop(task)


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
async def test_watchdog_loop_rejects_bad_intervals(interval: float) -> None:
    with pytest.raises(ValueError):
        await watchdog_loop(SystemdNotifier(environ={}), interval)
