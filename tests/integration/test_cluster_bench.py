"""``kvtier bench l3 --backend redis|mooncake`` end to end, on a few small pages.

The bench starts its own redis-server / mooncake_master (and a segment holder) on loopback,
times kvtier's backend against the client library used directly, and checks every page it
reads back; here it runs small so that a broken bench (say, an arena laid out unlike the
daemon's pool) fails in CI rather than at measuring time. No figure is asserted: speed is
what the bench reports, not what a test checks.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.bench.l3_cluster import run_cluster_bench
from kvtier.daemon.storage.registry import slot_headroom

from tests.servers import find_binary

pytestmark = pytest.mark.timeout(180)

KEYS = (
    "put_gbps",
    "get_gbps",
    "direct_put_gbps",
    "direct_get_gbps",
    "put_over_direct",
    "get_over_direct",
    "exists_us_per_key",
)


def _needs(backend: str) -> None:
    binary = "redis-server" if backend == "redis" else "mooncake_master"
    if find_binary(binary) is None:
        pytest.skip(f"{binary} is not installed (make sysdeps / the mooncake extra)")
    if backend == "mooncake":
        pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_the_bench_moves_and_verifies_every_page(backend: str) -> None:
    """A small run returns every figure, positive, with one sample per timed pass."""
    _needs(backend)
    result = run_cluster_bench(backend, pages=24, page_bytes=64 * 1024, batch=8, repeats=2)
    assert result["backend"] == backend and result["pages"] == 24 and result["repeats"] == 2
    for key in KEYS:
        assert result[key] > 0, key
    assert {k: len(v) for k, v in result["samples"].items()} == {
        "put": 2,
        "get": 2,
        "direct_put": 2,
        "direct_get": 2,
    }
    for op in ("put", "get"):  # a pass's ratio: its two sides' times over the same batches
        per_pass = [k / d for k, d in zip(result["samples"][op], result["samples"][f"direct_{op}"])]
        assert result["ratios"][op] == pytest.approx(per_pass)
        assert result[f"{op}_over_direct"] == pytest.approx(statistics.median(per_pass))


def test_the_mooncake_bench_lays_slots_out_as_the_daemon_does() -> None:
    """The Mooncake bench's slots have the daemon pool's headroom, so its kvtier side takes
    the one-buffer path kvtierd takes; the Redis bench's have none, as the daemon's."""
    from kvtier.bench.l3_cluster import _slot_stride

    assert slot_headroom("mooncake") > 0 and slot_headroom("redis") == 0
    assert _slot_stride("mooncake", 64 * 1024) == (
        slot_headroom("mooncake") + 64 * 1024,
        slot_headroom("mooncake"),
    )
    assert _slot_stride("redis", 5000) == (8192, 0)


def test_the_cli_writes_its_json(tmp_path: Path) -> None:
    """``python -m kvtier.bench.l3_cluster --backend redis --json PATH`` writes the result."""
    _needs("redis")
    out = tmp_path / "redis.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.bench.l3_cluster",
            "--backend",
            "redis",
            "--pages",
            "16",
            "--page-bytes",
            "65536",
            "--batch",
            "8",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    runs = data if isinstance(data, list) else [data]
    assert runs and all(r["backend"] == "redis" and r["put_gbps"] > 0 for r in runs)
