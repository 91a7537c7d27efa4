"""A pool file damaged while no kvtierd ran: what a restarted kvtierd adopts from it.

The pool file (``daemon/pool/layout.py``) is the host pool's index and bytes; a kvtierd that
restarts adopts what the previous one left (docs/architecture.md, "Restart survival" and
"Start and adoption"). Whatever the file holds, the new daemon must start, never serve a
page under a key (in a namespace) it was not stored under, and keep working: these tests
damage the file while the daemon is stopped (or kill the daemon while it writes it), then
restart it and look at what it serves.
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.config.loader import pool_path
from kvtier.daemon.pool.layout import DIGEST_BYTES, PoolLayout
from kvtier.daemon.pool.records import PageState

from tests.engines import engine, fill_page, page_bytes, tokens

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


# ---------------------------------------------------------------------------- helpers


def pool_file(d) -> Path:
    """The pool file of daemon ``d`` (the fixtures' pool_dir is /dev/shm)."""
    return pool_path(Path("/dev/shm"), d.runtime_dir)


@contextmanager
def mapped_meta(d, hicache: int = 64 * MIB, extent: int = 4 * MIB) -> Iterator[tuple]:
    """Map the metadata region of ``d``'s pool file (the daemon must be stopped): yields
    ``(layout, mapping, columns)`` where ``columns`` maps a column name to a numpy view."""
    lay = PoolLayout.plan(hicache, extent)
    with open(pool_file(d), "r+b") as f:
        mm = mmap.mmap(f.fileno(), lay.meta_bytes)
        views: dict[str, np.ndarray] = {}
        dtypes = {"q": np.int64, "Q": np.uint64, "i": np.int32, "b": np.int8, "B": np.uint8}
        for name, fmt, off in lay.columns:
            count = lay.n_slots * (32 if name == "key" else 1)
            views[name] = np.frombuffer(mm, dtype=dtypes[fmt], count=count, offset=off)
        try:
            yield lay, mm, views
        finally:
            views.clear()
            mm.flush()
            mm.close()


def adopt_info(d) -> dict:
    with AdminClient(d.endpoint) as admin:
        return dict(admin.stats()["adopt"])


def store_chain(pool, conn, salt: int, n: int = 8, seed0: int = 0) -> tuple[list, list]:
    """Store ``n`` pages (chain of ``salt``) from engine pages 0..n-1; return keys and bytes."""
    keys = conn.page_keys(tokens(n * 16, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=seed0 + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return keys, expected


def no_traceback(d) -> None:
    log = d.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


# ------------------------------------------------------------ the namespace table


@pytest.mark.timeout(90)
def test_a_namespace_entry_freed_in_the_table_does_not_give_its_pages_to_another_namespace(
    daemon_factory,
):
    """Pages are stored under a namespace id; the namespace table of the pool file maps
    fingerprints (model, tenant, geometry...) to those ids. When that table no longer names
    the id (its entry's used flag cleared, as a stray write or a torn release leaves it),
    the rows that carry the id belong to no namespace, and the id is never given to the
    next namespace to register (another model here; another tenant alike, since the tenant
    is in the fingerprint): it is never served the other's bytes."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, model="model-a")
    try:
        keys, expected = store_chain(pool, conn, salt=3, seed0=500)
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    with mapped_meta(d) as (lay, mm, _):
        used = lay.ids_off + 2 * lay.id_capacity * DIGEST_BYTES  # the namespaces' used flags
        assert mm[used] == 1, "model-a should hold namespace id 1"
        mm[used] = 0  # one byte: entry 1 no longer in use
    d2 = daemon_factory()
    pool, conn = engine(d2.runtime_dir, model="model-b")
    try:
        found = conn.lookup(keys).l2
        if found:
            h = conn.load(keys[:found], list(range(16, 16 + found)))
            assert h.wait()
            got = [page_bytes(pool, p) for p in range(16, 16 + found)]
            leaked = sum(g == e for g, e in zip(got, expected))
        else:
            leaked = 0
        assert found == 0 and leaked == 0, (
            f"namespace model-b was served {found} pages ({leaked} with model-a's exact "
            f"bytes) that were stored by model-a; adoption: {adopt_info(d2)}"
        )
    finally:
        conn.close()
        pool.close()
    no_traceback(d2)


# ---------------------------------------------------------------- the stamp column


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_last_access_stamp_at_int64_max_does_not_freeze_the_pool(daemon_factory, policy):
    """A page's last-access stamp is not covered by its seal. One stamp overwritten with
    2**63 - 1 while kvtierd was stopped is damage: that row is dropped (its chain is found
    up to it), and the adopted pool keeps evicting its coldest pages as new ones are
    stored: the pages the file held go before the pages stored after the restart. An
    access clock continued from such a stamp would overflow, and every page stored
    afterwards would look older than anything adopted, for good."""
    d = daemon_factory("--eviction-policy", policy)
    pool, conn = engine(d.runtime_dir, model="m")
    old = []
    try:
        for c in range(16):  # 128 pages of 32 KiB: 4 MiB of a 64 MiB pool
            keys, _ = store_chain(pool, conn, salt=1000 + c, seed0=c)
            old.append(keys)
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    with mapped_meta(d) as (_, _, cols):
        ready = np.flatnonzero(cols["state"] == PageState.READY)
        assert len(ready) == 128
        cols["stamp"][ready[0]] = 2**63 - 1  # one field of one row
    d2 = daemon_factory("--eviction-policy", policy)
    pool, conn = engine(d2.runtime_dir, model="m")
    try:
        assert 128 - 8 <= sum(conn.lookup(k).l2 for k in old) < 128  # one row dropped
        new = []
        for c in range(40):  # 2560 new pages: more than the 2048 the pool holds
            keys = conn.page_keys(tokens(64 * 16, salt=c))
            h = conn.store(keys, list(range(64)))
            assert h.wait()
            new.append(keys)
        old_left = sum(conn.lookup(k).l2 for k in old)
        last_new_left = sum(conn.lookup(k).l2 for k in new[-8:])
        assert old_left == 0 and last_new_left == 8 * 64, (
            f"after storing 2560 new pages, {old_left} of the 128 adopted pages are still "
            f"resident and {8 * 64 - last_new_left} of the last 512 pages stored were "
            "evicted: the damaged stamp froze the recency order"
        )
    finally:
        conn.close()
        pool.close()
    no_traceback(d2)


# -------------------------------------------------------------- the extent table


@pytest.mark.timeout(90)
def test_page_sizes_of_empty_extents_in_the_file_do_not_lock_engines_out(daemon_factory):
    """The extent table holds each extent's page size. Adoption registers the page size
    of the extents that hold an adopted page as a page class (a class is never forgotten,
    and engines may only add page sizes while fewer than 256 classes exist). A file whose
    extent table holds 300 distinct page sizes in extents with no page registers none of
    them: engines can register afterwards, never refused BUSY for "a page size past the
    256 this pool takes"."""
    flags = ("--extent-size", "64KiB")  # 1024 extents of 64 KiB in the 64 MiB pool
    d = daemon_factory(*flags)
    assert d.stop() == 0
    with mapped_meta(d, extent=64 << 10) as (lay, mm, _):
        ext = np.frombuffer(mm, dtype=np.int64, count=lay.n_extents, offset=lay.ext_off)
        ext[:300] = 1000 + np.arange(300)  # page sizes no row of those extents has
        del ext
    d2 = daemon_factory(*flags)
    try:
        pool, conn = engine(d2.runtime_dir, model="m")
    except Exception as err:  # what the engine gets is the finding
        pytest.fail(f"an engine cannot register after the adoption: {err}")
    try:
        keys, _ = store_chain(pool, conn, salt=9, seed0=40)
        assert conn.lookup(keys).l2 == len(keys)
    finally:
        conn.close()
        pool.close()
    no_traceback(d2)


# ---------------------------------------------- guards: damage adoption does handle


@pytest.mark.timeout(120)
def test_out_of_range_fields_in_rows_never_crash_or_serve_wrong_bytes(daemon_factory):
    """Single fields of rows overwritten with out-of-range values while kvtierd is stopped
    (state, key length, length, parent, namespace, owner, checksum flags, the extent table's
    page size): the daemon starts, adopts the intact rows, drops the damaged ones, and
    serves exactly the stored bytes or a miss (guard: passes)."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, model="m")
    chains = []
    try:
        for c in range(12):
            chains.append(store_chain(pool, conn, salt=200 + c, seed0=100 * c))
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    with mapped_meta(d) as (lay, mm, cols):
        ready = np.flatnonzero(cols["state"] == PageState.READY)
        assert len(ready) == 96
        damage: list[Callable[[int], None]] = [
            lambda s: cols["state"].__setitem__(s, 77),
            lambda s: cols["key_len"].__setitem__(s, 255),
            lambda s: cols["length"].__setitem__(s, -1),
            lambda s: cols["length"].__setitem__(s, 2**62),
            lambda s: cols["parent"].__setitem__(s, 2**31 - 1),
            lambda s: cols["parent"].__setitem__(s, -(2**31)),
            lambda s: cols["ns"].__setitem__(s, -1),
            lambda s: cols["ns"].__setitem__(s, 2**62),
            lambda s: cols["owner"].__setitem__(s, -(2**63)),
            lambda s: cols["flags"].__setitem__(s, 255),
            lambda s: cols["key"].__setitem__(32 * s, cols["key"][32 * s] ^ 1),
            lambda s: cols["stamp"].__setitem__(s, -(2**63)),
        ]
        for i, hurt in enumerate(damage):
            hurt(int(ready[8 * i + 3]))  # one row in each chain
        ext = np.frombuffer(mm, dtype=np.int64, count=lay.n_extents, offset=lay.ext_off)
        used_ext = sorted(set((ready // lay.per_extent).tolist()))
        ext[lay.n_extents - 1] = -5  # a free extent: garbage
        if len(used_ext) > 1:
            ext[used_ext[-1]] = 2**40  # an extent in use: its pages cannot be sized
        del ext
    d2 = daemon_factory()
    info = adopt_info(d2)
    assert info["adopted"] and 0 < info["pages_adopted"] < 96, info
    pool, conn = engine(d2.runtime_dir, model="m")
    try:
        for keys, expected in chains:
            n = conn.lookup(keys).l2
            if n:
                h = conn.load(keys[:n], list(range(16, 16 + n)))
                assert h.wait()
                got = [page_bytes(pool, p) for p in range(16, 16 + n)]
                assert got == expected[:n], "an adopted page holds other bytes"
        keys, _ = store_chain(pool, conn, salt=999, seed0=7)  # still works afterwards
        assert conn.lookup(keys).l2 == len(keys)
    finally:
        conn.close()
        pool.close()
    no_traceback(d2)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["truncated", "extended", "emptied"])
def test_a_resized_pool_file_is_discarded_naming_why(daemon_factory, how):
    """A pool file of another size is never mapped as it is (the arena could end inside
    the mapping: SIGBUS): it is discarded, the daemon starts empty and says why (guard)."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, model="m")
    try:
        keys, _ = store_chain(pool, conn, salt=5)
    finally:
        conn.close()
        pool.close()
    assert d.stop() == 0
    size = pool_file(d).stat().st_size
    new_size = {"truncated": size // 2, "extended": size + 4096, "emptied": 0}[how]
    os.truncate(pool_file(d), new_size)
    d2 = daemon_factory()
    info = adopt_info(d2)
    assert not info["adopted"] and str(new_size) in info["reason"], info
    assert info["reason"] in d2.log_tail()
    pool, conn = engine(d2.runtime_dir, model="m")
    try:
        assert conn.lookup(keys).l2 == 0
    finally:
        conn.close()
        pool.close()
    no_traceback(d2)


# ---------------------------------------------------- guard: SIGKILL while writing

_CHILD = r"""
import random, sys, time
from pathlib import Path
from tests.engines import engine, fill_page, tokens
rdir, base = Path(sys.argv[1]), int(sys.argv[2])
pool, conn = engine(rdir, num_pages=48, model="crash", request_timeout_s=5.0)
rng = random.Random(base)
done = []
c = base
while True:
    n = 16
    keys = conn.page_keys(tokens(n * 16, salt=c))
    for p in range(n):
        fill_page(pool, p, c * 100 + p)
    half = conn.store(keys[:8], list(range(8)))          # a prefix first, then the chain
    whole = conn.store(keys, list(range(n)))
    half.wait(); whole.wait()
    print(f"stored {c}", flush=True)
    done.append(keys)
    if len(done) > 2:                                   # a LOAD: pins, used again (T2)
        k = rng.choice(done[-12:])
        m = conn.lookup(k).l2
        if m:
            conn.load(k[:m], list(range(16, 16 + m))).wait()
    c += 1
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [(), ("--verify-on-adopt",)], ids=["trusted", "verified"])
def test_sigkill_during_stores_evictions_and_loads_serves_only_stored_bytes(daemon_factory, flags):
    """kvtierd killed (SIGKILL) again and again while an engine stores chains (prefix,
    then extension), evicts (the 16 MiB pool holds 32 chains) and loads: each restarted
    daemon adopts the pool, and every page a LOOKUP claims LOADs exactly the bytes stored
    under its key (guard: passes)."""
    args = ("--hicache-size", "16MiB", "--extent-size", "1MiB", *flags)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(7)
    d = daemon_factory(*args)
    tried: list[int] = []
    for rnd in range(4):
        base = 10_000 * (rnd + 1)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(d.runtime_dir), str(base)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line.startswith("stored"), f"engine failed: {line!r}"
            time.sleep(rng.uniform(0.3, 1.5))
            d.kill()
        finally:
            child.send_signal(signal.SIGKILL)
            out = child.communicate(timeout=20)[0]
            for leftover in Path("/dev/shm").glob(f"kvtier-engine-{child.pid}-*"):
                leftover.unlink(missing_ok=True)
        stored = [int(x.split()[1]) for x in (line + out).splitlines() if x.startswith("stored")]
        tried += list(range(base, (max(stored) if stored else base) + 2))
        d = daemon_factory(*args)
        info = adopt_info(d)
        assert info["adopted"], info
        pool, conn = engine(d.runtime_dir, num_pages=48, model="crash")
        try:
            served = 0
            for c in tried:
                keys = conn.page_keys(tokens(16 * 16, salt=c))
                n = conn.lookup(keys).l2
                if not n:
                    continue
                h = conn.load(keys[:n], list(range(n)))
                assert h.count == n and h.wait()
                for p in range(n):
                    fill_page(pool, 32, c * 100 + p)
                    assert page_bytes(pool, p) == page_bytes(pool, 32), (
                        f"round {rnd}: chain {c} page {p} holds other bytes"
                    )
                served += n
            assert served > 0
        finally:
            conn.close()
            pool.close()
        no_traceback(d)


# ------------------------------------------------------ the runtime-directory tag


@pytest.mark.timeout(60)
def test_kvtier_pools_lists_a_pool_file_whose_tag_holds_a_nul_byte(short_tmp):
    """``kvtier pools`` reads the runtime-directory tag (at 1 KiB of the header region,
    outside the checksum) of every ``kvtier-pool-*`` file in the pool directory, including
    other users' files, which anyone can create in a sticky /dev/shm. A tag holding a NUL
    byte is shown as unknown (no path has one), and the other files listed: ``kvtier
    pools`` (and ``--stale``, ``--json``) never dies with a traceback."""
    tag = b"/tmp/a\x00b"
    pool_dir = short_tmp / "pools"
    pool_dir.mkdir()
    good = pool_dir / "kvtier-pool-aaaa"
    good.write_bytes(bytes(4096))
    head = bytearray(4096)
    head[1024:1032] = b"KVTRDIR\x00"
    struct.pack_into("<H", head, 1032, len(tag))
    head[1034 : 1034 + len(tag)] = tag
    bad = pool_dir / "kvtier-pool-zzzz"
    bad.write_bytes(bytes(head))
    os.chmod(bad, 0o600)
    cli = Path(sys.executable).parent / "kvtier"
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
    env.pop("PYTHONIOENCODING", None)
    r = subprocess.run(
        [str(cli), "pools", "--pool-dir", str(pool_dir)],
        capture_output=True,
        env=env,
        timeout=30,
    )
    out, err = (x.decode(errors="replace") for x in (r.stdout, r.stderr))
    assert r.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert good.name in out and bad.name in out, out
