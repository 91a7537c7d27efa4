"""``kvtier demo`` end to end: a private daemon, an engine killed half-way, exact outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.cli.demo_report import header, restart_banner
from kvtier.client.connection.admin import AdminClient


def printed(stdout: str, label: str) -> str:
    """The value of the summary line ``<label>  <value>`` (fails when there is none)."""
    lines = [line for line in stdout.splitlines() if line.split("  ")[0] == label]
    assert len(lines) == 1, f"no single {label!r} line in:\n{stdout}"
    return lines[0][len(label) :].strip()


@pytest.mark.timeout(300)
def test_demo_uses_a_private_daemon_even_with_one_served_and_prints_its_plot(
    short_tmp: Path, daemon_factory
):
    """A kvtierd "served" where the user's engines would find it (its runtime dir given by
    KVTIER_RUNTIME_DIR, as `make serve` would use it) is not touched by the demo, nor is the
    user's state directory; the plot goes to ./kvtier-demo.png by default and its path is
    printed; the table is printed once (a line per turn) with the restart marked in it."""
    served = daemon_factory(name="served")
    user = short_tmp / "user"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(
        KVTIER_RUNTIME_DIR=str(served.runtime_dir),
        XDG_RUNTIME_DIR=str(user / "run"),
        KVTIER_STATE_DIR=str(user / "state"),
        XDG_STATE_HOME=str(user / "xdg-state"),
        KVTIER_ENDPOINT=served.endpoint,
    )
    work = short_tmp / "cwd"
    work.mkdir()
    out = short_tmp / "demo.json"
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli.main",
        "demo",
        "--model",
        "tiny",
        "--conversations",
        "2",
        "--turns",
        "4",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=280, env=env, cwd=work
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    assert "a private kvtierd" in stdout and str(served.runtime_dir) not in stdout
    with AdminClient(served.socket) as admin:
        snap = admin.stats()
    assert snap["sessions"] == [] and snap["counters"]["sessions_closed"] == 0
    assert snap["pool"]["pages_ready"] == 0
    assert not user.exists()  # nothing in the user's state (or runtime) directories
    png = work / "kvtier-demo.png"
    assert printed(stdout, "plot") == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed(stdout, "json") == str(out)
    # one table: the header once, a line per turn, the restart line between turns 1 and 2
    lines = stdout.splitlines()
    assert lines.count(header()[0]) == 1 and lines.count(restart_banner("engine")) == 1
    body = lines[lines.index(header()[1]) + 1 :]
    assert body.index(restart_banner("engine")) == 4  # after 2 turns x 2 conversations
    assert printed(stdout, "restart reuse").startswith("1.000")
    assert proc.stderr.count("turn") == 0  # no second copy of the rows as progress lines
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
        assert (
            t["prompt_tokens"] == t["cached_l1"] + t["cached_l2"] + t["cached_l3"] + t["computed"]
        )


@pytest.mark.timeout(300)
def test_demo_with_daemon_restart_reuses_l2(short_tmp: Path):
    """The engine and kvtierd are SIGKILLed half-way, kvtierd restarted: the new engine's
    first turn is served from the adopted host pool (L2, not L3), every output equals the
    uncached run, and the table says both restarted. (``--own-daemon`` is still accepted.)"""
    out = short_tmp / "demo.json"
    cmd = [
        sys.executable,
        "-m",
        "kvtier.cli.main",
        "demo",
        "--model",
        "tiny",
        "--own-daemon",
        "--restart",
        "daemon",
        "--conversations",
        "2",
        "--turns",
        "4",
        "--json",
        str(out),
        "--no-plot",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    turns = result["turns"]
    assert all(t["matches_uncached"] for t in turns)
    assert result["restart_reuse_ratio"] >= 0.99
    first = next(t for t in turns if t["first_after_restart"])
    assert first["cached_l2"] > 0 and first["cached_l3"] == 0
    assert first["cached_l2"] == result["restart_stored_tokens"]
    assert [(t["engine"], t["daemon"]) for t in turns] == [(0, 0)] * 4 + [(1, 1)] * 4
    assert proc.stdout.splitlines().count(restart_banner("daemon")) == 1
    assert "plot" not in [line.split("  ")[0] for line in proc.stdout.splitlines()]
