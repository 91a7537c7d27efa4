"""kvtierd restarted on a warm pool with a changed configuration (real kvtierd processes).

An operator stops kvtierd, edits its configuration and starts it again: the pool file in
shared memory is adopted when it fits the new configuration. Whatever changed, the adopted
pages are either served byte-exactly or dropped with a log line that names why; the pool
never exceeds what the new configuration allows, and no pool file is left behind unseen.
"""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.config.loader import pool_path
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonStartError

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens

REPO = Path(__file__).resolve().parents[2]


def store_chain(d, n=8, salt=3, seed=500, **cfg):
    """An engine on ``d`` stores an ``n``-page chain; returns (pool, conn, keys, bytes)."""
    pool, conn = engine(d.runtime_dir, **{"request_timeout_s": 5.0, **cfg})
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=seed + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return pool, conn, keys, expected


def stats(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return dict(admin.stats())


def kvtier_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO.parent,
        env={**os.environ, **(env or {})},
    )


def pools(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier pools ARGS`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "pools", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(120)
def test_pool_left_in_the_old_pool_dir_is_seen_as_stale_and_removable(daemon_factory, short_tmp):
    """``pool_dir`` moved between two runs: the first run's pool file in the old directory
    is removed once the second run serves (its pages are no daemon's any more). A pool file
    of that runtime directory found there all the same is one no daemon holds: ``kvtier
    pools --pool-dir OLD`` says so, and ``--stale`` removes it (the README: "kvtier pools
    --stale: remove every pool no daemon holds"); else it holds memory in /dev/shm for
    good."""
    old_dir, new_dir = short_tmp / "shm-old", short_tmp / "shm-new"
    old_dir.mkdir()
    new_dir.mkdir()
    d = daemon_factory("--pool-dir", str(old_dir))
    old_pool = pool_path(old_dir, d.runtime_dir)
    try:
        assert d.stop() == 0
        assert old_pool.exists()
        d2 = daemon_factory("--pool-dir", str(new_dir))
        new_pool = pool_path(new_dir, d2.runtime_dir)
        assert new_pool.exists()
        assert not old_pool.exists()  # removed by the second run
        shutil.copyfile(new_pool, old_pool)  # one left all the same (a copy of the header)
        os.chmod(old_pool, 0o600)
        listed = pools("--pool-dir", str(old_dir), "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {r["path"]: r for r in json.loads(listed.stdout)}
        assert rows[str(old_pool)]["held"] == "no", rows[str(old_pool)]
        stale = pools("--pool-dir", str(old_dir), "--stale")
        assert stale.returncode == 0, stale.stderr
        assert not old_pool.exists(), (stale.stdout, stale.stderr)
    finally:
        old_pool.unlink(missing_ok=True)


TOKEN_A = "tok-a-1b7e30"


def tenants_json(quota_a: int | None) -> str:
    a: dict[str, object] = {"token": TOKEN_A}
    if quota_a is not None:
        a["quota_pages"] = quota_a
    return json.dumps({"a": a})


def tenant_pages(d, name: str, token: str) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=token) as admin:
        return dict(admin.stats()["tenants"][name])


def store_chains(pool, conn, chains: int, n: int, salt: int) -> list[list[bytes]]:
    out = []
    for c in range(chains):
        keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt + c))
        for p in range(n):
            fill_page(pool, p, seed=salt * 10 + c * 100 + p)
        h = conn.store(keys, list(range(n)))
        h.wait()
        out.append(keys)
    return out


@pytest.mark.timeout(120)
def test_a_quota_lowered_across_a_restart_bounds_the_tenants_adopted_pages(daemon_factory):
    """A tenant held 32 pages; kvtierd restarts with ``quota_pages = 8`` for it (quotas
    are not live: a restart is the only way to change one). configuration.md: quota_pages
    is "the most L2 pages the tenant may hold". Once the tenant stores again, its stores
    must bring it down to its quota (evicting its own pages), not keep it at four times
    the quota for as long as the pool holds its old pages."""
    d = daemon_factory("--tenants", tenants_json(None))
    pool, conn = engine(d.runtime_dir, tenant="a", token=TOKEN_A, request_timeout_s=5.0)
    try:
        store_chains(pool, conn, 2, 16, salt=100)
        assert tenant_pages(d, "a", TOKEN_A)["pages"] == 32
        assert d.stop() == 0
        d2 = daemon_factory("--tenants", tenants_json(8))
        assert tenant_pages(d2, "a", TOKEN_A) == {"pages": 32, "quota_pages": 8}
        store_chains(pool, conn, 2, 8, salt=900)  # 16 new pages, each of its own
        held = tenant_pages(d2, "a", TOKEN_A)
        assert held["pages"] <= 8, held
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_turning_verify_on_adopt_on_keeps_the_warm_pool_or_says_why_it_is_dropped(
    daemon_factory,
):
    """kvtierd ran with ``verify_on_adopt`` off (the default) and is restarted with it on.
    configuration.md: verify_on_adopt "checksum[s] every stored page ... and verif[ies] each
    one when a restarted daemon adopts the pool"; nothing says that turning it on throws the
    warm pool away. The pages are adopted (stored without a checksum, they are
    trusted as before) and served byte-exactly, or, if they are dropped, the start says so
    naming ``verify_on_adopt`` (log and STATS' adopt reason), not "0 pages, 8 dropped"
    under the reason "metadata matches the config", which reads as damage."""
    d = daemon_factory()
    pool, conn, keys, expected = store_chain(d)
    try:
        assert d.stop() == 0
        d2 = daemon_factory("--verify-on-adopt")
        info = stats(d2)["adopt"]
        found = conn.lookup(keys).l2
        if found == len(keys):
            h = conn.load(keys, list(range(32, 40)))
            assert h.wait()
            assert [page_bytes(pool, p) for p in range(32, 40)] == expected
        else:
            assert "verify_on_adopt" in info["reason"], info
            assert "verify_on_adopt" in d2.log_tail(80), d2.log_tail(80)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_moving_pool_dir_back_never_resurrects_pages_flushed_meanwhile(daemon_factory, short_tmp):
    """Run 1 (``pool_dir`` A) stores a chain; run 2 (``pool_dir`` B, same runtime dir)
    flushes L2 (the model behind the id was replaced) and stores the same keys with the new
    bytes; run 3 goes back to ``pool_dir`` A. The flush dropped those pages for good as far
    as the operator can tell: run 3 must serve the bytes run 2 stored or a miss, never the
    flushed bytes of run 1 from the old pool file it finds in A (its header names this
    runtime dir and it is two runs old)."""
    a, b = short_tmp / "shm-a", short_tmp / "shm-b"
    a.mkdir()
    b.mkdir()
    d = daemon_factory("--pool-dir", str(a))
    pool, conn, keys, old = store_chain(d, seed=500)
    try:
        assert d.stop() == 0
        d2 = daemon_factory("--pool-dir", str(b))
        assert conn.lookup(keys).l2 == 0  # a new pool in B
        with AdminClient(d2.endpoint, timeout_s=5.0) as admin:
            admin.call(P.Flush(req_id=0, tier="all"))
        for p in range(len(keys)):
            fill_page(pool, p, seed=7000 + p)
        new = [page_bytes(pool, p) for p in range(len(keys))]
        assert new != old
        h = conn.store(keys, list(range(len(keys))))
        assert h.count == len(keys) and h.wait()
        assert d2.stop() == 0
        daemon_factory("--pool-dir", str(a))
        n = conn.lookup(keys).l2
        if n:
            h = conn.load(keys[:n], list(range(32, 32 + n)))
            assert h.wait()
            got = [page_bytes(pool, p) for p in range(32, 32 + n)]
            served_old = sum(g == o for g, o in zip(got, old))
            assert served_old == 0, f"{served_old} of {n} pages flushed two runs ago served again"
            assert [g == x for g, x in zip(got, new)] == [True] * n
    finally:
        conn.close()
        pool.close()


@pytest.fixture
def small_tmpfs(short_tmp):
    """A 100 MiB tmpfs to use as ``pool_dir`` (root may mount one; skipped otherwise)."""
    mnt = short_tmp / "shm-small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=100m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(120)
def test_a_start_refused_for_a_larger_hicache_size_leaves_the_warm_pool_alone(
    small_tmpfs, daemon_factory
):
    """The operator raises ``hicache_size`` beyond what ``pool_dir`` holds; kvtierd refuses
    to start naming hicache_size (as documented), and the operator puts the old size back.
    A start that was refused changed nothing: the pool the previous run left must still be
    adopted (README: "a start failing later removes the pool file it made", not the one it
    found)."""
    d = daemon_factory("--pool-dir", str(small_tmpfs))
    pool, conn, keys, expected = store_chain(d)
    try:
        assert d.stop() == 0
        big = daemon_factory(
            "--pool-dir", str(small_tmpfs), "--hicache-size", "128MiB", start=False
        )
        with pytest.raises(DaemonStartError) as refused:
            big.start()
        assert "hicache_size" in str(refused.value)
        d3 = daemon_factory("--pool-dir", str(small_tmpfs))
        info = stats(d3)["adopt"]
        assert info["adopted"] and info["pages_adopted"] == len(keys), info
        h = conn.load(keys, list(range(32, 40)))
        assert h.count == len(keys) and h.wait()
        assert [page_bytes(pool, p) for p in range(32, 40)] == expected
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_an_engine_with_a_new_geometry_under_the_same_model_is_never_served_old_pages(
    daemon_factory,
):
    """kvtierd restarts on its warm pool and the engine of model ``m`` comes back
    with another dtype (bfloat16 with twice the head_dim: the same page bytes, the same
    tokens per page). Its keys must find none of the pages of the old geometry."""
    d = daemon_factory()
    pool, conn, keys, _ = store_chain(d)
    try:
        assert d.stop() == 0
        daemon_factory()
        assert conn.lookup(keys).l2 == len(keys)  # adopted
        bf16 = P.Geometry(
            num_layers=SMALL.num_layers,
            page_size=SMALL.page_size,
            kv_heads=SMALL.kv_heads,
            head_dim=SMALL.head_dim * 2,
            dtype="bfloat16",
        )
        assert bf16.page_bytes == SMALL.page_bytes
        pool2, conn2 = engine(d.runtime_dir, geometry=bf16, request_timeout_s=5.0)
        try:
            keys2 = conn2.page_keys(tokens(len(keys) * SMALL.page_size, salt=3))
            assert conn2.lookup(keys2).l2 == 0
            assert conn2.lookup(keys).l2 == 0  # the old keys, sent as they are
        finally:
            conn2.close()
            pool2.close()
    finally:
        conn.close()
        pool.close()
