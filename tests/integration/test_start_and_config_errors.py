"""Configuration sources, reload and start failures of the real kvtierd.

Each test runs the real ``kvtierd`` (``daemon_factory`` or a subprocess): a bad value or an
unreadable config file stops the program with a message naming the field or file (never a
traceback, never a token), a reload that cannot be applied is refused with one log line and
systemd still hears READY=1, a socket that cannot be bound ends the start at once naming
its setting, and a pool that its directory has no room for is refused at start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from kvtier.config.loader import pool_path

from tests.servers import run_kvtierd

pytestmark = pytest.mark.timeout(180)

BASE = ["--hicache-storage-backend", "none", "--hicache-size", "64MiB", "--extent-size", "4MiB"]


def kvtierd(rdir: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvtierd`` with this module's :data:`BASE` flags to its end (it is expected to
    refuse to start)."""
    return run_kvtierd(rdir, *BASE, *args, timeout=timeout)


def wait_log(d, needle: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = d.log_path.read_text(errors="replace")
        if needle in text:
            return text
        time.sleep(0.1)
    return text


# ---------------------------------------------------------------- configuration sources


def test_config_path_that_is_a_directory_is_a_clear_error(short_tmp):
    cfgdir = short_tmp / "conf.d"
    cfgdir.mkdir()
    r = kvtierd(short_tmp / "rt", "--config", str(cfgdir))
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert r.returncode == 2 and str(cfgdir) in r.stderr, r.stderr[-600:]


def test_config_file_that_is_not_utf8_is_a_clear_error(short_tmp):
    cfg = short_tmp / "kvtierd.toml"
    cfg.write_bytes(b'log_level = "info"\nhicache_size = "\xff\xfe"\n')
    r = kvtierd(short_tmp / "rt", "--config", str(cfg))
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert r.returncode == 2 and str(cfg) in r.stderr, r.stderr[-600:]


@pytest.mark.parametrize(
    "secret_flags",
    [
        ("--admin-token", "S3CRET-ADMIN-TOKEN"),
        ("--tenants", '{"a": {"token": "S3CRET-TENANT-TOKEN"}}'),
    ],
    ids=["admin_token", "tenant_token"],
)
def test_a_config_error_never_prints_a_token(short_tmp, secret_flags):
    """A check across fields (extent_size > hicache_size) names the fields and their values,
    never the tokens set beside them (stderr goes to the journal)."""
    r = kvtierd(short_tmp / "rt", *secret_flags, "--hicache-size", "1MiB", "--extent-size", "4MiB")
    assert r.returncode == 2, r.stderr[-600:]
    assert "S3CRET" not in r.stderr, r.stderr[-600:]


def test_extent_size_error_names_the_setting(short_tmp):
    r = kvtierd(short_tmp / "rt", "--extent-size", "5000")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-600:]
    assert "extent_size" in r.stderr, r.stderr[-600:]


# ---------------------------------------------------------------- reload (SIGHUP)


def test_reload_of_an_undecodable_config_file_is_refused_with_a_log_line(daemon_factory, short_tmp):
    """SIGHUP re-reads the file; a file that became unreadable (not UTF-8) is refused like
    invalid TOML ('reload rejected, configuration unchanged'), and systemd gets READY=1
    after RELOADING=1 (else `systemctl reload` would hang until its timeout)."""
    cfg = short_tmp / "kvtierd.toml"
    cfg.write_text('log_level = "info"\nlease_s = 5\n')
    notify_path = short_tmp / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.2)
    try:
        d = daemon_factory("--config", str(cfg), env={"NOTIFY_SOCKET": str(notify_path)})
        got: list[str] = []

        def drain(until: float) -> None:
            while time.monotonic() < until:
                try:
                    got.append(notify.recv(4096).decode())
                except TimeoutError:
                    if got and any("READY=1" in m for m in got[-1:]):
                        return

        drain(time.monotonic() + 1.0)
        got.clear()
        cfg.write_bytes(b'log_level = "info"\nlease_s = "\xff"\n')
        os.kill(d.pid, signal.SIGHUP)
        log = wait_log(d, "reload rejected", timeout=10.0)
        drain(time.monotonic() + 2.0)
        assert "reload rejected" in log and "Traceback" not in log, log[-1500:]
        assert any("RELOADING=1" in m for m in got), got
        after = "".join(got).split("RELOADING=1", 1)[-1]
        assert "READY=1" in after, got
    finally:
        notify.close()


# ---------------------------------------------------------------- failed starts


def failed_start(rdir: Path, *args: str) -> str:
    """Run ``kvtierd`` expecting it to refuse to start, at once: its output (no traceback)."""
    try:
        r = kvtierd(rdir, *args, timeout=20)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(
            errors="replace"
        )
        pytest.fail(f"kvtierd still running 20 s after its start failed:\n{out[-1500:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-1500:]
    assert "Traceback" not in out, out[-1500:]
    return out


def test_kv_events_endpoint_that_cannot_be_bound_stops_the_start_promptly(short_tmp):
    """A bind failure of the events socket ends the start at once with an error naming
    kv_events_endpoint (no socket is left open to keep the daemon's ZeroMQ context alive)."""
    rt = short_tmp / "rt"
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the port is taken
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        out = failed_start(rt, "--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
        assert "kv_events_endpoint" in out, out[-1500:]
    finally:
        busy.close()
        pool_path(Path("/dev/shm"), rt).unlink(missing_ok=True)


def test_runtime_dir_too_long_for_a_socket_path_is_a_clear_error(short_tmp):
    """ipc:// socket paths are limited to about 107 bytes: a longer runtime_dir makes the
    control socket's bind fail, and kvtierd exits at once naming runtime_dir."""
    rt = short_tmp / ("r" * 110)
    out = failed_start(rt)
    assert "runtime_dir" in out, out[-1500:]


@pytest.mark.parametrize("kind", ["world_writable", "symlink"])
def test_a_runtime_dir_kvtierd_must_not_use_stops_the_start_with_status_2(short_tmp, kind):
    """A runtime directory that every user may write, or a symlink, is a setting to change:
    kvtierd exits 2 naming it, which the unit's RestartPreventExitStatus=2 does not retry
    (a restart cannot fix it)."""
    real = short_tmp / "real"
    real.mkdir()
    if kind == "world_writable":
        real.chmod(0o1777)
        rt = real
    else:
        rt = short_tmp / "link"
        rt.symlink_to(real)
    out = failed_start(rt)
    assert str(rt) in out and ("writable by every user" in out or "symlink" in out), out[-1500:]


# ---------------------------------------------------------------- pool_dir without room


@pytest.fixture
def small_tmpfs(short_tmp):
    """A 16 MiB tmpfs (root only): a pool_dir that a 64 MiB pool does not fit."""
    mnt = short_tmp / "shm"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_prefault_off_pool_larger_than_pool_dir_is_refused_at_start(daemon_factory, small_tmpfs):
    """With prefault off the pool file is made sparse (nothing allocated at start), but a
    pool larger than pool_dir's free space is refused at start all the same, naming
    hicache_size: copies into pages the file system cannot back would fail one by one."""
    from kvtier.launch.daemon_process import DaemonStartError

    with pytest.raises(DaemonStartError, match="hicache_size"):
        daemon_factory("--pool-dir", str(small_tmpfs), "--prefault", "false")


def test_a_metrics_port_in_use_stops_the_start_with_status_2(short_tmp: Path) -> None:
    """A ``metrics_port`` another process holds is a setting the start cannot apply: exit 2
    (systemd's RestartPreventExitStatus), the message naming the setting."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = failed_start(short_tmp / "rt", "--metrics-port", str(port))
    assert "metrics_port" in out and str(port) in out, out[-1500:]


def test_a_failed_start_removes_the_pool_file_it_created(short_tmp: Path) -> None:
    """A start that fails after making its pool file (here: the metrics port is taken)
    removes that file: it holds no page, and a daemon that systemd does not restart (exit 2)
    would leave memory the size of its pool in ``/dev/shm`` for nobody."""
    rt = short_tmp / "rt"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = failed_start(rt, "--metrics-port", str(busy.getsockname()[1]))
    assert "metrics_port" in out, out[-1500:]
    assert not pool_path(Path("/dev/shm"), rt).exists(), "the failed start left its pool file"


def test_a_failed_start_keeps_the_pool_it_adopted(daemon_factory, short_tmp: Path) -> None:
    """A pool file a previous kvtierd left (pages in it) survives a start that fails: the
    next start adopts its pages."""
    from tests.engines import SMALL, engine, tokens

    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=5))
        h = conn.store(keys, list(range(4)))
        assert h.count == 4 and h.wait()
    finally:
        conn.close()
        pool.close()
    d.stop()
    path = pool_path(Path("/dev/shm"), d.runtime_dir)
    assert path.exists()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        failed_start(d.runtime_dir, "--state-dir", str(short_tmp / "state"), "--metrics-port", port)
    assert path.exists(), "a failed start removed a pool it had adopted"
    d.start()
    pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
    try:
        assert conn.lookup(keys).l2 == 4, "the pages did not survive the failed start"
    finally:
        conn.close()
        pool.close()
