"""SIGHUP reload (``systemctl reload kvtier``), setting by setting, against a real kvtierd.

docs/configuration.md: a reload re-reads the sources; when every changed field is *live* it
applies them all and logs ``reload: applied <fields>``; when any changed field is not, it
refuses the whole reload with one log line naming those fields; a source that no longer loads
is refused the same way; a configuration is never half applied. The daemon never dies and
never stops serving because of a SIGHUP.

Every daemon here is started with ``--config FILE`` (no config flags, so the file is what a
reload re-reads) and is stopped, its pool removed, at the end of its test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import engine, tokens

BASE: dict[str, object] = {
    "hicache_size": "64MiB",
    "extent_size": "4MiB",
    "hicache_storage_backend": "none",
    "lease_s": 5.0,
    "log_level": "info",
}


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_cfg(path: Path, **fields: object) -> None:
    """Write ``BASE`` updated with ``fields`` (a value None drops the key) as TOML."""
    merged = {**BASE, **fields}
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in merged.items() if v is not None))


def log_text(d: DaemonProcess) -> str:
    return d.log_path.read_text(errors="replace")


def wait_log(d: DaemonProcess, text: str, start: int = 0, timeout: float = 30.0) -> int:
    """Wait until the daemon's log holds ``text`` after offset ``start``; return its end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = log_text(d).find(text, start)
        if at >= 0:
            return at + len(text)
        if d.proc is not None and d.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged after offset {start}; tail:\n{d.log_tail(60)}")


def hup(d: DaemonProcess) -> int:
    """Send SIGHUP; return the log's length before it."""
    mark = len(log_text(d))
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    return mark


def reload_and_wait(d: DaemonProcess, cfg: Path, expect: str, **fields: object) -> int:
    """Rewrite the file with ``fields``, SIGHUP, wait for ``expect``; return its log end."""
    write_cfg(cfg, **fields)
    return wait_log(d, expect, start=hup(d))


def stats(d: DaemonProcess) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.stats()


def health(d: DaemonProcess, timeout_s: float = 5.0) -> str:
    with AdminClient(d.endpoint, timeout_s=timeout_s) as admin:
        return admin.health().status


@pytest.fixture
def started(short_tmp: Path) -> Iterator:
    """``started(name="d", **fields)`` → (daemon, config path), kvtierd run with --config."""
    made: list[DaemonProcess] = []

    def make(name: str = "d", start: bool = True, **fields: object):
        cfg = short_tmp / f"{name}.toml"
        write_cfg(cfg, **fields)
        d = DaemonProcess(short_tmp / name, ["--config", str(cfg)])
        made.append(d)
        if start:
            d.start()
        return d, cfg

    yield make
    for d in made:
        if d.proc is not None:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
            d.stop()
        d.remove_pool()


def _ignores_sighup(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGHUP now (``SigIgn`` of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    except OSError:
        pass
    return False


def spawn(d: DaemonProcess, cfg: Path) -> subprocess.Popen:
    """Start kvtierd as :meth:`DaemonProcess.start` does, without waiting for it."""
    d.runtime_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "STATE_DIRECTORY": str(d.state_dir),
        "KVTIER_RUNTIME_DIR": str(d.runtime_dir),
    }
    env.pop("NOTIFY_SOCKET", None)
    d._log = open(d.log_path, "ab")  # noqa: SIM115  (closed by d.stop())
    d.proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.daemon", "--config", str(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=d._log,
        stderr=d._log,
        env=env,
    )
    return d.proc


def wait_health(d: DaemonProcess, want: tuple[str, ...], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.proc is not None
        if d.proc.poll() is not None:
            raise AssertionError(
                f"kvtierd exited with {d.proc.returncode} (log tail:\n{d.log_tail(30)})"
            )
        if d.socket.exists():
            try:
                st = health(d, timeout_s=0.5)
            except Exception:
                st = ""
            if st in want:
                return st
        time.sleep(0.02)
    raise AssertionError(f"no HEALTH in {want}; log tail:\n{d.log_tail(30)}")


# ------------------------------------------------------------------ SIGHUP at start and stop
@pytest.mark.timeout(90)
def test_sighup_early_in_start_up_does_not_kill_kvtierd(started):
    """A SIGHUP (``kill -HUP``, logrotate, ``systemctl kill -s HUP``) that arrives while
    kvtierd is starting never kills it (the signal's default action): kvtierd goes on to
    serve."""
    d, cfg = started(start=False)
    p = spawn(d, cfg)
    # as soon as kvtierd's own code runs (before its configuration, service and event loop
    # are up): a signal in the interpreter's own start-up comes before any code can see it
    deadline = time.monotonic() + 10
    while not _ignores_sighup(p.pid) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _ignores_sighup(p.pid), "kvtierd never ignores SIGHUP while it starts"
    p.send_signal(signal.SIGHUP)
    try:
        p.wait(3.0)
    except subprocess.TimeoutExpired:
        pass
    assert p.poll() is None, (
        f"kvtierd died of a SIGHUP sent during its start-up: exit status {p.returncode} "
        f"(log: {log_text(d)[-600:]!r})"
    )
    assert wait_health(d, ("ok",)) == "ok"


@pytest.mark.timeout(90)
def test_sighup_during_shutdown_keeps_the_clean_exit(started):
    """SIGTERM stops kvtierd gracefully with exit status 0, whatever SIGHUPs arrive
    meanwhile ('reload ignored: stopping'), even after the event loop has closed (its
    signal handlers removed)."""
    d, _cfg = started()
    p = d.proc
    assert p is not None
    p.send_signal(signal.SIGTERM)
    sent = 0
    while p.poll() is None and sent < 20000:
        try:
            p.send_signal(signal.SIGHUP)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.001)
    rc = p.wait(30)
    assert "reload ignored: stopping" in log_text(d)
    assert rc == 0, (
        f"kvtierd's graceful stop ended with status {rc} after {sent} SIGHUPs "
        f"(-1: killed by SIGHUP); log tail:\n{d.log_tail(8)}"
    )


@pytest.mark.timeout(120)
def test_sighup_while_the_service_is_being_built_is_not_lost(started):
    """A configuration changed and announced with SIGHUP while kvtierd is still starting
    (HEALTH says 'starting': the pool is being mapped and pre-faulted) is in force once it
    serves: the file changed after the start read it (here log_level becomes debug)."""
    d, cfg = started(start=False, hicache_size="768MiB")
    spawn(d, cfg)
    wait_health(d, ("starting",))
    write_cfg(cfg, hicache_size="768MiB", log_level="debug")
    mark = hup(d)
    wait_health(d, ("ok",), timeout=100.0)
    assert (
        "reload: still starting" in log_text(d)[mark:] or "reload: applied" in log_text(d)[mark:]
    ), d.log_tail(20)
    # a request kvtierd refuses and logs at debug level only
    before = len(log_text(d))
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        rep = admin.call(P.Heartbeat(req_id=0, session_id=424242))
    assert isinstance(rep, P.ErrorReply)
    # an info line after it (FLUSH is logged at info): once it is there, so is a debug line
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        admin.call(P.Flush(req_id=0, tier="l2"))
    wait_log(d, "flush tier=l2", start=before)
    assert "UNKNOWN_SESSION" in log_text(d)[before:], (
        "log_level = debug from the file (announced with SIGHUP during the start) is not in "
        f"force; log since the SIGHUP:\n{log_text(d)[mark:][-1500:]}"
    )


# ------------------------------------------------------------------ live fields
LIVE_CHANGES: dict[str, object] = {
    "max_keys_per_request": 2,
    "max_message_bytes": 4096,
    "max_sessions_per_user": 7,
    "max_handover_connections_per_user": 9,
    "max_handover_connections": 99,
    "max_handovers_waiting_per_user": 11,
    "max_handovers_waiting": 111,
    "max_handover_descriptors_per_user": 1000,
    "max_mapped_bytes_per_user": "3GiB",
    "max_mapped_bytes": "5GiB",
    "max_mapped_segments_per_user": 77,
    "shutdown_timeout_s": 3.0,
    "tp_group_timeout_s": 0.5,
    "hicache_write_policy": "write_back",
    "hicache_storage_prefetch_policy": "best_effort",
    "prefetch_threshold": 32,
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.2,
    "prefetch_timeout_max": 9.0,
    "prefetch_concurrency": 2,
    "write_back_queue": 5,
    "storage_timeout_s": 0.25,
    "log_level": "debug",
}


def big_lookup_error(d: DaemonProcess) -> str:
    """The refusal of a 6,400-byte LOOKUP frame of no session (message size is checked
    before the session)."""
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        rep = admin.call(P.Lookup(req_id=0, session_id=1, packed_keys=b"\x01" * 32 * 200))
    assert isinstance(rep, P.ErrorReply), rep
    return rep.message


@pytest.mark.timeout(120)
def test_live_fields_apply_together_and_a_fixed_one_refuses_the_whole_reload(started):
    """Every field the table marks live, changed at once, is applied (``reload:
    applied`` names them; STATS shows the per-user bounds; LOOKUP and the frame size are
    checked against the new values), the engine's session and its pages survive; a later
    reload that carries a fixed field (copy_threads, eviction_policy, tenants, admin_token)
    beside a live one is refused with one line naming the fixed ones, and the live one is
    not applied either."""
    d, cfg = started()
    pool, conn = engine(d.runtime_dir, num_pages=8)
    try:
        keys = conn.page_keys(tokens(4 * 16, salt=3))
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        assert conn.lookup(keys).l2 == 4
        sid = stats(d)["sessions"][0]["session_id"]
        assert "max_message_bytes" not in big_lookup_error(d)

        end = reload_and_wait(d, cfg, "reload: applied", **LIVE_CHANGES)
        line = log_text(d)[end:].splitlines()[0]
        assert sorted(line.strip().split(", ")) == sorted(LIVE_CHANGES), line
        bounds = stats(d)["limits"]["bounds"]
        for k in (
            "max_sessions_per_user",
            "max_handover_connections_per_user",
            "max_handover_connections",
            "max_handovers_waiting_per_user",
            "max_handovers_waiting",
            "max_handover_descriptors_per_user",
            "max_mapped_segments_per_user",
        ):
            assert bounds[k] == LIVE_CHANGES[k], (k, bounds)
        assert bounds["max_mapped_bytes_per_user"] == 3 << 30
        assert bounds["max_mapped_bytes"] == 5 << 30
        assert "max_message_bytes" in big_lookup_error(d)
        assert conn.lookup(keys).l2 == 0  # 4 keys > max_keys_per_request = 2: refused
        assert conn.lookup(keys[:2]).l2 == 2  # the pages survived
        assert [s["session_id"] for s in stats(d)["sessions"]] == [sid]

        for fixed, value in (
            ("copy_threads", 3),
            ("eviction_policy", "lru"),
            ("tenants", {"a": {"token": "t" * 16}}),
            ("admin_token", "secret-admin-token"),
            ("max_sessions", 17),
            ("prefault_threads", 2),
        ):
            fields = {**LIVE_CHANGES, "max_keys_per_request": 64, fixed: value}
            end = reload_and_wait(d, cfg, "cannot change while running", **fields)
            assert fixed in log_text(d)[:end].splitlines()[-1]
            assert conn.lookup(keys).l2 == 0, f"max_keys_per_request applied with {fixed}"
        assert health(d) == "ok"
        assert [s["session_id"] for s in stats(d)["sessions"]] == [sid]
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_a_raised_lease_s_holds_for_the_sessions_already_registered(started):
    """``lease_s`` is live ("session lease; heartbeats renew it"): after a reload that
    raises it (an operator gives engines that pause longer a longer lease), the next
    renewal of every session, those registered before included, gives it the new lease."""
    d, cfg = started(lease_s=3.0)
    pool, conn = engine(d.runtime_dir, num_pages=8, heartbeat_interval_s=3600.0)
    try:
        keys = conn.page_keys(tokens(2 * 16, salt=5))
        conn.lookup(keys)
        sid = stats(d)["sessions"][0]["session_id"]
        reload_and_wait(d, cfg, "reload: applied lease_s", lease_s=300.0)
        conn.lookup(keys)  # renews the lease: from now on 300 s
        deadline = time.monotonic() + 4 * 3.0  # four of the old leases
        while time.monotonic() < deadline:
            ids = [s["session_id"] for s in stats(d)["sessions"]]
            assert ids == [sid], (
                f"session {sid} was reaped with the old 3 s lease although lease_s = 300 was "
                f"applied before its last renewal; log tail:\n{d.log_tail(6)}"
            )
            time.sleep(0.25)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_an_applied_reload_is_logged_at_log_level_warning(started):
    """(docs/configuration.md) A reload whose changes are all live 'applies them all and
    logs ``reload: applied <fields>``' -- the operator's only confirmation that ``systemctl
    reload`` did something: logged with ``log_level = "warning"`` too."""
    d, cfg = started(log_level="warning")
    mark = len(log_text(d))
    write_cfg(cfg, log_level="warning", max_message_bytes=4096)
    hup(d)
    deadline = time.monotonic() + 30
    while "max_message_bytes" not in big_lookup_error(d):  # applied: 4 KiB in force
        assert time.monotonic() < deadline, d.log_tail(10)
        time.sleep(0.05)
    # an ERROR line after it: logged in order, so anything the reload logged is there
    cfg.write_text("lease_s = \n")
    d.proc.send_signal(signal.SIGHUP)
    wait_log(d, "reload rejected", start=mark)
    assert "reload: applied" in log_text(d)[mark:], (
        "no 'reload: applied max_message_bytes' line at log_level warning, though it is in "
        "force; log since:\n" + log_text(d)[mark:]
    )


# ------------------------------------------------------------------ sources that do not load
@pytest.mark.timeout(90)
def test_a_size_too_large_to_represent_is_refused_in_one_line_naming_the_key(started):
    """'An unknown key or a bad value' is refused with one log line naming the key, its
    source and the value, and nothing changes: a size whose digits overflow a float
    (``max_message_bytes = "9999…9"``) included, never a traceback."""
    d, cfg = started()
    write_cfg(cfg, max_message_bytes="9" * 400)
    mark = hup(d)
    end = wait_log(d, "reload rejected", start=mark)
    time.sleep(0.5)  # the rest of what the reload logged
    lines = [ln for ln in log_text(d)[mark:].splitlines() if ln.strip()]
    assert health(d) == "ok"
    assert "max_message_bytes" not in big_lookup_error(d)  # 16 MiB still in force
    assert end > 0
    assert len(lines) == 1 and "max_message_bytes" in lines[0], (
        "refusal is not one line naming the key:\n" + "\n".join(lines[:12])
    )


@pytest.mark.timeout(90)
def test_a_changed_extra_config_file_is_not_reported_as_no_change(started, short_tmp):
    """``hicache_storage_backend_extra_config`` is not live, and it may be ``@path`` to a
    file: a reload after that file changed (here the file store's ``capacity``) is refused
    with the line naming the field ('restart kvtierd to apply'), never 'applied no
    changes' while the backend runs with the old settings."""
    extra = short_tmp / "l3.json"
    extra.write_text(json.dumps({"path": str(short_tmp / "l3"), "capacity": "256MiB"}))
    fields = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": f"@{extra}",
    }
    d, _cfg = started(**fields)
    extra.write_text(json.dumps({"path": str(short_tmp / "l3"), "capacity": "512MiB"}))
    mark = hup(d)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tail = log_text(d)[mark:]
        if "reload: applied" in tail or "cannot change while running" in tail:
            break
        time.sleep(0.05)
    tail = log_text(d)[mark:]
    assert "hicache_storage_backend_extra_config cannot change" in tail, (
        "a changed backend settings file was not refused as a restart-only change:\n" + tail
    )


@pytest.mark.timeout(90)
def test_a_config_path_that_blocks_does_not_stop_kvtierd_serving(started):
    """'The daemon never stops serving' over a reload: a config path that blocks on open
    (here a FIFO with no writer; likewise a hung NFS mount) never holds the event loop
    (engines' requests, HEALTH), and the reload is refused with one line."""
    d, cfg = started()
    good = cfg.read_text()
    cfg.unlink()
    os.mkfifo(cfg)
    hup(d)
    try:
        time.sleep(0.5)
        try:
            status = health(d, timeout_s=3.0)
        except Exception as err:
            status = f"no answer: {err}"
        assert status == "ok", f"kvtierd stopped answering during a reload: {status}"
    finally:  # unblock the daemon: be the writer its open() waits for

        def feed() -> None:
            with open(cfg, "w") as fh:
                fh.write(good)

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        t.join(10)


@pytest.mark.timeout(90)
def test_a_burst_of_sighups_keeps_serving_and_applies_the_file(started):
    """200 SIGHUPs in a burst (signals coalesce) leave kvtierd serving, the engine's
    session and pages in place, and the file's live change in force."""
    d, cfg = started()
    pool, conn = engine(d.runtime_dir, num_pages=8)
    try:
        keys = conn.page_keys(tokens(2 * 16, salt=9))
        assert conn.store(keys, [0, 1]).wait()
        sid = stats(d)["sessions"][0]["session_id"]
        write_cfg(cfg, max_message_bytes=4096)
        mark = len(log_text(d))
        for _ in range(200):
            d.proc.send_signal(signal.SIGHUP)
        wait_log(d, "reload: applied max_message_bytes", start=mark)
        assert health(d) == "ok"
        assert "max_message_bytes" in big_lookup_error(d)
        assert conn.lookup(keys).l2 == 2
        assert [s["session_id"] for s in stats(d)["sessions"]] == [sid]
        assert d.proc.poll() is None
    finally:
        conn.close()
        pool.close()
