"""kvtierd in containers and on constrained file systems.

In Docker or Kubernetes ``/dev/shm`` is small (64 MiB by default; an ``emptyDir`` with
``medium: Memory`` counts against the pod's memory limit), the state directory may be full
or read-only, and the daemon's memory is limited by a cgroup. What users are promised
(README, "Runtime directory and pool files"; docs/configuration.md; the systemd unit's
``RestartPreventExitStatus=2``):

- a ``hicache_size`` that ``pool_dir`` has no room for stops the start with an error naming
  ``hicache_size``, the limit and the free space, and leaves no pool file behind; a setting
  a restart cannot fix exits with status 2;
- copies never end the daemon with SIGBUS; an engine's failure is its own, and a failure is
  reported with its real cause;
- HEALTH says ``degraded: <why>`` while L3 is configured but failing.

Every test mounts its own small tmpfs (root only; skipped elsewhere) and unmounts it at
teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.config.loader import pool_path
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, handover, tokens
from tests.servers import RawDealer, run_kvtierd, serve_redis

BASE = ["--hicache-storage-backend", "none", "--hicache-size", "16MiB", "--extent-size", "4MiB"]


# ------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def tmpfs(where: Path, size: str, *, ro: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``where`` (made if missing); unmounted at the end."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        if ro:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path) -> None:
    """Write a file into ``directory`` until its file system has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            try:
                for _ in range(1 << 16):
                    f.write(b"x" * chunk)
            except OSError:
                continue
    assert os.statvfs(directory).f_bavail == 0


def kvtierd(rdir: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvtierd`` with this module's :data:`BASE` flags to its end (it is expected to
    refuse to start)."""
    return run_kvtierd(rdir, *BASE, *args, timeout=timeout)


def health(d) -> str:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.health().status


def wait_log(d, needle: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = d.log_path.read_text(errors="replace")
        if needle in text:
            return text
        time.sleep(0.1)
    return text


# ------------------------------------------------------- pool_dir filling up after the start


def _store_into_full_pool_dir(daemon_factory, short_tmp: Path, *flags: str):
    """A daemon with ``prefault = false`` whose pool_dir (a 32 MiB tmpfs) the start found
    with room enough, then filled by someone else; one engine stores 32 pages. Returns the
    daemon, the store's result and the pool_dir."""
    shm = short_tmp / "shm"
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(tmpfs(shm, "32m"))
        d = daemon_factory(
            "--pool-dir", str(shm), "--prefault", "false", "--hicache-size", "16MiB", *flags
        )  # fmt: skip
        stack.callback(d.remove_pool, shm)
        stack.callback(d.stop)  # before the unmount: the daemon maps a file there
        fill(shm)  # another container / process writes to the same /dev/shm
        pool, conn = engine(d.runtime_dir, request_timeout_s=3.0, load_timeout_s=5.0)
        try:
            keys = conn.page_keys(tokens(32 * SMALL.page_size, salt=3))
            stored = conn.store(keys, list(range(32))).wait()
        finally:
            conn.close()
            pool.close()
    except BaseException:
        stack.close()
        raise
    return stack, d, stored


@pytest.mark.timeout(90)
def test_a_store_failing_because_pool_dir_is_full_is_not_blamed_on_the_engine(
    daemon_factory, short_tmp
):
    """The native copy survives a fault on a pool page its full pool_dir cannot back, and
    the log names the real cause (pool_dir, no space left), never the engine's memfd
    (sealed against shrinking: it cannot have shrunk)."""
    stack, d, stored = _store_into_full_pool_dir(daemon_factory, short_tmp)
    with stack:
        assert stored is False
        blames_pool_dir(d)


def blames_pool_dir(d) -> None:
    """Assert that ``d``'s log has failed copies, each naming pool_dir or a lack of space,
    none blaming the engine's memory."""
    text = wait_log(d, "failed")
    failures = [line for line in text.splitlines() if "failed" in line and "ERROR" in line]
    assert failures, text[-2000:]
    for line in failures:
        assert "engine shrank" not in line and ("pool_dir" in line or "space" in line.lower()), (
            f"the failure names the wrong cause: {line}"
        )


# ------------------------------------------------------------- hicache_size and the limits


@pytest.mark.timeout(60)
def test_a_hicache_size_larger_than_the_whole_pool_dir_exits_with_status_2(short_tmp):
    """A ``hicache_size`` larger than the whole file system of ``pool_dir`` (Docker's
    64 MiB /dev/shm and the default 1 GiB pool) is a setting a restart cannot fix: kvtierd
    exits with status 2, which systemd's ``RestartPreventExitStatus=2`` (and an
    operator's restart policy) takes as "do not restart", instead of being restarted every
    2 s for ever, failing the same way each time."""
    with tmpfs(short_tmp / "shm", "16m") as shm:
        out = kvtierd(short_tmp / "rt", "--pool-dir", str(shm), "--hicache-size", "64MiB")
        assert "hicache_size" in out.stderr, out.stderr[-1500:]
        assert not pool_path(shm, short_tmp / "rt").exists()
        assert out.returncode == 2, f"exit {out.returncode}:\n{out.stderr[-800:]}"


def _memory_cgroup(name: str, limit: int) -> tuple[Path, Path] | None:
    """Make a memory cgroup limited to ``limit`` bytes: (its dir, its procs file), or None."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        cg = v1 / name
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        return cg, cg / "cgroup.procs"
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            cg = v2 / name
            cg.mkdir()
            (cg / "memory.max").write_text(str(limit))
            (cg / "memory.swap.max").write_text("0") if (cg / "memory.swap.max").exists() else None
            return cg, cg / "cgroup.procs"
    return None


@pytest.mark.timeout(90)
def test_kvtierd_in_a_memory_cgroup_smaller_than_hicache_size_is_refused_at_start(short_tmp):
    """In a container the pool's tmpfs pages are charged to the daemon's memory cgroup
    (Kubernetes: an emptyDir of medium Memory counts against the pod's limit). A
    ``hicache_size`` the cgroup's limit has no room for stops the start with an error
    naming ``hicache_size`` and the limit, leaving no pool file, as a too small pool_dir
    does, never reserves the pool to be killed by the kernel's OOM killer (SIGKILL, no
    message at all: a CrashLoopBackOff)."""
    made = _memory_cgroup(f"kvt-ch-{os.getpid()}", 256 << 20)
    if made is None:
        pytest.skip("no memory cgroup controller can be used here")
    cg, procs = made
    rt = short_tmp / "rt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("NOTIFY_SOCKET", None)
    proc = None
    try:
        with tmpfs(short_tmp / "shm", "1g") as shm:
            try:
                cmd = f'echo $$ > {procs} && exec "$0" -m kvtier.daemon "$@"'
                proc = subprocess.Popen(
                    ["sh", "-c", cmd, sys.executable, "--runtime-dir", str(rt), *BASE,
                     "--hicache-size", "512MiB", "--pool-dir", str(shm)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                    stdin=subprocess.DEVNULL,
                )  # fmt: skip
                try:
                    out, _ = proc.communicate(timeout=40)
                except subprocess.TimeoutExpired:  # it started after all: stop it
                    proc.terminate()
                    out, _ = proc.communicate(timeout=20)
                    pytest.fail("kvtierd started with a pool larger than its memory limit")
                left = pool_path(shm, rt).exists()
            finally:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
                pool_path(shm, rt).unlink(missing_ok=True)
    finally:
        for _ in range(50):  # the cgroup goes once its last task has been reaped
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    code = proc.returncode
    assert code >= 0, (
        f"kvtierd was killed by {signal.Signals(-code).name} (the OOM killer) instead of "
        f"refusing hicache_size; its output: {out[-800:]!r}"
    )
    assert "hicache_size" in out, out[-1500:]
    assert not left, "the failed start left its pool file"


# --------------------------------------------- an L3 read into a pool_dir that filled up


@pytest.fixture
def redis_server():
    yield from serve_redis()


def _prefetch_into_full_pool_dir(daemon_factory, short_tmp: Path, backend: str, extra: str):
    """Daemon ``a`` stores 32 pages to L3 and stops; daemon ``b`` (same L3, a sparse pool
    in a 32 MiB tmpfs that fills up after its start) is asked to prefetch them. Returns
    (daemon b, the keys, lookup after the prefetch ended, b's L3 stats); b is stopped by the
    caller's ``with`` (the returned stack)."""
    l3 = ("--hicache-storage-backend", backend, "--hicache-storage-backend-extra-config", extra)
    a = daemon_factory(*l3, "--hicache-size", "16MiB", name="a")
    pool, conn = engine(a.runtime_dir, request_timeout_s=5.0)
    try:
        keys = conn.page_keys(tokens(32 * SMALL.page_size, salt=11))
        assert conn.store(keys, list(range(32))).wait()
    finally:
        conn.close()
        pool.close()
    with AdminClient(a.endpoint, timeout_s=20.0) as admin:
        admin.sync(10.0)
    a.stop()
    shm = short_tmp / "shm"
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(tmpfs(shm, "32m"))
        b = daemon_factory(
            *l3, "--pool-dir", str(shm), "--prefault", "false", "--hicache-size", "16MiB",
            name="b",
        )  # fmt: skip
        stack.callback(b.remove_pool, shm)
        stack.callback(b.stop)
        fill(shm)
        pool, conn = engine(b.runtime_dir, request_timeout_s=3.0)
        try:
            assert conn.lookup(keys).l3 == 32
            assert conn.prefetch(keys) > 0
            stats: dict = {}
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and b.proc.poll() is None:
                with contextlib.suppress(Exception), AdminClient(b.endpoint, 2.0) as admin:
                    stats = admin.stats()["l3"]  # type: ignore[assignment]
                    if stats["prefetching"] == 0 and stats["gets"] + stats["misses"] >= 32:
                        break
                time.sleep(0.2)
            after = conn.lookup(keys) if b.proc.poll() is None else None
        finally:
            conn.close()
            pool.close()
    except BaseException:
        stack.close()
        raise
    return stack, b, after, stats


@pytest.mark.timeout(120)
def test_a_redis_prefetch_into_a_full_pool_dir_never_ends_the_daemon_with_sigbus(
    daemon_factory, short_tmp, redis_server
):
    """With ``prefault = false`` and pool_dir filled up after the start (a shared
    /dev/shm), a prefetch from the redis L3 store into slots the file system can no longer
    back fails those pages (a miss); kvtierd never dies by SIGBUS (all C kernels on, the
    default)."""
    extra = json.dumps({"url": redis_server.url, "prefix": f"kvt-ch-{os.getpid()}"})
    stack, b, _after, _stats = _prefetch_into_full_pool_dir(
        daemon_factory, short_tmp, "redis", extra
    )
    with stack:
        code = b.proc.poll()
        assert code is None, (
            f"kvtierd died ({'signal ' + signal.Signals(-code).name if code < 0 else code}) "
            f"prefetching into a pool whose pool_dir filled up:\n{b.log_tail(10)}"
        )


@pytest.mark.timeout(120)
def test_a_prefetch_into_a_full_pool_dir_never_deletes_the_pages_from_the_file_store(
    daemon_factory, short_tmp
):
    """A prefetch from the file L3 store into a pool whose pool_dir filled up after the
    start cannot land its pages (the read into an arena slot the tmpfs cannot back fails
    with EFAULT): those pages are a miss, and L3 still holds them (the disk copy is sound;
    the next daemon, or this one once room is made, reads them). A failed read is never
    taken for corruption (counted ``corrupt``, its header wiped and its payload punched out
    of the store): a full /dev/shm never destroys the node's L3 data."""
    extra = json.dumps({"path": str(short_tmp / "l3")})
    stack, b, after, stats = _prefetch_into_full_pool_dir(daemon_factory, short_tmp, "file", extra)
    with stack:
        assert b.proc.poll() is None, b.log_tail(10)
        assert after is not None and after.l3 == 32, (
            f"L3 lost the pages a failed prefetch could not land: lookup {after}, L3 stats {stats}"
        )


# ------------------------------------------------------------------ the runtime directory


@pytest.mark.timeout(60)
def test_a_runtime_dir_on_a_full_file_system_is_a_clear_error_not_a_traceback(short_tmp):
    """A runtime directory on a full file system (a full /run or emptyDir): kvtierd must
    exit with one error line naming the directory and what is wrong (no space left), as it
    does for a read-only one (writing its pid into ``kvtierd.lock`` fails with ENOSPC),
    never a Python traceback."""
    with tmpfs(short_tmp / "run", "1m") as run:
        rt = run / "kvtier"
        rt.mkdir(mode=0o750)
        fill(run)
        out = kvtierd(rt)
        assert out.returncode in (1, 2), out.stderr[-1500:]
        assert "Traceback" not in out.stderr, out.stderr[-1500:]
        assert str(rt) in out.stderr and "No space left" in out.stderr, out.stderr[-1500:]
        assert not pool_path(Path("/dev/shm"), rt).exists()


# -------------------------------------------------------------------- the L3 file store


def _file_store_daemon(daemon_factory, state: Path):
    extra = json.dumps({"path": str(state / "l3"), "segment_bytes": "2MiB"})
    return daemon_factory(
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra,
        "--state-dir", str(state),
        "--hicache-size", "16MiB",
    )  # fmt: skip


@pytest.mark.timeout(90)
def test_an_l3_file_store_on_a_full_file_system_makes_health_degraded(daemon_factory, short_tmp):
    """The state directory's file system is full (a full volume): no page can be written
    to the file L3 store, ``kvtier sync`` reports every page failed, and HEALTH must say
    ``degraded: <why>`` (README: "while L3 is configured but failing"), so an operator and
    a readiness probe learn of it."""
    with tmpfs(short_tmp / "state", "8m") as state:
        fill(state)
        d = _file_store_daemon(daemon_factory, state)
        try:
            pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
            try:
                keys = conn.page_keys(tokens(16 * SMALL.page_size, salt=7))
                assert conn.store(keys, list(range(16))).wait()  # L2 serves
            finally:
                conn.close()
                pool.close()
            with AdminClient(d.endpoint, timeout_s=20.0) as admin:
                synced = admin.sync(10.0)
                assert synced.written == 0 and synced.failed > 0, synced
                status = admin.health().status
            assert status.startswith("degraded"), (
                f"HEALTH says {status!r} while every L3 write fails (file system full)"
            )
        finally:
            d.stop()
            d.remove_pool()


@pytest.mark.timeout(90)
def test_an_l3_file_store_that_fills_its_file_system_keeps_storing_by_eviction(
    daemon_factory, short_tmp
):
    """A file store whose capacity (16 GiB by default) is larger than its
    8 MiB file system creates segments until the disk is full, then evicts inside them:
    later pages still reach L3, and ``kvtier sync`` writes them all."""
    with tmpfs(short_tmp / "state", "8m") as state:
        d = _file_store_daemon(daemon_factory, state)
        try:
            pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
            try:
                for salt in range(20):  # 320 pages of 32 KiB: 10 MiB
                    keys = conn.page_keys(tokens(16 * SMALL.page_size, salt=100 + salt))
                    assert conn.store(keys, list(range(16))).wait()
            finally:
                conn.close()
                pool.close()
            with AdminClient(d.endpoint, timeout_s=20.0) as admin:
                synced = admin.sync(10.0)
                assert synced.failed == 0 and synced.left == 0, synced
            assert d.proc.poll() is None
        finally:
            d.stop()
            d.remove_pool()


# ------------------------------------------------------------- engine memory: huge pages


@pytest.mark.timeout(60)
def test_a_huge_page_memfd_the_node_cannot_back_is_refused_with_bad_memory(daemon):
    """An engine hands over an ``MFD_HUGETLB`` memfd on a node with no huge
    page free. REGISTER is refused at once with BAD_MEMORY saying so (not a timeout, not a
    SIGBUS at the first copy) and the daemon keeps serving."""
    free = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                free = int(line.split()[1])
    if free:
        pytest.skip("this node has huge pages free")
    try:
        fd = os.memfd_create("kvt-huge", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError as err:
        pytest.skip(f"no MFD_HUGETLB here: {err}")
    size = 2 << 20
    raw = None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        n_buf = SMALL.num_layers * SMALL.components
        step = 64 * SMALL.chunk_bytes
        memory = P.KVMemory(
            kind="fd",
            num_pages=64,
            segments=[P.MemorySegment(name="huge", size=size)],
            buffer_segments=[0] * n_buf,
            buffer_offsets=[i * step for i in range(n_buf)],
        )
        token = handover(daemon.runtime_dir, fds=[fd])
        raw = RawDealer(daemon.endpoint)
        rep = raw.ask(
            P.encode(
                P.Register(
                    req_id=1,
                    protocol_version=P.PROTOCOL_VERSION,
                    namespace=P.NamespaceSpec("huge"),
                    geometry=SMALL,
                    memory=memory,
                    pid=os.getpid(),
                    handover=token,
                )
            )
        )
        assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.BAD_MEMORY, rep
        assert "huge pages" in rep.message, rep.message
    finally:
        if raw is not None:
            raw.close()
        os.close(fd)
    assert daemon.proc.poll() is None and health(daemon) == "ok"
