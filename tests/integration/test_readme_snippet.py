"""The README's engine snippet runs as written: extracted from README.md (the fenced python
block after the ``readme-snippet: engine`` marker) and run against a real kvtierd, and without
one it fails the way the README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.client.connection.connection import DaemonUnavailable

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- readme-snippet: engine -->"


def readme_snippet() -> str:
    """The python block that follows the marker in README.md (fails when there is none)."""
    text = README.read_text()
    assert text.count(MARKER) == 1, f"{MARKER!r} must appear once in {README}"
    match = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.DOTALL)
    assert match, f"no ```python block right after {MARKER!r} in {README}"
    return match.group(1)


def run_snippet(runtime_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run the snippet in a fresh interpreter that finds its daemon in ``runtime_dir``, as an
    engine started with ``KVTIER_RUNTIME_DIR`` would (no other ``KVTIER_*`` variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_RUNTIME_DIR"] = str(runtime_dir)
    return subprocess.run(
        [sys.executable, "-c", readme_snippet()],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_readme_engine_snippet_runs_against_a_daemon_and_hits_l2_the_second_time(daemon_factory):
    # the snippet's engine heartbeats every 5 s (ClientConfig's default): a lease longer than
    # that, as kvtierd's default (30 s) is
    daemon = daemon_factory("--lease-s", "30")
    first = run_snippet(daemon.runtime_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip() == "0 of 6 pages from L2; stored: True", daemon.log_tail()
    second = run_snippet(daemon.runtime_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.strip() == "6 of 6 pages from L2; stored: True", daemon.log_tail()


def test_readme_snippet_without_a_daemon_raises_daemon_unavailable_as_documented(short_tmp):
    readme = README.read_text()
    assert "raises `DaemonUnavailable`" in readme
    r = run_snippet(short_tmp / "nobody-here")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    # the class the snippet's module exports (the traceback names where it is defined)
    assert last.startswith(f"{DaemonUnavailable.__module__}.DaemonUnavailable: ")
    assert str(short_tmp / "nobody-here" / "kvtierd.sock") in last
    assert "kvtier serve" in last  # the hint: how to start one
