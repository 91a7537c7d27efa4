"""A stop while an L3 write hangs (Redis frozen): what HEALTH says during the drain, and what
the stop does with the writes it abandons, against a real kvtierd and a real Redis."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvtier.client.connection.admin import AdminClient, AdminError

from tests.engines import SMALL, engine, fill_page, tokens
from tests.servers import RedisServer, serve_redis

pytestmark = pytest.mark.timeout(120)


def wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code of ``proc`` once it exits within ``timeout`` s, else None."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


@contextmanager
def stop_with_a_stuck_l3_write(daemon_factory, redis_server) -> Iterator:
    """A daemon writing through to Redis, 8 pages just stored, Redis frozen (SIGSTOP) so
    their L3 write hangs, then SIGTERM: yields ``(daemon, seconds since SIGTERM)``; the
    daemon's stop drains for up to shutdown_timeout_s (10 s) meanwhile. Redis is thawed
    and the engine closed on exit."""
    d = daemon_factory(
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        json.dumps({"url": redis_server.url}),
        "--storage-timeout-s",
        "10",
    )
    pool, conn = engine(d.runtime_dir)
    redis_server.pause()
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=13))
        for p in range(8):
            fill_page(pool, p, seed=p + 3)
        assert conn.store(keys, list(range(8))).wait()
        time.sleep(0.3)  # the write-through batch is with Redis now
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        yield d, lambda: time.monotonic() - t0
    finally:
        redis_server.resume()
        conn.close()
        pool.close()


def test_health_says_stopping_while_the_stop_drains(daemon_factory, redis_server):
    """docs/metrics.md and docs/protocol.md: HEALTH answers ``stopping`` once a stop has
    begun (and dispatch.SERVED_WHILE_STOPPING keeps HEALTH, STATS and UNREGISTER answered,
    every other request refused SHUTTING_DOWN). While the stop waits up to
    shutdown_timeout_s for an L3 write, a probe (`kvtier health`) asking every half second
    gets a ``stopping`` answer at least once, not only "did not answer"."""
    with stop_with_a_stuck_l3_write(daemon_factory, redis_server) as (d, since):
        seen = []
        while since() < 8.0 and d.proc is not None and d.proc.poll() is None:
            try:
                with AdminClient(d.endpoint, timeout_s=1.0) as admin:
                    seen.append(admin.health().status)
            except AdminError as err:
                seen.append(f"error: {err}")
            if "stopping" in seen:
                break
            time.sleep(0.5)
        rc = wait_exit(d.proc, 30.0)
    assert rc == 0, d.log_tail()
    assert "stopping" in seen, f"HEALTH during the stop's drain: {seen}"


def test_an_l3_write_abandoned_at_stop_does_not_touch_the_unmapped_pool(
    daemon_factory, redis_server
):
    """A stop gives in-flight L3 writes shutdown_timeout_s, then abandons them (README:
    "finish or cancel transfers, exit 0"). What it abandons must be cancelled before the
    pool is unmapped: an operator stopping kvtierd while its L3 server is slow expects a
    clean exit 0 and no error in the journal, not an L3 write batch that outlives the pool
    and fails on it (``ValueError: operation forbidden on released memoryview object``,
    ``unhandled exception during asyncio.run() shutdown``)."""
    with stop_with_a_stuck_l3_write(daemon_factory, redis_server) as (d, _since):
        rc = wait_exit(d.proc, 40.0)
    log = d.log_path.read_text(errors="replace")
    assert rc == 0, d.log_tail()
    bad = [
        line
        for line in log.splitlines()
        if "released memoryview" in line
        or "unhandled exception during asyncio.run() shutdown" in line
        or "an L3 write batch failed" in line
    ]
    assert not bad, "the abandoned L3 write ran on after the pool was unmapped:\n" + "\n".join(bad)
