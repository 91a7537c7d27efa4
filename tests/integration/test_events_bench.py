"""``kvtier bench events`` end to end, small: two real kvtierd, the stream checked whole.

Only what the bench asserts about the stream is tested (every page stored and evicted is
announced once; a late subscriber recovers every batch by replay), never its speed figures.
"""

from __future__ import annotations

import pytest
from kvtier.bench.events import run_events_bench

pytestmark = pytest.mark.timeout(300)


def test_the_stream_is_whole_and_a_late_subscriber_replays_it_all() -> None:
    r = run_events_bench(rounds=6, chains=2, pages=64, pool_mib=4)
    assert r["evictions"] > 0  # the pool was small enough to evict
    assert r["stored_events_over_pages_stored"] == 1.0
    assert r["removed_events_over_evictions"] == 1.0
    assert r["late_subscriber_replayed"] > 0
    assert r["replay_recovered"] is True
