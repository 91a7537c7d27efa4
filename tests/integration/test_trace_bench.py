"""``kvtier bench trace`` end to end on a slice of the shipped trace.

The bench starts its own kvtierd per pool size (L3 off) and engine worker processes that
replay the trace. Checked: every LOAD brought its page's bytes (``mismatched_bytes`` 0),
the fields are there and aligned with ``sizes``, and, with one engine (so the daemon sees
the trace's own order), the daemon's LRU serves the hits the LRU simulation counts over the
same sequence (the two differ only in when a request's evictions happen: before each new
page in the pool, after the whole request in the simulation).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtier.bench.trace import main

pytestmark = pytest.mark.timeout(240)


def test_trace_bench_one_engine_matches_lru_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trace.json"
    assert (
        main(
            [
                "--limit",
                "250",
                "--blocks",
                "150,600",
                "--engines",
                "1",
                "--speedup",
                "100000",
                "--policy",
                "lru",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["requests"] == 250 and r["sizes"] == [150, 600]
    for key in (
        "hit_rate",
        "lru_hit_rate",
        "min_hit_rate",
        "gap_closed",
        "daemon_cpu_ms_per_request",
        "latency_ms",
    ):
        assert len(r[key]) == 2, key
    assert r["mismatched_bytes"] == 0
    for hit, lru, best in zip(r["hit_rate"], r["lru_hit_rate"], r["min_hit_rate"], strict=True):
        assert 0 < hit <= best + 1e-9
        assert abs(hit - lru) <= 0.01 + 0.05 * lru
    assert "mismatched bytes: 0" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["arc", "reuse"])
def test_trace_bench_two_list_policies_over_two_engines(tmp_path: Path, policy: str) -> None:
    out = tmp_path / "trace.json"
    assert (
        main(
            [
                "--limit",
                "200",
                "--blocks",
                "300",
                "--engines",
                "2",
                "--speedup",
                "100000",
                "--policy",
                policy,
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["eviction_policy"] == policy and r["mismatched_bytes"] == 0
    assert r["hit_rate"][0] > 0


def test_trace_bench_reuse_serves_what_its_simulation_counts(tmp_path: Path) -> None:
    """One engine: the daemon's ``reuse`` policy against its block-for-block simulation
    (bench/trace_policies.py) over the same sequence, long enough for ghosts to return."""
    from kvtier.bench.trace_policies import reuse_hit_rate
    from kvtier.bench.trace_sim import load_trace

    out = tmp_path / "trace.json"
    args = ["--limit", "3000", "--blocks", "1000", "--engines", "1", "--speedup", "100000"]
    assert main([*args, "--policy", "reuse", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["eviction_policy"] == "reuse" and r["mismatched_bytes"] == 0
    chains = load_trace(limit=3000)[0]
    sim = reuse_hit_rate(chains, 1000)
    (hit,), (lru,) = r["hit_rate"], r["lru_hit_rate"]
    assert abs(hit - sim) <= 0.1 * sim, (hit, sim)
    assert sim > lru + 0.02, (sim, lru)  # the slice has returns a ghost catches
