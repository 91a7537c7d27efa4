"""Edges of the ``file`` L3 store: its capacity across page sizes and reopens, FLUSH's
space release under concurrent writes, a segment left short on a full disk, and a bad
``path`` in the extra config.

Daemon-level tests run real kvtierd processes; store-level ones drive :class:`FileBackend`
over an mmap arena where the daemon adds nothing.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend, table_bytes
from kvtier.daemon.storage.file import backend as file_backend
from kvtier.daemon.storage.file.segments import LOCK_NAME, parse_segment_name

from tests.engines import OTHER, SMALL, client_config, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import (
    fetch_back,
    flush,
    l3_flags,
    load_and_compare,
    runs,
    stats,
    store_pages,
    wait_written,
)

NS = hashlib.sha256(b"file store edges").digest()


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


@pytest.fixture
def arena() -> Iterator[HostArena]:
    mm = mmap.mmap(-1, 64 * 16384)
    view = memoryview(mm)
    yield HostArena(view=view, address=0, size=len(mm))
    view.release()
    mm.close()


def fill(arena: HostArena, offsets: list[int], length: int, salt: str) -> list[bytes]:
    out = []
    for i, off in enumerate(offsets):
        data = hashlib.shake_256(f"{salt}-{i}".encode()).digest(length)
        arena.view[off : off + length] = data
        out.append(data)
    return out


# --------------------------------------------------------------------- capacity, sizes
@pytest.mark.timeout(60)
def test_pages_of_another_size_are_stored_once_l3_is_flushed(daemon_factory, short_tmp):
    """A store whose capacity went to one page size, then emptied by a FLUSH of L3 (reclaim
    true), stores the pages of an engine with another page size: the capacity is the
    store's, not the first page size's, so the second engine's pages are written to L3 and
    come back from it byte for byte."""
    slots = 8
    segment = table_bytes(slots) + slots * SMALL.page_bytes
    extra = {"path": str(short_tmp / "l3"), "capacity": 2 * segment, "segment_bytes": segment}
    d = daemon_factory(
        *l3_flags("file", extra, prefetch_threshold="0", hicache_write_policy="write_back")
    )
    pool, conn = engine(d.runtime_dir)
    pool_b, conn_b = engine(d.runtime_dir, OTHER, model="other")
    try:
        store_pages(pool, conn, 2 * slots)
        with AdminClient(d.endpoint, timeout_s=30.0) as admin:
            first = admin.sync(20.0)
        assert (first.written, first.failed) == (2 * slots, 0)  # the capacity, exactly
        rep = flush(d, "all")
        assert rep.l3_pages == 2 * slots
        assert stats(d)["l3"]["healthy"]
        # L3 is empty now; an engine with 3 KiB pages stores four pages
        keys_b = conn_b.page_keys(tokens(4 * OTHER.page_size, salt=7))
        for p in range(4):
            fill_page(pool_b, p, seed=3000 + p)
        expected_b = [page_bytes(pool_b, p) for p in range(4)]
        h = conn_b.store(keys_b, list(range(4)))
        assert h.count == 4 and h.wait()
        with AdminClient(d.endpoint, timeout_s=30.0) as admin:
            second = admin.sync(20.0)
        assert (second.pages, second.written, second.failed) == (4, 4, 0), (
            f"SYNC of 4 pages of another size into an empty store: {second}"
        )
        flush(d, "l2")
        assert runs(conn_b, keys_b) == (0, 4)
        assert fetch_back(conn_b, keys_b) == 4
        load_and_compare(pool_b, conn_b, keys_b, expected_b)
    finally:
        for c in (conn, conn_b):
            c.close()
        pool.close()
        pool_b.close()


@pytest.mark.timeout(30)
async def test_a_store_reopened_smaller_creates_no_other_file(
    tmp_path: Path, arena: HostArena
) -> None:
    """A store reopened with a capacity below what its segments take keeps its segments
    and makes room by eviction: its directory holds only the lock file and well-formed
    segment files, and ``allocated_bytes`` stays the size of those segments."""
    page = 8192
    segment = table_bytes(4) + 4 * page
    path = tmp_path / "l3"
    store = FileBackend({"path": str(path), "capacity": 4 * segment, "segment_bytes": segment})
    await store.open(arena)
    keys = [key(f"old{i}") for i in range(16)]
    offsets = [i * page for i in range(16)]
    fill(arena, offsets, page, "old")
    assert all(await store.put_from(NS, keys, offsets, page))
    await store.close()
    before = sorted(os.listdir(path))
    store = FileBackend({"path": str(path), "capacity": 2 * segment, "segment_bytes": segment})
    await store.open(arena)
    try:
        on_disk = sum(os.path.getsize(path / n) for n in before if n != LOCK_NAME)
        assert store.allocated_bytes == on_disk == 4 * segment
        new = [key(f"new{i}") for i in range(4)]
        expected = fill(arena, offsets[:4], page, "new")
        assert all(await store.put_from(NS, new, offsets[:4], page))  # room by eviction
        names = sorted(os.listdir(path))
        strays = [n for n in names if n != LOCK_NAME and parse_segment_name(n) is None]
        assert names == before and not strays, f"files added to the store: {strays}"
        assert store.allocated_bytes == on_disk
        arena.view[: 4 * page] = bytes(4 * page)
        assert all(await store.get_into(NS, new, offsets[:4], page))
        assert [bytes(arena.view[o : o + page]) for o in offsets[:4]] == expected
    finally:
        await store.close()


# --------------------------------------------------------------------- FLUSH reclaim
@pytest.mark.timeout(30)
async def test_a_put_during_release_space_evicts_nothing_while_slots_are_free(
    tmp_path: Path, arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a FLUSH's ``release_space`` punches the free slots out of the segment files, a
    put batch into a store with free slots evicts no stored object: the four objects left
    after the flush stay in the store, and the new one is stored beside them."""
    page = 8192
    segment = table_bytes(8) + 8 * page
    store = FileBackend(
        {"path": str(tmp_path / "l3"), "capacity": segment, "segment_bytes": segment}
    )
    await store.open(arena)
    try:
        keys = [key(f"k{i}") for i in range(6)]
        offsets = [i * page for i in range(6)]
        fill(arena, offsets, page, "k")
        assert all(await store.put_from(NS, keys, offsets, page))
        assert await store.delete(NS, keys[4:]) == 2  # 4 stored, 4 slots free
        punching, go_on = threading.Event(), threading.Event()
        real = file_backend.free_payloads

        def slow_free_payloads(slots):  # the punch of a large store takes a while
            punching.set()
            go_on.wait(10)
            return real(slots)

        monkeypatch.setattr(file_backend, "free_payloads", slow_free_payloads)
        release = asyncio.ensure_future(store.release_space())
        try:
            assert await asyncio.to_thread(punching.wait, 10)
            fill(arena, [0], page, "new")
            put = await store.put_from(NS, [key("new")], [0], page)
        finally:
            go_on.set()
            await release
        assert put == [True]
        assert store.evictions == 0, "a stored object was evicted while 4 slots were free"
        assert await store.exists(NS, keys[:4]) == 4
    finally:
        await store.close()


# --------------------------------------------------------------------- full disk
@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs."""
    where = Path(tempfile.mkdtemp(prefix="kvt-edge-disk-", dir="/tmp"))
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


def fill_disk(where: Path) -> None:
    """Write a file in ``where`` until the file system is full."""
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\xa5" * 4096
        for _ in range(4096):  # 16 MiB at most: bounded
            try:
                os.write(fd, chunk)
            except OSError as err:
                assert err.errno == errno.ENOSPC
                return
        raise AssertionError("the small disk never filled up")
    finally:
        os.close(fd)


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_segment_cut_short_on_a_full_disk_keeps_the_other_segments_serving(
    small_disk, daemon_factory
):
    """A segment file shorter than its name says (as a daemon killed while creating it
    leaves one) on a disk with no room left does not take the store down: at the next
    start L3 opens, and every page of the store's whole segments comes back from it byte
    for byte."""
    extra = {"path": str(small_disk / "l3"), "capacity": 64 << 20, "segment_bytes": 256 << 10}
    flags = l3_flags("file", extra, prefetch_threshold="0")
    first = daemon_factory(*flags, name="a")
    pool, conn = engine(first.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 8)
        wait_written(first, 8)
    except BaseException:
        pool.close()
        raise
    finally:
        conn.close()
    first.stop()
    store = small_disk / "l3"
    segments = sorted(n for n in os.listdir(store) if parse_segment_name(n))
    slot, slots, seq = parse_segment_name(segments[-1])  # type: ignore[misc]
    short = store / f"seg-{slot}x{slots}-{seq + 1:06d}.kvt"
    short.write_bytes(bytes(table_bytes(slots)))  # its header table only: no payload yet
    fill_disk(small_disk)
    second = daemon_factory(*flags, name="b")
    conn = None
    try:
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        l3 = stats(second)["l3"]
        assert l3["healthy"], f"L3 not open at start: {second.log_tail(5)}"
        assert runs(conn, keys) == (0, 8)
        assert fetch_back(conn, keys) == 8
        load_and_compare(pool, conn, keys, expected)
    finally:
        if conn is not None:
            conn.close()
        pool.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
async def test_a_store_that_fills_its_disk_stays_healthy_while_it_can_evict(
    small_disk: Path, arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose segments fill the disk is a full cache, not a broken one: while a put
    whose segment could not be created (ENOSPC) writes by evicting, and after it, the
    health check passes, so the daemon keeps sending it puts (were it unhealthy, no put
    would run to find room and L3 would stay down for good)."""
    page = 16384
    path = small_disk / "l3"
    store = FileBackend({"path": str(path), "capacity": 64 << 20, "segment_bytes": 256 << 10})
    await store.open(arena)
    try:
        offsets = [i * page for i in range(8)]
        for n in range(12):  # 1.5 MiB of pages onto a 1 MiB disk, 8 pages a batch
            fill(arena, offsets, page, f"b{n}")
            await store.put_from(NS, [key(f"b{n}-{i}") for i in range(8)], offsets, page)
        assert store.stats.errors > 0, "the disk never ran out of room"
        fill_disk(small_disk)
        assert await store.health(), "a full store that can evict called unhealthy"

        writing, go_on = threading.Event(), threading.Event()
        real = FileBackend._write

        def slow_write(self, *args, **kwargs):  # the put is past its failed segment growth
            writing.set()
            go_on.wait(10)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(FileBackend, "_write", slow_write)
        errors = store.stats.errors
        fill(arena, offsets[:1], page, "last")
        put = asyncio.ensure_future(store.put_from(NS, [key("last")], offsets[:1], page))
        try:
            assert await asyncio.to_thread(writing.wait, 10)
            assert store.stats.errors > errors, "the put did not try to grow the store"
            assert await store.health(), "unhealthy while the put makes room by evicting"
        finally:
            go_on.set()
        assert await put == [True]
        assert await store.health()
        arena.view[:page] = bytes(page)
        assert await store.get_into(NS, [key("last")], offsets[:1], page) == [True]
    finally:
        await store.close()


# --------------------------------------------------------------------- extra config
@pytest.mark.timeout(60)
def test_a_path_with_a_nul_byte_stops_the_start_naming_the_key(daemon_factory, short_tmp):
    """A ``path`` that no file system accepts (a NUL byte in it) is a configuration error:
    kvtierd exits with status 2 and a message naming ``path``, without a traceback."""
    from kvtier.launch.daemon_process import DaemonStartError

    bad = json.dumps({"path": str(short_tmp / "l3") + "\u0000x"})
    d = daemon_factory(
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        bad,
        start=False,
    )
    with pytest.raises(DaemonStartError) as caught:
        d.start(timeout=30.0)
    message = str(caught.value)
    assert "exited with 2" in message, message[-1500:]
    assert "'path'" in message and "Traceback" not in message, message[-1500:]
