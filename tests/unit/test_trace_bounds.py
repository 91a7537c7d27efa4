"""The hindsight bound of class-TTL eviction (bench/trace/bounds.py) on hand-worked traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtier.bench.trace.bounds import main, ttl_bound


def test_a_class_by_request_length_keeps_the_reused_block_where_one_class_cannot() -> None:
    # [1] at 0 s comes back at 10 s; [2, 3] at 0 s never does; [4] at 20 s ends the trace,
    # so a capacity of 1 block is 20 page-seconds. One class: a hold time that catches the
    # reuse (15 s) also holds 2 and 3, 10 + 15 + 15 + 10 (1 after its reuse, to the end)
    # page-seconds, and only 20 / 50 of it fits (the hull). By request length, the chains
    # of one block keep 15 s (20 page-seconds: it fits) and those of two keep nothing.
    chains, stamps = [[1], [2, 3], [1], [4]], [0, 0, 10_000, 20_000]
    assert ttl_bound(chains, stamps, 1).hit_rate == pytest.approx(0.4 / 5)
    got = ttl_bound(chains, stamps, 1, ("length",))
    assert got.hit_rate == pytest.approx(1 / 5)
    assert got.ttl_s == {"1": 15, "2": 0}
    assert got.classes == 2 and got.occupancy == pytest.approx(1.0)


def test_the_capacity_is_kept_on_a_short_trace_and_a_reuse_on_a_grid_value_hits() -> None:
    # a trace of 0.1 s: a capacity of 1 block is 0.1 page-seconds. Blocks 1-3 come back
    # after 0.1 s (15 s hold times: 0.3 page-seconds in all, too much); only one of them fits
    # (the hull mixes it in), whatever price of a page-second the search starts from
    got = ttl_bound([[1, 2, 3], [1, 2, 3, 4]], [0, 100], 1, ("length",))
    assert got.hit_rate == pytest.approx(1 / 7)
    assert ttl_bound([[1], [0, 1]], [0, 1], 0, ("length",)).hit_rate == 0.0
    # 1.234 s and 16.234 s: 15 s apart exactly (in milliseconds), a hit with a 15 s hold
    assert ttl_bound([[1], [1]], [1234, 16234], 10**6).hit_rate == pytest.approx(1 / 2)
    # a hold past the last request takes no room: only the reuse's 15 s is paid
    got = ttl_bound([[1], [1], [2]], [0, 15_000, 15_000], 1, ("uses",))
    assert got.hit_rate == pytest.approx(1 / 3) and got.occupancy <= 1.0
    # one instant: a same-time reuse is a hit that costs nothing
    assert ttl_bound([[1], [1]], [5, 5], 0).hit_rate == pytest.approx(1 / 2)


def test_room_for_everything_counts_every_reuse_within_the_grid() -> None:
    # 5 blocks, 3 of them accesses that are reuses (2 within 20 s, one after 2 hours: past
    # the grid's longest hold time, never a hit)
    chains, stamps = [[1, 2], [1], [2], [1]], [0, 20_000, 20_000, 7_220_000]
    got = ttl_bound(chains, stamps, 10**6, ("uses", "gap", "length"))
    assert got.hit_rate == pytest.approx(2 / 5)
    assert ttl_bound(chains, stamps, 0).hit_rate == 0.0


def test_the_gap_feature_tells_a_quick_return_from_a_slow_one() -> None:
    # blocks 1 and 2 come back every 20 s and every 400 s (three times each); by their
    # previous gap the quick one is kept without paying for the slow one's long holds
    chains: list[list[int]] = []
    stamps: list[int] = []
    for t in range(0, 1201, 20):
        chains.append([1])
        stamps.append(t * 1000)
        if t % 400 == 0:
            chains.append([2])
            stamps.append(t * 1000)
    by_gap = ttl_bound(chains, stamps, 1, ("gap",)).hit_rate
    alone = ttl_bound(chains, stamps, 1).hit_rate
    assert by_gap > alone


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([[1]], [0], 1, ("colour",)), "features"),
        (([[1]], [0], -1), "capacity"),
        (([[1], [2]], [0]), "timestamps_ms"),
        (([[1], [2]], [5, 1], 1), "timestamps_ms"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(args: tuple, field: str) -> None:
    if len(args) == 2:
        args = (*args, 1)
    with pytest.raises(ValueError, match=field):
        ttl_bound(*args)


def test_the_command_writes_the_bound_of_each_feature_set(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 1000, "hash_ids": [0, 1 + i % 3]} for i in range(30)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "b.json"
    assert main(["--trace", str(trace), "--blocks", "2,8", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["sizes"] == [2, 8]
    assert set(got["ttl_bound"]) == {"nothing", "uses", "uses+gap", "uses+gap+length"}
    for row in got["ttl_bound"].values():
        assert len(row) == 2 and row[0] <= row[1] <= 1.0
    assert "uses+gap+length" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["--trace", str(trace), "--blocks", "2,x"])
    assert stop.value.code == 2
