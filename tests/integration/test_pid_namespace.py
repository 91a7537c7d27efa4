"""An engine in a pid namespace of its own (a container that reaches the node's kvtierd
through a mounted runtime directory): the daemon's pid it is told means nothing there, so
it watches the pid its handover socket shows, or none."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[2])

CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.engines import engine, fill_page, page_bytes, tokens, SMALL
pool, conn = engine(Path(sys.argv[1]), num_pages=16)
keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=5))
for p in range(4):
    fill_page(pool, p, seed=p + 1)
want = [page_bytes(pool, p) for p in range(4)]
assert conn.store(keys, [0, 1, 2, 3]).wait(), "the STORE did not complete"
assert conn.lookup(keys).l2 == 4, "the pages are not in L2"
h = conn.load(keys, [8, 9, 10, 11])
assert h.wait(), "the LOAD did not complete"
assert [page_bytes(pool, p) for p in (8, 9, 10, 11)] == want, "wrong bytes"
print("watched pid", conn.daemon_pid, "served", flush=True)
conn.close()
pool.close()
"""


def _own_pid_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30, check=False
    )
    return done.returncode == 0


@pytest.mark.timeout(90)
def test_an_engine_in_its_own_pid_namespace_is_served(daemon):
    """The engine registers, stores, looks up and loads byte-exact; the daemon's pid is not
    visible from its namespace, so it watches none (a request is not refused as if the
    daemon had exited)."""
    if not _own_pid_namespace_works():
        pytest.skip("unshare --pid cannot make a pid namespace here (needs root or userns)")
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", CHILD, str(daemon.runtime_dir), REPO],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "watched pid 0 served" in done.stdout, done.stdout
