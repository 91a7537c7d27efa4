"""What L2, L3 and the KV event stream say about a page stays consistent, through real
kvtierd processes: a page whose L3 object was deleted is written to L3 again; a prefetch
that others wait for outlives its own claim and session; the pages of a STORE committed in
slices are never reported removed before they are reported stored."""

from __future__ import annotations

import threading

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, tokens
from tests.integration.test_kv_events import drain, event_flags, subscriber
from tests.integration.test_l3_tier import (
    flush,
    l3_flags,
    load_and_compare,
    slow_flags,
    stats,
    store_pages,
    wait_written,
    REPO,
)

pytestmark = pytest.mark.timeout(120)


def test_sync_after_an_l3_flush_writes_the_l2_pages_again(daemon_factory):
    """FLUSH --tier l3 deletes the objects, so the L2 pages are no longer in L3: SYNC
    ("every L2 page not in L3 queued for L3") writes them again (under write_back, a page
    still marked in L3 could be evicted from L2 while in no tier)."""
    d = daemon_factory(*l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 8)
        wait_written(d, 8)
        assert flush(d, "l3").l3_pages == 8
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            rep = admin.sync(timeout_s=10.0)
        assert (rep.pages, rep.written, rep.left) == (8, 8, 0), rep
        flush(d, "l2")
        r = conn.lookup(keys)
        assert (r.l2, r.l3) == (0, 8)
    finally:
        conn.close()
        pool.close()


@pytest.mark.parametrize("first_leaves_by", ["best_effort_claim", "closing"])
def test_one_session_leaving_does_not_cancel_anothers_prefetch(
    daemon_factory, short_tmp, first_leaves_by
):
    """Two sessions prefetch the same chain: the second's pages are "on their way" by the
    first's fill (PREFETCH coming = 64). The first stops waiting (a best_effort CLAIM) or
    goes away (its engine closes); the fill goes on for the second, whose wait_complete
    CLAIM gets every page."""
    d = daemon_factory(*slow_flags(short_tmp, 0.5), env={"PYTHONPATH": REPO})
    pool, conn = engine(d.runtime_dir, num_pages=128)
    pool2, conn2 = engine(d.runtime_dir, num_pages=128)
    try:
        keys, expected = store_pages(pool, conn, 64)
        wait_written(d, 64)
        flush(d, "l2")
        assert conn.prefetch(keys) == 64
        assert conn2.prefetch_coming(keys) == 64  # all of it comes, by the first's fill
        if first_leaves_by == "closing":
            conn.close()
        else:
            conn.claim(keys, policy="best_effort")
        got = conn2.claim(keys, policy="wait_complete")
        assert got == 64, f"wait_complete claim got {got} of 64 pages"
        load_and_compare(pool2, conn2, keys, expected, first_page=64)
    finally:
        conn2.close()
        pool2.close()
        conn.close()
        pool.close()


def test_a_long_stores_pages_are_never_removed_before_they_are_announced(daemon_factory, short_tmp):
    """A STORE of more than ``slice_pages`` pages is committed in slices, tail first, the
    loop answering other requests between two slices; its BlockStored goes out after the
    last slice. Another engine's STOREs in between, into a full pool, must not evict a
    page of it before then: a router applying the stream in order would see a removal
    before the store and go on believing L2 holds the page."""
    d = daemon_factory(
        *event_flags(short_tmp),
        "--hicache-size",
        "8MiB",
        "--extent-size",
        "4MiB",
        "--slice-pages",
        "1",
        "--eviction-policy",
        "lru",
    )
    pool_a, conn_a = engine(d.runtime_dir, num_pages=256)
    pool_b, conn_b = engine(d.runtime_dir, num_pages=4)
    sub = subscriber(short_tmp)
    stop = threading.Event()
    spam_keys: list[bytes] = []

    def spam() -> None:
        i = 0
        while not stop.is_set() and i < 200_000:
            k = conn_b.page_keys(tokens(SMALL.page_size, salt=10_000 + i))
            spam_keys.extend(k)
            try:
                conn_b.store(k, [0]).wait()
            except Exception:
                pass
            i += 1

    t = threading.Thread(target=spam, daemon=True)
    try:
        n = stats(d)["pool"]["capacity_bytes"] // (
            SMALL.num_layers * 2 * SMALL.page_size * SMALL.kv_heads * SMALL.head_dim * 4
        )
        want: dict[int, bytes] = {}
        t.start()
        for r in range(6):
            keys = conn_a.page_keys(tokens(n * SMALL.page_size, salt=r))
            eng = P.EngineBlocks(hashes=[r * 100_000 + i for i in range(n)])
            want.update(zip(eng.hashes, keys))
            conn_a.store(keys, list(range(n)), engine=eng).wait()
        stop.set()
        t.join(30)
        msgs = sorted(drain(sub, 1.0), key=lambda m: m.seq)
        seqs = [m.seq for m in msgs]
        assert seqs == list(range(len(seqs))), "the test must see the whole stream"
        held: set = set()
        early_removals = []
        for m in msgs:
            for e in m.batch.events:
                if isinstance(e, E.BlockStored) and e.medium == "CPU":
                    held.update(e.block_hashes)
                elif isinstance(e, E.BlockRemoved) and e.medium == "CPU":
                    early_removals += [h for h in e.block_hashes if h not in held]
                    held.difference_update(e.block_hashes)
        router = {h for h in held if h in want}
        actual = {h for h, k in want.items() if conn_a.lookup([k]).l2 == 1}
        assert not early_removals and router == actual, (
            f"{len(early_removals)} BlockRemoved of blocks never announced; "
            f"router believes {len(router - actual)} pages are in L2 that are not"
        )
    finally:
        stop.set()
        t.join(30)
        sub.close()
        conn_b.close()
        pool_b.close()
        conn_a.close()
        pool_a.close()
