"""SYNC (``kvtier sync``): every L2 page not in L3 written to L3 before the answer, through
real kvtierd processes with the file backend (slowed on purpose where a deadline matters)."""

from __future__ import annotations

import math

import pytest
from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.ipc import protocol as P

from tests.engines import engine
from tests.integration.test_admin_cli import kvtier
from tests.integration.test_l3_tier import (
    REPO,
    counters,
    fetch_back,
    flush,
    l3_flags,
    load_and_compare,
    slow_flags,
    store_pages,
)

pytestmark = pytest.mark.timeout(90)

WRITE_BACK = ("--hicache-write-policy", "write_back")


def test_sync_writes_every_l2_page_then_answers(daemon_factory):
    d = daemon_factory(*WRITE_BACK, *l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 6)
        assert counters(d)["l3_write_written_pages"] == 0  # write-back: L2 has room
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            rep = admin.sync(30.0)
            assert (rep.pages, rep.written, rep.failed, rep.left) == (6, 6, 0, 0)
            assert counters(d)["l3_write_written_pages"] == 6  # written before the answer
            again = admin.sync(30.0)
        assert (again.pages, again.written, again.failed, again.left) == (0, 0, 0, 0)
        flush(d, "l2")
        assert fetch_back(conn, keys) == 6
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


def test_sync_answers_at_its_deadline_with_what_is_left(daemon_factory, short_tmp):
    d = daemon_factory(
        *WRITE_BACK, *slow_flags(short_tmp, 0.0, put_delay_s=1.5), env={"PYTHONPATH": REPO}
    )
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 4)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            short = admin.sync(0.3)
            # answered at its deadline: the 1.5 s write of the pages has not ended yet
            assert (short.pages, short.written, short.left) == (4, 0, 4)
            rest = admin.sync(20.0)  # the pages already queued are waited for
        assert (rest.pages, rest.written, rest.failed, rest.left) == (4, 4, 0, 0)
    finally:
        conn.close()
        pool.close()


def test_sync_refuses_bad_input_and_keeps_serving(daemon_factory):
    d = daemon_factory(*l3_flags("file"), "--admin-token", "s3cret")
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        for timeout_s in (0.0, -1.0, math.nan, math.inf, 3601.0):
            rep = admin.call(P.Sync(req_id=0, admin_token="s3cret", timeout_s=timeout_s))
            assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.BAD_MESSAGE, rep
            assert "timeout_s" in rep.message  # the typed decoder names the field
        rep = admin.call(P.Sync(req_id=0, admin_token="wrong"))
        assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED, rep
        assert admin.health().status == "ok"
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token="s3cret") as admin:
        assert admin.sync(5.0).left == 0


def test_sync_without_an_l3_backend_is_refused_by_name(daemon_factory):
    d = daemon_factory("--hicache-storage-backend", "none")
    with (
        AdminClient(d.endpoint, timeout_s=5.0) as admin,
        pytest.raises(AdminError, match="hicache_storage_backend"),
    ):
        admin.sync(5.0)


def test_kvtier_sync_prints_what_it_wrote_and_fails_without_l3(daemon_factory):
    d = daemon_factory(*WRITE_BACK, *l3_flags("file"))
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 3)
        r = kvtier("sync", "--runtime-dir", str(d.runtime_dir), "--wait", "30")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("3 of 3 pages written to L3"), r.stdout
    finally:
        conn.close()
        pool.close()
    e = daemon_factory("--hicache-storage-backend", "none", name="e")
    r = kvtier("sync", "--runtime-dir", str(e.runtime_dir))
    assert r.returncode == 1 and "hicache_storage_backend" in r.stderr, (r.stdout, r.stderr)
    r = kvtier("sync", "--runtime-dir", str(e.runtime_dir), "--wait", "7200")
    assert r.returncode == 2 and "3600" in r.stderr, r.stderr
