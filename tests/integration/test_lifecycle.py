"""kvtierd's lifecycle under a systemd stand-in: notifications, SIGHUP reload, SIGTERM stops.

A real ``AF_UNIX`` datagram socket plays systemd's ``NOTIFY_SOCKET``; the daemon is a real
subprocess. No test asserts an absolute time: orderings and states only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection, TransferHandle
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import socket_path
from kvtier.config.loader import pool_path
from kvtier.daemon.service.sessions import Session
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus
from kvtier.ipc.limits import MAX_PID
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import SMALL, client_config, engine, tokens

pytestmark = pytest.mark.timeout(120)

Fields = dict[str, str]


class NotifyListener:
    """Collects the datagrams a daemon sends to ``NOTIFY_SOCKET``, as systemd would.

    For each datagram it also records whether ``watch`` (the daemon's control socket)
    existed at the moment the datagram was received.
    """

    def __init__(self, path: Path, watch: Path) -> None:
        self.path = path
        self.watch = watch
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[Fields, bool]] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            existed = self.watch.exists()  # checked first, as close to arrival as possible
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append((fields, existed))
                self._cond.notify_all()

    def wait_for(
        self, pred: Callable[[Fields], bool], timeout: float = 30.0, after: int = -1
    ) -> int:
        """Index of the first message after index ``after`` matching ``pred``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (fields, _) in enumerate(self.messages):
                    if i > after and pred(fields):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching notification; got {self.fields()!r}")
                self._cond.wait(left)

    def fields(self) -> list[Fields]:
        """Every message so far."""
        with self._cond:
            return [f for f, _ in self.messages]

    def indexes(self, name: str) -> list[int]:
        """Indexes of the messages that carry field ``name``."""
        return [i for i, f in enumerate(self.fields()) if name in f]

    def close(self) -> None:
        """Stop listening and remove the socket file."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def notify(short_tmp: Path) -> Iterator[Callable[[Path], NotifyListener]]:
    """``notify(runtime_dir)`` → a listener watching that daemon's control socket."""
    made: list[NotifyListener] = []

    def make(rdir: Path) -> NotifyListener:
        listener = NotifyListener(short_tmp / f"notify-{len(made)}.sock", socket_path(rdir))
        made.append(listener)
        return listener

    yield make
    for listener in made:
        listener.close()


def wait_log(d: DaemonProcess, text: str, timeout: float = 30.0, start: int = 0) -> int:
    """Wait until the daemon's log holds ``text`` after character ``start``; return its end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = d.log_path.read_text(errors="replace")
        at = log.find(text, start)
        if at >= 0:
            return at + len(text)
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged; log tail:\n{d.log_tail()}")


def refused_heartbeat(d: DaemonProcess) -> None:
    """A request the daemon refuses and logs at debug level only (no session 424242)."""
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        rep = admin.call(P.Heartbeat(req_id=0, session_id=424242))
    assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNKNOWN_SESSION


def logged_flush(d: DaemonProcess) -> int:
    """Send an admin FLUSH of L2, which kvtierd logs at info level; return the log's length
    before it (where to look for its line)."""
    before = len(d.log_path.read_text(errors="replace"))
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
    return before


# ---------------------------------------------------------------------------- notifications
def test_ready_after_the_socket_exists_then_status_watchdog_stopping_and_exit_0(
    daemon_factory, notify, short_tmp
):
    rdir = short_tmp / "d0"
    listener = notify(rdir)
    d = daemon_factory(env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "1000000"})
    ready = listener.wait_for(lambda f: f.get("READY") == "1")
    assert listener.messages[ready][1], "READY=1 arrived before the control socket existed"
    status = listener.wait_for(lambda f: "STATUS" in f, after=ready)
    text = listener.fields()[status]["STATUS"]
    assert "sessions" in text and "pool" in text
    # before it: how long the start may take (a large pool's), and what it does
    assert listener.indexes("EXTEND_TIMEOUT_USEC")[0] < ready
    assert "mapping the host pool" in listener.fields()[listener.indexes("STATUS")[0]]["STATUS"]
    # watchdog pings while healthy: a few of them, all after READY=1
    third = listener.wait_for(
        lambda f: f.get("WATCHDOG") == "1",
        after=listener.wait_for(
            lambda f: f.get("WATCHDOG") == "1",
            after=listener.wait_for(lambda f: f.get("WATCHDOG") == "1"),
        ),
    )
    assert min(listener.indexes("WATCHDOG")) > ready
    assert third > ready
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        assert admin.health().status == "ok"
    assert d.stop() == 0  # SIGTERM
    stopping = listener.wait_for(lambda f: f.get("STOPPING") == "1")
    assert stopping > third
    assert [i for i in listener.indexes("WATCHDOG") if i > stopping] == []
    assert listener.indexes("READY") == [ready]
    assert not socket_path(rdir).exists()  # removed on the way out


# ---------------------------------------------------------------------------- SIGHUP
def write_config(path: Path, **fields: str) -> None:
    """Write a TOML config of string values."""
    path.write_text("".join(f'{k} = "{v}"\n' for k, v in fields.items()))


def test_sighup_applies_a_live_field_and_refuses_a_fixed_one(short_tmp, notify):
    rdir = short_tmp / "h"
    cfg = short_tmp / "kvtierd.toml"
    base = {"hicache_size": "64MiB", "extent_size": "4MiB", "lease_s": "5"}
    write_config(cfg, **base, log_level="info")
    listener = notify(rdir)
    d = DaemonProcess(rdir, ["--config", str(cfg)], env={"NOTIFY_SOCKET": str(listener.path)})
    try:
        d.start()
        first_ready = listener.wait_for(lambda f: f.get("READY") == "1")
        mark = wait_log(d, "kvtierd ready")
        refused_heartbeat(d)
        # an info line logged after the refusal: once it is in the file, a debug line
        # about the refusal would be there before it
        flushed = wait_log(d, "flush tier=l2", start=logged_flush(d))
        assert "UNKNOWN_SESSION" not in d.log_path.read_text()[mark:flushed]

        # a live field: applied
        write_config(cfg, **base, log_level="debug")
        d.proc.send_signal(signal.SIGHUP)
        mark = wait_log(d, "reload: applied log_level", start=mark)
        reloading = listener.wait_for(lambda f: f.get("RELOADING") == "1", after=first_ready)
        assert int(listener.fields()[reloading]["MONOTONIC_USEC"]) > 0
        listener.wait_for(lambda f: f.get("READY") == "1", after=reloading)
        refused_heartbeat(d)
        mark = wait_log(d, "UNKNOWN_SESSION", start=mark)  # debug lines now appear

        # a fixed field (with a live one beside it): the whole reload is refused
        write_config(cfg, **{**base, "hicache_size": "128MiB"}, log_level="info")
        d.proc.send_signal(signal.SIGHUP)
        mark = wait_log(d, "reload: hicache_size cannot change while running", start=mark)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            assert admin.health().status == "ok"
            assert admin.stats()["pool"]["capacity_bytes"] == 64 << 20
        refused_heartbeat(d)
        mark = wait_log(d, "UNKNOWN_SESSION", start=mark)  # log_level stayed debug

        # a file that does not parse: refused, still serving
        cfg.write_text("hicache_size = \n")
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d, "reload rejected, configuration unchanged", start=mark)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            assert admin.health().status == "ok"
        assert d.proc.poll() is None
        assert d.stop() == 0
    finally:
        if d.proc is not None:
            d.kill()
        d.remove_pool()


# ---------------------------------------------------------------------------- slow shutdown
# One layer of 2 MiB pages: a single layer copy of the whole transfer, which the daemon's
# cancellation (checked between layers) cannot cut short. Copying 1 GiB into a host pool
# that was not pre-faulted takes seconds (page faults), which makes the shutdown slow.
BIG = P.Geometry(num_layers=1, page_size=16, kv_heads=32, head_dim=512, dtype="float32")
BIG_POOL = 1 << 30


def host_pool_blocks(d: DaemonProcess) -> int:
    """Blocks allocated to ``d``'s host pool file (not pre-faulted: it grows as pages land)."""
    return pool_path(Path("/dev/shm"), d.runtime_dir).stat().st_blocks


def slow_store(d: DaemonProcess) -> tuple[SharedKVPool, Connection, TransferHandle]:
    """Start a store of 1 GiB (one layer) and return (pool, conn, handle) once its copy runs.

    The daemon checks cancellation before every layer, the first one included: a stop that
    comes before the copy thread has entered the layer (a busy machine may take that long to
    run the thread) cancels the store at once, CANCELLED with no layer done, and the stop is
    not slow. So wait until the copy writes into the host pool, which it does only past that
    check; the caller skips if the store ended first (``still_copying``).
    """
    n = BIG_POOL // BIG.page_bytes
    pool = SharedKVPool(BIG, n, prefault=False)
    try:
        conn = Connection(pool, model_id="big", config=client_config(d.runtime_dir))
    except BaseException:
        pool.close()
        raise
    try:
        keys = conn.page_keys(np.arange(n * BIG.page_size) % 32000)
        h = conn.store(keys, list(range(n)))
        assert h.writing == n
        # the pages were allocated before the reply: from now on only the copy grows the file
        blocks = host_pool_blocks(d)
        deadline = time.monotonic() + 30.0
        while still_copying(h) and host_pool_blocks(d) <= blocks:
            assert time.monotonic() < deadline, "the store's copy did not begin within 30 s"
            time.sleep(0.005)
    except BaseException:
        conn.close()
        pool.close()
        raise
    return pool, conn, h


def still_copying(h: TransferHandle) -> bool:
    """Whether the store's single layer has not ended (its completion slot says so).

    True also before the copy thread has begun it, when a stop would still cancel it at
    once: :func:`slow_store` returns only once the copy has begun.
    STATS cannot tell once a stop has begun: the daemon stops answering requests then.
    """
    assert h._block is not None
    seq, layers_done, status = h._block.read(h.slot)
    return seq == h.seq and layers_done == 0 and status == TransferStatus.RUNNING


SLOW_FLAGS = ("--hicache-size", "1GiB", "--prefault", "false", "--copy-threads", "1")


def test_a_second_sigterm_during_a_slow_shutdown_exits_at_once(daemon_factory, notify, short_tmp):
    listener = notify(short_tmp / "s")
    d = daemon_factory(
        *SLOW_FLAGS,
        "--shutdown-timeout-s",
        "60",
        name="s",
        env={"NOTIFY_SOCKET": str(listener.path)},
    )
    pool, conn, h = slow_store(d)
    try:
        if not still_copying(h):
            pytest.skip(
                "the 1 GiB store finished before the stop began: cannot make the "
                "shutdown slow on this machine"
            )
        d.proc.send_signal(signal.SIGTERM)
        listener.wait_for(lambda f: f.get("STOPPING") == "1")
        wait_log(d, "stopping: 1 sessions, 1 transfers in flight")
        wait_log(d, "session 1 closing: daemon stopping")
        if not still_copying(h):
            pytest.skip("the store finished during the stop: shutdown was not slow")
        # graceful stop in progress, waiting for the copy: the second signal cuts it short
        sock = socket_path(d.runtime_dir)
        assert sock.exists()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 1
        log = d.log_path.read_text()
        assert "second SIGTERM: exiting now" in log
        # `kvtier health` then says no daemon runs, not that a socket does not answer
        assert not sock.exists(), "the control socket was left behind"
        assert "transfers still running after" not in log  # it did not wait out the drain
        assert still_copying(h)  # it did not wait for the copy either: the store never ended
        assert not h.wait(timeout=5)
    finally:
        conn.close()
        pool.close()


def test_a_transfer_that_outlives_the_shutdown_timeout_does_not_crash_the_stop(
    daemon_factory, short_tmp
):
    """Regression: sessions were finalized (engine memory unmapped) under a running copy,
    and kvtierd died of SIGSEGV instead of exiting 0."""
    d = daemon_factory(*SLOW_FLAGS, "--shutdown-timeout-s", "0", name="t")
    pool, conn, h = slow_store(d)
    try:
        if not still_copying(h):
            pytest.skip("the 1 GiB store finished too soon to outlive the shutdown timeout")
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(timeout=60)
        assert "transfers still running after" in d.log_path.read_text()
        assert rc == 0, f"kvtierd exited with {rc} ({signal.Signals(-rc).name if rc < 0 else rc})"
    finally:
        conn.close()
        pool.close()


def test_a_second_sigterm_after_the_drain_gave_up_exits_at_once(daemon_factory, short_tmp):
    d = daemon_factory(*SLOW_FLAGS, "--shutdown-timeout-s", "0", name="u")
    pool, conn, h = slow_store(d)
    try:
        if not still_copying(h):
            pytest.skip("the 1 GiB store finished too soon to outlive the shutdown timeout")
        d.proc.send_signal(signal.SIGTERM)
        wait_log(d, "transfers still running after")
        if not still_copying(h):
            pytest.skip("the store finished during the stop: shutdown was not slow")
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 1
        assert "second SIGTERM: exiting now" in d.log_path.read_text()
        assert still_copying(h), "kvtierd waited for the copy to end before exiting"
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- impossible pids
@pytest.mark.parametrize("pid", [2**31, 2**40, -1])
def test_register_with_an_impossible_pid_is_refused_and_the_daemon_keeps_serving(daemon, pid):
    """Regression: a pid of 2**31 or more was accepted, and os.kill(pid, 0) in the reaper
    then raised OverflowError and ended the daemon. The refusal names the field."""
    with SharedKVPool(SMALL, 4) as other, AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        rep = admin.call(
            P.Register(
                req_id=5,
                protocol_version=P.PROTOCOL_VERSION,
                namespace=P.NamespaceSpec("x"),
                geometry=other.geometry,
                memory=other.export(),
                pid=pid,
            )
        )
    assert isinstance(rep, P.ErrorReply), rep
    assert rep.code == P.ErrorCode.BAD_MESSAGE and "pid" in rep.message, rep
    # the daemon is alive and serves a well-formed engine
    pool, conn = engine(daemon.runtime_dir)
    try:
        keys = conn.page_keys(tokens(2 * SMALL.page_size))
        assert conn.store(keys, [0, 1]).wait()
        with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
            assert admin.health().status == "ok"
            assert [s["pid"] for s in admin.stats()["sessions"]] == [os.getpid()]
        assert conn.lookup(keys).l2 == 2
    finally:
        conn.close()
        pool.close()
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("pid", [2**31, 2**40, 2**64 + 1, MAX_PID + 1])
def test_engine_alive_never_raises_and_an_impossible_pid_is_dead(pid):
    assert session_with_pid(pid).engine_alive() is False


def test_engine_alive_of_real_pids():
    assert session_with_pid(os.getpid()).engine_alive() is True
    assert session_with_pid(0).engine_alive() is True  # unknown: only the lease ends it
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process now
    assert session_with_pid(child.pid).engine_alive() is False


def session_with_pid(pid: int) -> Session:
    """A session with only its pid filled in (``engine_alive`` reads nothing else)."""
    return Session(
        session_id=1,
        identity=b"x",
        tenant="default",
        owner=0,
        ns_id=0,
        ns_fingerprint=b"",
        geometry=SMALL,
        class_id=0,
        memory=None,
        completion=None,
        pid=pid,
        tp_rank=0,
        tp_size=1,
        lease_s=5.0,
    )


def test_discard_removes_the_pool_file_also_when_the_stop_is_interrupted(short_tmp):
    """``DaemonProcess.discard`` (benchmarks, the demo): the daemon's pool file is gone
    afterwards, also when its stop raised (a Ctrl-C while waiting for the exit)."""
    for interrupted in (False, True):
        d = DaemonProcess(
            short_tmp / f"d{int(interrupted)}",
            ["--hicache-size", str(16 << 20), "--extent-size", str(4 << 20)],
        )
        d.start()
        path = pool_path(Path("/dev/shm"), d.runtime_dir)
        assert path.exists()
        real_stop = d.stop
        if interrupted:

            def stop(timeout: float = 20.0) -> int:
                raise KeyboardInterrupt

            d.stop = stop  # type: ignore[method-assign]
        try:
            if interrupted:
                with pytest.raises(KeyboardInterrupt):
                    d.discard()
            else:
                assert d.discard() == 0
            assert not path.exists()
        finally:
            real_stop()
            d.remove_pool()
