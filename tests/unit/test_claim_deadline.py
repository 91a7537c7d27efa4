"""When a CLAIM stops waiting for its prefetch, by a clock the test moves (no sleeps).

The tier counts a claim's deadline from its event loop's clock: ``timeout`` waits until the
prefetch's start plus ``min(prefetch_timeout_max, prefetch_timeout_base +
prefetch_timeout_per_ki_token x tokens / 1024)``, ``wait_complete`` until the start plus
``prefetch_timeout_max``, ``best_effort`` not at all. Here the loop is one whose clock
stands still until the test moves it (``tests/still_clock.py``), and every L3 read of the
prefetch is held, so the prefetch never ends by itself: the claim must end exactly when
the clock passes its deadline, not before, and not only when the cap or the prefetch's end
would have ended it.

The tier, the host pool, the prefetcher and the file store are the real ones
(``open_rig``); only the store's reads wait behind a gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kvtier.daemon.tier.prefetch import Prefetcher

from tests.still_clock import START, StillClockLoop, run, turns
from tests.unit.test_prefetch import CONCURRENCY
from tests.unit.test_tier_store import GEOMETRY, Rig, chain, open_rig, written_to_l3

pytestmark = pytest.mark.timeout(60)

PAGES = 16
TOKENS = PAGES * GEOMETRY.page_size  # 256 tokens: a quarter of a Ki-token


class HeldReads:
    """The rig's L3 reads, each held until :attr:`gate` is set."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.gate = asyncio.Event()
        self.waiting = 0

    async def __call__(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        self.waiting += 1
        await self.gate.wait()
        return await self.rig.tier.l3.get(ns, keys, offsets, length)


@contextlib.asynccontextmanager
async def claim_behind_held_reads(
    loop: StillClockLoop, rig: Rig, policy: str, salt: str = ""
) -> AsyncIterator[tuple[asyncio.Task[int], HeldReads]]:
    """A prefetch of a chain only in L3, its reads held; the claim of it, started. On exit
    the claim is cancelled if it still runs, and the reads are let go and waited for (the
    clock stays where it is: the prefetcher's close waits for its reads, not the clock)."""
    keys = chain(PAGES, salt)
    rig.store(keys)
    await written_to_l3(rig, keys)
    assert rig.pool.flush(rig.session.ns_id) == PAGES
    reads = HeldReads(rig)
    rig.tier.prefetcher = Prefetcher(rig.pool, rig.counters, reads, CONCURRENCY)
    loop.now = START
    assert await rig.tier.prefetch(rig.session, keys, "") == PAGES
    await turns()
    assert reads.waiting > 0 and rig.tier.prefetcher.active == 1  # reading, nothing read
    task = loop.create_task(rig.tier.claim(rig.session, keys, "", policy))
    try:
        await turns()
        yield task, reads
    finally:
        task.cancel()
        reads.gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await rig.tier.prefetcher.close(60.0)
        assert not rig.tier.prefetcher.active


async def ends_at(loop: StillClockLoop, task: asyncio.Task[int], deadline: float) -> int:
    """Check that ``task`` waits until the clock reaches ``deadline`` and ends then; its
    result."""
    for now in (START + 0.001, deadline - 0.01, deadline - 0.001):
        loop.now = now
        await turns()
        assert not task.done(), f"the claim ended at {now - START:.3f} s, before its deadline"
    loop.now = deadline + 0.001
    await turns()
    assert task.done(), f"the claim still waits past its deadline ({deadline - START:.3f} s)"
    return task.result()


@pytest.mark.parametrize(
    ("base", "per_ki", "cap", "expect"),
    [
        (0.5, 2.0, 30.0, 0.5 + 2.0 * TOKENS / 1024),  # the formula: 1.0 s
        (0.5, 40.0, 3.0, 3.0),  # the formula (10.5 s) capped at prefetch_timeout_max
        (0.0, 0.0, 30.0, 0.0),  # no time at all: the claim does not wait
    ],
)
def test_timeout_claim_ends_at_its_computed_deadline(
    tmp_path: Path, base: float, per_ki: float, cap: float, expect: float
) -> None:
    async def test(loop: StillClockLoop) -> None:
        tmp = tmp_path
        async with open_rig(
            tmp,
            prefetch_timeout_base=base,
            prefetch_timeout_per_ki_token=per_ki,
            prefetch_timeout_max=cap,
        ) as rig:
            s = rig.session
            async with claim_behind_held_reads(loop, rig, "timeout") as (task, _):
                assert not s.prefetches  # the claim took its prefetch
                if expect == 0.0:
                    assert task.done() and task.result() == 0
                else:
                    assert await ends_at(loop, task, START + expect) == 0  # nothing read
            assert rig.tier.claim_deadline(s, None, "timeout") == loop.now  # no prefetch

    run(test)


def test_wait_complete_waits_until_the_cap_and_best_effort_not_at_all(tmp_path: Path) -> None:
    async def test(loop: StillClockLoop) -> None:
        tmp = tmp_path
        async with open_rig(
            tmp,
            prefetch_timeout_base=0.5,
            prefetch_timeout_per_ki_token=2.0,
            prefetch_timeout_max=7.0,
        ) as rig:
            async with claim_behind_held_reads(loop, rig, "wait_complete") as (task, _):
                assert await ends_at(loop, task, START + 7.0) == 0
            async with claim_behind_held_reads(loop, rig, "best_effort", salt="b") as (task, _):
                assert task.done() and task.result() == 0

    run(test)


def test_a_timeout_claim_whose_reads_end_in_time_gets_every_page(tmp_path: Path) -> None:
    async def test(loop: StillClockLoop) -> None:
        tmp = tmp_path
        async with (
            open_rig(
                tmp,
                prefetch_timeout_base=0.5,
                prefetch_timeout_per_ki_token=2.0,
                prefetch_timeout_max=30.0,
            ) as rig,
            claim_behind_held_reads(loop, rig, "timeout") as (task, reads),
        ):
            loop.now = START + 0.9  # before the deadline (1.0 s)
            await turns()
            assert not task.done()
            reads.gate.set()  # the reads end in time; the clock stays
            assert await task == PAGES

    run(test)
