"""``kvtier stats | sessions | flush | health``: the installed console script against real daemons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.config import format_size
from kvtier.daemon.storage.file import table_bytes

from tests.engines import OTHER, SMALL, engine, fill_page, tokens
from tests.integration.test_l3_tier import (
    fetch_back,
    l3_flags,
    load_and_compare,
    store_pages,
    wait_written,
)
from tests.servers import find_binary

pytestmark = pytest.mark.timeout(120)

KVTIER = find_binary("kvtier")


def kvtier(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the ``kvtier`` console script with a clean ``KVTIER_*`` environment plus ``env``."""
    if KVTIER is None:
        pytest.fail(f"the kvtier console script is not installed next to {sys.executable}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    base.update(env or {})
    base["COLUMNS"] = "120"  # rich wraps at the terminal width; keep rows on one line
    return subprocess.run(
        [KVTIER, *args], env=base, capture_output=True, text=True, timeout=timeout, check=False
    )


def one_line(text: str) -> str:
    """The only line of ``text`` (fails when there are more or none)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines!r}"
    return lines[0]


def stored(rdir: Path, n: int = 4, model: str = "m", geometry=SMALL, salt: int = 0):
    """A registered engine that stored ``n`` pages; returns (pool, conn, keys)."""
    pool, conn = engine(rdir, geometry, model=model)
    keys = conn.page_keys(tokens(n * geometry.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=p + 1)
    assert conn.store(keys, list(range(n))).wait()
    assert conn.lookup(keys).l2 == n
    return pool, conn, keys


# ---------------------------------------------------------------------------- health
def test_health_exits_0_when_serving_and_1_once_the_daemon_is_gone(daemon):
    r = kvtier("health", "--runtime-dir", str(daemon.runtime_dir))
    assert r.returncode == 0, r.stderr
    line = one_line(r.stdout)
    assert line.startswith("ok: ") and str(daemon.socket) in line and "0 sessions" in line
    # the endpoint found through the environment, as engines find it
    r = kvtier("health", env={"KVTIER_RUNTIME_DIR": str(daemon.runtime_dir)})
    assert r.returncode == 0 and r.stdout.startswith("ok: ")
    assert kvtier("health", "--endpoint", daemon.endpoint).returncode == 0
    assert kvtier("health", "--endpoint", str(daemon.socket)).returncode == 0
    assert daemon.stop() == 0
    r = kvtier("health", "--runtime-dir", str(daemon.runtime_dir), "--timeout", "1")
    assert r.returncode == 1
    assert one_line(r.stdout).startswith("unhealthy: kvtierd is not running")
    assert "kvtier serve" in r.stdout  # how to start one


def test_health_exits_1_when_a_killed_daemon_left_its_socket_behind(daemon):
    daemon.kill()
    assert daemon.socket.exists()  # kill -9: nobody removed it, so the client must time out
    r = kvtier("health", "--runtime-dir", str(daemon.runtime_dir), "--timeout", "0.5")
    assert r.returncode == 1
    assert one_line(r.stdout).startswith("unhealthy: ")
    assert "did not answer" in r.stdout or "not reachable" in r.stdout


# ---------------------------------------------------------------------------- stats
def test_stats_table_and_json_show_pool_sessions_hits_and_bytes(daemon):
    pool, conn, keys = stored(daemon.runtime_dir, n=3)
    try:
        assert conn.load(keys, [10, 11, 12]).wait()
        r = kvtier("stats", "--runtime-dir", str(daemon.runtime_dir))
        assert r.returncode == 0, r.stderr
        out = r.stdout
        for text in (
            "L2 host pool",
            "Hit rates",
            "Bytes moved",
            "L3 storage",
            "sessions    1",
            "adopted at start",
            "started empty (no pool file",
            "of 64.0 MiB",
            "3 of 3 (100.0%)",
            "engine → L2",
            "L2 → engine",
            f"{3 * SMALL.page_size:,} tokens loaded",
        ):
            assert text in out, f"{text!r} missing from:\n{out}"
        r = kvtier("stats", "--json", "--runtime-dir", str(daemon.runtime_dir))
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert snap["pool"]["pages_ready"] == 3
        assert snap["counters"]["store_pages"] == 3
        assert snap["counters"]["bytes_to_engine"] == 3 * SMALL.page_bytes
        assert [s["pid"] for s in snap["sessions"]] == [os.getpid()]
    finally:
        conn.close()
        pool.close()


def test_stats_watch_refreshes_a_bounded_number_of_times(daemon):
    rdir = str(daemon.runtime_dir)
    r = kvtier("stats", "--runtime-dir", rdir, "--watch", "0.1", "--count", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("L2 host pool") == 3
    r = kvtier("stats", "--runtime-dir", rdir, "--watch", "0.1", "--count", "3", "--json")
    assert r.returncode == 0, r.stderr
    frames = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(frames) == 3
    # each frame is a new STATS snapshot: the daemon counts every request it answers
    requests = [f["counters"]["requests"] for f in frames]
    assert requests[0] < requests[1] < requests[2], requests
    # a daemon that goes away: each refresh reports it, and the last one sets the status
    assert daemon.stop() == 0
    r = kvtier("stats", "--runtime-dir", rdir, "--watch", "0.1", "--count", "2", "--json")
    assert r.returncode == 1
    assert [json.loads(line).keys() for line in r.stdout.splitlines()] == [{"error"}, {"error"}]


def test_sessions_table_and_json(daemon):
    r = kvtier("sessions", "--runtime-dir", str(daemon.runtime_dir))
    assert r.returncode == 0 and one_line(r.stdout) == "no sessions"
    pa, ca, ka = stored(daemon.runtime_dir, n=1, model="a")
    pb, cb, kb = stored(daemon.runtime_dir, n=1, model="b", geometry=OTHER)
    try:
        r = kvtier("sessions", "--runtime-dir", str(daemon.runtime_dir))
        assert r.returncode == 0, r.stderr
        assert "2 sessions" in r.stdout
        assert r.stdout.count(str(os.getpid())) == 2
        assert (
            format_size(SMALL.page_bytes) in r.stdout and format_size(OTHER.page_bytes) in r.stdout
        )
        r = kvtier("sessions", "--json", "--runtime-dir", str(daemon.runtime_dir))
        sessions = json.loads(r.stdout)
        assert sorted(s["session_id"] for s in sessions) == sorted([ca.session_id, cb.session_id])
        assert {s["tenant"] for s in sessions} == {"default"}
        assert {s["page_bytes"] for s in sessions} == {SMALL.page_bytes, OTHER.page_bytes}
        # each session's model and namespace: what `kvtier flush --namespace HEX` takes
        named = {s["model_id"]: s["namespace"] for s in sessions}
        assert named == {"a": ca.ns_fingerprint.hex(), "b": cb.ns_fingerprint.hex()}
        r = kvtier("flush", "--namespace", named["a"], "--runtime-dir", str(daemon.runtime_dir))
        assert r.returncode == 0 and "flushed 1 L2 pages" in r.stdout, r.stdout + r.stderr
        assert (ca.lookup(ka).l2, cb.lookup(kb).l2) == (0, 1)  # b's page stays
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()


def test_namespaces_list_the_pools_namespaces_also_after_their_engines_left(daemon):
    """An operator finds the namespace of a model whose engines are gone (to flush it):
    `kvtier namespaces` lists each namespace L2 holds pages of, most pages first, with its
    sessions, tenant and model, and the namespace whole, as `flush --namespace` takes it."""
    rdir = str(daemon.runtime_dir)
    r = kvtier("namespaces", "--runtime-dir", rdir)
    assert r.returncode == 0 and one_line(r.stdout) == "no namespaces", r.stdout + r.stderr
    pa, ca, _ = stored(daemon.runtime_dir, n=3, model="gone-model")
    gone = ca.ns_fingerprint.hex()
    ca.close()
    pa.close()
    pb, cb, kb = stored(daemon.runtime_dir, n=2, model="live-model", geometry=OTHER)
    try:
        r = kvtier("namespaces", "--json", "--runtime-dir", rdir)
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert rows == [
            {
                "namespace": gone,
                "pages": 3,
                "sessions": 0,
                "tenant": "default",
                "models": ["gone-model"],
            },
            {
                "namespace": cb.ns_fingerprint.hex(),
                "pages": 2,
                "sessions": 1,
                "tenant": "default",
                "models": ["live-model"],
            },
        ], rows
        r = kvtier("namespaces", "--runtime-dir", rdir)
        assert r.returncode == 0 and "2 namespaces" in r.stdout and gone in r.stdout, r.stdout
        r = kvtier("flush", "--namespace", gone, "--runtime-dir", rdir)
        assert r.returncode == 0 and "flushed 3 L2 pages" in r.stdout, r.stdout + r.stderr
        rows = json.loads(kvtier("namespaces", "--json", "--runtime-dir", rdir).stdout)
        assert [row["namespace"] for row in rows] == [cb.ns_fingerprint.hex()]
        assert cb.lookup(kb).l2 == 2
    finally:
        cb.close()
        pb.close()


def test_namespaces_adopted_by_a_restart_are_still_the_default_tenants(daemon):
    """Without tenants configured every namespace is the default tenant's, also the ones a
    restarted kvtierd adopted with the pool (no engine of theirs has registered since)."""
    rdir = str(daemon.runtime_dir)
    pool, conn, _ = stored(daemon.runtime_dir, n=2, model="m1")
    fp = conn.ns_fingerprint.hex()
    conn.close()
    pool.close()
    assert daemon.stop() == 0
    daemon.start()
    r = kvtier("namespaces", "--json", "--runtime-dir", rdir)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["namespace"], row["pages"], row["tenant"]) for row in rows] == [
        (fp, 2, "default")
    ], rows


# ---------------------------------------------------------------------------- flush and admin
def test_flush_and_stats_need_the_admin_token_when_one_is_configured(daemon_factory):
    d = daemon_factory("--admin-token", "s3cret")
    rdir = str(d.runtime_dir)
    pool, conn, keys = stored(d.runtime_dir, n=4)
    try:
        for args, env in (
            (("flush",), None),
            (("flush", "--admin-token", "wrong-token"), None),
            (("flush",), {"KVTIER_ADMIN_TOKEN": "wrong-token"}),
            (("stats",), None),
            (("sync", "--wait", "1"), None),
        ):
            r = kvtier(*args, "--runtime-dir", rdir, env=env)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            line = one_line(r.stderr)
            assert "UNAUTHORIZED" in line
            # the hint: where this command takes the token from, where the daemon's comes from
            assert "--admin-token or $KVTIER_ADMIN_TOKEN" in line and "admin_token" in line
            assert "wrong-token" not in r.stderr + r.stdout
        assert conn.lookup(keys).l2 == 4  # nothing was dropped
        r = kvtier("flush", "--runtime-dir", rdir, env={"KVTIER_ADMIN_TOKEN": "s3cret"})
        assert r.returncode == 0, r.stderr
        assert one_line(r.stdout).startswith("flushed 4 L2 pages")
        assert conn.lookup(keys).l2 == 0
        r = kvtier("stats", "--json", "--runtime-dir", rdir, "--admin-token", "s3cret")
        assert r.returncode == 0 and json.loads(r.stdout)["pool"]["pages_ready"] == 0
    finally:
        conn.close()
        pool.close()


def test_flush_one_namespace_leaves_the_others(daemon):
    pa, ca, ka = stored(daemon.runtime_dir, n=4, model="a")
    pb, cb, kb = stored(daemon.runtime_dir, n=3, model="b")
    try:
        r = kvtier(
            "flush",
            "--runtime-dir",
            str(daemon.runtime_dir),
            "--tier",
            "l2",
            "--namespace",
            ca.ns_fingerprint.hex(),
        )
        assert r.returncode == 0, r.stderr
        assert one_line(r.stdout).startswith("flushed 4 L2 pages")
        assert ca.lookup(ka).l2 == 0
        assert cb.lookup(kb).l2 == 3
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()


@pytest.mark.parametrize(
    "args",
    [
        ("flush", "--tier", "l4"),
        ("flush", "--namespace", "zz"),
        ("flush", "--namespace", "ab" * 31),
        ("stats", "--watch", "0"),
        ("stats", "--watch", "nan"),
        ("stats", "--count", "2"),
        ("stats", "--bogus"),
        ("health", "--timeout", "-1"),
        ("health", "--runtime-dir", "/tmp/x", "--endpoint", "ipc:///tmp/x/s"),
    ],
)
def test_usage_errors_exit_2_with_one_line_and_send_nothing(daemon, args):
    r = (
        kvtier(*args[:1], "--runtime-dir", str(daemon.runtime_dir), *args[1:])
        if "--runtime-dir" not in args
        else kvtier(*args)
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = one_line(r.stderr)
    assert line.startswith(f"kvtier {args[0]}: ") and "--help" in line
    assert r.stdout == ""


def test_bad_environment_is_a_usage_error():
    r = kvtier("health", env={"KVTIER_REQUEST_TIMEOUT_S": "soon"})
    assert r.returncode == 2
    assert "KVTIER_REQUEST_TIMEOUT_S" in one_line(r.stderr)


def test_flush_all_gives_the_file_stores_disk_space_back(daemon_factory, short_tmp):
    store = short_tmp / "l3"
    d = daemon_factory(
        *l3_flags("file", {"path": str(store), "segment_bytes": "1MiB"}, prefetch_threshold="0")
    )

    def allocated() -> tuple[int, int]:
        """(bytes the segment files hold on disk, bytes of their header tables)."""
        segs = list(store.glob("seg-*.kvt"))
        tables = sum(table_bytes(int(s.name[4:].split("-")[0].split("x")[1])) for s in segs)
        return sum(s.stat().st_blocks * 512 for s in segs), tables

    pool, conn = engine(d.runtime_dir, num_pages=64)
    try:
        keys, _ = store_pages(pool, conn, 24)
        wait_written(d, 24)
        on_disk, tables = allocated()
        assert on_disk >= tables + 24 * SMALL.page_bytes  # preallocated segments
        r = kvtier("flush", "--tier", "all", "--runtime-dir", str(d.runtime_dir))
        assert r.returncode == 0, r.stderr
        assert one_line(r.stdout).startswith("flushed 24 L2 pages and 24 L3 pages")
        on_disk, tables = allocated()
        assert on_disk <= tables + 4096 * len(list(store.glob("seg-*.kvt")))  # the tables, about
        # the store still works: pages written to it again come back from it
        keys, expected = store_pages(pool, conn, 6, salt=5, seed=5)
        wait_written(d, 24 + 6)
        assert kvtier("flush", "--tier", "l2", "--runtime-dir", str(d.runtime_dir)).returncode == 0
        assert fetch_back(conn, keys) == 6
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()
