"""The daemon's L2 page hit rate over a sliding window (daemon/counters.py)."""

from __future__ import annotations

from kvtier.daemon.counters import HitWindow


def test_hit_window_forgets_what_left_the_window() -> None:
    now = [100.0]
    w = HitWindow(seconds=60, clock=lambda: now[0])
    assert w.as_dict()["l2_page_hit_ratio"] is None
    w.add(10, 10)
    now[0] = 130.5
    w.add(10, 0)
    w.add(20, 5)
    assert w.as_dict() == {
        "seconds": 60,
        "lookup_keys": 40,
        "lookup_hit_keys": 15,
        "l2_page_hit_ratio": 15 / 40,
    }
    now[0] = 160.0  # the first second (100) has left the window
    assert w.as_dict()["l2_page_hit_ratio"] == 5 / 30
