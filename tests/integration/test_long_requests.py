"""Long STOREs and LOADs in slices, against a real kvtierd: others are answered while one is
half done, and what they see of it is whole or nothing.

The daemon runs with ``--slice-pages 1``: a STORE of ``N`` new pages allocates them over
``N`` turns of its event loop, and commits them over ``N`` more once copied. "In progress"
is not waited for but observed in the daemon's own state: STATS shows some of the STORE's
pages WRITING and not all of them, which only a STORE allocated or committed in slices can
show (one done in one go goes from none to all, and back, at once). A request answered
between two such readings was answered while the STORE was half done. Each test tries a
few STOREs (a new chain each) until it catches one so; a daemon that does not slice is
never caught, and the test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engine_child import TINY
from tests.engines import engine, fill_page, page_bytes, tokens

REPO = Path(__file__).resolve().parents[2]
N = 4096  # pages of the long STORE (1 KiB each)
TRIES = 5  # long STOREs tried, each a new chain, until one is caught half done
DEADLINE_S = 60.0  # bound on each wait below


@pytest.fixture
def sliced(daemon_factory):
    return daemon_factory("--slice-pages", "1")


def writing(admin: AdminClient) -> int:
    return int(admin.stats()["pool"]["pages_writing"])


def store_in_thread(conn, keys, pages) -> tuple[threading.Thread, list]:
    """Send a STORE from a thread (its reply takes many turns); ``out`` gets its handle and
    whether its copy completed."""
    out: list = []

    def run() -> None:
        h = conn.store(keys, pages)
        out.append(h)
        out.append(h.wait())

    t = threading.Thread(target=run, name="long-store")
    t.start()
    return t, out


def catch_half_allocated(
    admin: AdminClient, total: int, alive: Callable[[], bool], act: Callable[[], None]
) -> bool:
    """Poll STATS while a STORE of ``total`` new pages runs; once some but not all of them are
    WRITING, ``act`` (another engine's request), then read STATS again. True when both
    readings showed the STORE half done (allocated, or committed, in part): ``act`` was
    answered in between."""
    end = time.monotonic() + DEADLINE_S
    while alive() and time.monotonic() < end:
        if 0 < writing(admin) < total:
            act()
            return 0 < writing(admin) < total
    return False


def test_a_lookup_is_answered_while_a_long_store_is_half_done(sliced):
    (pool_a, a), (pool_b, b) = (
        engine(sliced.runtime_dir, TINY, num_pages=N, model="long"),
        engine(sliced.runtime_dir, TINY, num_pages=64, model="long"),
    )
    try:
        mine = b.page_keys(tokens(16 * TINY.page_size, salt=99))
        assert b.store(mine, list(range(16))).wait()
        caught, seen = False, []
        with AdminClient(sliced.endpoint) as admin:
            for attempt in range(TRIES):
                keys = a.page_keys(tokens(N * TINY.page_size, salt=attempt))
                t, out = store_in_thread(a, keys, list(range(N)))

                def look(keys: list[bytes] = keys) -> None:
                    seen.append((b.lookup(keys).l2, b.lookup(mine).l2))

                caught = catch_half_allocated(admin, N, t.is_alive, look)
                t.join(DEADLINE_S)
                assert out[0].writing == N and out[1], "the long STORE completed"
                assert a.lookup(keys).l2 == N
                if caught:
                    break
        assert caught, "no request was answered while a long STORE was half done"
        assert all(chain == 0 and other == 16 for chain, other in seen), seen
    finally:
        for pool, conn in ((pool_a, a), (pool_b, b)):
            conn.close()
            pool.close()


def test_a_load_during_a_long_store_of_its_chain_gets_the_stored_prefix(sliced):
    """And a second STORE of the same chain meanwhile shares its pages with the first (it
    writes those the first has not allocated yet; the chain is whole in L2 once both end)."""
    (pool_a, a), (pool_b, b) = (
        engine(sliced.runtime_dir, TINY, num_pages=N, model="long"),
        engine(sliced.runtime_dir, TINY, num_pages=N, model="long"),
    )
    prefix = N // 8  # stored before: the LOAD pins it in fewer turns than the STORE takes
    sampled = range(0, N, 97)
    try:
        for p in sampled:  # both engines hold the chain's bytes (only these pages are checked)
            fill_page(pool_a, p, seed=p + 1)
            fill_page(pool_b, p, seed=p + 1)
        want = {p: page_bytes(pool_a, p) for p in sampled}
        caught = False
        with AdminClient(sliced.endpoint) as admin:
            for attempt in range(TRIES):
                keys = a.page_keys(tokens(N * TINY.page_size, salt=100 + attempt))
                assert a.store(keys[:prefix], list(range(prefix))).wait()  # READY
                t, out = store_in_thread(a, keys, list(range(N)))  # skips it, adds the rest
                for p in sampled:
                    pool_b.k[0][p].zero_()
                loaded: list = []
                caught = catch_half_allocated(
                    admin,
                    N - prefix,
                    t.is_alive,
                    lambda keys=keys, loaded=loaded: loaded.append(b.load(keys, list(range(N)))),
                )
                if loaded:
                    assert loaded[0].wait()
                    got = [page_bytes(pool_b, p) == want[p] for p in sampled if p < prefix]
                for p in sampled:
                    fill_page(pool_b, p, seed=p + 1)
                second = b.store(keys, list(range(N)))  # the same chain, maybe mid-way
                t.join(DEADLINE_S)
                assert out[1] and second.wait()
                # the second counts the first's pages only once READY (they could be cancelled)
                assert out[0].count == N and prefix <= second.count <= N
                assert out[0].writing + second.writing == N - prefix  # each page stored once
                assert b.lookup(keys).l2 == N
                if caught:
                    assert loaded[0].count == prefix, "a LOAD mid-STORE pins the stored prefix"
                    assert all(got)
                    break
        assert caught, "no LOAD started while a long STORE of its chain was half done"
        for p in sampled:
            pool_b.k[0][p].zero_()
        h = b.load(keys, list(range(N)))
        assert h.count == N and h.wait()
        assert all(page_bytes(pool_b, p) == want[p] for p in sampled)
    finally:
        for pool, conn in ((pool_a, a), (pool_b, b)):
            conn.close()
            pool.close()


def test_an_engine_killed_mid_store_leaves_nothing_behind_and_others_are_served(sliced):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pool_b, b = engine(sliced.runtime_dir, TINY, num_pages=64, model="other")
    try:
        mine = b.page_keys(tokens(16 * TINY.page_size, salt=5))
        assert b.store(mine, list(range(16))).wait()
        killed_mid_store = False
        with AdminClient(sliced.endpoint) as admin:
            for _ in range(TRIES):
                child = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.engine_child",
                        "long",
                        str(sliced.runtime_dir),
                        str(N),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                    env=env,
                )
                try:
                    assert child.stdout is not None
                    assert child.stdout.readline().strip() == "storing"
                    killed_mid_store = catch_half_allocated(
                        admin,
                        N,
                        lambda child=child: child.poll() is None,
                        lambda child=child: child.send_signal(signal.SIGKILL),
                    )
                finally:
                    child.kill()
                    child.wait()
                # the others are served meanwhile and after
                assert b.lookup(mine).l2 == 16
                end = time.monotonic() + DEADLINE_S
                while True:
                    st = admin.stats()
                    pool = st["pool"]
                    if len(st["sessions"]) == 1 and not pool["pages_writing"]:
                        break
                    assert time.monotonic() < end, f"left behind: {pool} {st['sessions']}"
                    assert b.lookup(mine).l2 == 16
                assert pool["pages_pinned"] == 0
                assert st["sessions"][0]["transfers"] == 0
                if killed_mid_store:
                    break
        assert killed_mid_store, "the engine was never killed while its STORE was half done"
        # its slots went back: a STORE of as many pages fits again, and completes
        pool_c, c = engine(sliced.runtime_dir, TINY, num_pages=N, model="long")
        try:
            keys = c.page_keys(tokens(N * TINY.page_size, salt=1))  # no child's chain
            h = c.store(keys, list(range(N)))
            assert h.writing == N and h.wait()
            assert np.all(np.asarray([b.lookup(mine).l2]) == 16)
        finally:
            c.close()
            pool_c.close()
    finally:
        b.close()
        pool_b.close()
