"""``kvtier bench scale --quick`` end to end, and its engine-process launcher.

The bench starts its own kvtierd processes (L3 off), engine worker processes and the bare
echo server; here it runs with tiny sizes (N up to 2, a 4,096-page "million" pool) so
that a broken bench fails in CI rather than at measuring time. No figure is asserted
against a target: speed is what the bench reports, not what a test checks; what is
checked is that every figure is there, finite and positive, and that the table prints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvtier.bench.scale import main
from kvtier.bench.scale.baselines import ScaleBenchError
from kvtier.bench.scale.worker import run_workers

pytestmark = pytest.mark.timeout(240)

RATIOS = (
    "transfer_fixed_cost_over_lookup_rtt",
    "transfer_64_over_memcpy",
    "l2_aggregate_over_memcpy_8",
    "lookup_throughput_over_echo_8",
    "lookup_8192_over_echo",
    "load_8192_over_memcpy",
    "million_lookup_p50_over_small",
    "daemon_cpu_s_per_gb",
    "million_adopt_seconds",
    "l2_aggregate_over_cpu_bound_8",
    "memcpy_cpu_s_per_gb",
    "daemon_cpu_s_per_gb_over_memcpy",
    "daemon_cpu_s_per_gb_with_sessions",
    "daemon_cpu_s_per_gb_with_sessions_over_memcpy",
)
FIGURES = (
    "transfer_fixed_cost_us",
    "lookup_rtt_us_p50",
    "transfer_memcpy_gbps",
    "lookups_per_s",
    "echo_per_s",
    "lookup_long_us_p50",
    "echo_long_us_p50",
    "load_long_gbps",
    "load_long_memcpy_gbps",
    "million_store_pages_per_s",
    "million_evict_pages_per_s",
    "million_lookup_p50_us",
    "million_small_lookup_p50_us",
    "million_restart_to_healthy_seconds",
    "million_rss_beyond_pool_bytes",
    "daemon_bytes_moved",
    "stall_store_accept_ms_p50",
    "stall_lookup_idle_us_p99",
    "stall_lookup_busy_us_p99",
    "stall_lookup_p99_over_idle",
    "stall_stores",
    "leave_engine_bytes",
    "leave_unregister_ms",
    "leave_lookup_p99_before_us",
    "leave_lookup_max_after_us",
    "leave_lookup_max_after_over_p99_before",
)
PER_SIZE = (
    "transfer_store_us_p50",
    "transfer_load_us_p50",
    "transfer_store_gbps",
    "transfer_load_gbps",
)
PER_N = ("l2_aggregate_gbps", "l2_memcpy_gbps", "l2_aggregate_over_memcpy", "l2_cpu_bound_gbps")


def _positive(name: str, value: object) -> None:
    assert isinstance(value, int | float) and not isinstance(value, bool), (name, value)
    assert math.isfinite(value) and value > 0, (name, value)


def test_the_quick_scale_bench_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --quick run writes every field (each ratio finite and > 0, one per N and per
    transfer size), finds every page after the SIGKILL, prints the table and draws the plot."""
    out = tmp_path / "scale.json"
    args = ["--quick", "--json", str(out)]
    plotting = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plotting = False
    if plotting:
        args += ["--plot", str(tmp_path / "scale.png")]
    assert main(args) == 0
    r = json.loads(out.read_text())
    for name in RATIOS + FIGURES:
        _positive(name, r.get(name))
    for name in PER_SIZE:
        assert sorted(r[name], key=int) == ["1", "8", "64", "512"], name
        for size, value in r[name].items():
            _positive(f"{name}[{size}]", value)
    assert r["engines"] == [1, 2]
    for name in PER_N:
        assert sorted(r[name], key=int) == ["1", "2"], name
        for n, value in r[name].items():
            _positive(f"{name}[{n}]", value)
    assert r["l2_aggregate_over_memcpy_8"] == r["l2_aggregate_over_memcpy"]["2"]
    # the ratio is of the unrounded figures; the JSON holds each rounded to 3 decimals
    assert r["l2_aggregate_over_cpu_bound_8"] == pytest.approx(
        r["l2_aggregate_gbps"]["2"] / r["l2_cpu_bound_gbps"]["2"], abs=0.002
    )
    # the timed windows lie inside the whole part, sessions' setup and teardown outside them
    assert r["daemon_cpu_s_per_gb_with_sessions"] >= r["daemon_cpu_s_per_gb"]
    assert r["million_pages_stored"] == r["million_pages"] == 4096
    assert r["million_pages_found_after_restart"] == r["million_pages_stored"]
    assert r["million_evicted_pages"] > 0
    printed = capsys.readouterr().out
    assert "kvtier bench scale" in printed
    for row in (
        "2 engines: L2 aggregate vs memcpy",
        "lookups/s vs echoes/s",
        "adopt after SIGKILL",
        "vs what the CPU per GB allows",
        "vs memcpy shm <-> memfd",
        "sessions opened and closed included",
    ):
        assert row in printed, row
    if plotting:
        assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_the_stall_part_runs_with_only_stall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--only stall measures the stall figures and nothing else; an unknown part is refused."""
    out = tmp_path / "stall.json"
    assert main(["--quick", "--only", "stall", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for name in ("stall_lookup_p99_over_idle", "stall_lookup_busy_us_p99", "stall_stores"):
        _positive(name, r.get(name))
    assert not any(k.startswith(("l2_", "million_", "transfer_", "load_")) for k in r), r
    assert "lookups_per_s" not in r and "lookup_rtt_us_p50" not in r
    assert "stall_lookup_p99_over_idle" in capsys.readouterr().out
    with pytest.raises(ScaleBenchError, match="the parts are"):
        main(["--quick", "--only", "stal"])


def test_a_worker_that_cannot_connect_fails_the_run_with_its_log(short_tmp: Path) -> None:
    """An engine worker that dies before ``ready`` (no daemon at its runtime directory)
    ends the run with ScaleBenchError carrying the worker's log, not a hang."""
    settings = {
        "runtime_dir": str(short_tmp / "nobody"),
        "tag": "dead",
        "pages": 4,
        "iters": 1,
        "geometry": {
            "num_layers": 1,
            "page_size": 16,
            "kv_heads": 1,
            "head_dim": 64,
            "dtype": "float16",
        },
    }
    with pytest.raises(ScaleBenchError, match="DaemonUnavailable"):
        run_workers("transfer", 2, settings, short_tmp, timeout_s=60)
