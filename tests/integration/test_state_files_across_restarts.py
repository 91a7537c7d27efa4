"""The small state kvtierd keeps across restarts besides the pool file (the tenant
-> namespaces map a tenant's FLUSH of L3 uses, and other state-directory files), against
real kvtierd processes, a real file L3 store and real clients."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine
from tests.integration.test_admin_plane_scope import store
from tests.key_chain import spec_fingerprint

TOKEN_A = "tok-a-p5rs1s"
TOKEN_B = "tok-b-p5rs1s"
ADMIN = "adm-p5rs1s"
TENANTS = json.dumps({"a": {"token": TOKEN_A}, "b": {"token": TOKEN_B}})
MAP_FILE = "tenant-namespaces.msgpack"
MAX_ENTRIES = 65536


def flags(state: Path, *more: str) -> list[str]:
    return [
        "--tenants",
        TENANTS,
        "--admin-token",
        ADMIN,
        "--hicache-storage-backend",
        "file",
        "--state-dir",
        str(state),
        *more,
    ]


def call(d, msg: P.Request, token: str = "", wait_s: float = 30.0) -> P.Reply:
    with AdminClient(d.endpoint, timeout_s=15.0, admin_token=token) as admin:
        return admin.call(msg, wait_s=wait_s)


def sync(d) -> None:
    rep = call(d, P.Sync(req_id=0, admin_token=ADMIN, timeout_s=20.0), ADMIN)
    assert isinstance(rep, P.SyncReply) and rep.left == 0 and rep.failed == 0, rep


def flush_l3(d, token: str) -> P.FlushReply:
    rep = call(d, P.Flush(req_id=0, tier="l3", admin_token=token), token)
    assert isinstance(rep, P.FlushReply), rep
    return rep


def fp(i: int) -> bytes:
    return (0xB0B << 200 | i).to_bytes(32, "big")


# ------------------------------------------------------------------ the tenant map
@pytest.mark.timeout(120)
def test_a_tenants_l3_flush_reaches_its_namespace_after_a_crash_soon_after_it_stored(
    daemon_factory, short_tmp
):
    """Tenant a's engine registers, stores 3 pages and they are written to the file L3
    store (SYNC answered). kvtierd is then killed (SIGKILL: a crash, the OOM killer) and
    started again on the same state directory. The L3 objects survived the crash, so tenant
    a's FLUSH of L3 (with its tenant token) deletes those 3 pages; nothing of a's is left
    for the admin's FLUSH of L3 to find."""
    state = short_tmp / "state"
    d = daemon_factory(*flags(state))
    pool, conn = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    try:
        store(conn, pool, 3, salt=11)
        sync(d)
        d.kill()
    finally:
        conn.close()
        pool.close()
    d.start()
    rep = flush_l3(d, TOKEN_A)
    left = flush_l3(d, ADMIN)
    assert (rep.l3_pages, rep.l3_error, left.l3_pages) == (3, "", 0), (
        f"after a crash, tenant a's FLUSH of L3 deleted {rep.l3_pages} of its 3 L3 pages "
        f"(l3_error {rep.l3_error!r}); the admin's FLUSH then found {left.l3_pages} still there"
    )


@pytest.mark.timeout(180)
def test_a_tenants_live_namespace_is_not_pushed_out_of_the_map_by_another_tenant(
    daemon_factory, short_tmp
):
    """The tenant map holds the latest 65,536 namespaces. Tenant a's engine registered its
    namespace first, long ago; tenant b has since registered 65,535 other namespaces (the
    planted file is exactly the map kvtierd writes then). a's engine registers again (it is
    in use), stores 3 pages that reach L3, then b registers one more namespace. a's own
    FLUSH of L3 must still delete a's 3 L3 pages: a namespace in use now is among the
    latest seen, and another tenant's churn never makes a's FLUSH report success while its
    pages stay in L3."""
    state = short_tmp / "state"
    state.mkdir(parents=True)
    mine = spec_fingerprint(SMALL, model_id="m", tenant="a")
    fps = [mine] + [fp(i) for i in range(MAX_ENTRIES - 1)]
    tenants = ["a"] + ["b"] * (MAX_ENTRIES - 1)
    (state / MAP_FILE).write_bytes(msgspec.msgpack.encode([1, fps, tenants]))
    os.chmod(state / MAP_FILE, 0o600)
    d = daemon_factory(*flags(state))
    pa, ca = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    try:
        assert ca.ns_fingerprint == mine
        store(ca, pa, 3, salt=21)
        sync(d)
        pb, cb = engine(d.runtime_dir, model="b-new", tenant="b", token=TOKEN_B)
        cb.close()
        pb.close()
        rep = flush_l3(d, TOKEN_A)
        left = flush_l3(d, ADMIN)
    finally:
        ca.close()
        pa.close()
    assert (rep.l3_pages, rep.l3_error, left.l3_pages) == (3, "", 0), (
        f"tenant a's FLUSH of L3 deleted {rep.l3_pages} of its 3 L3 pages (l3_error "
        f"{rep.l3_error!r}) while its engine was registered; the admin's FLUSH then found "
        f"{left.l3_pages} still there"
    )


# ------------------------------------------------------------------ planted state files
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name", ["tenant-namespaces.msgpack", "kv-event-hashes.msgpack", "kv-event-namespaces.log"]
)
def test_a_state_file_that_is_not_a_regular_file_is_ignored_at_start(
    daemon_factory, short_tmp, name
):
    """The state directory's small files are read at start as untrusted input, "bounded in
    size" and refused whole with a warning naming the file, the daemon then starting
    without them. One that is not a regular file at all (here a FIFO left where the file
    belongs) is refused the same way: kvtierd becomes healthy (within its usual start
    time, here 30 s) and logs a line naming the file, never sitting forever in its start
    (which under systemd is a restart loop with no error to read)."""
    state = short_tmp / "state"
    state.mkdir(parents=True)
    os.mkfifo(state / name, 0o600)
    d = daemon_factory(
        *flags(state, "--kv-events-endpoint", f"ipc://{short_tmp}/ev.sock"), start=False
    )
    try:
        d.start(timeout=30.0)
        started = True
    except Exception as err:  # DaemonStartError: not healthy in time
        started, why = False, str(err)[-600:]
    assert started, f"kvtierd did not start with a FIFO at {name} in its state directory: {why}"
    assert name in d.log_tail(200), d.log_tail(40)
