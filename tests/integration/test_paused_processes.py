"""Engines and daemons that are paused (SIGSTOP) and resumed (SIGCONT).

A real engine process can be stopped for longer than kvtierd's lease (a debugger, a
Kubernetes pod freeze, a CRIU checkpoint, a long GC pause), and so can kvtierd itself.
docs/protocol.md ("Failure semantics") promises: a session ends when its lease expires
*without heartbeats*; a client whose daemon is late past ``request_timeout_s`` degrades to
misses and ``wait_layer`` gives up after ``load_timeout_s``; the engine never hangs and never
reads a page that was not completely written; the next request re-registers.

The engines here are real: a child process running the client library (driven line by line
over its stdin) that the test stops and continues, or a connection in this process while
the daemon is the one stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.driven_engine import Child
from tests.engines import engine, fill_page, page_bytes, tokens

BIG = P.Geometry(
    num_layers=8, page_size=64, kv_heads=4, head_dim=64, dtype="float32"
)  # 1 MiB pages: a LOAD of a few hundred pages runs on the copy threads for a while


def _stats(d) -> dict:  # type: ignore[no-untyped-def]
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.stats()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until(cond, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _running_load(d, conn, pool, keys, first: int, n: int):  # type: ignore[no-untyped-def]
    """A LOAD of ``keys`` into pages ``first..`` caught running with kvtierd stopped (it
    stays stopped); the handle."""
    for _ in range(10):
        h = conn.load(keys, list(range(first, first + n)))
        os.kill(d.pid, signal.SIGSTOP)
        if h.count == n and h.layers_ready() < BIG.num_layers:
            return h
        os.kill(d.pid, signal.SIGCONT)
        h.wait()
    pytest.skip("could not stop kvtierd in the middle of a LOAD")


@pytest.mark.timeout(90)
def test_paused_engine_is_reaped_then_reregisters_without_leaks(daemon_factory):
    """An engine process stopped for longer than the lease loses its session (its
    slots, mapping and descriptors are freed), and once continued it carries on with the
    old session id, re-registers by itself and its cache works again: the pages it stored
    load back byte for byte, a LOAD accepted before the pause never reports DONE with other
    bytes, the other engine's session is untouched, and afterwards the daemon holds exactly
    the sessions and descriptors it held before."""
    d = daemon_factory("--lease-s", "1")
    fds0 = _fds(d.pid)
    cfg = dict(request_timeout_s=1.0)
    a, b = Child(d.runtime_dir, "a", cfg=cfg), Child(d.runtime_dir, "b", cfg=cfg)
    try:
        want = a.ask("fill 7 0 4")[0]
        assert a.ask("store 7 0 4") == ["4", "True"]
        assert a.ask("load_nowait 7 8 4") == ["4"]
        os.kill(a.pid, signal.SIGSTOP)
        assert _until(lambda: [s["session_id"] for s in _stats(d)["sessions"]] == [b.session_id])
        assert b.ask("lookup 7 4") == ["0"]  # another namespace: b works on meanwhile
        os.kill(a.pid, signal.SIGCONT)
        ok, got = a.ask("wait")
        assert ok == "False" or got == want  # DONE only with the stored bytes
        assert a.ask("lookup 7 4") == ["4"]
        assert a.ask("load 7 16 4") == ["4", "True", want]
        assert int(a.ask("sid")[0]) != a.session_id
        assert int(b.ask("sid")[0]) == b.session_id
        assert len(_stats(d)["sessions"]) == 2
    finally:
        a.stop()
        b.stop()
    assert _until(lambda: not _stats(d)["sessions"] and _fds(d.pid) == fds0), (
        _stats(d)["sessions"],
        fds0,
        _fds(d.pid),
    )


@pytest.mark.timeout(90)
def test_daemon_paused_longer_than_lease_keeps_heartbeating_sessions(daemon_factory):
    """A session ends on a lease that expires *without heartbeats*
    (docs/protocol.md, Failure semantics). When kvtierd itself is stopped for longer than
    its lease while its engines keep sending heartbeats (every ``heartbeat_interval_s``,
    well inside the lease), those heartbeats wait in its socket; once it continues, no
    session must be expired for the time kvtierd itself did not run, and a LOAD whose
    engine is still waiting (well within ``load_timeout_s``) completes with the right bytes."""
    d = daemon_factory("--lease-s", "2", "--hicache-size", "512MiB")
    n = 192
    cfg = dict(request_timeout_s=0.5, load_timeout_s=30.0, heartbeat_interval_s=0.1)
    pool, conn = engine(d.runtime_dir, BIG, num_pages=2 * n, model="paused-daemon", **cfg)
    opool, other = engine(d.runtime_dir, BIG, num_pages=2, model="other", **cfg)
    try:
        sids = (conn.session_id, other.session_id)
        keys = conn.page_keys(tokens(n * BIG.page_size, salt=11))
        for p in range(0, n, 8):
            fill_page(pool, p, p + 1)
        assert conn.store(keys, list(range(n))).wait(30.0)
        results = []
        for _ in range(3):  # which of the lease loop and the reader runs first is a race
            for t in pool.k + pool.v:
                t[n : 2 * n] = 0
            h = _running_load(d, conn, pool, keys, n, n)
            try:
                time.sleep(5.0)  # kvtierd stopped for 2.5 leases; heartbeats keep coming
            finally:
                os.kill(d.pid, signal.SIGCONT)
            ok = h.wait()
            h.until_ended()
            same = all(page_bytes(pool, n + p) == page_bytes(pool, p) for p in range(0, n, 8))
            time.sleep(1.0)
            expired = int(_stats(d)["counters"]["sessions_expired"])
            results.append((ok and same, expired))
            if not ok or expired:
                break
        assert results[-1] == (True, 0), results
        assert conn.lookup(keys).l2 == n
        assert (conn.session_id, other.session_id) == sids
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        other.close()
        pool.close()
        opool.close()


@pytest.mark.timeout(90)
def test_wait_layer_gives_up_after_load_timeout_while_daemon_is_stopped(daemon_factory):
    """``wait_layer`` gives up after ``load_timeout_s`` (docs/protocol.md, Failure
    semantics; docs/configuration.md: "longest wait for one layer of a load before it
    fails"): an engine whose daemon is stopped in the middle of a LOAD gets its miss after
    about ``load_timeout_s``, recomputes, and (once the daemon continues and ends the copy:
    ``until_ended``) no late copy overwrites what it recomputed; the cancel (RELEASE) it
    sends never holds it for ``request_timeout_s`` more."""
    d = daemon_factory("--hicache-size", "512MiB")
    n = 192
    load_timeout, request_timeout = 0.5, 8.0
    pool, conn = engine(
        d.runtime_dir,
        BIG,
        num_pages=2 * n,
        model="stopped-daemon",
        request_timeout_s=request_timeout,
        load_timeout_s=load_timeout,
        heartbeat_interval_s=60.0,  # no heartbeat competes for the connection
    )
    try:
        keys = conn.page_keys(tokens(n * BIG.page_size, salt=12))
        for p in range(n):
            fill_page(pool, p, p + 1)
        assert conn.store(keys, list(range(n))).wait(30.0)
        h = _running_load(d, conn, pool, keys, n, n)
        try:
            t0 = time.monotonic()
            ok = h.wait_layer(BIG.num_layers - 1)
            waited = time.monotonic() - t0
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert not ok  # a miss
        h.until_ended()  # the daemon continued: the copy ends (cancelled) promptly
        for p in range(n, 2 * n):  # the engine recomputes into the pages
            fill_page(pool, p, 99)
        mine = page_bytes(pool, n)
        time.sleep(0.5)
        assert all(page_bytes(pool, p) == mine for p in range(n, 2 * n, 16))
        assert waited < load_timeout + request_timeout / 2, (
            f"wait_layer held the engine {waited:.1f}s with load_timeout_s = {load_timeout}"
        )
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_daemon_paused_right_after_a_disconnect_keeps_heartbeating_sessions(daemon_factory):
    """A peer's disconnect makes kvtierd check its engines' processes a moment later. When
    kvtierd is stopped in that moment for longer than its lease, the check that runs first
    once it continues must not end sessions whose heartbeats wait unread in its socket: a
    lease ends only after heartbeats stopped coming, never for the time kvtierd itself did
    not run (docs/protocol.md, Failure semantics)."""
    d = daemon_factory("--lease-s", "1")
    cfg = dict(request_timeout_s=0.5, heartbeat_interval_s=0.1)
    pool, conn = engine(d.runtime_dir, **cfg)
    try:
        sid = conn.session_id
        for delay in (0.0, 0.002, 0.004, 0.006):
            admin = AdminClient(d.endpoint, timeout_s=10.0)
            admin.health()
            admin.close()  # a peer disconnects: the daemon checks engines soon after
            time.sleep(delay)
            os.kill(d.pid, signal.SIGSTOP)
            try:
                time.sleep(2.5)  # 2.5 leases; the engine's heartbeats keep coming
            finally:
                os.kill(d.pid, signal.SIGCONT)
            time.sleep(0.5)
            assert int(_stats(d)["counters"]["sessions_expired"]) == 0, delay
        assert conn.session_id == sid
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()
