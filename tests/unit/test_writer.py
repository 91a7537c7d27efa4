"""The L3 writer in-process, over a real host pool and the real ``file`` backend in a tmp dir:
only pages missing from L3 are written, failed writes are retried and then given up, and a
batch that raises lets go of its pages. Backend puts are counted by the backend's own stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from kvtier.daemon.tier.guard import L3Backend
from kvtier.daemon.tier.writer import MAX_RETRIES, L3Writer

from tests.unit.test_tier_store import chain, open_rig, until, written_to_l3

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def running(writer: L3Writer) -> AsyncIterator[L3Writer]:
    """Run ``writer``'s loop for the duration (without the backend's health checks)."""
    task = asyncio.get_running_loop().create_task(writer.run())
    try:
        yield writer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_only_pages_missing_from_l3_are_written(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        c = rig.counters
        old = chain(8)
        rig.store(old)
        await written_to_l3(rig, old)
        assert rig.backend.stats.puts == 8 and c.l3_write_written_pages == 8
        # the same pages committed again, and a chain that extends them by 4
        more = chain(4, salt="more ")
        rig.store(more, parent=old[-1])
        await written_to_l3(rig, old + more)
        assert rig.backend.stats.puts == 12
        assert c.l3_write_written_pages == 12 and c.l3_write_skipped_pages == 8
        # pages another daemon wrote meanwhile are found there, not written again
        theirs = chain(3, salt="theirs ")
        rig.store(theirs)
        slots = rig.slots(theirs)
        flags = await rig.tier.l3.put(
            rig.session.ns_fingerprint, theirs, [rig.pool.slot_offset(x) for x in slots], 16384
        )
        assert flags == [True] * 3 and rig.backend.stats.puts == 15
        await written_to_l3(rig, theirs)
        assert rig.backend.stats.puts == 15 and c.l3_write_skipped_pages == 11
        # a sync finds every page of L2 marked in L3: it waits for nothing
        assert await rig.tier.writer.sync(5.0) == (0, 0, 0, 0)


async def test_failed_writes_are_retried_until_the_store_is_back(tmp_path: Path) -> None:
    """The store's directory is removed (no segment can be created: every put fails), and
    comes back after the second failed attempt: the third writes every page."""
    async with open_rig(tmp_path, run=False) as rig, running(rig.tier.writer):
        c, keys = rig.counters, chain(4)
        rig.store(keys)
        shutil.rmtree(rig.l3_dir)
        rig.tier.stored(rig.session, keys)
        await until(lambda: c.l3_write_retries == 2 * 4, "a second failed attempt")
        assert c.l3_write_written_pages == 0 and rig.backend.stats.errors > 0
        rig.l3_dir.mkdir()
        await until(lambda: c.l3_write_written_pages == 4, "the pages written")
        assert c.l3_write_retries == 2 * 4 and c.l3_write_failed_pages == 0
        assert rig.backend.stats.puts == 4 and rig.tier.writer.queued == 0
        assert await rig.tier.l3.exists(rig.session.ns_fingerprint, keys) == 4
        assert all(rig.pool.describe(x).in_l3 for x in rig.slots(keys))


async def test_pages_are_given_up_after_the_last_retry(tmp_path: Path) -> None:
    async with open_rig(tmp_path, run=False) as rig, running(rig.tier.writer):
        c, keys = rig.counters, chain(4)
        rig.store(keys)
        shutil.rmtree(rig.l3_dir)
        rig.tier.stored(rig.session, keys)
        pages, written, failed, left = await rig.tier.writer.sync(10.0)
        assert (pages, written, failed, left) == (4, 0, 4, 0)
        assert c.l3_write_retries == 4 * MAX_RETRIES and c.l3_write_failed_pages == 4
        assert rig.tier.writer.queued == 0 and rig.backend.stats.puts == 0


class PassThrough:
    """The tier's guarded backend as the writer uses it, every call passed on to ``inner``
    (subclasses change one call)."""

    def __init__(self, inner: L3Backend) -> None:
        self.inner = inner

    @property
    def available(self) -> bool:
        return self.inner.available

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        return await self.inner.exists(ns, keys)

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        return await self.inner.put(ns, keys, offsets, length)


class PutRaises(PassThrough):
    """The tier's guarded backend, whose next ``raises`` puts raise (a bug in a batch, which
    the guard lets through, unlike a backend fault)."""

    def __init__(self, inner: L3Backend, raises: int) -> None:
        super().__init__(inner)
        self.raises = raises

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        if self.raises:
            self.raises -= 1
            raise RuntimeError("a bug in a write batch")
        return await self.inner.put(ns, keys, offsets, length)


async def test_a_batch_that_raises_lets_go_of_its_pages(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pages leave the queue and are retried: a SYNC sees them written, not waiting."""
    async with open_rig(tmp_path, run=False) as rig:
        writer = L3Writer(
            rig.cfg, PutRaises(rig.tier.l3, raises=1), rig.tier, rig.pool, rig.counters
        )
        keys = chain(5)
        rig.store(keys)
        with caplog.at_level(logging.ERROR, logger="kvtier.daemon.tier.writer"):
            async with running(writer):
                writer.committed(rig.session.ns_fingerprint, rig.session.ns_id, keys, 16384)
                assert await writer.sync(10.0) == (5, 5, 0, 0)
        assert "an L3 write batch failed" in caplog.text
        assert rig.counters.l3_write_retries == 5 and rig.backend.stats.puts == 5
        assert writer.queued == 0


async def test_a_batch_that_keeps_raising_gives_its_pages_up(tmp_path: Path) -> None:
    async with open_rig(tmp_path, run=False) as rig:
        writer = L3Writer(
            rig.cfg,
            PutRaises(rig.tier.l3, raises=1 + MAX_RETRIES),
            rig.tier,
            rig.pool,
            rig.counters,
        )
        keys = chain(3)
        rig.store(keys)
        async with running(writer):
            writer.committed(rig.session.ns_fingerprint, rig.session.ns_id, keys, 16384)
            assert await writer.sync(10.0) == (3, 0, 3, 0)
        assert rig.counters.l3_write_failed_pages == 3 and writer.queued == 0
        assert rig.pool.lookup(rig.session.ns_id, keys) == 3  # L2 keeps the pages


async def test_write_back_writes_nothing_while_l2_has_room(tmp_path: Path) -> None:
    async with (
        open_rig(tmp_path, run=False, hicache_write_policy="write_back") as rig,
        running(rig.tier.writer) as writer,
    ):
        keys = chain(6)
        rig.store(keys)
        rig.tier.stored(rig.session, keys)
        checks = writer.write_back_checks
        await until(lambda: writer.write_back_checks > checks, "write-back to look at the pool")
        assert rig.counters.l3_write_queued_pages == 0 and rig.backend.stats.puts == 0
        assert rig.pool.evict_requires_l3
        # a shortfall makes evictable pages now: the coldest pages not in L3 are written
        writer.shortfall()
        await until(lambda: rig.counters.l3_write_written_pages == 6, "the pages written back")
        assert rig.backend.stats.puts == 6


async def test_a_write_back_scan_past_the_queue_counts_no_page_dropped(tmp_path: Path) -> None:
    """Pages a write-back scan finds no room for in the queue are offered again by a later
    scan: none of them is counted as dropped."""
    async with (
        open_rig(tmp_path, run=False, hicache_write_policy="write_back", write_back_queue=2) as rig,
        running(rig.tier.writer) as writer,
    ):
        for c in range(6):  # six chains of two pages: six tails for a scan to start from
            keys = chain(2, salt=f"c{c} ")
            rig.store(keys)
            rig.tier.stored(rig.session, keys)
        for _ in range(6):  # each shortfall scans the pool: two pages fit at a time
            writer.shortfall()
            await asyncio.sleep(0.05)
        await until(lambda: rig.counters.l3_write_written_pages >= 4, "pages written back")
        assert rig.counters.l3_write_dropped_pages == 0


async def test_a_fault_of_another_batch_during_a_flush_does_not_stop_it(tmp_path: Path) -> None:
    """A FLUSH stops at a delete that failed, not at a fault another batch counted while
    the delete ran (the read below stands for any such batch: its fault lands in the same
    ``stats.errors``); the reply then tells every page deleted and no problem."""
    async with open_rig(tmp_path) as rig:
        pages = chain(8)
        rig.store(pages)
        await written_to_l3(rig, pages)
        backend = rig.backend
        real_delete = backend.delete

        async def delete_while_a_read_fails(ns: bytes, keys: Sequence[bytes]) -> int:
            backend.stats.errors += 1  # a read of another batch failed meanwhile
            return await real_delete(ns, keys)

        backend.delete = delete_while_a_read_fails  # type: ignore[method-assign]
        deleted, problem = await rig.tier.l3.flush(None)
        assert (deleted, problem) == (8, None)
        assert backend.delete_faults == 0
