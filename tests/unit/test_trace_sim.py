"""Exact tests of the trace simulations (bench/trace/sim.py) on hand-made traces."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from kvtier.bench.trace.sim import (
    DEFAULT_TRACE,
    TraceError,
    arc_hit_rate,
    load_trace,
    lru_hit_rate,
    min_hit_rate,
    synthetic_trace,
)


def test_leading_prefix_only_counts() -> None:
    # the second request finds 1 and 2 but not 3's parent chain past 9: hits 1, 2 only
    chains = [[1, 2, 3], [1, 2, 9, 3]]
    for sim in (lru_hit_rate, arc_hit_rate, min_hit_rate):
        assert sim(chains, 100) == pytest.approx(2 / 7)


def test_lru_evicts_leaves_oldest_first_and_min_keeps_what_comes_back() -> None:
    chains = [[1], [2], [3], [1]]
    assert lru_hit_rate(chains, 2) == 0.0  # 1 is the oldest when 3 comes
    assert min_hit_rate(chains, 2) == pytest.approx(1 / 4)  # 2 and 3 never come back


def test_lru_never_cuts_a_chain() -> None:
    # [1, 2] then [3]: capacity 2 evicts 2 (the leaf), never 1 under its child
    chains = [[1, 2], [3], [1, 4]]
    assert lru_hit_rate(chains, 2) == pytest.approx(1 / 5)


def test_arc_keeps_a_reused_block_through_a_scan() -> None:
    hot = [[1], [1]]
    scan = [[b] for b in range(10, 16)]
    chains = hot + scan + [[1]]
    assert lru_hit_rate(chains, 3) == pytest.approx(1 / 9)  # the scan pushed 1 out
    assert arc_hit_rate(chains, 3) == pytest.approx(2 / 9)  # 1 is in T2, the scan in T1


def test_load_trace_reads_gzip_and_names_bad_lines(tmp_path: Path) -> None:
    chains, stamps = load_trace(DEFAULT_TRACE, limit=3)
    assert len(chains) == 3 and chains[0][0] == 0 and stamps == [0, 0, 0]
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write('{"timestamp": 1, "hash_ids": [1, 2]}\n{"timestamp": 2, "hash_ids": [1, -3]}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl.gz:2: hash_ids"):
        load_trace(bad)
    (tmp_path / "t.jsonl").write_text("not json\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1: not JSON"):
        load_trace(tmp_path / "t.jsonl")


def test_synthetic_trace_is_reproducible() -> None:
    assert synthetic_trace(200, seed=3) == synthetic_trace(200, seed=3)
    assert synthetic_trace(200, seed=3) != synthetic_trace(200, seed=4)
