"""The runtime directory and the pool file are one daemon's alone.

Three groups:

- the runtime-dir pieces themselves (:mod:`kvtier.daemon.service.runtime`), called directly;
- real kvtierd subprocesses: a pool file that is not the daemon's alone, resources too
  large for the machine, ``kvtier health`` as a user who cannot enter the runtime dir;
- ``WIRED``: behaviour that needs :func:`claim_runtime_dir` and :class:`SocketFile` wired
  into ``daemon/service/server.py`` (one daemon per runtime dir, its socket kept, stale
  completion blocks swept at start). These fail until that wiring is in.

Multi-user cases use real distinct uids (4242, 4343) and need root; they skip otherwise.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.config import socket_path
from kvtier.config.loader import pool_path
from kvtier.daemon.pool.layout import PoolLayout
from kvtier.daemon.service.runtime import (
    DaemonLock,
    DaemonRunningError,
    RuntimeDirError,
    SocketFile,
    claim_runtime_dir,
    lock_holder,
    prepare_runtime_dir,
    remove_stale_files,
)
from kvtier.launch.daemon_process import DaemonProcess, DaemonStartError

from tests.engines import engine, fill_page, page_bytes, tokens
from tests.unit.test_pool_file import small_tmpfs

pytestmark = pytest.mark.timeout(120)

OTHER_UID = 4343
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="files and processes of another uid need root"
)
POOL_DIR = Path("/dev/shm")  # the fixtures' daemons use the default pool_dir


def exited(d: DaemonProcess) -> tuple[int, str]:
    """Start ``d``, which must fail; return (exit code, its log)."""
    with pytest.raises(DaemonStartError):
        d.start(timeout=60)
    return d.proc.returncode if d.proc is not None else -1, d.log_path.read_text()


# ------------------------------------------------------------------ the pieces, directly
def test_a_missing_runtime_dir_is_created_0750_whatever_the_umask(short_tmp: Path) -> None:
    old = os.umask(0o077)
    try:
        rdir = prepare_runtime_dir(short_tmp / "a" / "rd")
    finally:
        os.umask(old)
    st = os.lstat(rdir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750


def test_a_symlinked_or_world_writable_runtime_dir_is_refused(short_tmp: Path) -> None:
    real = short_tmp / "real"
    real.mkdir()
    (short_tmp / "link").symlink_to(real)
    with pytest.raises(RuntimeDirError, match="is a symlink"):
        prepare_runtime_dir(short_tmp / "link")
    os.chmod(real, 0o777)
    with pytest.raises(RuntimeDirError, match="writable by every user"):
        prepare_runtime_dir(real)


@needs_root
def test_a_runtime_dir_of_another_uid_is_refused(short_tmp: Path) -> None:
    rdir = short_tmp / "theirs"
    rdir.mkdir(mode=0o750)
    os.chown(rdir, OTHER_UID, OTHER_UID)
    with pytest.raises(RuntimeDirError, match=f"owner uid {OTHER_UID}"):
        prepare_runtime_dir(rdir)


def test_the_lock_names_its_holder_and_is_free_after_release(short_tmp: Path) -> None:
    rdir = short_tmp / "rd"
    assert lock_holder(rdir) is None  # no lock file yet
    with claim_runtime_dir(rdir) as lock:
        assert lock.held and lock_holder(rdir) == os.getpid()
        with pytest.raises(DaemonRunningError) as err:
            DaemonLock(rdir).acquire()  # another open file description: refused
        assert str(err.value) == f"another kvtierd (pid {os.getpid()}) is running on {rdir}"
    assert lock_holder(rdir) is None
    with DaemonLock(rdir):
        pass


def test_lock_holder_sees_a_lock_held_by_another_process(short_tmp: Path) -> None:
    rdir = prepare_runtime_dir(short_tmp / "rd")
    code = (
        "import sys, time; from kvtier.daemon.service.runtime import DaemonLock\n"
        f"with DaemonLock({str(rdir)!r}):\n    print('held', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        assert lock_holder(rdir) == child.pid
        with pytest.raises(DaemonRunningError, match=f"pid {child.pid}"):
            DaemonLock(rdir).acquire()
    finally:
        child.communicate(timeout=30)
    assert lock_holder(rdir) is None


def test_stale_completion_blocks_and_sockets_are_swept_ours_only(short_tmp: Path) -> None:
    rdir = prepare_runtime_dir(short_tmp / "rd")
    stale = [rdir / "completion-1f-1", rdir / "completion-abc-22"]
    for p in stale:
        p.write_bytes(b"x")
    keep = [rdir / "completion-notours", rdir / "kvtierd.log", rdir / "completion-1-x"]
    for p in keep:
        p.write_bytes(b"x")
    (rdir / "completion-2-2").symlink_to(short_tmp / "elsewhere")
    keep.append(rdir / "completion-2-2")
    old = socket.socket(socket.AF_UNIX)
    old.bind(str(rdir / "kvtierd-mem.sock"))
    old.close()  # a killed daemon's handover socket
    if os.geteuid() == 0:
        theirs = rdir / "completion-3-3"
        theirs.write_bytes(b"x")
        os.chown(theirs, OTHER_UID, OTHER_UID)
        keep.append(theirs)
    removed = remove_stale_files(rdir)
    assert sorted(removed) == sorted([*stale, rdir / "kvtierd-mem.sock"])
    assert all(os.path.lexists(p) for p in keep)


def test_the_socket_is_removed_only_while_it_is_still_ours(short_tmp: Path) -> None:
    path = short_tmp / "kvtierd.sock"
    ours = socket.socket(socket.AF_UNIX)
    ours.bind(str(path))
    rec = SocketFile.record(path)
    path.unlink()  # a second daemon rebinds the path
    theirs = socket.socket(socket.AF_UNIX)
    theirs.bind(str(path))
    try:
        assert rec.remove() is False and path.exists()
        assert SocketFile.record(path).remove() is True and not path.exists()
        assert rec.remove() is False
    finally:
        ours.close()
        theirs.close()


# ------------------------------------------------------------------ the pool file
def stored(rdir: Path, n: int = 4):
    """An engine that stored ``n`` pages L2 did not hold; returns (pool, conn, keys, their
    bytes)."""
    pool, conn = engine(rdir)
    keys = conn.page_keys(tokens(n * 16, salt=7))
    assert conn.lookup(keys).l2 == 0
    for p in range(n):
        fill_page(pool, p, seed=900 + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return pool, conn, keys, expected


def test_a_world_writable_pool_file_is_not_adopted_and_the_engine_loads_its_own_bytes(
    daemon_factory,
) -> None:
    """Regression: a pool file anyone could write was adopted as is; its pages, rewritten
    by another user, were served to engines."""
    d = daemon_factory()
    pool, conn, keys, expected = stored(d.runtime_dir)
    conn.close()
    pool.close()
    d.kill()
    path = pool_path(POOL_DIR, d.runtime_dir)
    lay = PoolLayout.plan(64 << 20, 4 << 20)
    os.chmod(path, 0o666)
    with open(path, "r+b") as fh:  # another user rewrites every stored page
        fh.seek(lay.arena_offset)
        fh.write(b"\x5a" * lay.capacity_bytes)
    d2 = daemon_factory()
    with AdminClient(d2.endpoint) as admin:
        info = dict(admin.stats()["adopt"])
    assert not info["adopted"] and "mode 0666" in info["reason"], info
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    pool, conn, keys2, _ = stored(d2.runtime_dir)  # the same model and tokens: same keys
    try:
        assert keys2 == keys
        dst = list(range(32, 32 + len(keys)))
        h = conn.load(keys, dst)
        assert h.count == len(keys) and h.wait()
        assert [page_bytes(pool, p) for p in dst] == expected
    finally:
        conn.close()
        pool.close()


@needs_root
def test_a_pool_file_precreated_by_another_uid_is_refused(daemon_factory) -> None:
    d = daemon_factory(start=False)
    path = pool_path(POOL_DIR, d.runtime_dir)
    lay = PoolLayout.plan(64 << 20, 4 << 20)
    with open(path, "wb") as fh:
        fh.truncate(lay.file_bytes)  # the size the daemon wants: only ownership can refuse it
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o666)
    try:
        code, log = exited(d)
        assert code == 1
        assert f"refusing the pool file {path}" in log and f"owner uid {OTHER_UID}" in log
        assert "mode 0666" in log and "kvtier pools --remove" in log and "Traceback" not in log
        assert os.stat(path).st_uid == OTHER_UID  # left alone
    finally:
        path.unlink(missing_ok=True)


@needs_root
def test_a_symlinked_pool_file_is_refused(daemon_factory, short_tmp: Path) -> None:
    d = daemon_factory(start=False)
    path = pool_path(POOL_DIR, d.runtime_dir)
    target = short_tmp / "target"
    target.write_bytes(b"precious")
    path.symlink_to(target)
    os.lchown(path, OTHER_UID, OTHER_UID)
    try:
        code, log = exited(d)
        assert code == 1 and f"refusing the pool file {path}: it is a symlink" in log
        assert target.read_bytes() == b"precious"
    finally:
        path.unlink(missing_ok=True)


def test_ten_terabytes_is_a_config_error_naming_hicache_size(daemon_factory) -> None:
    d = daemon_factory("--hicache-size", "10TB", "--extent-size", "32MiB", start=False)
    code, log = exited(d)
    assert code == 2 and "hicache_size = 9.1 TiB (10000000000000 bytes) is too large" in log
    assert "the largest hicache_size with extent_size 32.0 MiB is 8.0 TiB" in log
    assert "min_page_bytes" not in log and "Traceback" not in log


@needs_root
def test_a_pool_larger_than_pool_dir_names_hicache_size_and_the_free_space(daemon_factory):
    with small_tmpfs("32m") as mnt:
        d = daemon_factory("--pool-dir", str(mnt), "--hicache-size", "1GiB", start=False)
        code, log = exited(d)
        assert code == 2, log  # larger than the whole file system: no restart can fit it
        assert "hicache_size = 1.0 GiB" in log and f"pool_dir {mnt}" in log
        assert "32.0 MiB" in log and "free" in log and "Traceback" not in log
        assert os.listdir(mnt) == []


def cli_as(uid: int, argv: list[str]) -> tuple[int, str]:
    """Run ``kvtier argv`` in a forked child whose uid, gid and groups are ``uid`` only.

    Forked rather than executed: the interpreter may live where another uid cannot reach
    it (e.g. under /root), so everything the command needs is imported here first.
    Returns (exit status, stdout and stderr together).
    """
    import kvtier.cli.admin  # noqa: F401  (the command's modules, loaded before the switch)
    from kvtier.cli.main import main

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, run, exit without running the parent's cleanup
        rc = 70
        os.close(r)
        out = os.fdopen(w, "w")
        sys.stdout = sys.stderr = out
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            rc = main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            out.flush()
            os._exit(rc)
    os.close(w)
    with os.fdopen(r) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


@needs_root
def test_health_as_a_user_who_cannot_enter_the_runtime_dir_is_one_line(daemon) -> None:
    """``kvtier health`` as a user who cannot enter the runtime dir says ``unhealthy:``
    and why in one line (exit 1), never a PermissionError traceback."""
    assert stat.S_IMODE(os.stat(daemon.runtime_dir.parent).st_mode) == 0o700
    code, text = cli_as(OTHER_UID, ["health", "--runtime-dir", str(daemon.runtime_dir)])
    assert code == 1, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    assert lines[0].startswith(
        "unhealthy: cannot reach kvtierd's socket "
        f"{socket_path(daemon.runtime_dir)}: permission denied entering "
        f"{daemon.runtime_dir.parent} (owner uid 0"
    ), lines[0]
    assert f"uid {OTHER_UID}" in lines[0]


# ------------------------------------------------------------------ WIRED (server.py)
def test_wired_a_second_daemon_on_the_same_runtime_dir_exits_and_the_first_serves(
    daemon_factory, short_tmp: Path
) -> None:
    first = daemon_factory()
    sock = socket_path(first.runtime_dir)
    ino = os.stat(sock).st_ino
    pool = pool_path(POOL_DIR, first.runtime_dir)
    pool_ino = os.stat(pool).st_ino
    # not DaemonProcess.start: it would find the first daemon's socket healthy and return
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.daemon",
            "--hicache-storage-backend",
            "none",
            "--hicache-size",
            "64MiB",
            "--extent-size",
            "4MiB",
        ],
        env={
            **os.environ,
            "KVTIER_RUNTIME_DIR": str(first.runtime_dir),
            "STATE_DIRECTORY": str(short_tmp / "second-state"),
        },
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode == 1, second.stderr
    assert (
        f"another kvtierd (pid {first.pid}) is running on {first.runtime_dir}" in second.stderr
    ), second.stderr
    assert os.stat(sock).st_ino == ino and os.stat(pool).st_ino == pool_ino
    with AdminClient(first.endpoint, timeout_s=5.0) as admin:
        assert admin.health().status == "ok"
    assert first.proc is not None and first.proc.poll() is None
    assert lock_holder(first.runtime_dir) == first.pid


def test_wired_stale_completion_blocks_go_at_start_and_the_lock_is_free_after_stop(
    daemon_factory, short_tmp: Path
) -> None:
    rdir = short_tmp / "d0"
    rdir.mkdir()
    stale = rdir / "completion-deadbeef-3"
    stale.write_bytes(b"\0" * 4096)
    d = daemon_factory()
    assert not stale.exists()
    assert lock_holder(rdir) == d.pid
    assert d.stop() == 0
    assert lock_holder(rdir) is None and not socket_path(rdir).exists()
    daemon_factory()  # the next one starts on the same dir


def test_wired_the_pool_file_names_its_runtime_dir(daemon) -> None:
    from kvtier.daemon.pool.inventory import inspect_pool_file

    info = inspect_pool_file(pool_path(POOL_DIR, daemon.runtime_dir))
    assert info.runtime_dir == daemon.runtime_dir
