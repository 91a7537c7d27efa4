"""Long STOREs and LOADs handled in slices (``--slice-pages``), raced against other requests
from real engine processes and against the engine's own requests, on a real kvtierd.

The daemon runs with a tiny ``slice_pages`` so that a STORE of a few thousand 1 KiB pages
takes hundreds of turns of its event loop to allocate and as many to commit. Each test
catches the STORE between two slices by watching the daemon's own STATS (some of its pages
WRITING, some READY), then does what the test is about, and checks what the docs promise
(docs/architecture.md, docs/protocol.md):

- the pool's counts add up once the engines have left: nothing WRITING, nothing pinned;
- every LOAD brings exactly the bytes stored under its keys (pages are filled with bytes
  derived from their key);
- the daemon never logs a traceback and keeps answering.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P

from tests.engine_child import TINY
from tests.engines import engine, tokens

REPO = Path(__file__).resolve().parents[2]
N = 4096  # pages of the long STORE (TINY: 1 KiB each, 4 MiB in all)
DEADLINE_S = 30.0  # bound on every wait below
TRIES = 5
SETTLE_S = 10.0  # how long the pool may take to settle once every request has ended


@pytest.fixture
def sliced(daemon_factory):
    return daemon_factory("--slice-pages", "1")


# ---------------------------------------------------------------- helpers
def key_bytes(keys: list[bytes], page_bytes: int) -> np.ndarray:
    """Each key's page contents: its 32 bytes, xored with the byte's position, over the
    page (rows in key order)."""
    k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
    reps = -(-page_bytes // 32)
    rows = np.tile(k, (1, reps))[:, :page_bytes]
    pos = (np.arange(page_bytes) // 32).astype(np.uint8)
    return rows ^ pos[None, :]


def engine_bufs(pool) -> list[np.ndarray]:
    """Each buffer of the engine pool (K, V of each layer) as ``[num_pages, chunk_bytes]``
    uint8 arrays sharing its memory."""
    out = []
    for buf in pool.k + pool.v:
        raw = buf.view(-1).view(torch.uint8).numpy()
        out.append(raw.reshape(pool.num_pages, -1))
    return out


def fill(pool, pages: list[int], keys: list[bytes]) -> None:
    """Write the key-derived bytes of ``keys`` into engine ``pages``."""
    for i, b in enumerate(engine_bufs(pool)):
        data = key_bytes(keys, b.shape[1])
        b[np.asarray(pages, dtype=np.int64)] = data ^ np.uint8(i * 17 + 1)


def wrong_pages(pool, pages: list[int], keys: list[bytes]) -> list[int]:
    """The engine pages whose bytes are not those of their key."""
    bad = np.zeros(len(pages), dtype=bool)
    for i, b in enumerate(engine_bufs(pool)):
        data = key_bytes(keys, b.shape[1]) ^ np.uint8(i * 17 + 1)
        bad |= (b[np.asarray(pages, dtype=np.int64)] != data).any(axis=1)
    return [pages[j] for j in np.nonzero(bad)[0].tolist()]


def zero(pool) -> None:
    for b in engine_bufs(pool):
        b[:] = 0


def pool_stats(admin: AdminClient) -> dict:
    return admin.stats()["pool"]


def settled(admin: AdminClient, sessions: int | None = None) -> dict:
    """Wait until nothing is WRITING or pinned (and ``sessions`` sessions are left);
    the last STATS."""
    end = time.monotonic() + SETTLE_S
    while True:
        st = admin.stats()
        p = st["pool"]
        if (
            not p["pages_writing"]
            and not p["pages_pinned"]
            and (sessions is None or len(st["sessions"]) == sessions)
        ):
            return st
        if time.monotonic() > end:
            return st
        time.sleep(0.02)


def log_problems(d) -> list[str]:
    text = d.log_path.read_text(errors="replace")
    return [
        line
        for line in text.splitlines()
        if "Traceback" in line or "Error" in line or "ERROR" in line or "failed" in line
    ]


def catch(admin: AdminClient, phase: str, base_ready: int, alive, total: int = N) -> bool:
    """Poll STATS until the long STORE is in ``phase``: "alloc" (some but not all of its
    pages WRITING, none READY yet) or "commit" (some READY, some still WRITING)."""
    end = time.monotonic() + DEADLINE_S
    while alive() and time.monotonic() < end:
        p = pool_stats(admin)
        w, r = p["pages_writing"], p["pages_ready"] - base_ready
        if phase == "alloc" and total // 16 < w < total // 2 and r == 0:
            return True
        if phase == "commit" and w > 0 and 0 < r < total:
            return True
    return False


# ---------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_release_of_a_long_store_while_it_commits_in_slices(sliced):
    """A RELEASE of a long STORE's slot that arrives while its commit runs in
    slices either lets the STORE end DONE (all pages READY) or CANCELLED (none stored);
    either way no page is left WRITING or pinned, the pool's counts add up (READY pages
    are all found by LOOKUP/LOAD), and the daemon logs no traceback."""
    pool_a, a = engine(sliced.runtime_dir, TINY, num_pages=N, model="long")
    try:
        with AdminClient(sliced.endpoint) as admin:
            caught = False
            for attempt in range(TRIES):
                keys = a.page_keys(tokens(N * TINY.page_size, salt=attempt + 1))
                fill(pool_a, list(range(N)), keys)
                base = pool_stats(admin)["pages_ready"]
                h = a.store(keys, list(range(N)))
                assert h.writing == N
                caught = catch(admin, "commit", base, lambda h=h: not h.done)
                if caught:
                    a.release([h])
                ok = h.wait()
                st = settled(admin)
                if caught:
                    break
            assert caught, "the RELEASE never landed between two commit slices"
            p = st["pool"]
            assert p["pages_writing"] == 0, f"pages left WRITING: {p}\n{log_problems(sliced)}"
            assert p["pages_pinned"] == 0, p
            n = a.lookup(keys).l2
            # whatever the RELEASE did, the READY pages are whole chains a LOOKUP finds,
            # and the engine was told DONE exactly when its chain is stored
            assert p["pages_ready"] - base == n, (p, base, n)
            assert ok == (n == N), (ok, n)
        assert log_problems(sliced) == []
    finally:
        a.close()
        pool_a.close()


@pytest.mark.timeout(120)
def test_unregister_while_a_long_store_commits_in_slices(sliced):
    """An engine that UNREGISTERs (closes its connection) while its long STORE is
    being committed in slices leaves a clean pool: its session goes away, no page stays
    WRITING or pinned, every READY page is reachable, and the daemon logs no traceback."""
    pool_b, b = engine(sliced.runtime_dir, TINY, num_pages=64, model="long")
    try:
        with AdminClient(sliced.endpoint) as admin:
            caught = False
            for attempt in range(TRIES):
                pool_a, a = engine(sliced.runtime_dir, TINY, num_pages=N, model="long")
                try:
                    keys = a.page_keys(tokens(N * TINY.page_size, salt=50 + attempt))
                    fill(pool_a, list(range(N)), keys)
                    base = pool_stats(admin)["pages_ready"]
                    h = a.store(keys, list(range(N)))
                    assert h.writing == N
                    caught = catch(admin, "commit", base, lambda h=h: not h.done)
                    if caught:
                        a.close()  # UNREGISTER, mid-commit
                    else:
                        h.wait()
                finally:
                    a.close()
                    pool_a.close()
                st = settled(admin, sessions=1)
                if caught:
                    break
            assert caught, "the UNREGISTER never landed between two commit slices"
            p = st["pool"]
            assert len(st["sessions"]) == 1, st["sessions"]
            assert p["pages_writing"] == 0, f"pages left WRITING: {p}\n{log_problems(sliced)}"
            assert p["pages_pinned"] == 0, p
            assert p["pages_ready"] - base == b.lookup(keys).l2, p
        assert log_problems(sliced) == []
    finally:
        b.close()
        pool_b.close()


def spawn_long_child(rdir, n: int) -> subprocess.Popen:
    """An engine process storing a new chain of ``n`` TINY pages in one STORE (keys:
    ``tokens(n * 16, salt=pid)`` of model "long"); it prints ``storing`` before."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.engine_child", "long", str(rdir), str(n)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "storing"
    return child


def session_closing(admin: AdminClient) -> bool:
    return any(s["state"] == "closing" for s in admin.stats()["sessions"])


@pytest.mark.timeout(120)
def test_a_store_of_the_same_chain_after_a_long_store_was_cancelled_mid_allocation(sliced):
    """Once an engine whose long STORE was being allocated in slices is gone (its
    session closing, the STORE cancelled), another engine's STORE of the same chain stores
    the chain itself: the cancelled STORE's pages will never be READY, so they must not
    count as "being stored" (a cancelled STORE's keys leave the index of pages being
    written at once: ``ServiceContext.cancel_transfer``). Once both are settled a LOOKUP of
    the chain finds every page the second STORE reported (``count``), with its bytes."""
    n = 4 * N  # the killed engine's chain: its abort takes as many turns as it allocated
    pool_b, b = engine(sliced.runtime_dir, TINY, num_pages=n, model="long")
    try:
        with AdminClient(sliced.endpoint) as admin:
            caught = False
            for _ in range(TRIES):
                child = spawn_long_child(sliced.runtime_dir, n)
                try:
                    keys = b.page_keys(tokens(n * TINY.page_size, salt=child.pid))
                    fill(pool_b, list(range(n)), keys)
                    base = pool_stats(admin)["pages_ready"]
                    if not catch(admin, "alloc", base, lambda c=child: c.poll() is None, n):
                        continue
                    caught = True
                    child.send_signal(signal.SIGKILL)
                    end = time.monotonic() + DEADLINE_S
                    while not session_closing(admin) and time.monotonic() < end:
                        pass
                    # sent once the killed engine's session is closing: its STORE is cancelled
                    h = b.store(keys, list(range(n)))
                    ok = h.wait()
                finally:
                    child.kill()
                    child.wait()
                    child.stdout.close()
                break
            assert caught, "never caught a killed engine's long STORE between two slices"
            st = settled(admin, sessions=1)
            assert st["pool"]["pages_writing"] == 0, st["pool"]
            found = b.lookup(keys).l2
            # nothing else stores this chain: every page the second STORE counts, it writes
            assert h.writing == h.count and found == h.count and ok, (
                f"the second STORE said {h.count} pages were stored or being stored "
                f"(writing {h.writing} itself, ended {'DONE' if ok else 'not DONE'}); "
                f"a LOOKUP finds {found}"
            )
            zero(pool_b)
            ld = b.load(keys, list(range(n)))
            assert ld.count == found and ld.wait()
            assert wrong_pages(pool_b, list(range(found)), keys[:found]) == []
        assert log_problems(sliced) == []
    finally:
        b.close()
        pool_b.close()


@pytest.mark.timeout(120)
def test_sigterm_while_a_long_store_commits_in_slices_drains_cleanly(sliced):
    """SIGTERM while a long STORE is being committed in slices drains (the drain
    waits for the slices, docs/architecture.md): kvtierd exits 0 without logging a
    traceback or a failed request."""
    n = 4 * N  # a commit of this many turns outlasts the signal's delivery
    pool_a, a = engine(sliced.runtime_dir, TINY, num_pages=n, model="long")
    try:
        with AdminClient(sliced.endpoint) as admin:
            keys = a.page_keys(tokens(n * TINY.page_size, salt=200))
            fill(pool_a, list(range(n)), keys)
            h = a.store(keys, list(range(n)))
            assert h.writing == n
            end = time.monotonic() + DEADLINE_S
            while not h.done and time.monotonic() < end:  # the first commit slices are done
                p = pool_stats(admin)
                if p["pages_writing"] and 0 < p["pages_ready"] < n // 4:
                    break
            assert 0 < p["pages_ready"] < n // 4, "never caught the commit's first slices"
        rc = sliced.stop()
        problems = log_problems(sliced)
        assert rc == 0 and problems == [], (rc, problems)
    finally:
        a.close()
        pool_a.close()


@pytest.mark.timeout(120)
def test_flushes_and_lookups_during_a_long_store_see_it_whole_or_not_at_all(sliced):
    """While a long STORE allocates and commits in slices, admin FLUSHes,
    session-scoped FLUSHes and another engine's LOOKUPs interleave with its slices; every
    LOOKUP of its chain sees 0 or all of its pages (never a half-committed chain), the
    STORE ends DONE, and a LOAD of what is left brings back the stored bytes exactly."""
    (pool_a, a), (pool_b, b) = (
        engine(sliced.runtime_dir, TINY, num_pages=N, model="long"),
        engine(sliced.runtime_dir, TINY, num_pages=N, model="long"),
    )
    try:
        keys = a.page_keys(tokens(N * TINY.page_size, salt=7))
        fill(pool_a, list(range(N)), keys)
        out: list = []
        t = threading.Thread(target=lambda: out.append(a.store(keys, list(range(N))).wait()))
        seen, flushes = set(), 0
        with AdminClient(sliced.endpoint) as admin:
            t.start()
            end = time.monotonic() + DEADLINE_S
            while t.is_alive() and time.monotonic() < end:
                seen.add(b.lookup(keys).l2)
                if N in seen:
                    break  # committed: the flushes below would drop it
                admin.call(P.Flush(req_id=0, tier="l2"))
                b._call(P.Flush(req_id=0, tier="l2", session_id=b.session_id))
                flushes += 1
            t.join(DEADLINE_S)
            assert out == [True]
            assert seen <= {0, N}, sorted(seen)[:10]
            st = settled(admin)
            assert st["pool"]["pages_writing"] == 0 and st["pool"]["pages_pinned"] == 0
            n = b.lookup(keys).l2
            assert n in (0, N) and st["pool"]["pages_ready"] == n, (n, st["pool"])
            zero(pool_b)
            h = b.load(keys, list(range(N)))
            assert h.count == n and (n == 0 or h.wait())
            assert wrong_pages(pool_b, list(range(n)), keys[:n]) == []
        assert flushes > 1
        assert log_problems(sliced) == []
    finally:
        for pool, conn in ((pool_a, a), (pool_b, b)):
            conn.close()
            pool.close()
