"""``kvtier pools``: lists the pool files with their runtime dir and holder; removes only
the ones no daemon holds. Real daemons with their pools in a temp ``pool_dir``.

The runtime-dir column and "held" by lock need the runtime-dir wiring in
``daemon/service/server.py`` (the pool file's tag and the lock); without it, a running
daemon is still seen as the holder through its mapping of the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.config.loader import pool_path

pytestmark = pytest.mark.timeout(120)


def pools(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier pools ARGS`` as a separate process (``env``: its environment)."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "pools", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def listing(pool_dir: Path) -> dict[str, dict]:
    done = pools("--pool-dir", str(pool_dir), "--json")
    assert done.returncode == 0, done.stderr
    return {row["path"]: row for row in json.loads(done.stdout)}


def test_wired_pools_lists_held_and_stale_pools_and_removes_only_the_stale(
    daemon_factory, short_tmp: Path
) -> None:
    shm = short_tmp / "shm"
    shm.mkdir()
    (shm / "not-a-pool").write_bytes(b"x")
    live = daemon_factory("--pool-dir", str(shm), name="live")
    gone = daemon_factory("--pool-dir", str(shm), name="gone")
    assert gone.stop() == 0  # its pool stays behind (keep_pool_on_stop)
    live_pool = str(pool_path(shm, live.runtime_dir))
    gone_pool = str(pool_path(shm, gone.runtime_dir))

    rows = listing(shm)
    assert set(rows) == {live_pool, gone_pool}
    assert (rows[live_pool]["held"], rows[live_pool]["holder_pid"]) == ("yes", live.pid)
    assert rows[gone_pool]["held"] == "no" and rows[gone_pool]["holder_pid"] is None
    for path, d in ((live_pool, live), (gone_pool, gone)):
        assert rows[path]["runtime_dir"] == str(d.runtime_dir)
        assert rows[path]["uid"] == os.geteuid() and rows[path]["mode"] == "0600"
        assert rows[path]["size"] == os.stat(path).st_size > 64 << 20
        assert rows[path]["header"].startswith("kvtier v2, 64.0 MiB")

    table = pools("--pool-dir", str(shm))
    assert table.returncode == 0 and live_pool in table.stdout and gone_pool in table.stdout
    assert f"yes (pid {live.pid})" in table.stdout

    refused = pools("--pool-dir", str(shm), "--remove", live_pool)
    assert refused.returncode == 1 and "held by a running kvtierd" in refused.stderr
    assert os.path.exists(live_pool)

    stale = pools("--pool-dir", str(shm), "--stale")
    assert stale.returncode == 0, stale.stderr
    assert stale.stdout.splitlines() == [f"removed {gone_pool} (66.0 MiB)"]  # 2 MiB metadata
    assert not os.path.exists(gone_pool) and os.path.exists(live_pool)
    assert (shm / "not-a-pool").exists()

    with_daemon = listing(shm)
    assert list(with_daemon) == [live_pool]
    assert live.proc is not None and live.proc.poll() is None  # still serving
    assert live.stop() == 0
    done = pools("--pool-dir", str(shm), "--remove", live_pool)
    assert done.returncode == 0 and done.stdout.startswith(f"removed {live_pool}"), done
    assert listing(shm) == {}


def test_pools_remove_refuses_what_is_not_a_pool_file(short_tmp: Path) -> None:
    other = short_tmp / "precious"
    other.write_bytes(b"x")
    done = pools("--pool-dir", str(short_tmp), "--remove", str(other))
    assert done.returncode == 2 and "is not a kvtier pool file" in done.stderr
    assert other.exists()
    missing = pools("--pool-dir", str(short_tmp), "--remove", str(short_tmp / "kvtier-pool-0"))
    assert missing.returncode == 1 and "no such pool file" in missing.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another uid needs root")
def test_pools_removes_a_file_another_uid_planted_where_a_pool_goes(short_tmp: Path) -> None:
    """What the daemon's refusal of such a file tells the operator to run."""
    planted = short_tmp / "kvtier-pool-0123456789abcdef"
    planted.write_bytes(b"\0" * 8192)
    os.chown(planted, 4343, 4343)
    os.chmod(planted, 0o666)
    rows = listing(short_tmp)
    assert rows[str(planted)]["held"] == "no" and rows[str(planted)]["uid"] == 4343
    assert rows[str(planted)]["header"] == "no kvtier header (empty)"
    done = pools("--pool-dir", str(short_tmp), "--remove", str(planted))
    assert done.returncode == 0, done.stderr
    assert not planted.exists()


def test_a_pool_file_whose_lock_is_held_is_held_and_never_removed(short_tmp: Path) -> None:
    """A kvtierd holds an exclusive lock on the pool file it maps: a file whose lock a
    process holds is listed held by that pid, and ``--remove`` refuses it, even when its
    runtime directory is gone and the process does not map it (here: a process that only
    locks it)."""
    shm = short_tmp / "shm"
    shm.mkdir()
    path = shm / "kvtier-pool-0123456789abcdef"
    path.write_bytes(b"\0" * 4096)
    path.chmod(0o600)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        row = listing(shm)[str(path)]
        assert (row["held"], row["holder_pid"]) == ("yes", holder.pid), row
        refused = pools("--pool-dir", str(shm), "--remove", str(path))
        assert refused.returncode == 1 and "held" in refused.stderr, refused.stderr
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert listing(shm)[str(path)]["held"] != "yes"  # its lock went with its holder


def test_pools_reads_pool_dir_from_the_daemons_config_file(short_tmp: Path) -> None:
    """A service whose config file moves pool_dir (systemd: /etc/kvtier/kvtierd.toml) has
    its pools listed with ``--config`` or ``$KVTIER_CONFIG``; ``--pool-dir`` and
    ``$KVTIER_POOL_DIR`` beat the file, as they do for kvtierd; a bad file is named."""
    shm = short_tmp / "shm"
    shm.mkdir()
    path = shm / "kvtier-pool-0123456789abcdef"
    path.write_bytes(b"\0" * 4096)
    cfg = short_tmp / "kvtierd.toml"
    cfg.write_text(f'pool_dir = "{shm}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    for args, extra in ((("--config", str(cfg)), {}), ((), {"KVTIER_CONFIG": str(cfg)})):
        done = pools(*args, "--json", env={**env, **extra})
        assert done.returncode == 0, done.stderr
        assert [row["path"] for row in json.loads(done.stdout)] == [str(path)]
    other = short_tmp / "other"
    other.mkdir()
    for args, extra in (
        (("--config", str(cfg), "--pool-dir", str(other)), {}),
        (("--config", str(cfg)), {"KVTIER_POOL_DIR": str(other)}),
    ):
        done = pools(*args, "--json", env={**env, **extra})
        assert done.returncode == 0 and json.loads(done.stdout) == [], done.stderr
    cfg.write_text("pool_dirr = 1\n")
    bad = pools("--config", str(cfg), env=env)
    assert bad.returncode == 2 and "pool_dirr" in bad.stderr, bad.stderr
    # a file that does not decide pool_dir is not read: it cannot stop the command
    for args, extra in (
        (("--pool-dir", str(shm), "--json"), {"KVTIER_CONFIG": str(cfg)}),
        (("--json",), {"KVTIER_CONFIG": str(cfg), "KVTIER_POOL_DIR": str(shm)}),
    ):
        done = pools(*args, env={**env, **extra})
        assert done.returncode == 0, done.stderr
        assert [row["path"] for row in json.loads(done.stdout)] == [str(path)]
    gone = pools("--remove", str(shm / "kvtier-pool-00"), env={**env, "KVTIER_CONFIG": str(cfg)})
    assert gone.returncode == 1 and "no such pool file" in gone.stderr, gone.stderr
