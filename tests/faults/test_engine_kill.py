"""Engines killed with SIGKILL in the middle of transfers leave no pins and no torn pages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.client.connection.admin import AdminClient

from tests.engine_child import BIG, CHAIN_PAGES, chain_tokens, seed_of
from tests.engines import engine, fill_page, page_bytes

REPO = Path(__file__).resolve().parents[2]


def spawn(mode: str, rdir: Path, n: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engine_child", mode, str(rdir), str(n)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def wait_line(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    lines = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"engine exited early: {lines}"
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines


def wait_quiet(endpoint: str, deadline_s: float = 20.0) -> dict:
    """Poll STATS until no session and no pinned or writing page remains."""
    end = time.monotonic() + deadline_s
    with AdminClient(endpoint) as admin:
        while True:
            st = admin.stats()
            pool = st["pool"]
            if not st["sessions"] and pool["pages_pinned"] == 0 and pool["pages_writing"] == 0:
                return st
            assert time.monotonic() < end, f"daemon still busy: {pool} {st['sessions']}"
            time.sleep(0.05)


def wait_pinned(endpoint: str, deadline_s: float = 20.0) -> None:
    """Poll STATS until some page is pinned: a load is being copied right now."""
    end = time.monotonic() + deadline_s
    with AdminClient(endpoint) as admin:
        while admin.stats()["pool"]["pages_pinned"] == 0:
            assert time.monotonic() < end, "no load was ever seen in flight"
            time.sleep(0.001)


def expected_page(pool, chain: int, page: int, scratch: int) -> bytes:
    fill_page(pool, scratch, seed_of(chain, page))
    return page_bytes(pool, scratch)


def test_engine_killed_mid_load_leaves_no_pins(daemon_factory):
    d = daemon_factory("--hicache-size", "64MiB", "--extent-size", "16MiB")
    proc = spawn("load", d.runtime_dir, 10_000)
    try:
        wait_line(proc, "loading")
        wait_line(proc, "loading")
        wait_pinned(d.endpoint)  # the engine dies with a load in flight, not between loads
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_quiet(d.endpoint)
        # the pages are still there, intact, for the next engine (restart-survival reuse)
        pool, conn = engine(d.runtime_dir, BIG, num_pages=2 * CHAIN_PAGES + 1, model="fault")
        try:
            keys = conn.page_keys(chain_tokens(0))
            h = conn.load(keys, list(range(CHAIN_PAGES)))
            assert h.count == CHAIN_PAGES and h.wait()
            scratch = 2 * CHAIN_PAGES
            got = [page_bytes(pool, p) for p in range(CHAIN_PAGES)]
            assert got == [expected_page(pool, 0, p, scratch) for p in range(CHAIN_PAGES)]
        finally:
            conn.close()
            pool.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_killed_mid_store_never_exposes_a_torn_page(daemon_factory):
    d = daemon_factory("--hicache-size", "64MiB", "--extent-size", "16MiB")
    n_chains = 6
    proc = spawn("store", d.runtime_dir, n_chains)
    try:
        lines = wait_line(proc, "storing 2")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        completed = {int(x.split()[1]) for x in lines if x.startswith("stored ")}
        wait_quiet(d.endpoint)
        pool, conn = engine(d.runtime_dir, BIG, num_pages=CHAIN_PAGES + 1, model="fault")
        try:
            scratch = CHAIN_PAGES
            for chain in range(n_chains):
                keys = conn.page_keys(chain_tokens(chain))
                n = conn.lookup(keys).l2
                if chain in completed:
                    assert n == CHAIN_PAGES, f"chain {chain} was stored but is not in L2"
                if n == 0:
                    continue
                h = conn.load(keys, list(range(n)))
                assert h.count == n and h.wait()
                got = [page_bytes(pool, p) for p in range(n)]
                want = [expected_page(pool, chain, p, scratch) for p in range(n)]
                assert got == want, f"chain {chain}: a visible page has wrong bytes"
        finally:
            conn.close()
            pool.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
