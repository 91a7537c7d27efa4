"""With tenants configured, STATS, SESSIONS and FLUSH never show or drop another tenant's
data: without the admin token a request is scoped to the caller's tenant (its connection's
sessions, or the tenant token it carries) or refused UNAUTHORIZED naming ``admin_token``;
the admin token, when one is set, still sees and flushes everything."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_admin_cli import kvtier

pytestmark = pytest.mark.timeout(120)

TOKEN_A = "tok-a-71c0de"
TOKEN_B = "tok-b-2be4f1"
ADMIN = "adm-9e13a7"
TENANTS = json.dumps({"a": {"token": TOKEN_A}, "b": {"token": TOKEN_B}})


def stored(conn: Connection, pool: SharedKVPool, n: int, salt: int) -> list[bytes]:
    """Store ``n`` pages through ``conn``; return their keys."""
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=salt + p)
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    assert conn.lookup(keys).l2 == n
    return keys


def call(d: Any, msg: P.Stats | P.Flush, token: str = "") -> P.Reply:
    """Send one request, carrying ``token`` as its credential, from a connection that
    registered nothing."""
    msg.admin_token = token
    with AdminClient(d.endpoint, timeout_s=10.0) as admin:
        return admin.call(msg)


def refused(rep: P.Reply) -> str:
    """The message of an UNAUTHORIZED reply (fails on anything else)."""
    assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED, rep
    return rep.message


@pytest.fixture(params=["no-admin-token", "admin-token"])
def tenants_daemon(request, daemon_factory) -> Iterator[tuple[Any, ...]]:
    """A daemon with tenants a and b (and an admin token, per param); a stored 3 pages, b 5."""
    flags = ["--tenants", TENANTS]
    if request.param == "admin-token":
        flags += ["--admin-token", ADMIN]
    d = daemon_factory(*flags)
    pa, ca = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    pb, cb = engine(d.runtime_dir, model="m", tenant="b", token=TOKEN_B)
    try:
        ka, kb = stored(ca, pa, 3, salt=10), stored(cb, pb, 5, salt=20)
        yield d, request.param == "admin-token", (ca, ka), (cb, kb)
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()


def test_a_tenants_stats_show_its_own_sessions_and_pages_only(tenants_daemon):
    d, _, (ca, _), (cb, _) = tenants_daemon
    for snap in (ca.stats(), call(d, P.Stats(req_id=0), TOKEN_A).stats):
        assert snap["scope"] == {"tenants": ["a"]}
        assert [s["tenant"] for s in snap["sessions"]] == ["a"]
        assert snap["tenants"] == {"a": {"pages": 3, "quota_pages": None}}
        assert not {"pool", "counters", "l3", "adopt"} & set(snap)  # nothing daemon-wide
    snap = cb.stats()
    assert ([s["tenant"] for s in snap["sessions"]], snap["tenants"]["b"]["pages"]) == (["b"], 5)


def test_a_tenant_lists_its_own_namespaces_only(tenants_daemon):
    d, has_admin, (ca, _), (cb, _) = tenants_daemon
    snap = call(d, P.Stats(req_id=0, namespaces=True), TOKEN_A).stats
    assert [(r["namespace"], r["pages"], r["tenant"]) for r in snap["namespaces"]] == [
        (ca.ns_fingerprint.hex(), 3, "a")
    ]
    assert "namespaces" not in call(d, P.Stats(req_id=0), TOKEN_A).stats  # only when asked
    r = kvtier(
        "namespaces",
        "--json",
        "--runtime-dir",
        str(d.runtime_dir),
        env={"KVTIER_ADMIN_TOKEN": TOKEN_B},
    )
    assert r.returncode == 0, r.stderr
    assert [(row["namespace"], row["tenant"]) for row in json.loads(r.stdout)] == [
        (cb.ns_fingerprint.hex(), "b")
    ]
    if has_admin:
        rows = call(d, P.Stats(req_id=0, namespaces=True), ADMIN).stats["namespaces"]
        assert [(r["tenant"], r["pages"]) for r in rows] == [("b", 5), ("a", 3)]


def test_without_a_credential_stats_and_flush_are_refused(tenants_daemon):
    d, has_admin, (ca, ka), (cb, kb) = tenants_daemon
    for token in ("", "not-a-token"):
        message = refused(call(d, P.Stats(req_id=0), token))
        assert "admin_token" in message
        assert ("missing or wrong" in message) if has_admin else ("not set" in message)
        refused(call(d, P.Flush(req_id=0, tier="all"), token))
    assert (ca.lookup(ka).l2, cb.lookup(kb).l2) == (3, 5)  # nothing was flushed
    r = kvtier("sessions", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 1 and "UNAUTHORIZED" in r.stderr and "admin_token" in r.stderr
    assert TOKEN_A not in r.stderr + r.stdout and TOKEN_B not in r.stderr + r.stdout


def test_a_tenants_flush_drops_its_own_pages_only(tenants_daemon):
    d, _, (ca, ka), (cb, kb) = tenants_daemon
    b_ns = cb.ns_fingerprint.hex()
    rep = call(d, P.Flush(req_id=0, tier="l2", namespace=b_ns), TOKEN_A)  # b's, by name
    assert isinstance(rep, P.FlushReply) and rep.l2_pages == 0
    assert cb.lookup(kb).l2 == 5
    rep = call(d, P.Flush(req_id=0, tier="all"), TOKEN_A)
    assert isinstance(rep, P.FlushReply) and (rep.l2_pages, rep.tenants) == (3, ("a",))
    assert (ca.lookup(ka).l2, cb.lookup(kb).l2) == (0, 5)
    r = kvtier(
        "flush",
        "--tier",
        "all",
        "--runtime-dir",
        str(d.runtime_dir),
        env={"KVTIER_ADMIN_TOKEN": TOKEN_B},
    )
    assert r.returncode == 0, r.stderr
    assert "flushed 5 L2 pages" in r.stdout and "every namespace of tenant b)" in r.stdout
    assert cb.lookup(kb).l2 == 0


def test_the_admin_token_sees_and_flushes_every_tenant(tenants_daemon):
    d, has_admin, (ca, ka), (cb, kb) = tenants_daemon
    if not has_admin:  # then that string is nobody's credential
        refused(call(d, P.Stats(req_id=0), ADMIN))
        refused(call(d, P.Flush(req_id=0, tier="l2"), ADMIN))
        assert (ca.lookup(ka).l2, cb.lookup(kb).l2) == (3, 5)
        return
    snap = call(d, P.Stats(req_id=0), ADMIN).stats
    assert "scope" not in snap and sorted(s["tenant"] for s in snap["sessions"]) == ["a", "b"]
    assert snap["pool"]["pages_ready"] == 8
    rep = call(d, P.Flush(req_id=0, tier="l2"), ADMIN)
    assert isinstance(rep, P.FlushReply) and (rep.l2_pages, rep.tenants) == (8, ())
    assert (ca.lookup(ka).l2, cb.lookup(kb).l2) == (0, 0)


def test_without_tenants_stats_and_flush_are_as_before(daemon):
    pool, conn = engine(daemon.runtime_dir, model="m")
    try:
        keys = stored(conn, pool, 2, salt=1)
        snap = call(daemon, P.Stats(req_id=0)).stats
        assert "scope" not in snap and len(snap["sessions"]) == 1
        rep = call(daemon, P.Flush(req_id=0, tier="l2"))
        assert isinstance(rep, P.FlushReply) and rep.l2_pages == 2
        assert conn.lookup(keys).l2 == 0
    finally:
        conn.close()
        pool.close()
