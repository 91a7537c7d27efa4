"""Exact eviction orders of the candidate policies (bench/trace/policies.py) on tiny traces."""

from __future__ import annotations

import pytest
from kvtier.bench.trace.policies import (
    lirs_hit_rate,
    reuse_hit_rate,
    reused_min_hit_rate,
    twoq_hit_rate,
    wtinylfu_hit_rate,
)
from kvtier.bench.trace.sim import lru_hit_rate


def test_twoq_keeps_a_ghost_hit_through_a_scan() -> None:
    # capacity 2 (A1's share 1): [3] pushes 1 out of A1 into A1out; 1 comes back, enters
    # Am; the scan 4, 5, 6 cycles through A1 only, so the last [1] hits
    chains = [[1], [2], [3], [1], [4], [5], [6], [1]]
    assert twoq_hit_rate(chains, 2) == pytest.approx(1 / 8)
    assert lru_hit_rate(chains, 2) == 0.0


def test_twoq_ghost_length_decides_the_admission() -> None:
    # 1 leaves A1 at [3], then 2 and 3 join A1out: with room for 2 ids, 1 is forgotten
    # and re-enters A1, where the scan evicts it again
    chains = [[1], [2], [3], [4], [5], [1], [6], [7], [1]]
    assert twoq_hit_rate(chains, 2, ghost=1.0) == 0.0
    assert twoq_hit_rate(chains, 2, ghost=3.0) == pytest.approx(1 / 9)


def test_candidates_never_cut_a_chain() -> None:
    # [1, 2] then [3]: capacity 2 evicts a leaf (2, or 3 under LIRS), never 1 under its child
    chains = [[1, 2], [3], [1, 4]]
    for sim in (twoq_hit_rate, wtinylfu_hit_rate, lirs_hit_rate):
        assert sim(chains, 2) == pytest.approx(1 / 5)


def test_wtinylfu_rejects_a_newcomer_seen_less_often_than_the_victim() -> None:
    # capacity 3: window 1, probation 2; 1 (seen twice) and 10 fill probation; 11, 12
    # leave the window seen once each and lose to 1, so the last [1] hits
    chains = [[1], [1], [10], [11], [12], [13], [1]]
    assert wtinylfu_hit_rate(chains, 3) == pytest.approx(2 / 7)
    assert lru_hit_rate(chains, 3) == pytest.approx(1 / 7)


def test_lirs_promotes_a_block_reused_within_the_stack() -> None:
    # capacity 3: 1 and 2 are LIR (warm-up), Q holds 1 block; 3 leaves Q for 4 but stays
    # in S, so its next access makes it LIR and demotes 1 (the oldest LIR) to Q, from
    # where 1 and then 5 are evicted; 2 and 3 hit at the end, where LRU keeps neither
    chains = [[1], [2], [3], [4], [3], [5], [6], [2], [3]]
    assert lirs_hit_rate(chains, 3) == pytest.approx(2 / 9)
    assert lru_hit_rate(chains, 3) == pytest.approx(1 / 9)


def test_reused_min_keeps_only_what_was_seen_twice_by_its_future() -> None:
    # capacity 4, share 0.5: 2 blocks for first uses (LRU), 2 for reused ones (MIN); 1, 2
    # and then 3 are reused: MIN drops 3 (never back), not 1 (the oldest), so 2 and 1 hit
    # after 4 and 5 pass through the first-use list
    chains = [[1], [2], [1], [2], [3], [3], [4], [5], [2], [1]]
    assert reused_min_hit_rate(chains, 4, first_share=0.5) == pytest.approx(5 / 10)
    # with no room for reused blocks, only the second uses of 1, 2 and 3 (still in the
    # first-use list) hit; they are dropped as they move to the reused side
    assert reused_min_hit_rate(chains, 2, first_share=1.0) == pytest.approx(3 / 10)


def test_reuse_keeps_a_reused_block_for_its_lifetime_only() -> None:
    # capacity 2: 1 is hit (T2) at tick 2; new blocks then pass through T1. Before any
    # re-use distance is known the lifetime is 4 x the 3 blocks resident at an eviction,
    # 12 ticks: 1 outlives ten newer blocks (the last eviction at tick 12, 10 ticks idle)
    # and hits again, where LRU lost it at the first eviction
    chains = [[1], [1]] + [[b] for b in range(2, 12)] + [[1]]
    assert reuse_hit_rate(chains, 2) == pytest.approx(2 / 13)
    assert lru_hit_rate(chains, 2) == pytest.approx(1 / 13)
    # two more: at tick 15 block 1 has been idle 13 > 12 ticks and is colder than T1's
    # coldest, so it goes, and the last [1] misses
    chains = [[1], [1]] + [[b] for b in range(2, 16)] + [[1]]
    assert reuse_hit_rate(chains, 2) == pytest.approx(1 / 17)
