"""The engine-side client as real engines use it: several threads, fork, close at odd moments.

vLLM and SGLang call the connector from scheduler and worker threads, fork worker processes
and shut down abruptly. These tests use a real kvtierd (the ``daemon`` fixtures) and the real
:class:`~kvtier.client.connection.connection.Connection`:

- a forked child that inherits a registered Connection: using it (lookup, close) must fail
  or answer within ``request_timeout_s`` ("lookups report 0 ... when the daemon is gone or
  late past request_timeout_s", connection.py's module docstring), never spin forever, and
  never end the parent's session; merely exiting must leave the parent's session alone;
- ``close()`` while another thread waits for a reply (a CLAIM) or for a transfer: the waiter
  is told promptly, and ``close()`` itself does not wait for that waiter's timeout;
- a closed connection whose daemon died: its calls still report a miss ("Failure is never
  fatal for the engine"), they do not raise ZeroMQ errors into the engine;
- a connection dropped without ``close()`` is collected (its finalizer says "was not
  closed"), so its heartbeats stop and the daemon ends its session;
- the interpreter exits silently with an open connection; several threads sharing one
  connection each get their own pages back.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.replies import LookupReply
from kvtier.ipc import protocol as P

from tests.engines import engine, fill_page, page_bytes, tokens

REPO = str(Path(__file__).resolve().parents[2])
"""The repository's root (``import tests`` from there)."""

BIG = P.Geometry(num_layers=16, page_size=16, kv_heads=8, head_dim=128, dtype="float16")
"""1 MiB pages: a 32-page LOAD runs long enough to be caught in the middle by SIGSTOP."""


def sessions(d) -> list[dict]:
    """The daemon's open sessions (STATS)."""
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return list(admin.stats()["sessions"])


def wait_child(pid: int, limit_s: float) -> int | None:
    """The exit status of forked child ``pid`` once it exits within ``limit_s``; else kill it
    (SIGKILL, reaped) and return None."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def fork_and_run(conn, action, limit_s: float) -> tuple[int | None, str]:
    """Fork; the child runs ``action(conn)`` and writes its result to a pipe, then leaves
    with ``os._exit`` (never back into pytest). Returns (exit status or None if it had to be
    killed, what the child wrote)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            out = repr(action(conn))
            os.write(w, out.encode())
            code = 0
        except BaseException as err:
            try:
                os.write(w, f"raised {err!r}".encode())
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(w)
    status = wait_child(pid, limit_s)
    os.set_blocking(r, False)
    try:
        got = os.read(r, 65536).decode(errors="replace")
    except BlockingIOError:
        got = ""
    os.close(r)
    return status, got


# ---------------------------------------------------------------------------- fork


@pytest.mark.timeout(120)
def test_forked_child_lookup_returns_within_request_timeout(daemon) -> None:
    """A worker forked after the engine registered inherits the Connection. A lookup there
    must come back (an answer, or a miss) within about ``request_timeout_s``, as every
    lookup does when the daemon cannot be reached; the parent's session stays as it was."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0)
    try:
        keys = conn.page_keys(tokens(64))
        assert conn.store(keys[:2], [0, 1]).wait()
        sid = conn.session_id
        limit = 15 * conn.config.request_timeout_s
        status, got = fork_and_run(conn, lambda c: c.lookup(keys), limit)
        assert status is not None, (
            f"the forked child's lookup on the inherited connection did not return within "
            f"{limit:.0f}s (request_timeout_s = {conn.config.request_timeout_s}s); child "
            f"wrote {got!r}"
        )
        assert status == 0 and got.startswith("LookupReply"), (status, got)
        # the parent is unaffected
        assert conn.lookup(keys).l2 == 2
        assert conn.session_id == sid
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_forked_child_close_returns_and_leaves_parent_session(daemon) -> None:
    """A forked worker that closes its inherited copy of the Connection (an engine's
    shutdown path runs in every process) must return promptly and must not end the parent's
    session: the session is the parent's, registered under the parent's pid."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0)
    try:
        keys = conn.page_keys(tokens(64, salt=1))
        assert conn.store(keys[:2], [0, 1]).wait()
        sid = conn.session_id
        limit = 15 * conn.config.request_timeout_s
        status, got = fork_and_run(conn, lambda c: c.close(), limit)
        assert status is not None, (
            f"close() of the inherited connection in a forked child did not return within "
            f"{limit:.0f}s; child wrote {got!r}"
        )
        assert status == 0, (status, got)
        assert conn.lookup(keys).l2 == 2
        assert conn.session_id == sid, "the parent had to register again"
        assert [s["pid"] for s in sessions(daemon)] == [os.getpid()]
    finally:
        conn.close()
        pool.close()


FORK_EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from tests.engines import engine, tokens
    pool, conn = engine(Path(sys.argv[1]), request_timeout_s=1.0, heartbeat_interval_s=0.05)
    keys = conn.page_keys(tokens(64, salt=2))
    assert conn.store(keys[:2], [0, 1]).wait()
    sid = conn.session_id
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a worker that exits normally: atexit, finalizers, GC of what it inherited
    _, status = os.waitpid(pid, 0)
    h = conn.load(keys[:2], [2, 3])
    print("RESULT", status, conn.session_id == sid, conn.lookup(keys).l2, h.count, h.wait())
    conn.close()
    pool.close()
    """
)


@pytest.mark.timeout(120)
def test_forked_child_exit_leaves_parent_session(daemon) -> None:
    """A forked worker that merely exits through the normal
    interpreter exit (finalizers of the inherited Connection and pool included) neither
    ends the parent's session nor unmaps or closes the parent's memory: the parent keeps its
    session and loads its pages afterwards."""
    p = subprocess.run(
        [sys.executable, "-c", FORK_EXIT_SCRIPT, str(daemon.runtime_dir)],
        capture_output=True,
        timeout=90,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    out = p.stdout.decode()
    assert p.returncode == 0, (out, p.stderr.decode()[-2000:])
    assert "RESULT 0 True 2 2 True" in out, (out, p.stderr.decode()[-2000:])


# ---------------------------------------------------------------------------- close


@pytest.mark.timeout(120)
def test_close_wakes_a_thread_waiting_for_a_claim_reply(daemon) -> None:
    """An engine shutting down calls close() while its scheduler thread waits in claim()
    for a daemon that has stopped answering (stalled: SIGSTOP). close() must return
    promptly (Unregister is best effort) and the claim must end at once as a miss, not
    each wait out ``claim_timeout_s``."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0, claim_timeout_s=60.0)
    stopped = False
    try:
        keys = conn.page_keys(tokens(64, salt=3))
        assert conn.store(keys[:2], [0, 1]).wait()
        result: dict[str, int] = {}
        claimer = threading.Thread(target=lambda: result.update(l2=conn.claim(keys)))
        os.kill(daemon.pid, signal.SIGSTOP)
        stopped = True
        claimer.start()
        time.sleep(0.3)  # the claim is waiting for its reply
        closer = threading.Thread(target=conn.close)
        closer.start()
        bound = conn.config.claim_timeout_s / 4
        closer.join(bound)
        claimer.join(bound)
        assert not closer.is_alive(), (
            f"close() still blocked after {bound:.0f}s, a quarter of claim_timeout_s "
            f"({conn.config.claim_timeout_s}s), by a claim waiting in another thread"
        )
        assert not claimer.is_alive(), "the claim was not woken by close()"
        assert result == {"l2": 0}
    finally:
        if stopped:
            os.kill(daemon.pid, signal.SIGCONT)
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_close_wakes_a_thread_waiting_for_a_transfer(daemon_factory) -> None:
    """A forward-pass thread waits on a LOAD (``handle.wait()``) while the daemon stalls
    in the middle of the copy (SIGSTOP), and the engine shuts down: close() unregisters and
    unmaps the completion block. The waiting thread must then be told promptly that the
    transfer failed (False), not keep watching the closed connection's slot for the whole
    ``load_timeout_s``."""
    d = daemon_factory("--hicache-size", "160MiB")
    pool, conn = engine(
        d.runtime_dir, geometry=BIG, num_pages=64, request_timeout_s=1.0, load_timeout_s=60.0
    )
    stopped = False
    try:
        keys = conn.page_keys(tokens(16 * 32, salt=4))
        assert conn.store(keys, list(range(32))).wait()
        caught = None
        for _ in range(30):  # SIGSTOP the daemon right after a LOAD of 32 MiB starts
            h = conn.load(keys, list(range(32, 64)))
            assert h.count == 32
            os.kill(d.pid, signal.SIGSTOP)
            stopped = True
            if h.copying():
                caught = h
                break
            os.kill(d.pid, signal.SIGCONT)
            stopped = False
            assert h.wait()
        assert caught is not None, "never caught a LOAD in the middle of its copy"
        result: dict[str, bool] = {}
        waiter = threading.Thread(target=lambda: result.update(ok=caught.wait()))
        waiter.start()
        time.sleep(0.3)
        conn.close()
        bound = conn.config.load_timeout_s / 4
        waiter.join(bound)
        assert not waiter.is_alive(), (
            f"the transfer's waiter still blocked {bound:.0f}s after close(), a quarter of "
            f"load_timeout_s ({conn.config.load_timeout_s}s)"
        )
        assert result == {"ok": False}
    finally:
        if stopped:
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_closed_connection_reports_a_miss_after_its_daemon_died(daemon) -> None:
    """Once closed, a connection's lookup and store report a miss / a dropped store
    (``LookupReply(0, 0)``, ``count == 0``) whatever happened to the daemon: an engine's
    scheduler thread may still call it while another thread shuts down, and "failure is
    never fatal for the engine"."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0)
    try:
        keys = conn.page_keys(tokens(64, salt=5))
        conn.close()
        daemon.kill()  # the daemon crashes (its socket file stays behind)
        assert conn.lookup(keys) == LookupReply(0, 0)
        h = conn.store(keys[:2], [0, 1])
        assert h.count == 0
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- lifetime


@pytest.mark.timeout(120)
def test_dropped_connection_is_collected_and_its_session_ends(daemon) -> None:
    """An engine that drops a Connection without close() (a failed start, a reconnect that
    makes a new one) must not leak it for the life of the process: the Connection's own
    finalizer ("kvtier Connection ... was not closed") closes its socket when it is
    collected, heartbeats stop, and the daemon ends the session after its lease (5 s here),
    releasing the engine memory it holds mapped."""
    pool, conn = engine(daemon.runtime_dir, heartbeat_interval_s=0.2)
    ref = weakref.ref(conn)
    assert len(sessions(daemon)) == 1
    try:
        with warnings.catch_warnings():  # the finalizer's "was not closed" warning
            warnings.simplefilter("ignore", ResourceWarning)
            del conn
            gc.collect()
        end = time.monotonic() + 30.0
        while sessions(daemon) and time.monotonic() < end:
            time.sleep(0.25)
        assert sessions(daemon) == [], (
            f"the dropped connection's session is still open "
            f"(collected: {ref() is None}; threads: "
            f"{[t.name for t in threading.enumerate()]})"
        )
    finally:
        leaked = ref()
        if leaked is not None:
            leaked.close()
        pool.close()


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.engines import engine, tokens
    pool, conn = engine(Path(sys.argv[1]), heartbeat_interval_s=0.0005)
    keys = conn.page_keys(tokens(64))
    conn.lookup(keys)
    h = conn.store(keys[:2], [0, 1])
    time.sleep(0.05)
    print("EXITING", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_interpreter_exit_with_open_connection_is_silent(daemon) -> None:
    """A process that exits with an open connection whose heartbeat
    thread is busy (a heartbeat every 0.5 ms) exits at once, with status 0 and nothing on
    stderr: the heartbeat thread keeps nothing alive and no traceback is printed."""
    for _ in range(3):
        p = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, str(daemon.runtime_dir)],
            capture_output=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert p.returncode == 0, p.stderr.decode()[-2000:]
        assert b"EXITING" in p.stdout
        assert p.stderr.decode().strip() == ""


@pytest.mark.timeout(120)
def test_threads_sharing_a_connection_get_their_own_pages(daemon) -> None:
    """Four threads share one Connection, each storing its own pages
    and loading them back into other pages, many times: every load returns that thread's
    bytes (no reply or completion slot goes to another thread's transfer)."""
    pool, conn = engine(daemon.runtime_dir, num_pages=64)
    errors: list[str] = []

    def worker(t: int) -> None:
        base = 16 * t
        for rnd in range(15):
            keys = conn.page_keys(tokens(64, salt=1000 + 100 * t + rnd))[:4]
            src = list(range(base, base + 4))
            dst = list(range(base + 8, base + 12))
            for i, page in enumerate(src):
                fill_page(pool, page, seed=10_000 * t + 10 * rnd + i)
            if not conn.store(keys, src).wait():
                errors.append(f"thread {t} round {rnd}: store failed")
                continue
            h = conn.load(keys, dst)
            if h.count != 4 or not h.wait():
                errors.append(f"thread {t} round {rnd}: load {h.count}")
                continue
            for s, dd in zip(src, dst, strict=True):
                if page_bytes(pool, s) != page_bytes(pool, dd):
                    errors.append(f"thread {t} round {rnd}: page {dd} differs from {s}")

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_a_forked_childs_load_is_a_miss_while_a_parent_thread_held_the_lock(daemon) -> None:
    """A worker forked while another thread of the parent held the connection's lock (a
    heartbeat, a request to a slow daemon) inherits that lock held for good: its LOAD and
    STORE are a miss at once instead of waiting on it forever."""
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0)
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with conn._lock:
            held.set()
            let_go.wait(30)

    holder = threading.Thread(target=hold)
    try:
        keys = conn.page_keys(tokens(64))
        assert conn.store(keys[:2], [0, 1]).wait()
        holder.start()
        assert held.wait(10)
        status, got = fork_and_run(
            conn, lambda c: (c.load(keys[:2], [2, 3]).count, c.store(keys[:2], [2, 3]).count), 15
        )
        let_go.set()
        assert status == 0 and got == "(0, 0)", (status, got)
        assert conn.load(keys[:2], [2, 3]).wait()  # the parent's session is untouched
    finally:
        let_go.set()
        if holder.is_alive():
            holder.join()
        conn.close()
        pool.close()
