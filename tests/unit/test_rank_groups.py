"""Tensor-parallel rank groups in-process: a round answers the element-wise minimum over the
ranks, 0 for everyone when a rank misses the deadline, and rounds are matched by order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from kvtier.daemon.tier.rank_groups import GroupKey, Member, RankGroups

from tests.still_clock import START, StillClockLoop, run, turns

pytestmark = pytest.mark.timeout(30)


def key(tp_size: int) -> GroupKey:
    return GroupKey(
        uid=1000,
        tenant="t",
        model_id="m",
        revision="",
        cache_salt="",
        attention="mha",
        tp_size=tp_size,
        tp_group="",
    )


def answer(*values: int) -> Callable[[], Awaitable[tuple[int, ...]]]:
    async def compute() -> tuple[int, ...]:
        return values

    return compute


class Rounds:
    """The groups, with the ``on_round`` calls they made."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.ended: list[bool] = []
        self.groups = RankGroups(timeout_s, on_round=self.ended.append)

    def join(self, tp_size: int) -> list[Member]:
        members = [self.groups.join(key(tp_size), rank, 100 + rank) for rank in range(tp_size)]
        assert all(m is not None for m in members)
        return members  # type: ignore[return-value]


def later(coro: Awaitable[tuple[int, ...]]) -> asyncio.Task[tuple[int, ...]]:
    return asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]


async def test_every_rank_gets_the_minimum_over_the_ranks() -> None:
    r = Rounds()
    m0, m1, m2 = r.join(3)
    t0 = later(r.groups.agree(m0, "lookup", 2, answer(5, 9)))
    t1 = later(r.groups.agree(m1, "lookup", 2, answer(7, 3)))
    await asyncio.sleep(0)
    assert r.ended == [] and not t0.done()  # both contributed; rank 2 has not asked yet
    assert await r.groups.agree(m2, "lookup", 2, answer(6, 6)) == (5, 3)
    assert await t0 == await t1 == (5, 3)
    assert r.ended == [False]


async def test_a_single_rank_engine_has_no_group() -> None:
    assert RankGroups(1.0).join(key(1), 0, 1) is None


async def test_a_missing_rank_makes_the_answer_zero_for_everyone() -> None:
    r = Rounds(timeout_s=0.05)
    m0, m1 = r.join(2)
    assert await r.groups.agree(m0, "claim", 1, answer(8)) == (0,)
    assert r.ended == [True]
    asked = []

    async def late() -> tuple[int, ...]:
        asked.append(1)
        return (8,)

    # the late rank is answered 0 at once, without doing its work
    assert await r.groups.agree(m1, "claim", 1, late) == (0,)
    assert not asked and r.ended == [True]
    # the next round is a fresh one for both
    t0 = later(r.groups.agree(m0, "claim", 1, answer(4)))
    assert await r.groups.agree(m1, "claim", 1, answer(6)) == (4,)
    assert await t0 == (4,) and r.ended == [True, False]


async def test_rounds_are_matched_in_order_per_operation() -> None:
    r = Rounds()
    m0, m1 = r.join(2)
    first = later(r.groups.agree(m0, "lookup", 1, answer(10)))
    second = later(r.groups.agree(m0, "lookup", 1, answer(20)))
    claim = later(r.groups.agree(m0, "claim", 1, answer(1)))
    await asyncio.sleep(0)
    # rank 1's first lookup meets rank 0's first, its second the second; claims apart
    assert await r.groups.agree(m1, "lookup", 1, answer(15)) == (10,)
    assert await r.groups.agree(m1, "lookup", 1, answer(5)) == (5,)
    assert await first == (10,) and await second == (5,)
    assert not claim.done()
    assert await r.groups.agree(m1, "claim", 1, answer(2)) == (1,)
    assert await claim == (1,) and r.ended == [False, False, False]


async def test_a_rank_that_counts_its_requests_stays_paired_after_one_it_never_sent() -> None:
    """A rank whose LOOKUP 2 never reached the daemon (its connection backed off) still has
    its LOOKUP 3 paired with the other rank's LOOKUP 3, not with its LOOKUP 2: rounds
    follow the ranks' counts; the round of the request that never came ends without it."""
    r = Rounds(timeout_s=0.05)
    m0, m1 = r.join(2)
    t = later(r.groups.agree(m0, "lookup", 1, answer(4), count=1))
    assert await r.groups.agree(m1, "lookup", 1, answer(6), count=1) == (4,)
    assert await t == (4,)
    # round 2: rank 1 asks, rank 0 never does; it ends at its deadline with 0
    assert await r.groups.agree(m1, "lookup", 1, answer(9), count=2) == (0,)
    for n, (v0, v1) in enumerate([(7, 8), (3, 5), (11, 2)], start=3):
        t = later(r.groups.agree(m0, "lookup", 1, answer(v0), count=n))
        assert await r.groups.agree(m1, "lookup", 1, answer(v1), count=n) == (min(v0, v1),)
        assert await t == (min(v0, v1),)
    assert r.ended == [False, True, False, False, False]


async def test_a_rank_that_skipped_a_request_before_it_joined_stays_paired() -> None:
    """A daemon restarted under a running TP engine: rank 0's LOOKUP 5 opens the new
    daemon's first round; rank 1, whose LOOKUP 5 fell into the restart (counted, never
    sent), registers meanwhile and asks LOOKUP 6. Its 6 must meet rank 0's 6, not rank 0's
    5 (then every later round would be shifted for good): rank 0's 5 ends without it."""
    r = Rounds(timeout_s=0.2)
    m0 = r.groups.join(key(2), 0, 100)
    assert m0 is not None
    first = later(r.groups.agree(m0, "lookup", 1, answer(4), count=5))
    await asyncio.sleep(0.1)  # rank 0 asks its 6 once its 5 has ended: before rank 1's 6 does
    m1 = r.groups.join(key(2), 1, 101)
    assert m1 is not None
    sixth = later(r.groups.agree(m1, "lookup", 1, answer(6), count=6))
    assert await first == (0,)  # rank 1 never asked round 5
    for n, (v0, v1) in enumerate([(7, 6), (3, 5), (11, 2)], start=6):
        mine = later(r.groups.agree(m0, "lookup", 1, answer(v0), count=n))
        if n == 6:
            assert await sixth == (6,)
        else:
            assert await r.groups.agree(m1, "lookup", 1, answer(v1), count=n) == (min(v0, v1),)
        assert await mine == (min(v0, v1),)


async def test_a_request_counted_before_the_groups_first_round_is_answered_at_once() -> None:
    """The other order of a restart: rank 1 skipped its LOOKUP 5 and its LOOKUP 6 reaches
    the new daemon first; rank 0's LOOKUP 5 comes after. Rank 0's 5 is answered 0 at once
    (no rank will ask round 5 here) and the ranks' 6th, 7th, ... LOOKUPs meet."""
    r = Rounds(timeout_s=5.0)
    m0, m1 = r.join(2)
    sixth = later(r.groups.agree(m1, "lookup", 1, answer(6), count=6))
    await asyncio.sleep(0)
    assert await r.groups.agree(m0, "lookup", 1, answer(4), count=5) == (0,)
    assert await r.groups.agree(m0, "lookup", 1, answer(7), count=6) == (6,)
    assert await sixth == (6,)
    seventh = later(r.groups.agree(m0, "lookup", 1, answer(3), count=7))
    assert await r.groups.agree(m1, "lookup", 1, answer(9), count=7) == (3,)
    assert await seventh == (3,)


async def test_a_rank_taking_a_live_ranks_place_maps_counts_anew() -> None:
    """A restarted engine whose old sessions are still open: its ranks count from 1 again
    and take the old ranks' places; their k-th requests meet, whatever the old engine's
    counts were."""
    r = Rounds(timeout_s=5.0)
    m0, m1 = r.join(2)
    for n in (100, 101):  # the old engine's first counted requests here
        t = later(r.groups.agree(m0, "lookup", 1, answer(1), count=n))
        assert await r.groups.agree(m1, "lookup", 1, answer(2), count=n) == (1,)
        assert await t == (1,)
    n0, n1 = (r.groups.join(key(2), rank, 300 + rank) for rank in (0, 1))
    assert n0 is not None and n1 is not None
    for n, (v0, v1) in enumerate([(5, 8), (9, 4)], start=1):
        t = later(r.groups.agree(n0, "lookup", 1, answer(v0), count=n))
        assert await r.groups.agree(n1, "lookup", 1, answer(v1), count=n) == (min(v0, v1),)
        assert await t == (min(v0, v1),)


async def test_the_last_rank_leaving_ends_its_open_rounds_with_zero() -> None:
    r = Rounds()
    m0, m1 = r.join(2)
    waiting = later(r.groups.agree(m0, "lookup", 1, answer(3)))
    await asyncio.sleep(0)
    r.groups.leave(m1)
    assert not waiting.done()  # rank 0 is still there: its round waits on
    r.groups.leave(m0)
    assert await waiting == (0,) and len(r.groups) == 0


async def test_a_rank_that_joins_mid_round_joins_that_round() -> None:
    r = Rounds()
    m0, m1 = r.join(2)
    assert await asyncio.gather(
        r.groups.agree(m0, "lookup", 1, answer(3)), r.groups.agree(m1, "lookup", 1, answer(4))
    ) == [(3,), (3,)]
    waiting = later(r.groups.agree(m0, "lookup", 1, answer(9)))
    await asyncio.sleep(0)
    again = r.groups.join(key(2), 1, 200)  # rank 1's engine restarted
    assert again is not None
    assert await r.groups.agree(again, "lookup", 1, answer(7)) == (7,)
    assert await waiting == (7,)


def test_a_round_ends_at_its_deadline_by_the_loop_clock() -> None:
    """A round ends ``wait_s + timeout_s`` after its latest contribution, by the loop's
    clock (one the test moves: no waiting): not before, and not at the first rank's
    deadline once a later rank has pushed it back."""

    async def test(loop: StillClockLoop) -> None:
        r = Rounds(timeout_s=2.0)
        m0, m1, _ = r.join(3)  # rank 2 never asks
        t0 = later(r.groups.agree(m0, "lookup", 1, answer(5), wait_s=1.0))  # until +3.0
        await turns()
        loop.now = START + 2.999
        await turns()
        assert not t0.done()
        t1 = later(r.groups.agree(m1, "lookup", 1, answer(4), wait_s=0.5))  # until +5.499
        await turns()
        for now in (START + 3.001, START + 5.49):
            loop.now = now
            await turns()
            assert not t0.done() and not t1.done() and r.ended == []
        loop.now = START + 5.5
        await turns()
        assert t0.done() and t1.done() and t0.result() == t1.result() == (0,)
        assert r.ended == [True]

    run(test)


async def test_a_resumed_rank_keeps_its_rounds_and_a_forgotten_one_is_answered_at_once() -> None:
    """Rank 1's session ended while its process was stopped (LOOKUP 2 went on without it
    and ended at its deadline). It registers again saying its counts go on: its LOOKUP 2 is
    answered at once with that round's 0, its LOOKUP 3 meets rank 0's 3. If the round of its
    stalled request has been forgotten meanwhile, the answer is 0 at once as well, with no
    new round opened that nobody would join."""
    r = Rounds(timeout_s=0.05)
    m0, m1 = r.join(2)
    t = later(r.groups.agree(m0, "lookup", 1, answer(4), count=1))
    assert await r.groups.agree(m1, "lookup", 1, answer(6), count=1) == (4,)
    assert await t == (4,)
    r.groups.leave(m1)  # its lease ran out while it was stopped
    assert await r.groups.agree(m0, "lookup", 1, answer(5), count=2) == (0,)
    m1 = r.groups.join(key(2), 1, 201, counts_continue=True)
    assert m1 is not None and r.ended == [False, True]
    assert await r.groups.agree(m1, "lookup", 1, answer(9), count=2) == (0,)  # at once
    t = later(r.groups.agree(m0, "lookup", 1, answer(7), count=3))
    assert await r.groups.agree(m1, "lookup", 1, answer(8), count=3) == (7,)
    assert await t == (7,) and r.ended == [False, True, False]
    # the same again, the stalled request's round forgotten before the rank comes back
    r.groups.leave(m1)
    assert await r.groups.agree(m0, "lookup", 1, answer(5), count=4) == (0,)
    m1 = r.groups.join(key(2), 1, 202, counts_continue=True)
    assert m1 is not None
    m1.group.rounds.clear()
    assert await r.groups.agree(m1, "lookup", 1, answer(9), count=4) == (0,)
    assert r.ended == [False, True, False, True]  # no round opened for it, none timed out
    t = later(r.groups.agree(m0, "lookup", 1, answer(3), count=5))
    assert await r.groups.agree(m1, "lookup", 1, answer(6), count=5) == (3,)
    assert await t == (3,)


async def test_a_rank_replacing_its_own_orphaned_session_keeps_its_rounds() -> None:
    """Rank 1's REGISTER reached the daemon but its reply never reached the engine (a
    timeout): the session it opened is live. The engine registers again from the same
    process saying its counts go on; its next counted request still meets rank 0's request
    of the same count, at once, with no round left to time out. A new process in that place
    (another pid) maps its counts anew."""
    r = Rounds(timeout_s=5.0)
    m0 = r.groups.join(key(2), 0, 100, pid=500)
    m1 = r.groups.join(key(2), 1, 101, pid=501)
    assert m0 is not None and m1 is not None
    for n in (1, 2):
        t = later(r.groups.agree(m0, "lookup", 1, answer(n), count=n))
        assert await r.groups.agree(m1, "lookup", 1, answer(9), count=n) == (n,)
        assert await t == (n,)
    orphan = r.groups.join(key(2), 1, 102, counts_continue=True, pid=501)  # reply lost
    again = r.groups.join(key(2), 1, 103, counts_continue=True, pid=501)
    assert orphan is not None and again is not None and again.resumed
    t = later(r.groups.agree(m0, "lookup", 1, answer(4), count=3))
    got = await asyncio.wait_for(r.groups.agree(again, "lookup", 1, answer(6), count=3), 1.0)
    assert got == (4,) and await t == (4,) and r.ended == [False, False, False]
    other = r.groups.join(key(2), 1, 104, counts_continue=True, pid=777)
    assert other is not None and not other.resumed and not m0.group.offset
