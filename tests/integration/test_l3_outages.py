"""L3 outages and recovery as an operator meets them: a Redis stopped (or frozen) and
answering again, a file store whose disk fills up and then frees, an L3 that is down when
kvtierd starts.

While L3 is down L2 keeps serving; once L3 is healthy again the pages L2 holds reach L3
(write-through: by themselves; SYNC: on request), and SYNC / HEALTH tell the truth about it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kvtier.client.connection.admin import AdminClient

from tests.engines import engine
from tests.integration.test_admin_cli import kvtier
from tests.integration.test_l3_tier import (
    counters,
    l3_flags,
    stats,
    store_pages,
    wait_for,
    wait_written,
)
from tests.servers import RedisServer, serve_redis, start_redis


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def _page_name(ns: bytes, key: bytes) -> bytes:
    return f"kvtier:{ns.hex()}:{key.hex()}".encode()


def _in_redis(url: str, ns: bytes, keys: list[bytes]) -> int:
    """How many of ``keys`` (pages of namespace ``ns``) Redis holds."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(_page_name(ns, k))
        return sum(int(x) for x in pipe.execute())
    finally:
        client.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(d) -> bool:
    return bool(stats(d)["l3"]["healthy"])


def _fill_l2_under_write_back(pool, conn) -> list[list[bytes]]:
    """Four chains of 60 pages (32 KiB each) into an 8 MiB pool: past write-back's 90 %."""
    return [store_pages(pool, conn, 60, salt=10 + i, seed=i + 1)[0] for i in range(4)]


WRITE_BACK_FLAGS = {
    "prefetch_threshold": "0",
    "hicache_write_policy": "write_back",
    "hicache_size": "8MiB",
    "extent_size": "1MiB",
}


# ------------------------------------------------------------------ write-through, redis
@pytest.mark.timeout(120)
def test_write_through_pages_stored_while_redis_was_down_reach_it_once_it_is_back(
    redis_server, daemon_factory
):
    """Under write_through, pages an engine stores while Redis is stopped are served from L2;
    once Redis answers again (HEALTH ok, new stores written again), the pages stored during
    the outage reach Redis too, by themselves (no SYNC needed), as pages "stored while L3
    was away" are backed up."""
    d = daemon_factory(
        *l3_flags("redis", {"url": redis_server.url, "timeout_s": 0.5}, prefetch_threshold="0")
    )
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 4, salt=1)
        wait_written(d, 4)
        redis_server.kill()
        wait_for(lambda: not _healthy(d), timeout=30, what="L3 seen down")
        during, _ = store_pages(pool, conn, 6, salt=2, seed=2)
        assert conn.lookup(during).l2 == 6  # L2 serves meanwhile
        wait_for(lambda: stats(d)["l3"]["write_queue"] == 0, what="the outage's writes settled")
        redis_server.restart()
        wait_for(lambda: _healthy(d), timeout=30, what="L3 healthy again")
        after, _ = store_pages(pool, conn, 3, salt=3, seed=3)
        ns = conn.ns_fingerprint
        wait_for(
            lambda: _in_redis(redis_server.url, ns, after) == 3,
            timeout=20,
            what="a store made after the outage written to Redis",
        )
        wait_for(
            lambda: _in_redis(redis_server.url, ns, during) == 6,
            timeout=15,
            what="the pages stored during the outage written to Redis",
        )
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ L3 down at start: SYNC
@pytest.mark.timeout(90)
def test_sync_while_l3_never_opened_does_not_report_l2_as_backed_up(daemon_factory):
    """L3 (Redis) has been unreachable since kvtierd started and an engine stored pages in
    L2. An operator runs `kvtier sync` before a reboot: nothing can reach L3, so SYNC must
    count the L2 pages not in L3 as failed or left, and `kvtier sync` must exit 1 (not 0
    with "0 of 0 pages written")."""
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 5)
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            rep = admin.sync(2.0)
        assert rep.failed + rep.left >= 5, rep
        assert rep.l3_error.startswith("L3 backend redis not open: "), rep
        r = kvtier("sync", "--wait", "2", "--runtime-dir", str(d.runtime_dir))
        assert r.returncode == 1, r.stdout + r.stderr
        assert "L3 backend redis not open" in r.stdout, r.stdout  # says why
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ write-back, redis
@pytest.mark.timeout(120)
def test_sync_during_a_write_back_outage_does_not_report_l2_as_backed_up(
    redis_server, daemon_factory
):
    """Under write_back, Redis stops answering (frozen) while L2 fills past write-back's
    mark: L2 keeps serving. `kvtier sync` run during the outage cannot write anything, so it
    must exit 1 and count the L2 pages that are not in L3 as failed or left."""
    d = daemon_factory(
        *l3_flags("redis", {"url": redis_server.url, "timeout_s": 0.5}, **WRITE_BACK_FLAGS)
    )
    pool, conn = engine(d.runtime_dir, num_pages=256)
    try:
        redis_server.pause()
        wait_for(lambda: not _healthy(d), timeout=30, what="L3 seen down")
        chains = _fill_l2_under_write_back(pool, conn)
        wait_for(
            lambda: counters(d)["l3_write_failed_pages"] > 0 and stats(d)["l3"]["write_queue"] == 0,
            timeout=30,
            what="write-back tried during the outage",
        )
        assert [conn.lookup(k).l2 for k in chains] == [60] * 4  # L2 serves
        with AdminClient(d.endpoint, timeout_s=20.0) as admin:
            rep = admin.sync(5.0)
        assert rep.failed + rep.left >= 1, rep
        assert rep.l3_error.startswith("L3 backend redis down: "), rep
        r = kvtier("sync", "--wait", "5", "--runtime-dir", str(d.runtime_dir))
        assert r.returncode == 1, r.stdout + r.stderr
        assert "L3 backend redis down" in r.stdout, r.stdout
    finally:
        redis_server.resume()
        conn.close()
        pool.close()


@pytest.mark.timeout(150)
def test_write_back_pages_l2_holds_after_an_outage_are_synced_once_redis_is_back(
    redis_server, daemon_factory
):
    """Under write_back, Redis stops answering (frozen) while L2 fills past write-back's
    mark; then it answers again (same server, HEALTH ok). An operator's SYNC must then write
    every L2 page that is not in Redis: afterwards Redis holds every page L2 holds."""
    d = daemon_factory(
        *l3_flags("redis", {"url": redis_server.url, "timeout_s": 0.5}, **WRITE_BACK_FLAGS)
    )
    pool, conn = engine(d.runtime_dir, num_pages=256)
    try:
        redis_server.pause()
        wait_for(lambda: not _healthy(d), timeout=30, what="L3 seen down")
        chains = _fill_l2_under_write_back(pool, conn)
        wait_for(
            lambda: counters(d)["l3_write_failed_pages"] > 0 and stats(d)["l3"]["write_queue"] == 0,
            timeout=30,
            what="write-back tried during the outage",
        )
        redis_server.resume()
        wait_for(lambda: _healthy(d), timeout=30, what="L3 healthy again")
        with AdminClient(d.endpoint, timeout_s=40.0) as admin:
            rep = admin.sync(30.0)
        assert rep.left == 0 and rep.failed == 0, rep
        ns = conn.ns_fingerprint
        resident = [k[: conn.lookup(k).l2] for k in chains]
        total = sum(len(k) for k in resident)
        assert total > 0
        held = sum(_in_redis(redis_server.url, ns, k) for k in resident)
        assert held == total, f"Redis holds {held} of the {total} L2 pages after SYNC {rep}"
    finally:
        redis_server.resume()
        conn.close()
        pool.close()


# ------------------------------------------------------------------ file store, disk full
@pytest.fixture
def full_disk() -> Iterator[tuple[Path, Path]]:
    """A 2 MiB tmpfs filled up by a file: ``(mount point, the filler)``."""
    where = Path(tempfile.mkdtemp(prefix="kvt-disk-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode(errors='replace')}")
    filler = where / "filler"
    try:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True, timeout=30
        )
        assert os.statvfs(where).f_bavail == 0
        yield where, filler
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)
        shutil.rmtree(where, ignore_errors=True)


def _file_store_flags(where: Path) -> list[str]:
    extra = {"path": str(where / "l3"), "capacity": 64 << 20, "segment_bytes": 256 << 10}
    return l3_flags("file", extra, prefetch_threshold="0")


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_file_store_pages_stored_while_the_disk_was_full_reach_it_once_space_frees(
    full_disk, daemon_factory
):
    """A file store whose disk is full: L3 is down, L2 serves the engine's pages. Once space
    frees up and L3 is healthy again, the pages stored meanwhile are written to the store by
    themselves under write_through (no SYNC needed): LOOKUP then finds them in L3."""
    where, filler = full_disk
    d = daemon_factory(*_file_store_flags(where))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 4)
        wait_for(lambda: not _healthy(d), timeout=30, what="L3 down for want of disk")
        wait_for(lambda: stats(d)["l3"]["write_queue"] == 0, what="the writes settled")
        assert conn.lookup(keys).l2 == 4
        filler.unlink()
        wait_for(lambda: _healthy(d), timeout=30, what="L3 healthy again")
        wait_for(
            lambda: stats(d)["l3"]["puts"] >= 4,
            timeout=15,
            what="the pages stored while the disk was full written to L3",
        )
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_health_names_a_full_disk_as_the_cause_of_a_file_store_outage(full_disk, daemon_factory):
    """HEALTH while a file store is down because its disk is full names the cause from the
    error itself (docs/metrics.md: `degraded: L3 backend file down: CAUSE`, CAUSE named
    from the error), so an operator sees "No space left on device" without reading logs."""
    where, _ = full_disk
    d = daemon_factory(*_file_store_flags(where))
    pool, conn = engine(d.runtime_dir)
    try:
        store_pages(pool, conn, 4)
        wait_for(lambda: not _healthy(d), timeout=30, what="L3 down for want of disk")
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            status = admin.health().status
        assert status.startswith("degraded: L3 backend file down: "), status
        assert "no space left" in status.lower(), status
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ L3 down at start
@pytest.mark.timeout(90)
def test_pages_stored_before_l3_first_opened_reach_it_once_it_opens(daemon_factory):
    """Redis is not running when kvtierd starts (HEALTH degraded, L2 serves). Once Redis is
    started, L3 opens by itself and the pages stored meanwhile are written to it."""
    server = start_redis()
    server.kill()  # not running when kvtierd starts, on a port it will come back to
    url = server.url
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 5)
        assert not _healthy(d)
        server.restart()
        wait_for(lambda: _healthy(d), timeout=30, what="L3 open")
        wait_for(
            lambda: _in_redis(url, conn.ns_fingerprint, keys) == 5,
            timeout=20,
            what="the pages stored before L3 opened written to Redis",
        )
    finally:
        conn.close()
        pool.close()
        server.stop()
