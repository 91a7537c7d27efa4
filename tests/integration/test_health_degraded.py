"""A daemon whose L3 is configured but failing is ``degraded``: HEALTH says so, naming L3
and the cause; ``kvtier health --strict`` exits 1 while plain ``kvtier health`` prints the
state and exits 0. The guard logs a failing spell once with its real cause, then at most
once a minute with the count of failures in between, and once when L3 is back."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import mmap
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis_asyncio
from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.tier.fault_log import REPEAT_S, FaultLog, describe_fault
from kvtier.daemon.tier.guard import L3Backend

from tests.integration.test_admin_cli import kvtier, one_line
from tests.integration.test_l3_tier import l3_flags, wait_for
from tests.servers import RedisServer, serve_redis

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def closed_port() -> int:
    """A loopback port nobody listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def arena() -> Iterator[HostArena]:
    mm = mmap.mmap(-1, 1 << 20)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor
    view = memoryview(mm)
    yield HostArena(view=view, address=address, size=len(mm))
    view.release()
    mm.close()


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- HEALTH
def test_strict_health_fails_while_l3_cannot_be_reached(daemon_factory):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    rdir = str(d.runtime_dir)
    r = kvtier("health", "--strict", "--runtime-dir", rdir)
    assert r.returncode == 1, r.stdout
    line = one_line(r.stdout)
    assert line.startswith("unhealthy: degraded: L3 backend redis not open: ")
    assert "could not open" in line and "L2 keeps serving" in line
    r = kvtier("health", "--runtime-dir", rdir)
    assert r.returncode == 0, r.stdout
    assert one_line(r.stdout).startswith("degraded: L3 backend redis")


def test_health_is_ok_again_once_l3_answers(redis_server, daemon_factory):
    redis_server.kill()
    d = daemon_factory(*l3_flags("redis", {"url": redis_server.url, "timeout_s": 0.5}))
    rdir = str(d.runtime_dir)
    assert kvtier("health", "--strict", "--runtime-dir", rdir).returncode == 1
    redis_server.restart()
    wait_for(
        lambda: kvtier("health", "--strict", "--runtime-dir", rdir).returncode == 0,
        what="health ok once redis answers",
    )
    assert one_line(kvtier("health", "--strict", "--runtime-dir", rdir).stdout).startswith("ok: ")


def test_health_without_l3_is_ok(daemon):
    r = kvtier("health", "--strict", "--runtime-dir", str(daemon.runtime_dir))
    assert r.returncode == 0 and one_line(r.stdout).startswith("ok: ")


def test_health_names_a_refused_connection_as_such(daemon_factory):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    d = daemon_factory(*l3_flags("redis", {"url": url, "timeout_s": 0.5}))
    r = kvtier("health", "--strict", "--runtime-dir", str(d.runtime_dir))
    assert "connection refused" in r.stdout and "no answer within" not in r.stdout


# ---------------------------------------------------------------------------- causes
async def test_the_cause_is_named_from_the_exception_itself():
    port = closed_port()
    with pytest.raises(OSError) as refused:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert describe_fault(refused.value).startswith("connection refused (")
    client = redis_asyncio.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2)
    try:
        with pytest.raises(redis_asyncio.ConnectionError) as wrapped:  # the OSError inside
            await client.ping()
    finally:
        await client.aclose()
    assert describe_fault(wrapped.value).startswith("connection refused (ConnectionError: ")
    with pytest.raises(TimeoutError) as slow:
        await asyncio.wait_for(asyncio.sleep(1), 0.01)
    assert describe_fault(slow.value).startswith("timed out")
    assert describe_fault(ValueError("odd")) == "ValueError: odd"


# ---------------------------------------------------------------------------- the log
def test_a_failing_spell_is_logged_once_then_once_a_minute_then_recovery(caplog):
    clock = Clock()
    log = logging.getLogger("kvtier.test.faults")
    faults = FaultLog(log, "L3 backend x", clock=clock)
    caplog.set_level(logging.INFO, logger=log.name)
    for _ in range(30):  # 30 failures, 5 s apart: 145 s of failing
        faults.failed("connection refused (ConnectionRefusedError)")
        clock.now += 5.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + int(145 // REPEAT_S), lines
    assert lines[0] == "L3 backend x: connection refused (ConnectionRefusedError)"
    assert lines[1].startswith("L3 backend x still failing for 60 s: connection refused")
    assert "(12 more failures since the last line)" in lines[1]
    assert faults.recovered() and not faults.failing
    assert caplog.records[-1].levelno == logging.INFO
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith("L3 backend x healthy again after 30 failures in 150 s")
    )
    assert not faults.recovered()  # one recovery line per spell
    assert len(caplog.records) == len(lines) + 1


async def test_the_guard_logs_an_unreachable_backend_once_per_minute(
    tmp_path: Path, arena: HostArena, redis_server: RedisServer, caplog
):
    redis_server.kill()
    clock = Clock()
    cfg = DaemonConfig(
        hicache_storage_backend="redis",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "state",
        hicache_storage_backend_extra_config=json.dumps(
            {"url": redis_server.url, "timeout_s": 0.5}
        ),
    )
    l3 = L3Backend(cfg, Counters(), tmp_path, clock=clock)
    caplog.set_level(logging.INFO, logger="kvtier.daemon.l3")
    await l3.open(arena)
    tries = 1
    for _ in range(20):  # open retries, as the health loop makes them, 10 s apart
        clock.now += 10.0
        assert not await l3.check()
        tries += 1
    mine = [r for r in caplog.records if r.name == "kvtier.daemon.l3"]
    assert len(mine) == 1 + int(200 // REPEAT_S), [r.getMessage() for r in mine]
    assert mine[0].getMessage().startswith("L3 backend redis: could not open: ")
    assert "retrying every 1s" in mine[0].getMessage()
    assert l3.problem() is not None and l3.problem().startswith("L3 backend redis not open")
    redis_server.restart()
    clock.now += 10.0
    assert await l3.check()
    back = [r.getMessage() for r in caplog.records if r.name == "kvtier.daemon.l3"][len(mine) :]
    assert back[0].startswith(f"L3 backend redis open after {tries} failures in 210 s")
    assert l3.problem() is None
    await l3.close()
