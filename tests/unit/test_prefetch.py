"""The prefetcher in-process, over a real host pool and the real ``file`` backend in a tmp dir:
a run of pages in L3 is read into WRITING slots that become READY in chain order; a miss
cuts the run; a cancellation or a shutdown frees the slots (never one still being read).

Reads go through the tier's real guarded backend; a gate in front of it holds the first
batch's read back, so the order in which batches finish is chosen by the test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kvtier.daemon.pool.host_pool import PageState
from kvtier.daemon.tier.prefetch import Fate, Fill, Prefetcher, ReadLimit, read_batch

from tests.unit.test_tier_store import GEOMETRY, Rig, chain, open_rig, until, written_to_l3

pytestmark = pytest.mark.timeout(30)

PAGES = 32
CONCURRENCY = 4
BATCH = read_batch(PAGES, CONCURRENCY)


class GatedReads:
    """Reads from the rig's L3; a read whose first key is ``held`` waits for ``gate``."""

    def __init__(self, rig: Rig, held: bytes) -> None:
        self.rig = rig
        self.held = held
        self.gate = asyncio.Event()
        self.calls = 0

    async def __call__(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        self.calls += 1
        if keys[0] == self.held:
            await self.gate.wait()
        return await self.rig.tier.l3.get(ns, keys, offsets, length)


async def in_l3_only(rig: Rig, n: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of ``n`` pages written to L3 and flushed from L2; (keys, payloads)."""
    keys = chain(n)
    payloads = rig.store(keys)
    await written_to_l3(rig, keys)
    assert rig.pool.flush(rig.session.ns_id) == n
    return keys, payloads


def start(rig: Rig, pf: Prefetcher, keys: list[bytes]) -> tuple[Fill, asyncio.Task[int]]:
    s = rig.session
    fill = pf.new_fill(s.ns_fingerprint, s.ns_id, GEOMETRY.page_bytes)
    task = asyncio.get_running_loop().create_task(pf.fill(fill, s.owner, s.class_id, keys, None))
    return fill, task


def resident(rig: Rig) -> tuple[int, int]:
    """(READY, WRITING) pages in the pool."""
    st = rig.pool.stats()
    return st.pages_ready, st.pages_writing


def states(rig: Rig, fill: Fill) -> list[PageState]:
    return [rig.pool.describe(x).state for x in fill.slots]


async def test_pages_become_ready_in_chain_order(tmp_path: Path) -> None:
    assert PAGES // BATCH == 2  # two read batches
    async with open_rig(tmp_path) as rig:
        keys, payloads = await in_l3_only(rig, PAGES)
        reads = GatedReads(rig, held=keys[0])
        pf = Prefetcher(rig.pool, rig.counters, reads, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        assert await task == PAGES
        # the second batch has verified, the first is still being read: nothing is READY
        await until(lambda: fill.fate[BATCH:] == [Fate.VERIFIED] * BATCH, "the second batch")
        assert fill.fate[:BATCH] == [Fate.READING] * BATCH
        assert states(rig, fill) == [PageState.WRITING] * PAGES
        assert rig.pool.lookup(rig.session.ns_id, keys) == 0 and fill.committed == 0
        reads.gate.set()
        await pf.wait([fill], 10.0)
        assert fill.done.done() and fill.committed == PAGES
        assert states(rig, fill) == [PageState.READY] * PAGES
        assert rig.pool.lookup(rig.session.ns_id, keys) == PAGES
        assert [rig.payload(x) for x in fill.slots] == payloads
        assert all(rig.pool.describe(x).in_l3 for x in fill.slots)
        c = rig.counters
        assert c.l3_prefetch_started_pages == c.l3_prefetch_completed_pages == PAGES
        assert c.l3_prefetch_failed_pages == c.l3_prefetch_cancelled_pages == 0
        assert pf.active == 0 and reads.calls == 2


async def test_a_page_missing_from_l3_cuts_the_run_there(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        keys, payloads = await in_l3_only(rig, PAGES)
        cut = BATCH + 3
        assert await rig.backend.delete(rig.session.ns_fingerprint, [keys[cut]]) == 1
        pf = Prefetcher(rig.pool, rig.counters, rig.tier.l3.get, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        await task
        await pf.wait([fill], 10.0)
        assert fill.committed == cut and rig.pool.lookup(rig.session.ns_id, keys) == cut
        assert [rig.payload(x) for x in fill.slots[:cut]] == payloads[:cut]
        assert rig.pool.resident_run(rig.session.ns_id, keys[cut:]) == 0  # freed
        assert rig.counters.l3_prefetch_failed_pages == PAGES - cut
        assert rig.counters.l3_prefetch_unused_pages == PAGES - cut - 1  # read, then dropped
        assert resident(rig) == (cut, 0)


async def test_cancel_frees_the_slots_but_not_those_being_read(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        keys, _ = await in_l3_only(rig, PAGES)
        reads = GatedReads(rig, held=keys[0])
        pf = Prefetcher(rig.pool, rig.counters, reads, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        await task
        await until(lambda: fill.fate[BATCH:] == [Fate.VERIFIED] * BATCH, "the second batch")
        pf.cancel(fill)
        # the verified batch is freed at once (no prefix); the batch being read is kept
        assert states(rig, fill)[BATCH:] == [PageState.FREE] * BATCH
        assert states(rig, fill)[:BATCH] == [PageState.WRITING] * BATCH
        assert not fill.done.done()
        reads.gate.set()
        await pf.wait([fill], 10.0)
        assert fill.done.done() and fill.committed == 0
        assert states(rig, fill) == [PageState.FREE] * PAGES
        assert resident(rig) == (0, 0)
        c = rig.counters
        assert c.l3_prefetch_cancelled_pages == PAGES and c.l3_prefetch_completed_pages == 0
        assert pf.active == 0


async def test_cancel_keeps_the_verified_leading_run(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        keys, payloads = await in_l3_only(rig, PAGES)
        reads = GatedReads(rig, held=keys[BATCH])  # the second batch is held this time
        pf = Prefetcher(rig.pool, rig.counters, reads, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        await task
        await until(lambda: fill.committed == BATCH, "the first batch READY")
        pf.cancel(fill)
        reads.gate.set()
        await pf.wait([fill], 10.0)
        assert rig.pool.lookup(rig.session.ns_id, keys) == BATCH
        assert [rig.payload(x) for x in fill.slots[:BATCH]] == payloads[:BATCH]
        assert states(rig, fill)[BATCH:] == [PageState.FREE] * BATCH
        assert rig.counters.l3_prefetch_cancelled_pages == BATCH


async def test_close_gives_every_fill_up(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        keys, _ = await in_l3_only(rig, PAGES)
        reads = GatedReads(rig, held=keys[0])
        pf = Prefetcher(rig.pool, rig.counters, reads, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        await task
        closing = asyncio.get_running_loop().create_task(pf.close(10.0))
        await until(lambda: fill.fate[BATCH:] == [Fate.ABORTED] * BATCH, "the second batch")
        assert not closing.done()  # it waits for the read in flight
        reads.gate.set()
        await closing
        assert fill.done.done() and pf.active == 0
        assert resident(rig) == (0, 0)


async def test_committed_runs_are_told_with_their_own_parents_around_a_skipped_page(
    tmp_path: Path,
) -> None:
    """A page of the run is already in L2 (a STORE of it is being copied): the fill skips
    it, and what it commits is told as two chain runs, the second parented by the skipped
    page (a KV event subscriber builds its tree from these)."""
    async with open_rig(tmp_path) as rig:
        keys, payloads = await in_l3_only(rig, PAGES)
        s = rig.session
        gap = BATCH - 2  # inside the first read batch
        storing = rig.pool.allocate(s.ns_id, s.owner, s.class_id, [keys[gap]], keys[gap - 1])
        assert len(storing) == 1  # WRITING: a STORE's copy in flight
        told: list[tuple[list[bytes], bytes | None]] = []
        pf = Prefetcher(rig.pool, rig.counters, rig.tier.l3.get, CONCURRENCY)
        pf.on_committed = lambda ns_id, ks, parent: told.append((list(ks), parent))
        fill, task = start(rig, pf, keys)
        assert await task == PAGES - 1
        await pf.wait([fill], 10.0)
        assert fill.committed == PAGES - 1
        assert [rig.payload(x) for x in fill.slots] == payloads[:gap] + payloads[gap + 1 :]
        runs = [(ks, parent) for ks, parent in told]
        flat = [k for ks, _ in runs for k in ks]
        assert flat == keys[:gap] + keys[gap + 1 :]
        for ks, parent in runs:  # each run's parent is the key before its first in the chain
            i = keys.index(ks[0])
            assert parent == (keys[i - 1] if i else None)
            assert ks == keys[i : i + len(ks)]
        rig.pool.abort([slot for _, slot in storing])


async def test_a_flush_of_l3_cancels_the_fills_reading_from_it(tmp_path: Path) -> None:
    """A FLUSH of L3 while a prefetch's reads are in flight: the reads that land after it
    do not make their pages READY (they would be marked as held by L3, whose objects are
    gone); what had verified before stays, and is no longer marked in L3."""
    async with open_rig(tmp_path) as rig:
        keys, _ = await in_l3_only(rig, PAGES)
        gate = asyncio.Event()

        async def read_then_wait(ns: bytes, ks: list[bytes], offs: list[int], n: int) -> list[bool]:
            flags = await rig.tier.l3.get(ns, ks, offs, n)  # the bytes are read ...
            if ks[0] == keys[BATCH]:
                await gate.wait()  # ... and the second batch's read returns after the flush
            return flags

        pf = rig.tier.prefetcher = Prefetcher(rig.pool, rig.counters, read_then_wait, CONCURRENCY)
        fill, task = start(rig, pf, keys)
        await task
        await until(lambda: fill.committed == BATCH, "the first batch")
        assert await rig.tier.flush([rig.session.ns_fingerprint]) == (PAGES, None)
        gate.set()
        await pf.wait([fill], 10.0)
        s = rig.session
        assert fill.committed == BATCH and rig.pool.lookup(s.ns_id, keys) == BATCH
        assert not any(rig.pool.describe(x).in_l3 for x in fill.slots[:BATCH])
        assert rig.pool.resident_run(s.ns_id, keys[BATCH:]) == 0


async def test_a_raised_read_limit_counts_the_reads_in_flight(tmp_path: Path) -> None:
    """A reload that raises ``prefetch_concurrency`` while reads are in flight: those reads
    count against the new limit, so reads in flight never exceed it (the old and the new
    limit's reads never run side by side), and reads waiting are admitted up to it."""
    pages = 128
    assert pages // read_batch(pages // 2, 2) == 8  # four reads a fill, three admitted
    async with open_rig(tmp_path) as rig:
        keys, keys2 = chain(pages // 2), chain(pages // 2, salt="another ")
        for ks in (keys, keys2):
            rig.store(ks)
            await written_to_l3(rig, ks)
        assert rig.pool.flush(rig.session.ns_id) == pages
        gate = asyncio.Event()
        now = most = 0

        async def counted(ns: bytes, ks: list[bytes], offs: list[int], n: int) -> list[bool]:
            nonlocal now, most
            now += 1
            most = max(most, now)
            try:
                await gate.wait()
                return await rig.tier.l3.get(ns, ks, offs, n)
            finally:
                now -= 1

        pf = Prefetcher(rig.pool, rig.counters, counted, 2)
        fill, task = start(rig, pf, keys)
        await task
        await until(lambda: now == 2, "two reads in flight")
        pf.set_concurrency(3)
        await until(lambda: now == 3, "a third read admitted")
        more, task = start(rig, pf, keys2)  # a fill started after the reload waits its turn
        await task
        await asyncio.sleep(0.05)
        assert most == 3, f"{most} reads in flight under a limit of 3"
        gate.set()
        await pf.wait([fill, more], 10.0)
        assert fill.committed == more.committed == pages // 2 and most == 3


async def test_a_read_limit_admits_in_order_across_resizes_and_cancellations() -> None:
    """The limit admits waiters first come first served; a lower limit admits nobody new
    until holders fall below it; a waiter cancelled before its turn (or as it came) leaves
    the count exact."""
    limit = ReadLimit(2)
    order: list[int] = []
    release = [asyncio.Event() for _ in range(6)]

    async def hold(i: int) -> None:
        async with limit:
            order.append(i)
            await release[i].wait()

    tasks = [asyncio.create_task(hold(i)) for i in range(6)]
    await until(lambda: order == [0, 1], "the first two admitted")
    limit.resize(1)
    release[0].set()
    await asyncio.sleep(0.01)
    assert order == [0, 1] and limit.held == 1  # one left, at the new limit: nobody new
    tasks[2].cancel()  # a waiter gives up before its turn
    release[1].set()
    await until(lambda: order == [0, 1, 3], "the next waiter in line")
    limit.resize(3)
    await until(lambda: order == [0, 1, 3, 4, 5], "two more at the higher limit")
    assert limit.held == 3
    for e in release:
        e.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert limit.held == 0

    limit = ReadLimit(1)
    first = asyncio.create_task(hold(0))
    release[0].clear()
    await until(lambda: limit.held == 1, "the first holder")
    late = asyncio.create_task(hold(1))
    await asyncio.sleep(0.01)
    release[0].set()
    await asyncio.sleep(0)  # the turn passes to the waiter ...
    late.cancel()  # ... which is cancelled before it runs: the turn is given back
    await asyncio.gather(first, late, return_exceptions=True)
    assert limit.held == 0


async def test_a_waiter_cancelled_as_its_turn_is_skipped_leaves_the_limit_exact() -> None:
    """A read waiting for its turn is cancelled, and the holder ends before the waiter runs
    again (its cancelled turn is passed over): the waiter ends cancelled, nothing else
    raises, and the limit counts no holder."""
    limit = ReadLimit(1)
    await limit.__aenter__()

    async def wait_turn() -> None:
        async with limit:
            pass

    waiter = asyncio.create_task(wait_turn())
    await asyncio.sleep(0)  # the waiter waits for its turn
    waiter.cancel()
    await limit.__aexit__(None, None, None)  # its cancelled turn is passed over
    (ended,) = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(ended, asyncio.CancelledError), ended
    assert limit.held == 0
