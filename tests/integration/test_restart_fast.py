"""A restarted kvtierd answers at once while it starts, and never from a pool not adopted yet.

The control socket is bound before the service is built (its modules imported, the pool
mapped and adopted): HEALTH says ``starting`` meanwhile, every other request is held and
answered once the pool is adopted, and READY=1 (what ``DaemonProcess`` and systemd wait
for) comes only then. Real daemons, a real SIGKILL; no test asserts an absolute time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from kvtier.client.connection.admin import AdminClient
from kvtier.config import KvtierError, socket_path
from kvtier.config.loader import pool_path
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_lifecycle import NotifyListener

pytestmark = pytest.mark.timeout(180)

PAGES = 8
DEADLINE_S = 60.0


def store_then_kill(d) -> list[bytes]:
    """Store PAGES pages through a real engine connection, then SIGKILL the daemon."""
    pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
    try:
        keys = conn.page_keys(tokens(PAGES * SMALL.page_size, salt=11))
        h = conn.store(keys, list(range(PAGES)))
        assert h.count == PAGES and h.wait()
    finally:
        conn.close()
        pool.close()
    d.kill()
    return keys


def file_id(path: Path) -> tuple[int, int] | None:
    """Tells the file at ``path`` from an earlier one there (an inode number may be reused)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def wait_for_new_socket(path: Path, stale: tuple[int, int] | None, proc_alive) -> None:
    """Wait until a socket other than ``stale`` (the killed daemon's) is at ``path``."""
    deadline = time.monotonic() + DEADLINE_S
    while file_id(path) in (None, stale):
        assert proc_alive(), "kvtierd exited before binding its socket"
        assert time.monotonic() < deadline, f"no new socket at {path}"
        time.sleep(0.002)


def collect(sock: zmq.Socket, want: set[int]) -> list[P.Reply]:
    """Replies to the requests ``want`` (by req_id), in the order they arrive."""
    got: list[P.Reply] = []
    deadline = time.monotonic() + DEADLINE_S
    while {r.req_id for r in got} != want:
        assert time.monotonic() < deadline, f"unanswered: {want - {r.req_id for r in got}}"
        if sock.poll(100):
            got.append(P.decode_reply(sock.recv()))
    return got


def test_requests_while_starting_wait_for_the_adopted_pool(daemon_factory, short_tmp):
    keys = store_then_kill(daemon_factory())
    listener = NotifyListener(short_tmp / "notify.sock", socket_path(short_tmp / "d0"))
    d2 = daemon_factory(env={"NOTIFY_SOCKET": str(listener.path)}, start=False)
    started: list[KvtierError | None] = []

    def start() -> None:
        try:
            d2.start(timeout=DEADLINE_S)
            started.append(None)
        except KvtierError as err:  # reported by the main thread
            started.append(err)

    stale = file_id(d2.socket)
    starter = threading.Thread(target=start)
    starter.start()
    zctx = zmq.Context()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        wait_for_new_socket(d2.socket, stale, lambda: not started)
        dealer.connect(d2.endpoint)
        # all at once, as soon as the socket exists: a HEALTH is answered while the rest wait
        requests = [
            P.Health(req_id=1),
            P.Stats(req_id=2),
            P.Heartbeat(req_id=3, session_id=1),
            P.Health(req_id=4),
        ]
        for msg in requests:
            dealer.send(P.encode(msg))
        dealer.send_multipart([b"", b"x"])  # bad frame count: refused, not lost
        # READY=1 means serving: a HEALTH sent once it arrived says ok
        listener.wait_for(lambda f: f.get("READY") == "1", timeout=DEADLINE_S)
        dealer.send(P.encode(P.Health(req_id=5)))
        replies = collect(dealer, {1, 2, 3, 4, 0, 5})
        by_id = {r.req_id: r for r in replies}
        statuses = [r.status for r in replies if isinstance(r, P.HealthReply) and r.req_id != 5]
        assert set(statuses) <= {"starting", "ok"}, statuses
        assert statuses == sorted(statuses, key=lambda s: s == "ok"), "starting after ok"
        assert len({r.epoch for r in replies}) == 1
        stats = by_id[2]
        assert isinstance(stats, P.StatsReply), stats
        adopt, pool = stats.stats["adopt"], stats.stats["pool"]
        # answered only once the pool was adopted: every stored page is there
        assert adopt.get("adopted") and adopt.get("pages_adopted") == PAGES, adopt
        assert pool["pages_ready"] == PAGES, pool
        assert isinstance(by_id[3], P.ErrorReply) and by_id[3].code == P.ErrorCode.UNKNOWN_SESSION
        assert isinstance(by_id[0], P.ErrorReply) and by_id[0].code == P.ErrorCode.BAD_MESSAGE
        after_ready = by_id[5]
        assert isinstance(after_ready, P.HealthReply) and after_ready.status == "ok"
        starter.join(DEADLINE_S)
        assert started == [None], started
        pool_, conn = engine(d2.runtime_dir, request_timeout_s=5.0)
        try:
            assert conn.lookup(keys).l2 == PAGES
        finally:
            conn.close()
            pool_.close()
        if "starting" not in statuses:
            pytest.skip("the daemon was up before the first request: nothing was held")
    finally:
        dealer.close()
        zctx.term()
        starter.join(DEADLINE_S)
        listener.close()


def test_sigterm_while_starting_stops_cleanly_and_keeps_the_pool(daemon_factory, short_tmp):
    keys = store_then_kill(daemon_factory())
    rdir = short_tmp / "d0"
    env = {**os.environ, "KVTIER_RUNTIME_DIR": str(rdir), "STATE_DIRECTORY": str(rdir / "state")}
    env.pop("NOTIFY_SOCKET", None)
    flags = [
        "--hicache-storage-backend",
        "none",
        "--hicache-size",
        "64MiB",
        "--extent-size",
        "4MiB",
        "--log-level",
        "info",
    ]  # as the first daemon (the fixture's flags)
    stale = file_id(socket_path(rdir))
    with open(rdir / "starting.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.daemon", *flags],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_new_socket(socket_path(rdir), stale, lambda: proc.poll() is None)
        with AdminClient(f"ipc://{socket_path(rdir)}", timeout_s=DEADLINE_S) as admin:
            first = admin.health().status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE_S) == 0, (rdir / "starting.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = (rdir / "starting.log").read_text()
    assert "Traceback" not in log_text, log_text
    assert not socket_path(rdir).exists()
    assert pool_path(Path("/dev/shm"), rdir).exists()  # kept for the next start
    d3 = daemon_factory()
    pool, conn = engine(d3.runtime_dir, request_timeout_s=5.0)
    try:
        assert conn.lookup(keys).l2 == PAGES
    finally:
        conn.close()
        pool.close()
    if first != "starting":
        pytest.skip("the daemon was up before SIGTERM: the stop was not during the start")
