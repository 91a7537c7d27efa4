"""The admin plane against real kvtierd processes: who may SYNC and FLUSH, what a tenant's
FLUSH reaches after a restart, the CLI's handling of its own ``--timeout`` and the label
set of the metrics endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P
from prometheus_client.parser import text_string_to_metric_families

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_admin_cli import kvtier
from tests.servers import free_port

pytestmark = pytest.mark.timeout(60)

TOKEN_A = "tok-a-3e71c9"
TOKEN_B = "tok-b-8d02f4"
ADMIN = "adm-51be07"
TENANTS = json.dumps({"a": {"token": TOKEN_A}, "b": {"token": TOKEN_B}})
REPO = Path(__file__).parents[2]


def store(conn, pool, n: int, salt: int) -> list[bytes]:
    """Store ``n`` pages through ``conn``; return their keys."""
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=salt + p)
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    assert conn.lookup(keys).l2 == n
    return keys


def call(d, msg: P.Request, token: str = "", wait_s: float = 15.0) -> P.Reply:
    """One request from a connection that registered nothing."""
    with AdminClient(d.endpoint, timeout_s=10.0, admin_token=token) as admin:
        return admin.call(msg, wait_s=wait_s)


# ---------------------------------------------------------------------------- SYNC
def test_sync_with_tenants_and_no_admin_token_is_refused_without_a_credential(daemon_factory):
    """With tenants configured, SYNC is admin-only: where no admin_token is set, nobody may
    SYNC, and a request with no credential at all is refused UNAUTHORIZED naming
    ``admin_token`` (its reply would tell the caller how many pages every tenant holds in
    L2 but not in L3)."""
    d = daemon_factory(
        "--tenants",
        TENANTS,
        "--hicache-storage-backend",
        "file",
        "--hicache-write-policy",
        "write_back",
    )
    pool, conn = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    try:
        store(conn, pool, 3, salt=40)
        rep = call(d, P.Sync(req_id=0, admin_token="", timeout_s=5.0))
    finally:
        conn.close()
        pool.close()
    assert isinstance(rep, P.ErrorReply), f"an uncredentialed SYNC was served: {rep}"
    assert rep.code == P.ErrorCode.UNAUTHORIZED and "admin_token" in rep.message


# ---------------------------------------------------------------------------- FLUSH
def test_a_tenants_l3_flush_after_a_restart_drops_its_l3_pages(daemon_factory):
    """A tenant's FLUSH of L3 (with its tenant token) deletes that tenant's L3 pages, also
    those written before the daemon restarted: the file store keeps them across the
    restart and the admin's FLUSH finds them."""
    d = daemon_factory(
        "--tenants", TENANTS, "--admin-token", ADMIN, "--hicache-storage-backend", "file"
    )
    pool, conn = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    try:
        store(conn, pool, 3, salt=50)
        synced = call(d, P.Sync(req_id=0, admin_token=ADMIN, timeout_s=10.0), ADMIN)
        assert isinstance(synced, P.SyncReply) and synced.left == 0 and synced.failed == 0
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    d.start()
    rep = call(d, P.Flush(req_id=0, tier="l3", admin_token=TOKEN_A))
    assert isinstance(rep, P.FlushReply), rep
    left = call(d, P.Flush(req_id=0, tier="l3", admin_token=ADMIN), ADMIN)
    assert isinstance(left, P.FlushReply), left
    assert (rep.l3_pages, left.l3_pages) == (3, 0), (
        f"tenant a's L3 flush deleted {rep.l3_pages} of its 3 L3 pages; "
        f"{left.l3_pages} were still there for the admin's flush"
    )


# a FLUSH by an engine session of another user, as that user (the daemon runs as root)
GROUP = 4610
MALLORY = 4611
CHILD = r"""
import json, os, sys
from pathlib import Path
from kvtier.ipc import protocol as P
from tests.engines import SMALL, engine

uid, gid, rdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
os.setgroups([gid])
os.setgid(gid)
os.setuid(uid)
pool, conn = engine(rdir, model="mallory")
try:
    rep = conn._session_call(
        lambda sid: P.Flush(req_id=0, session_id=sid, tier="l2"), P.FlushReply
    )
    print(json.dumps({"uid": os.getuid(), "l2_pages": rep.l2_pages}), flush=True)
finally:
    conn.close()
    pool.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs an engine as another uid")
def test_another_users_engine_session_cannot_flush_the_daemon_without_the_admin_token(
    short_tmp, daemon_factory
):
    """With admin_token set (and no tenants), FLUSH needs the admin token: an engine of
    another user, in the daemon's group, flushing through its own session without the
    token drops no page of a model it never registered (here root's 4 pages of model
    ``victim`` stay in L2)."""
    short_tmp.chmod(0o711)
    rdir = short_tmp / "d0"
    rdir.mkdir()
    os.chown(rdir, 0, GROUP)
    rdir.chmod(0o750)
    d = daemon_factory("--admin-token", ADMIN)
    pool, conn = engine(d.runtime_dir, model="victim")
    try:
        keys = store(conn, pool, 4, salt=60)
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(MALLORY), str(GROUP), str(d.runtime_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=45,
            env={**os.environ, "HOME": "/tmp"},
        )
        assert child.returncode == 0 or "UNAUTHORIZED" in child.stderr, child.stderr[-2000:]
        out = json.loads(child.stdout) if child.returncode == 0 else {"l2_pages": 0}
        assert out.get("uid", MALLORY) == MALLORY
        held = conn.lookup(keys).l2
    finally:
        conn.close()
        pool.close()
    assert (out["l2_pages"], held) == (0, 4), (
        f"uid {MALLORY}'s session flush dropped {out['l2_pages']} pages; "
        f"root's model 'victim' holds {held} of its 4"
    )


# ---------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("command", ["health", "stats"])
def test_a_long_timeout_is_served_or_refused_as_usage_never_a_traceback(daemon, command):
    """``--timeout`` accepts any finite positive number of seconds: a long one (1e7 s)
    either waits that long at most (the daemon answers at once: exit 0) or is refused as
    bad usage (exit 2, one line on stderr); never a Python traceback."""
    r = kvtier(command, "--runtime-dir", str(daemon.runtime_dir), "--timeout", "1e7")
    assert "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.returncode in (0, 2), (r.returncode, r.stdout, r.stderr)
    if r.returncode == 2:
        assert len(r.stderr.strip().splitlines()) == 1 and "--timeout" in r.stderr


def test_kvtier_events_without_a_timeout_waits_for_its_events(daemon_factory, short_tmp):
    """``kvtier events`` with its default ``--timeout 0`` (never stop for quiet) waits as
    long as it takes: started before anything is stored, it prints the event of a store
    made a second later and stops at ``--count 1``, exit 0, no traceback."""
    ev, rep = f"ipc://{short_tmp}/ev.sock", f"ipc://{short_tmp}/evr.sock"
    d = daemon_factory("--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rep)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    cli = Path(sys.executable).with_name("kvtier")
    tail = subprocess.Popen(
        [str(cli), "events", "--endpoint", ev, "--replay", rep, "--json", "--count", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pool, conn = engine(d.runtime_dir, model="tail")
    try:
        time.sleep(1.0)  # the subscriber waits on a quiet stream
        store(conn, pool, 2, salt=90)
        out, err = tail.communicate(timeout=30)
    finally:
        tail.kill()
        conn.close()
        pool.close()
    assert "Traceback" not in err, err[-1500:]
    assert tail.returncode == 0, err[-1500:]
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["BlockStored"]


# ---------------------------------------------------------------------------- metrics
def test_engines_that_left_do_not_grow_the_page_class_label_set(daemon_factory):
    """``kvtier_pool_class_extents`` has one series per page size among the engines: once
    engines of 200 distinct page sizes have registered and closed (no page stored), no
    class is left to report, so a client cannot grow the endpoint's label set (or the STATS
    ``pool.classes`` list) without bound by registering made-up geometries."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    for head_dim in range(1, 201):
        g = P.Geometry(num_layers=1, page_size=1, kv_heads=1, head_dim=head_dim, dtype="float16")
        pool, conn = engine(d.runtime_dir, g, num_pages=1, model="x")
        conn.close()
        pool.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as rep:
        text = rep.read().decode()
    series = [
        s.labels["page_bytes"]
        for fam in text_string_to_metric_families(text)
        if fam.name == "kvtier_pool_class_extents"
        for s in fam.samples
    ]
    assert len(series) == 0, f"{len(series)} page-class series left by closed engines"


def test_engines_bring_at_most_256_page_sizes(daemon_factory):
    """The pool holds pages of at most 256 page sizes from engines: with 256 sizes holding
    cached pages (no session open), a REGISTER with a 257th takes over the class of the
    size used the longest ago (its page is dropped, the others stay), and a size already
    known still registers without taking anything."""
    d = daemon_factory("--hicache-size", "64MiB", "--extent-size", "256KiB")

    def geometry(head_dim: int) -> P.Geometry:
        return P.Geometry(num_layers=1, page_size=1, kv_heads=1, head_dim=head_dim, dtype="float16")

    def held(head_dim: int) -> int:
        pool, conn = engine(d.runtime_dir, geometry(head_dim), num_pages=1, model="x")
        try:
            return conn.lookup(conn.page_keys([head_dim])).l2
        finally:
            conn.close()
            pool.close()

    for head_dim in range(1, 257):  # each size keeps a page (and an extent) in the pool
        pool, conn = engine(d.runtime_dir, geometry(head_dim), num_pages=1, model="x")
        assert conn.store(conn.page_keys([head_dim]), [0]).wait()
        conn.close()
        pool.close()
    assert held(3) == 1  # a known size registers and takes nothing
    pool, conn = engine(d.runtime_dir, geometry(257), num_pages=1, model="x")
    assert conn.store(conn.page_keys([257]), [0]).wait()
    conn.close()
    pool.close()
    assert held(2) == 1 and held(257) == 1
    assert held(1) == 0  # the oldest size's page went with its class
