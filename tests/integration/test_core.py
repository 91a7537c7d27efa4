"""The core data path against a real kvtierd subprocess."""

from __future__ import annotations

from kvtier.client.connection.admin import AdminClient

from tests.engines import OTHER, SMALL, engine, fill_page, page_bytes, tokens


def test_store_then_load_returns_identical_bytes(daemon):
    pool, conn = engine(daemon.runtime_dir)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size))
        for p in range(8):
            fill_page(pool, p, seed=p + 1)
        expected = [page_bytes(pool, p) for p in range(8)]
        assert conn.lookup(keys).l2 == 0
        h = conn.store(keys, list(range(8)))
        assert (h.count, h.writing) == (8, 8)
        assert h.wait()
        assert conn.lookup(keys).l2 == 8
        # a second store of the same keys copies nothing
        h2 = conn.store(keys, list(range(8)))
        assert (h2.count, h2.writing) == (8, 0)
        # load into other pages, layer by layer
        dst = list(range(20, 28))
        h = conn.load(keys, dst)
        assert h.count == 8
        for layer in range(SMALL.num_layers):
            assert h.wait_layer(layer)
        assert h.wait()
        for i, p in enumerate(dst):
            assert page_bytes(pool, p) == expected[i]
    finally:
        conn.close()
        pool.close()


def test_lookup_stops_at_first_missing_key_and_load_only_the_run(daemon):
    pool, conn = engine(daemon.runtime_dir)
    try:
        keys = conn.page_keys(tokens(6 * SMALL.page_size))
        assert conn.store(keys[:3], [0, 1, 2]).wait()
        assert conn.lookup(keys).l2 == 3
        other = conn.page_keys(tokens(6 * SMALL.page_size, salt=9))
        assert conn.lookup(other).l2 == 0
        h = conn.load(keys, [10, 11, 12, 13, 14, 15])
        assert h.count == 3 and h.wait()
        assert conn.load(other, [20]).count == 0
    finally:
        conn.close()
        pool.close()


def test_two_engines_with_different_geometries(daemon):
    pa, ca = engine(daemon.runtime_dir, SMALL, model="a")
    pb, cb = engine(daemon.runtime_dir, OTHER, model="b")
    try:
        ka = ca.page_keys(tokens(4 * SMALL.page_size))
        kb = cb.page_keys(tokens(4 * OTHER.page_size))
        for p in range(4):
            fill_page(pa, p, seed=100 + p)
            fill_page(pb, p, seed=200 + p)
        ea = [page_bytes(pa, p) for p in range(4)]
        eb = [page_bytes(pb, p) for p in range(4)]
        ha, hb = ca.store(ka, [0, 1, 2, 3]), cb.store(kb, [0, 1, 2, 3])
        assert ha.wait() and hb.wait()
        # namespaces differ: neither sees the other's keys
        assert ca.lookup(kb).l2 == 0 and cb.lookup(ka).l2 == 0
        ha, hb = ca.load(ka, [4, 5, 6, 7]), cb.load(kb, [4, 5, 6, 7])
        assert ha.wait() and hb.wait()
        assert [page_bytes(pa, p) for p in range(4, 8)] == ea
        assert [page_bytes(pb, p) for p in range(4, 8)] == eb
        with AdminClient(daemon.endpoint) as admin:
            st = admin.stats()
        assert len(st["sessions"]) == 2
        assert {s["page_bytes"] for s in st["sessions"]} == {SMALL.page_bytes, OTHER.page_bytes}
    finally:
        for c in (ca, cb):
            c.close()
        pa.close()
        pb.close()


def test_pool_full_evicts_instead_of_failing(daemon_factory):
    # 8 MiB pool of 4 MiB extents holds 2 x 256 pages of 16 KiB... use 512 pages of 16 KiB.
    d = daemon_factory("--hicache-size", "8MiB", "--extent-size", "4MiB")
    pool, conn = engine(d.runtime_dir, num_pages=256)
    try:
        capacity = (8 << 20) // SMALL.page_bytes
        chains = []
        for c in range(4):
            keys = conn.page_keys(tokens(200 * SMALL.page_size, salt=c))
            h = conn.store(keys, list(range(200)))
            assert h.count == 200, "a full pool must evict, not refuse"
            assert h.wait()
            chains.append(keys)
        assert conn.lookup(chains[-1]).l2 == 200
        resident = sum(conn.lookup(k).l2 for k in chains)
        assert resident <= capacity
        # tail-first: an older chain keeps a prefix (its head), never a suffix
        assert conn.lookup(chains[0]).l2 < 200
        with AdminClient(d.endpoint) as admin:
            assert admin.stats()["pool"]["evictions"] > 0
    finally:
        conn.close()
        pool.close()


def test_session_survives_engine_restart_in_process(daemon):
    """Pages stored by one engine are loaded by the next one with the same model."""
    pool, conn = engine(daemon.runtime_dir)
    keys = conn.page_keys(tokens(4 * SMALL.page_size))
    for p in range(4):
        fill_page(pool, p, seed=7 + p)
    expected = [page_bytes(pool, p) for p in range(4)]
    assert conn.store(keys, [0, 1, 2, 3]).wait()
    conn.close()
    pool.close()
    pool2, conn2 = engine(daemon.runtime_dir)
    try:
        keys2 = conn2.page_keys(tokens(4 * SMALL.page_size))
        assert keys2 == keys
        h = conn2.load(keys2, [9, 8, 7, 6])
        assert h.count == 4 and h.wait()
        assert [page_bytes(pool2, p) for p in (9, 8, 7, 6)] == expected
    finally:
        conn2.close()
        pool2.close()


def test_client_does_not_hang_when_daemon_is_killed(daemon):
    pool, conn = engine(daemon.runtime_dir, request_timeout_s=1.0, load_timeout_s=5.0)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        daemon.kill()
        # every call returns within its timeout (pytest-timeout fails a hang)
        assert conn.lookup(keys).l2 == 0
        assert conn.load(keys, [4, 5, 6, 7]).count == 0
        assert conn.store(keys, [0, 1, 2, 3]).count == 0
    finally:
        conn.close()
        pool.close()
