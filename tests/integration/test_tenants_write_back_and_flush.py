"""Tenants as a tenant and an operator meet them: a tenant at its quota under write-back
beside another tenant's cold pages, and FLUSH of L3 where no L3 is configured."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_l3_tier import l3_flags

TOKEN_A = "tok-a-r3v13w"
TOKEN_B = "tok-b-r3v13w"
ADMIN = "adm-r3v13w"


def tenants(quota_a: int | None = None) -> str:
    """The ``--tenants`` JSON for tenants a (with ``quota_a``) and b."""
    a: dict[str, object] = {"token": TOKEN_A}
    if quota_a is not None:
        a["quota_pages"] = quota_a
    return json.dumps({"a": a, "b": {"token": TOKEN_B}})


def admin_stats(d) -> dict[str, Any]:
    with AdminClient(d.endpoint, timeout_s=10.0, admin_token=ADMIN) as admin:
        return admin.stats()


def store(
    conn: Connection, pool: Any, n: int, salt: int, first_page: int = 0
) -> tuple[list[bytes], Any]:
    """Store ``n`` pages (engine pages first_page..) under a fresh chain; (keys, handle)."""
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, first_page + p, seed=salt * 1000 + p)
    h = conn.store(keys, list(range(first_page, first_page + n)))
    h.wait()
    return keys, h


# ------------------------------------------------------------------ write-back + quota
def written(d) -> int:
    return int(admin_stats(d)["counters"]["l3_write_written_pages"])


def settled(d, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
    """Wait until L3 writes stop for ``quiet_s``; the pages written."""
    deadline = time.monotonic() + timeout
    last = written(d)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = written(d)
        if now == last:
            return now
        last = now
    raise AssertionError("L3 writes never settled")


@pytest.mark.timeout(180)
def test_under_write_back_a_tenant_at_its_quota_gets_its_own_pages_written_back(
    daemon_factory, short_tmp
):
    """Under ``write_back`` a tenant at its ``quota_pages`` evicts only its own pages, and
    only those already in L3. When its STORE falls short for that reason, write-back makes
    its own cold pages evictable, so a retry a moment later is accepted: another tenant
    holding many cold pages (in a pool far from full, so nobody needs their slots) does not
    keep it refused."""
    d = daemon_factory(
        *l3_flags("file", hicache_write_policy="write_back", prefetch_threshold="0"),
        "--state-dir",
        str(short_tmp / "state"),
        "--hicache-size",
        "512MiB",  # 16,384 slots of 32 KiB
        "--tenants",
        tenants(16),
        "--admin-token",
        ADMIN,
    )
    pb, cb = engine(d.runtime_dir, num_pages=256, model="m", tenant="b", token=TOKEN_B)
    pa, ca = engine(d.runtime_dir, num_pages=64, model="m", tenant="a", token=TOKEN_A)
    try:
        for i in range(40):  # b: 10,240 cold pages (62 % of the pool), none in L3 yet
            keys = cb.page_keys(tokens(256 * SMALL.page_size, salt=5000 + i))
            h = cb.store(keys, list(range(256)))
            assert h.wait() and h.count == 256, (i, h.count)
        _, h = store(ca, pa, 16, salt=1)  # a at its quota
        assert h.count == 16
        assert settled(d) == 0  # no pressure: nothing was written back yet
        counts = []
        for i in range(6):  # the first may fall short (L2 never waits for L3); retries
            _, h = store(ca, pa, 4, salt=100 + i, first_page=32)
            counts.append(h.count)
            if h.count == 4:
                break
            settled(d)
        pages_b = sum(
            cb.lookup(cb.page_keys(tokens(256 * SMALL.page_size, salt=5000 + i))).l2
            for i in range(40)
        )
        assert counts[-1] == 4, (
            f"tenant a's STOREs at its quota accepted {counts} pages of 4; write-back wrote "
            f"{written(d)} pages meanwhile, tenant a's quota is 16 and tenant b holds "
            f"{pages_b} pages in L2"
        )
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()


def call(d, msg: P.Request, token: str = "") -> P.Reply:
    """One request from a connection that registered nothing, carrying ``token``."""
    with AdminClient(d.endpoint, timeout_s=15.0, admin_token=token) as admin:
        return admin.call(msg, wait_s=30.0)


# ------------------------------------------------------------------ FLUSH of L3 without an L3
@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["tenant-token", "engine-session", "admin-token"])
def test_a_flush_of_l3_leaves_l2_pages_where_no_l3_is_configured(daemon_factory, who):
    """``kvtier flush --tier l3`` (FLUSH ``tier = "l3"``) drops L3 copies only; L2 pages
    stay. With no L3 backend configured (the fixtures' ``none``) there is nothing to drop:
    the reply counts 0 L2 pages and every L2 page of the caller's tenant is still there."""
    d = daemon_factory("--tenants", tenants(), "--admin-token", ADMIN)
    pa, ca = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    try:
        keys, h = store(ca, pa, 3, salt=7)
        assert h.count == 3 and ca.lookup(keys).l2 == 3
        if who == "engine-session":
            rep = ca._session_call(
                lambda sid: P.Flush(req_id=0, session_id=sid, tier="l3"), P.FlushReply
            )
        else:
            token = TOKEN_A if who == "tenant-token" else ADMIN
            rep = call(d, P.Flush(req_id=0, tier="l3", admin_token=token), token)
        held = ca.lookup(keys).l2
        dropped = rep.l2_pages if isinstance(rep, P.FlushReply) else 0  # or refused: no L3
        assert (dropped, held) == (0, 3), (
            f"FLUSH tier=l3 dropped {dropped} L2 pages; {held} of 3 are left in L2"
        )
    finally:
        ca.close()
        pa.close()
