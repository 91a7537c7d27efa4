"""kvtierd as systemd runs it (systemd/kvtier.service): exit codes, sd_notify, stop and start.

systemd itself cannot run here (no PID 1 systemd): a real ``AF_UNIX`` datagram socket plays
``NOTIFY_SOCKET``, the daemon is a real ``python -m kvtier.daemon`` process, and what the
unit file promises (``RestartPreventExitStatus=2``, ``TimeoutStartSec=300s``,
``TimeoutStopSec=60s``, "kvtierd may also extend this with EXTEND_TIMEOUT_USEC") is checked
against what the daemon does. No assertion depends on an absolute time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.connection import Connection, TransferHandle
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config.loader import pool_path
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import TransferStatus
from kvtier.launch.daemon_process import DaemonProcess

from tests.engines import client_config
from tests.integration.test_lifecycle import NotifyListener

REPO = Path(__file__).parents[2]
UNIT = REPO / "systemd" / "kvtier.service"
POOL_DIR = Path("/dev/shm")

Fields = dict[str, str]


def unit_value(key: str) -> str:
    """The last ``key=`` value of the shipped unit file."""
    found = None
    for line in UNIT.read_text().splitlines():
        if line.startswith(f"{key}="):
            found = line.split("=", 1)[1].strip()
    assert found is not None, f"{key}= not in {UNIT}"
    return found


def seconds(text: str) -> float:
    """``300s`` / ``60`` / ``2min`` → seconds (the forms the unit uses)."""
    text = text.strip()
    if text.endswith("min"):
        return float(text[:-3]) * 60
    return float(text.rstrip("s"))


@pytest.fixture
def listener(short_tmp: Path) -> Iterator[NotifyListener]:
    made = NotifyListener(short_tmp / "notify.sock", short_tmp / "unwatched")
    try:
        yield made
    finally:
        made.close()


def _env(rdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("NOTIFY_SOCKET", None)
    env.update({"KVTIER_RUNTIME_DIR": str(rdir), "STATE_DIRECTORY": str(rdir / "state")})
    env.update(extra)
    return env


# ---------------------------------------------------------------------------- exit codes
@pytest.mark.timeout(60)
def test_a_pool_dir_that_is_a_file_is_a_config_error_exit_2_not_a_traceback(short_tmp: Path):
    """``pool_dir`` naming a regular file is a configuration mistake, like a
    ``pool_dir`` that does not exist (which exits 2 with "pool_dir '...' does not exist:
    cannot create the pool file there"). kvtierd should print one line naming
    ``pool_dir`` and exit with status 2, which the unit's ``RestartPreventExitStatus=2``
    keeps systemd from restarting in a loop."""
    rdir = short_tmp / "d"
    rdir.mkdir()
    not_a_dir = short_tmp / "pooldir-is-a-file"
    not_a_dir.write_text("")
    proc = subprocess.run(
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
            "--pool-dir",
            str(not_a_dir),
        ],
        env=_env(rdir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert "pool_dir" in out, out
    assert proc.returncode == 2, (proc.returncode, out)


@pytest.mark.timeout(60)
def test_a_missing_pool_dir_exits_2_guard(short_tmp: Path):
    """A ``pool_dir`` that does not exist is refused with one line naming
    it and status 2 (no restart loop under ``RestartPreventExitStatus=2``)."""
    rdir = short_tmp / "d"
    rdir.mkdir()
    proc = subprocess.run(
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
            "--pool-dir",
            str(short_tmp / "no-such-dir"),
        ],
        env=_env(rdir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 2, (proc.returncode, out)


# ---------------------------------------------------------------------------- sd_notify
@pytest.mark.timeout(120)
def test_bogus_notify_sockets_never_stop_the_daemon_guard(daemon_factory, short_tmp: Path):
    """A NOTIFY_SOCKET that names nothing, a directory, a regular file, a
    bare ``@`` or an abstract name nobody listens on never stops kvtierd: it serves, and
    SIGTERM still ends it with status 0."""
    plain = short_tmp / "plain-file"
    plain.write_text("")
    for i, value in enumerate(
        ["/nonexistent/notify", str(short_tmp), str(plain), "@", "@kvt-nobody-listens-here"]
    ):
        d = daemon_factory(name=f"b{i}", env={"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "200000"})
        time.sleep(0.3)  # a few watchdog pings to the bogus address
        assert d.proc is not None and d.proc.poll() is None, d.log_tail()
        assert d.stop() == 0, d.log_tail()
        d.remove_pool()


@pytest.mark.timeout(120)
def test_a_start_that_prefaults_a_large_pool_extends_systemds_start_timeout(
    daemon_factory, listener: NotifyListener
):
    """The unit gives the start ``TimeoutStartSec=300s`` and says "Pre-faulting a
    large host pool ... can take minutes; kvtierd may also extend this with
    EXTEND_TIMEOUT_USEC while it works". Pre-faulting runs at roughly a GiB a second, so a
    host pool of a few hundred GiB (usual for HiCache nodes) takes longer than 300 s: while
    it creates and pre-faults the pool, kvtierd should tell systemd it is still working
    (``EXTEND_TIMEOUT_USEC``, sd_notify(3)) before ``READY=1``."""
    d = daemon_factory(
        "--hicache-size",
        "2GiB",
        "--prefault",
        "true",
        env={"NOTIFY_SOCKET": str(listener.path)},
    )
    ready = listener.wait_for(lambda f: f.get("READY") == "1")
    before = listener.fields()[:ready]
    assert d.stop() == 0
    assert any("EXTEND_TIMEOUT_USEC" in f for f in before), (
        f"no EXTEND_TIMEOUT_USEC before READY=1 while pre-faulting a 2 GiB pool "
        f"(TimeoutStartSec={unit_value('TimeoutStartSec')}); before READY=1: {before!r}"
    )


# One layer of 2 MiB pages: a 1 GiB STORE into a pool that is not pre-faulted is copied in
# one layer step, which a stop cannot cut short (cancellation is checked between layers).
BIG = P.Geometry(num_layers=1, page_size=16, kv_heads=32, head_dim=512, dtype="float32")
SLOW = ("--hicache-size", "1GiB", "--prefault", "false", "--copy-threads", "1")


def _still_copying(h: TransferHandle) -> bool:
    assert h._block is not None
    seq, layers_done, status = h._block.read(h.slot)
    return seq == h.seq and layers_done == 0 and status == TransferStatus.RUNNING


def _slow_store(d: DaemonProcess) -> tuple[SharedKVPool, Connection, TransferHandle]:
    n = (1 << 30) // BIG.page_bytes
    pool = SharedKVPool(BIG, n, prefault=False)
    conn = Connection(pool, model_id="big", config=client_config(d.runtime_dir))
    keys = conn.page_keys(np.arange(n * BIG.page_size) % 32000)
    h = conn.store(keys, list(range(n)))
    ppath = pool_path(POOL_DIR, d.runtime_dir)
    blocks = ppath.stat().st_blocks
    deadline = time.monotonic() + 30.0
    while _still_copying(h) and ppath.stat().st_blocks <= blocks:
        assert time.monotonic() < deadline, "the store's copy did not begin"
        time.sleep(0.005)
    return pool, conn, h


@pytest.mark.timeout(120)
def test_a_drain_longer_than_timeout_stop_sec_asks_systemd_for_the_time(
    daemon_factory, listener: NotifyListener
):
    """``shutdown_timeout_s`` ("how long a stop waits for transfers in flight",
    no upper bound, changeable by a reload) is the daemon's own drain deadline, while the
    unit gives the whole stop ``TimeoutStopSec=60s`` and then SIGKILLs ("drain ... with a
    deadline shorter than this"). When the operator sets a longer drain (here 2 minutes)
    and transfers are in flight at the stop, kvtierd should ask systemd for that time with
    ``EXTEND_TIMEOUT_USEC`` (sd_notify(3): also valid while stopping) along with or after
    ``STOPPING=1``, so that its drain is not cut by SIGKILL."""
    limit = seconds(unit_value("TimeoutStopSec"))
    drain = 2 * limit
    d = daemon_factory(
        *SLOW,
        "--shutdown-timeout-s",
        str(drain),
        name="s",
        env={"NOTIFY_SOCKET": str(listener.path)},
    )
    pool, conn, h = _slow_store(d)
    try:
        listener.wait_for(lambda f: f.get("READY") == "1")
        if not _still_copying(h):
            pytest.skip("the 1 GiB store ended before the stop could begin")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for(lambda f: f.get("STOPPING") == "1")
        in_flight = _still_copying(h)
        d.proc.wait(timeout=100)
        after = listener.fields()[stopping:]
        if not in_flight:
            pytest.skip("the store ended before the drain began: nothing to drain")
        extends = [int(f["EXTEND_TIMEOUT_USEC"]) for f in after if "EXTEND_TIMEOUT_USEC" in f]
        assert extends and max(extends) > limit * 1_000_000, (
            f"shutdown_timeout_s={drain} with a copy in flight, TimeoutStopSec={limit}s: "
            f"no EXTEND_TIMEOUT_USEC past {limit}s after STOPPING=1: {after!r}"
        )
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)  # the second exits at once
            d.proc.wait(timeout=30)
        conn.close()
        pool.close()
