"""A daemon that dies costs an engine milliseconds, not ``request_timeout_s``.

Engines call kvtier from their scheduler and I/O threads (SGLang counts a slow backend
against every rank). When kvtierd's process is gone, a call must become a miss at once:
before sending (the pid is checked) and while waiting for a reply (checked every few
milliseconds). The configured timeouts are an hour: a call that waited for one would run
past each test's time limit (``pytest.mark.timeout``, far above what a miss takes and far
below any timeout), which fails it; no elapsed time is asserted.
"""

from __future__ import annotations

import threading

import pytest

from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool

from tests.engines import SMALL, client_config, tokens

LONG_S = 3600.0  # request_timeout_s and the rank-group wait: far past the test time limit


@pytest.mark.timeout(30)
def test_a_call_to_a_dead_daemon_is_a_miss_at_once(daemon_factory):
    d = daemon_factory()
    with SharedKVPool(SMALL, 8) as pool:
        conn = Connection(
            pool, model_id="m", config=client_config(d.runtime_dir, request_timeout_s=LONG_S)
        )
        try:
            keys = conn.page_keys(tokens(2 * SMALL.page_size))
            assert conn.store(keys, [0, 1]).wait(10.0)
            assert conn.lookup(keys).l2 == 2
            d.kill()
            assert conn.lookup(keys).l2 == 0
            assert conn.claim(keys) == 0
            assert conn.load(keys, [2, 3]).count == 0
        finally:
            conn.close()


@pytest.mark.timeout(30)
def test_a_call_waiting_when_the_daemon_dies_returns_at_once(daemon_factory):
    """Rank 0 of a TP group of 2 waits in the daemon for rank 1 (which never asks) when the
    daemon is killed: its LOOKUP must end then, not at the group's or the request's timeout."""
    d = daemon_factory("--tp-group-timeout-s", str(LONG_S))
    with SharedKVPool(SMALL, 8) as pool:
        conn = Connection(
            pool,
            model_id="m",
            tp_size=2,
            config=client_config(d.runtime_dir, request_timeout_s=LONG_S),
        )
        try:
            keys = conn.page_keys(tokens(2 * SMALL.page_size))
            killer = threading.Timer(0.5, d.kill)
            killer.start()
            assert conn.lookup(keys).l2 == 0
            killer.join()
        finally:
            conn.close()
