"""The pause watch and the deadlines of running time (``daemon/pauses.py``).

A pause here is the event loop held by a synchronous sleep (as kvtierd's loop is when the
process is stopped, starved or busy): the watch must record it, and deadlines of running
time must not count it. Only lower bounds of elapsed time are asserted (a slow machine only
adds to them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from kvtier.daemon.pauses import SLACK_S, TICK_S, PauseWatch, RunningTimer, running_timeout

HOLD_S = 0.6
"""How long a test holds the loop: far past TICK_S + SLACK_S."""


@contextlib.asynccontextmanager
async def ticking(watch: PauseWatch):  # type: ignore[no-untyped-def]
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0)
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_held_loop_is_recorded_once_by_whoever_looks_first():
    seen: list[float] = []
    async with ticking(PauseWatch()) as watch:
        undo = watch.listen(seen.append)
        await asyncio.sleep(2 * TICK_S)
        before = watch.catch_up()  # a loaded machine may have made the tick late already
        time.sleep(HOLD_S)
        total = watch.catch_up()  # looked before the tick could
        await asyncio.sleep(2 * TICK_S)
        undo()
    assert total - before >= HOLD_S - TICK_S - SLACK_S
    assert len(seen) == watch.pauses and sum(seen) == pytest.approx(watch.paused)


async def test_a_watch_that_does_not_tick_records_nothing():
    watch = PauseWatch()
    time.sleep(2 * (TICK_S + SLACK_S))
    assert watch.catch_up() == 0.0 and watch.pauses == 0


async def test_a_running_timer_does_not_count_a_pause_within_its_span():
    loop = asyncio.get_running_loop()
    fired = loop.create_future()
    async with ticking(PauseWatch()) as watch:
        t0 = loop.time()
        RunningTimer(0.3, lambda: fired.set_result(loop.time()), watch=watch)
        await asyncio.sleep(0.05)
        time.sleep(HOLD_S)  # past the timer's delay: it falls due meanwhile
        at = await asyncio.wait_for(fired, 10)
    assert at - t0 >= 0.3 + HOLD_S - TICK_S - SLACK_S


async def test_a_running_timer_without_pauses_fires_once_and_cancels():
    loop = asyncio.get_running_loop()
    calls: list[int] = []
    async with ticking(PauseWatch()) as watch:
        t = RunningTimer(0.05, calls.append, 1, watch=watch)
        c = RunningTimer(0.05, calls.append, 2, watch=watch)
        c.cancel()
        c.cancel()
        assert c.cancelled() and not t.cancelled()
        t0 = loop.time()
        while not calls and loop.time() - t0 < 10:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    assert calls == [1] and t.cancelled()


async def test_a_running_timeout_does_not_count_a_pause_but_ends_running_time():
    async with ticking(PauseWatch()) as watch:
        async with running_timeout(0.3, watch=watch):
            time.sleep(HOLD_S)  # the loop held past the timeout: not running time
            await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            async with running_timeout(0.1, watch=watch):
                await asyncio.sleep(10)


async def test_a_tp_round_keeps_the_pause_its_later_rank_arrived_after():
    """Rank 0 asks (its answer takes 1.8 s of running time, allowed 2 s); kvtierd is then
    held for 2 s, and rank 1 arrives with a short wait of its own. The round's timer was
    moved on by the pause; rank 1's shorter deadline must not bring it back: both ranks get
    the agreed answer, and no round times out."""
    from kvtier.daemon.pauses import WATCH
    from kvtier.daemon.tier.rank_groups import GroupKey, RankGroups

    loop = asyncio.get_running_loop()
    rounds: list[bool] = []
    groups = RankGroups(0.5, on_round=rounds.append)
    key = GroupKey(
        uid=1, tenant="t", model_id="m", revision="", cache_salt="", attention="mha",
        tp_size=2, tp_group="",
    )  # fmt: skip
    m0, m1 = groups.join(key, 0, 1), groups.join(key, 1, 2)

    async def slow() -> tuple[int]:
        done = loop.create_future()
        RunningTimer(1.8, done.set_result, None)
        await done
        return (7,)

    async def fast() -> tuple[int]:
        return (9,)

    async with ticking(WATCH):
        a = asyncio.create_task(groups.agree(m0, "claim", 1, slow, wait_s=2.0, count=1))
        await asyncio.sleep(0.1)
        time.sleep(2.0)  # rank 1's CLAIM waits unread meanwhile
        await asyncio.sleep(0.05)
        b = asyncio.create_task(groups.agree(m1, "claim", 1, fast, wait_s=0.3, count=1))
        got = await asyncio.wait_for(asyncio.gather(a, b), 30)
    assert got == [(7,), (7,)] and rounds == [False]
