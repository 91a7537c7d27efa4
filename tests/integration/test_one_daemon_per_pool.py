"""kvtierd's lifecycle against real processes: one daemon per pool file, and the systemd
notification protocol around a stop."""

from __future__ import annotations

import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection, TransferHandle
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config.loader import pool_path
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus
from kvtier.launch.daemon_process import DaemonProcess, DaemonStartError

from tests.conftest import _daemon_flags
from tests.engines import client_config, engine, fill_page, page_bytes, tokens

pytestmark = pytest.mark.timeout(90)

POOL_DIR = Path("/dev/shm")


def _store(pool: SharedKVPool, conn: Connection, n: int, salt: int, seed: int):
    keys = conn.page_keys(tokens(n * 16, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=seed + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return keys, expected


def _adopt(endpoint: str) -> dict:
    with AdminClient(endpoint, timeout_s=5.0) as admin:
        return dict(admin.stats()["adopt"])


# ------------------------------------------------------------------ one daemon per pool
def test_a_daemon_started_after_the_runtime_dir_vanished_never_shares_the_running_pool(
    short_tmp: Path,
) -> None:
    """The pool file is one running daemon's alone. When the first daemon's runtime
    directory is removed under it (a tmpfiles clean-up of /tmp/kvtier-<uid>, a logout
    emptying /run/user/<uid>, an ``rm -rf``) and a second kvtierd is started on the same
    path, the second one never maps the pool the first still serves from: it refuses to
    start, or starts on a pool of its own. The first daemon's engines keep loading their
    own bytes."""
    rdir = short_tmp / "d0"
    first = DaemonProcess(rdir, _daemon_flags(short_tmp, "d0"), log_path=short_tmp / "first.log")
    second = DaemonProcess(rdir, _daemon_flags(short_tmp, "d1"), log_path=short_tmp / "second.log")
    ppath = pool_path(POOL_DIR, rdir)
    pool_a = conn_a = pool_b = conn_b = None
    info = None
    try:
        first.start()
        pool_a, conn_a = engine(rdir, model="m", request_timeout_s=5.0)
        keys_a, expected_a = _store(pool_a, conn_a, 8, salt=1, seed=100)
        shutil.rmtree(rdir)  # the first daemon still runs and serves its pool
        try:
            second.start()
        except DaemonStartError:
            second.proc = None  # refused: nothing shared
        else:
            assert first.proc is not None and first.proc.poll() is None
            info = _adopt(second.endpoint)
            # what the second daemon writes must not land in the first one's pages
            pool_b, conn_b = engine(rdir, model="m", request_timeout_s=5.0)
            with AdminClient(second.endpoint, timeout_s=5.0) as admin:
                assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
            _store(pool_b, conn_b, 8, salt=2, seed=900)
        # the first daemon's engine, on its existing connection, still hits its pages
        # (nobody flushed the first daemon) and loads its own bytes
        epoch = conn_a.epoch
        hits = conn_a.lookup(keys_a).l2
        assert conn_a.epoch == epoch, "the first daemon's engine moved to the second daemon"
        assert hits == len(keys_a), (
            f"the first daemon (pid {first.pid}) lost {len(keys_a) - hits} of the "
            f"{len(keys_a)} pages it serves: a second kvtierd changed the pool file "
            f"{ppath} under it (adopted: {info})"
        )
        h = conn_a.load(keys_a, list(range(32, 40)))
        assert h.count == len(keys_a) and h.wait()
        got = [page_bytes(pool_a, p) for p in range(32, 40)]
        assert got == expected_a, (
            f"the first daemon (pid {first.pid}) served bytes the second daemon wrote into "
            f"the pool file {ppath} it adopted from under it: {info}"
        )
        assert info is None or info["pages_adopted"] == 0, (
            f"a second kvtierd adopted the pool file {ppath} that kvtierd pid "
            f"{first.pid} is serving from: {info}"
        )
    finally:
        for c in (conn_a, conn_b):
            if c is not None:
                c.close()
        for p in (pool_a, pool_b):
            if p is not None:
                p.close()
        for d in (second, first):
            if d.proc is not None:
                d.kill()
        ppath.unlink(missing_ok=True)


# ------------------------------------------------------------------ sd_notify around a stop
class Listener:
    """Collects the datagrams a daemon sends to ``NOTIFY_SOCKET``, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[dict[str, str]] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append(fields)
                self._cond.notify_all()

    def wait_for(self, pred: Callable[[dict[str, str]], bool], timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, f in enumerate(self.messages):
                    if pred(f):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching notification in {self.messages!r}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        self.path.unlink(missing_ok=True)


# One layer of 2 MiB pages: a 1 GiB STORE into a pool that is not pre-faulted is copied in
# one layer step, which a stop cannot cut short (cancellation is checked between layers).
BIG = P.Geometry(num_layers=1, page_size=16, kv_heads=32, head_dim=512, dtype="float32")
SLOW = ("--hicache-size", "1GiB", "--prefault", "false", "--copy-threads", "1")


def _still_copying(h: TransferHandle) -> bool:
    assert h._block is not None
    seq, layers_done, status = h._block.read(h.slot)
    return seq == h.seq and layers_done == 0 and status == TransferStatus.RUNNING


def _slow_store(d: DaemonProcess):
    n = (1 << 30) // BIG.page_bytes
    pool = SharedKVPool(BIG, n, prefault=False)
    conn = Connection(pool, model_id="big", config=client_config(d.runtime_dir))
    keys = conn.page_keys(np.arange(n * BIG.page_size) % 32000)
    h = conn.store(keys, list(range(n)))
    assert h.writing == n
    ppath = pool_path(POOL_DIR, d.runtime_dir)
    blocks = ppath.stat().st_blocks
    deadline = time.monotonic() + 30.0
    while _still_copying(h) and ppath.stat().st_blocks <= blocks:
        assert time.monotonic() < deadline, "the store's copy did not begin"
        time.sleep(0.005)
    return pool, conn, h


def test_a_reload_signal_during_a_stop_never_reports_ready_after_stopping(
    daemon_factory, short_tmp: Path
) -> None:
    """Once kvtierd has sent STOPPING=1 it is shutting down: a SIGHUP that arrives during
    the drain (``systemctl reload`` racing ``systemctl stop``, or a config-management
    hook) sends no RELOADING=1 and no READY=1 after it. READY=1 tells systemd the service
    is up and serving, which a daemon in its drain is not (sd_notify(3))."""
    listener = Listener(short_tmp / "notify.sock")
    d = daemon_factory(
        *SLOW, "--shutdown-timeout-s", "60", name="s", env={"NOTIFY_SOCKET": str(listener.path)}
    )
    pool, conn, h = _slow_store(d)
    try:
        first_ready = listener.wait_for(lambda f: f.get("READY") == "1")
        assert _still_copying(h), "the 1 GiB store ended before the stop could begin"
        d.proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for(lambda f: f.get("STOPPING") == "1")
        assert _still_copying(h), "the store ended before the drain: the stop was not slow"
        d.proc.send_signal(signal.SIGHUP)
        # the reload, if the daemon runs one, is logged; give it time to show up
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and "reload" not in d.log_path.read_text():
            time.sleep(0.05)
        time.sleep(0.2)
        after = [f for f in listener.messages[stopping + 1 :] if "READY" in f or "RELOADING" in f]
        assert first_ready < stopping
        assert after == [], f"notifications after STOPPING=1: {after}"
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)  # the second one exits at once
            d.proc.wait(timeout=30)
        conn.close()
        pool.close()
        listener.close()
