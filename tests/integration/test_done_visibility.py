"""DONE in the completion block means "visible": a transfer's final status is written only
after the daemon committed a store's pages (READY) or dropped a load's pins.

An engine that sees DONE may tell another engine at once that the pages are there, or reuse
its own device pages. If DONE came first (the copy thread writing it, or the event loop
writing it before the commit), another session's LOOKUP right after DONE could miss pages
that were stored. The window is short, so each check runs a few hundred small transfers in
a bounded loop; each iteration fails on its own, with its number.
"""

from __future__ import annotations

import pytest
from kvtier.client.admin import AdminClient
from kvtier.client.daemon_process import DaemonProcess

from tests.engines import SMALL, engine, fill_page, tokens
from tests.key_chain import spec_page_keys

pytestmark = pytest.mark.timeout(120)

P = SMALL.page_size
ROUNDS = 400


@pytest.fixture
def daemon(module_daemon: DaemonProcess) -> DaemonProcess:
    """The module's daemon; each test uses a model id (a namespace) of its own."""
    return module_daemon


def test_a_store_seen_done_is_visible_to_another_session_at_once(daemon):
    wpool, writer = engine(daemon.runtime_dir, num_pages=8, model="visible")
    rpool, reader = engine(daemon.runtime_dir, num_pages=8, model="visible")
    try:
        assert reader.session_id != writer.session_id
        assert reader.ns_fingerprint == writer.ns_fingerprint
        fill_page(wpool, 0, seed=1)
        for i in range(ROUNDS):
            n = 1 + i % 3  # one to three pages, all of them must be visible
            keys = spec_page_keys(writer.ns_fingerprint, tokens(n * P, salt=10_000 + i), P)
            h = writer.store(keys, list(range(n)))
            assert h.count == n and h.wait(), f"round {i}: the store failed"
            got = reader.lookup(keys).l2
            assert got == n, f"round {i}: DONE seen, but another session finds {got} of {n} pages"
    finally:
        for conn, pool in ((writer, wpool), (reader, rpool)):
            conn.close()
            pool.close()


def test_a_load_seen_done_holds_no_pin(daemon):
    pool, conn = engine(daemon.runtime_dir, num_pages=16, model="unpinned")
    try:
        keys = spec_page_keys(conn.ns_fingerprint, tokens(4 * P, salt=3), P)
        for p in range(4):
            fill_page(pool, p, seed=p + 1)
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
            for i in range(ROUNDS // 4):
                h = conn.load(keys, [8, 9, 10, 11])
                assert h.count == 4 and h.wait(), f"round {i}: the load failed"
                pinned = admin.stats()["pool"]["pages_pinned"]
                assert pinned == 0, f"round {i}: DONE seen, {pinned} pages still pinned"
    finally:
        conn.close()
        pool.close()
