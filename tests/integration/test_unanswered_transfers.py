"""A STORE or LOAD whose reply never came in time is a miss, and stays one: the engine uses
its pages again at once, so kvtierd must not copy into them (a LOAD) or from them (a STORE)
once it catches up.

kvtierd is stopped with SIGSTOP while the request is sent (the client gives up after
``request_timeout_s``), the engine writes its own data into the pages, then kvtierd resumes and
comes to the request: past the request's ``deadline_ns`` it copies nothing, which the pages
(LOAD) and the pool (STORE) show, and STATS counts it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import DaemonUnavailable
from kvtier.client.kv_pool.shared import SharedKVPool

from tests.engines import SMALL, client_config, tokens

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.5


def _fill(pool: SharedKVPool, pages: range, value: float) -> None:
    for t in pool.k + pool.v:
        t[pages.start : pages.stop] = value


def _values(pool: SharedKVPool, pages: range) -> set[float]:
    return {float(x) for t in pool.k + pool.v for x in t[pages.start : pages.stop].flatten()}


def _stalled(d, call):  # type: ignore[no-untyped-def]
    """``call()`` while kvtierd is stopped; resumed afterwards in any case."""
    os.kill(d.pid, signal.SIGSTOP)
    try:
        return call()
    finally:
        os.kill(d.pid, signal.SIGCONT)


def _caught_up(conn: Connection, keys: list[bytes]) -> int:
    """kvtierd answers again (past the client's down window): the L2 run of ``keys``."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(DaemonUnavailable):
            conn.stats()
            return conn.lookup(keys).l2
        time.sleep(0.05)
    raise AssertionError("kvtierd did not answer again")


def _expired(d) -> int:  # type: ignore[no-untyped-def]
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return int(admin.stats()["counters"]["transfers_expired"])


def test_a_load_answered_too_late_never_writes_the_engines_pages(daemon_factory):
    d = daemon_factory()
    with SharedKVPool(SMALL, 16) as pool:
        conn = Connection(
            pool, model_id="m", config=client_config(d.runtime_dir, request_timeout_s=TIMEOUT_S)
        )
        try:
            keys = conn.page_keys(tokens(4 * SMALL.page_size))
            _fill(pool, range(0, 4), 1.0)
            assert conn.store(keys, [0, 1, 2, 3]).wait(10.0)
            h = _stalled(d, lambda: conn.load(keys, [8, 9, 10, 11]))
            assert h.count == 0 and not h.copying()  # a miss: the engine computes
            _fill(pool, range(8, 12), 7.0)
            assert _caught_up(conn, keys) == 4
            time.sleep(0.3)  # a late copy would have landed by now
            assert _values(pool, range(8, 12)) == {7.0}
            assert _expired(d) == 1
            h = conn.load(keys, [8, 9, 10, 11])  # and the next one is served
            assert h.count == 4 and h.wait(10.0) and _values(pool, range(8, 12)) == {1.0}
        finally:
            conn.close()


def test_a_store_answered_too_late_never_reads_the_engines_pages(daemon_factory):
    d = daemon_factory()
    with SharedKVPool(SMALL, 16) as pool:
        conn = Connection(
            pool, model_id="m", config=client_config(d.runtime_dir, request_timeout_s=TIMEOUT_S)
        )
        try:
            keys = conn.page_keys(tokens(3 * SMALL.page_size, salt=5))
            _fill(pool, range(4, 7), 3.0)
            h = _stalled(d, lambda: conn.store(keys, [4, 5, 6]))
            assert h.count == 0  # dropped: the engine reuses pages 4..6 for another request
            _fill(pool, range(4, 7), 9.0)
            assert _caught_up(conn, keys) == 0  # nothing stored under these keys
            assert _expired(d) == 1
            _fill(pool, range(4, 7), 3.0)
            assert conn.store(keys, [4, 5, 6]).wait(10.0)  # stored again, now answered
            _fill(pool, range(12, 15), 0.0)
            assert conn.load(keys, [12, 13, 14]).wait(10.0)
            assert _values(pool, range(12, 15)) == {3.0}
        finally:
            conn.close()
