"""``kvtier bench l3 --backend file`` end to end, on a few small pages.

The bench runs the file backend alone and through a real kvtierd (STORE, SYNC, PREFETCH,
CLAIM) against raw pwrite / preadv in the same directory; here it runs small so that a broken
bench fails in CI rather than at measuring time. No figure is asserted: speed is what the
bench reports, not what a test checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.bench.l3 import run_file_bench

pytestmark = pytest.mark.timeout(240)

RATIOS = (
    "backend_put_over_raw_write",
    "backend_get_over_raw_read",
    "put_over_raw_write",
    "store_put_over_raw_write",
    "store_over_raw_write",
    "get_over_raw_read",
)


def test_the_file_bench_reports_every_figure(tmp_path: Path) -> None:
    """A small run returns every throughput and ratio, positive, and its store was rebuilt
    from disk with every object."""
    result = run_file_bench(str(tmp_path), pages=32, page_bytes=64 * 1024, batch=8, repeats=2)
    assert result["backend"] == "file" and result["pages"] == 32 and result["repeats"] == 2
    for name in (
        "raw_write",
        "raw_read",
        "put",
        "get",
        "store_put",
        "store",
        "backend_raw_write",
        "backend_raw_read",
        "backend_put",
        "backend_get",
    ):
        assert result[f"{name}_gbps"] > 0, name
    for name in RATIOS:
        assert result[name] > 0, name
    assert result["rebuild_objects"] == 32
    assert list(tmp_path.iterdir()) == [], "the bench leaves its scratch directory empty"
