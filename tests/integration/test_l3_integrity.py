"""What comes back from L3 through real kvtierd processes: damaged or foreign objects in
Redis and in the file store, a store that refuses writes or fills up, and what STATS says.

Every L3 failure must read as a miss, never hand wrong bytes to an engine, never stop the
daemon serving, and show in STATS; a damaged object must not keep a page out of L3 for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kvtier.client.connection.admin import AdminClient

from tests.engines import SMALL, engine, tokens
from tests.integration.test_l3_tier import (
    counters,
    fetch_back,
    flush,
    l3_flags,
    load_and_compare,
    runs,
    stats,
    store_pages,
    wait_for,
    wait_written,
)
from tests.servers import RedisServer, serve_redis

REPO = str(Path(__file__).resolve().parents[2])
OTHER_UID = 65534  # nobody: a real uid distinct from the daemon's (root)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def _redis_keys(server: RedisServer) -> list[bytes]:
    client = redis.Redis.from_url(server.url)
    try:
        return sorted(client.scan_iter(match="kvtier:*"))
    finally:
        client.close()


def _page_name(ns: bytes, key: bytes, prefix: str = "kvtier") -> bytes:
    return f"{prefix}:{ns.hex()}:{key.hex()}".encode()


# ----------------------------------------------------------------------------- redis
@pytest.mark.timeout(90)
def test_a_damaged_redis_object_is_written_again_by_the_next_store(redis_server, daemon_factory):
    """A value in Redis that does not verify (a flipped byte) is a miss; the page's next STORE
    must write a good copy again, so the page comes back from L3 afterwards, and LOOKUP
    must stop promising an L3 run that can never be read."""
    d = daemon_factory(*l3_flags("redis", {"url": redis_server.url}, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys, expected = store_pages(pool, conn, 4)
        wait_written(d, 4)
        name = _page_name(conn.ns_fingerprint, keys[0])
        value = client.get(name)
        assert value is not None and len(value) == 96 + len(expected[0])
        client.setrange(name, 96 + 100, bytes([value[96 + 100] ^ 0xFF]))  # one payload byte
        flush(d, "l2")
        assert runs(conn, keys) == (0, 4)
        assert fetch_back(conn, keys) == 0  # damaged: a miss, never the bytes
        assert stats(d)["l3"]["corrupt"] >= 1
        # the object was found damaged: L3 no longer holds page 0 for LOOKUP
        assert runs(conn, keys) == (0, 0)
        # the engine computes and stores the chain again: L3 gets a good copy
        written = counters(d)["l3_write_written_pages"]
        h = conn.store(keys, list(range(4)))
        assert h.count == 4 and h.wait()
        wait_for(
            lambda: (
                counters(d)["l3_write_queued_pages"] >= 8 and stats(d)["l3"]["write_queue"] == 0
            ),
            what="the second store's pages settled",
        )
        assert counters(d)["l3_write_written_pages"] > written
        flush(d, "l2")
        assert fetch_back(conn, keys) == 4
        load_and_compare(pool, conn, keys, expected)
    finally:
        client.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_sync_after_redis_restarted_empty_writes_l2_again(redis_server, daemon_factory):
    """An operator persists L2 with SYNC before a reboot. Redis restarted meanwhile (it
    keeps nothing): the pages L2 once wrote there are gone, so SYNC must write them again
    rather than answer that nothing is left to write."""
    d = daemon_factory(*l3_flags("redis", {"url": redis_server.url}, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 4)
        wait_written(d, 4)
        assert len(_redis_keys(redis_server)) == 4
        redis_server.restart()
        assert _redis_keys(redis_server) == []
        # the daemon's client reconnects by itself: a lookup past L2 goes to the new server
        wait_for(
            lambda: (
                conn.lookup(keys + conn.page_keys(tokens(16, salt=9), parent=keys[-1])).l2 == 4
                and stats(d)["l3"]["healthy"]
            ),
            what="L3 healthy again",
        )
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            rep = admin.sync(30.0)
        assert rep.left == 0 and rep.failed == 0
        assert len(_redis_keys(redis_server)) == 4, (rep.pages, rep.written)
        flush(d, "l2")
        assert fetch_back(conn, keys) == 4
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_redis_values_of_another_key_or_cut_short_are_misses_never_bytes(
    redis_server, daemon_factory
):
    """Covers the daemon path (prefetch, claim, load) for values that do not belong under
    their name: another page's value copied over page 1, and a value cut one byte short.
    Only the verified leading run reaches L2; the rest reads as a miss and is counted."""
    d = daemon_factory(*l3_flags("redis", {"url": redis_server.url}, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys, expected = store_pages(pool, conn, 4)
        wait_written(d, 4)
        names = [_page_name(conn.ns_fingerprint, k) for k in keys]
        client.set(names[1], client.get(names[3]))  # a well-formed object of another key
        flush(d, "l2")
        assert fetch_back(conn, keys) == 1
        assert runs(conn, keys)[0] == 1  # nothing after the bad page became READY
        load_and_compare(pool, conn, keys[:1], expected[:1])
        assert stats(d)["l3"]["corrupt"] == 1
        assert client.get(names[1]) is None  # deleted as damaged: the next write replaces it
        c = counters(d)
        assert c["l3_prefetch_completed_pages"] == 1, c
        assert c["l3_prefetch_failed_pages"] + c["l3_prefetch_cancelled_pages"] == 3, c
        whole = client.get(names[0])
        client.set(names[0], whole[:-1])  # cut short
        flush(d, "l2")
        assert fetch_back(conn, keys) == 0
        assert stats(d)["l3"]["corrupt"] == 2  # page 0 now; page 1 was deleted, a miss
        assert conn.lookup(keys).l2 == 0 and stats(d)["l3"]["healthy"]
    finally:
        client.close()
        conn.close()
        pool.close()


@pytest.fixture
def full_redis() -> Iterator[RedisServer]:
    yield from serve_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")


@pytest.mark.timeout(60)
def test_a_redis_that_refuses_writes_leaves_l2_serving_and_shows_in_stats(
    full_redis, daemon_factory
):
    """Covers Redis at maxmemory with noeviction (every SET answered OOM): the pages stay
    in L2 and load, the failed writes show in STATS and in SYNC's answer, and the pages L3
    did take come back whole."""
    d = daemon_factory(*l3_flags("redis", {"url": full_redis.url}, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir, num_pages=256)
    try:
        keys, expected = store_pages(pool, conn, 192)  # 3 MiB of pages into a 2 MiB server
        wait_for(
            lambda: counters(d)["l3_write_failed_pages"] > 0 and stats(d)["l3"]["write_queue"] == 0,
            what="writes given up",
        )
        c = counters(d)
        assert c["l3_write_written_pages"] + c["l3_write_failed_pages"] == 192
        assert stats(d)["l3"]["errors"] > 0
        assert runs(conn, keys)[0] == 192
        load_and_compare(pool, conn, keys, expected, first_page=0)
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            rep = admin.sync(5.0)
        assert rep.failed > 0 and rep.left == 0
        flush(d, "l2")
        l2, l3 = runs(conn, keys)
        # which batches the server refused is a race between concurrent writes: the leading
        # run L3 holds may be empty (the first batch refused) but never the whole chain
        assert l2 == 0 and l3 < 192
        if l3:
            assert fetch_back(conn, keys) == l3
            load_and_compare(pool, conn, keys[:l3], expected[:l3], first_page=0)
    finally:
        conn.close()
        pool.close()


# ----------------------------------------------------------------------------- file store
PLANT = r"""
import asyncio, json, os, sys
uid, where, npages, salt = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from kvtier.client.page_keys import page_keys
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend
from kvtier.ipc import protocol as P
from kvtier.ipc.namespace import namespace_fingerprint
from tests.engines import SMALL, tokens

# modules loaded as root (the interpreter's files may be unreadable to the other user);
# everything from here on runs as that user
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
# what any local user can compute: the namespace of model "m" and the keys of a prompt
fp = namespace_fingerprint(P.NamespaceSpec(model_id="m"), SMALL, 0, 1, "default")
keys = page_keys(fp, tokens(npages * SMALL.page_size, salt=salt), SMALL.page_size)
length = SMALL.page_bytes
buf = bytearray(b"\xa5" * (length * npages))  # the bytes the planter wants engines to get
arena = HostArena(view=memoryview(buf), address=0, size=len(buf))

async def main():
    os.makedirs(where, exist_ok=True)
    os.chmod(where, 0o700)  # its owner's alone: still not the daemon's user
    store = FileBackend({"path": where, "capacity": 8 << 20})
    await store.open(arena)
    ok = await store.put_from(fp, keys, [i * length for i in range(npages)], length)
    await store.close()
    os.unlink(os.path.join(where, "kvtier-file.lock"))
    print(json.dumps({"fp": fp.hex(), "stored": sum(ok), "uid": os.getuid()}))

asyncio.run(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: plants the store as another uid")
def test_a_file_store_another_user_owns_is_not_served_to_engines(daemon_factory):
    """A file L3 directory that another user created (in a shared place such as /tmp) and
    filled with well-formed objects: checksums are not signatures, so its objects must not
    reach an engine. The daemon must refuse the store (as it refuses a runtime directory or
    a pool file of another user): no L3 run, no page from it."""
    parent = Path(tempfile.mkdtemp(prefix="kvt-shared-", dir="/tmp"))
    os.chmod(parent, 0o1777)  # a shared, sticky place like /tmp itself
    where = parent / "l3"
    try:
        child = subprocess.run(
            [sys.executable, "-c", PLANT, str(OTHER_UID), str(where), "4", "3"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert child.returncode == 0, child.stderr[-2000:]
        planted = json.loads(child.stdout.strip().splitlines()[-1])
        assert planted["stored"] == 4 and planted["uid"] == OTHER_UID
        assert os.stat(where).st_uid == OTHER_UID
        d = daemon_factory(
            *l3_flags("file", {"path": str(where)}, prefetch_threshold="0"), start=False
        )
        try:
            d.start()
        except Exception:
            return  # refusing to start over another user's store is a fine answer too
        pool, conn = engine(d.runtime_dir)
        try:
            assert conn.ns_fingerprint.hex() == planted["fp"]
            keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=3))
            assert runs(conn, keys) == (0, 0), "the planted objects are offered as L3 pages"
            assert fetch_back(conn, keys) == 0
        finally:
            conn.close()
            pool.close()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs: a file store on it runs out of space (ENOSPC) long before its
    configured capacity."""
    where = Path(tempfile.mkdtemp(prefix="kvt-disk-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode(errors='replace')}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_file_store_out_of_disk_space_degrades_to_misses(small_disk, daemon_factory):
    """Covers ENOSPC in the file store: segments cannot grow past the disk (each failed
    growth counts in STATS' errors), the store makes room by evicting instead, L2 keeps
    serving every page, and what L3 holds afterwards comes back whole."""
    extra = {"path": str(small_disk / "l3"), "capacity": 64 << 20, "segment_bytes": 256 << 10}
    d = daemon_factory(*l3_flags("file", extra, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir, num_pages=160)
    try:
        keys, expected = store_pages(pool, conn, 128)  # 4 MiB of pages, a 1 MiB disk
        wait_for(
            lambda: (
                stats(d)["l3"]["write_queue"] == 0
                and counters(d)["l3_write_written_pages"] + counters(d)["l3_write_failed_pages"]
                == 128
            ),
            what="every write settled",
        )
        assert stats(d)["l3"]["errors"] > 0
        # a full disk under a store that holds segments is a full cache: one more page is
        # written by evicting, and the health check says healthy
        before = counters(d)["l3_write_written_pages"]
        store_pages(pool, conn, 1, salt=99, seed=9)
        wait_for(lambda: counters(d)["l3_write_written_pages"] > before, what="one more write")
        wait_for(lambda: stats(d)["l3"]["healthy"], what="L3 healthy again")
        assert runs(conn, keys)[0] == 128
        load_and_compare(pool, conn, keys, expected, first_page=0)
        flush(d, "l2")
        held = [j for j in range(128) if conn.lookup(keys[j : j + 1]).l3 == 1]
        assert 0 < len(held) < 128  # the disk holds some pages, not all
        j = held[0]
        n = runs(conn, keys[j:])[1]
        assert fetch_back(conn, keys[j : j + n]) == n
        load_and_compare(pool, conn, keys[j : j + n], expected[j : j + n], first_page=0)
    finally:
        conn.close()
        pool.close()
