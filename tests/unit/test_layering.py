"""The package layering and module sizes hold (what ``make lint`` checks, run in ``make test``).

The import contracts live in ``.importlinter`` at the repository root: ``config`` <- ``ipc``,
``kernels`` <- ``daemon`` | ``client`` <- ``engine`` | ``launch`` <- ``bench`` <- ``cli``; inside the
daemon ``service`` -> ``tier`` | ``transfer`` -> ``pool`` | ``storage`` -> ``counters``; inside the
client ``adapters`` -> ``cache`` -> ``connection`` | ``staging`` -> ``kv_pool`` | ``radix`` |
``page_keys``; the pool imports no asyncio;
no import circles between siblings. Modules aim at about 400 lines (a module much longer is
usually two concepts: split it where the concept splits); 800 is the hard limit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("config", "ipc", "kernels", "daemon", "client", "engine", "launch", "cli", "bench")
MAX_LINES = 800


def test_import_contracts_are_kept() -> None:
    """``lint-imports`` passes: no layer imports upward, no circle, the pool stays pure."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.skip("import-linter is not installed (it is in the dev extra)")
        exe = Path(found)
    proc = subprocess.run(
        [str(exe), str(ROOT / ".importlinter")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_module_over_800_lines() -> None:
    """Every Python module of the packages is at most 800 lines long."""
    long = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_daemon_and_client_do_not_import_each_other() -> None:
    """The rule read in the source itself, independent of import-linter's contract file."""
    for pkg, other in (("daemon", "kvtier.client"), ("client", "kvtier.daemon")):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            assert f"from {other}" not in text and f"import {other}" not in text, path
