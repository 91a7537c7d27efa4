"""``kvtier demo`` end to end: a private daemon, an engine killed half-way, exact outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_demo_with_engine_restart(short_tmp: Path):
    out, png = short_tmp / "demo.json", short_tmp / "demo.png"
    cmd = [sys.executable, "-m", "kvtier.cli.main", "demo", "--model", "tiny", "--own-daemon",
           "--conversations", "2", "--turns", "4", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    turns = result["turns"]
    assert len(turns) == 2 * 4
    assert all(t["matches_uncached"] for t in turns)
    assert result["restart_reuse_ratio"] >= 0.99
    assert {t["engine"] for t in turns} == {0, 1}
    first = next(t for t in turns if t["first_after_restart"])
    assert (first["turn"], first["conversation"], first["cached_l1"]) == (2, 0, 0)
    assert first["cached_l2"] > 0 and first["cached_l2"] == result["restart_stored_tokens"]
    # before the restart, later turns reuse earlier turns from L1
    assert all(t["cached_l1"] > 0 for t in turns if t["engine"] == 0 and t["turn"] > 0)
    for t in turns:
        assert t["prompt_tokens"] == t["cached_l1"] + t["cached_l2"] + t["cached_l3"] + t["computed"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "restart_reuse_ratio" in proc.stdout


@pytest.mark.timeout(300)
def test_demo_with_daemon_restart_reuses_l2(short_tmp: Path):
    """kvtierd is SIGKILLed half-way and restarted: the reference engine's next turn is
    served from the adopted host pool (L2, not L3) and every output equals the uncached run."""
    out = short_tmp / "demo.json"
    cmd = [sys.executable, "-m", "kvtier.cli.main", "demo", "--model", "tiny", "--own-daemon",
           "--restart", "daemon", "--conversations", "2", "--turns", "4", "--json", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    turns = result["turns"]
    assert all(t["matches_uncached"] for t in turns)
    assert result["restart_reuse_ratio"] >= 0.99
    first = next(t for t in turns if t["first_after_restart"])
    assert first["cached_l2"] > 0 and first["cached_l3"] == 0
    assert first["cached_l2"] == result["restart_stored_tokens"]
