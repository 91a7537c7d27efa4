"""``python -m kvtier.bench.scale.million``: the million-page part of the scale bench alone.

Run with a tiny pool (2,048 pages): the command starts its own kvtierd, fills the pool,
SIGKILLs and restarts the daemon, and must report every page found again, with the
adoption figures it prints and writes. No figure is checked against a target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvtier.bench.scale.million import main

pytestmark = pytest.mark.timeout(240)


def test_the_million_part_runs_alone_and_reports_adoption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "million.json"
    assert main(["--pages", "2048", "--batch", "512", "--samples", "10", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["million_pages_stored"] == r["million_pages_found_after_restart"] == 2048
    for name in (
        "million_adopt_seconds",
        "million_daemon_adopt_seconds",
        "million_find_all_seconds",
        "million_restart_to_healthy_seconds",
        "million_lookup_p50_over_small",
    ):
        assert isinstance(r[name], float) and math.isfinite(r[name]) and r[name] > 0, name
    # the adoption figure spans the restart: it counts from the same start as the time to a
    # healthy daemon and ends later, on a monotonic clock, so this holds however long each took
    assert r["million_restart_to_healthy_seconds"] <= r["million_adopt_seconds"]
    printed = capsys.readouterr().out
    assert "million_adopt_seconds" in printed and "million_pages_found_after_restart" in printed
