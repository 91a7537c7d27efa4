"""Deadlines and timers of kvtierd while kvtierd itself is stopped (SIGSTOP) and continued.

A kvtierd process can be paused (a debugger, a cgroup freeze, a CRIU checkpoint, a VM or
pod pause) while requests of its engines wait unread in its sockets and its own calls to
L3 are in flight. Leases get back the time kvtierd did not run (docs/protocol.md, Failure
semantics; tests/integration/test_paused_processes.py), and so does every other deadline:
nothing the engines asked for in time is ended, refused or counted as timed out because
kvtierd itself did not run.

Everything here is real: kvtierd processes (``daemon_factory``), real client connections,
a real redis-server and the file store for L3.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.channel import DaemonChannel
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import KvtierError
from kvtier.daemon.service.handover import HANDOVER_TTL_S
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, fill_page, tokens
from tests.servers import RedisServer, serve_redis

BIG = P.Geometry(
    num_layers=8, page_size=64, kv_heads=4, head_dim=64, dtype="float32"
)  # 1 MiB pages: a prefetch of a hundred of them reads from L3 for a while


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def _stats(d) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    with AdminClient(d.endpoint, timeout_s=20.0) as admin:
        return admin.stats()


def _sync(d) -> None:  # type: ignore[no-untyped-def]
    with AdminClient(d.endpoint, timeout_s=30.0) as admin:
        rep = admin.sync(30.0)
    assert rep.left == 0 and rep.failed == 0, rep


def _l3_flags(backend: str, extra: dict[str, Any], **more: str) -> list[str]:
    flags = [
        "--hicache-storage-backend",
        backend,
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
    ]
    for name, value in more.items():
        flags += [f"--{name.replace('_', '-')}", value]
    return flags


def _in_thread(fn) -> tuple[threading.Thread, dict[str, Any]]:  # type: ignore[no-untyped-def]
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # reported by the test
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ------------------------------------------------------------------ memory handover


@pytest.mark.timeout(150)
def test_register_waiting_while_kvtierd_is_stopped_takes_its_handover(daemon_factory, monkeypatch):
    """An engine hands its memory over and sends REGISTER at once; kvtierd is stopped
    right then, for longer than a handover waits for its REGISTER (10 s,
    docs/protocol.md). The REGISTER came in time (it waits unread in kvtierd's socket), and
    the engine waits for the reply (``request_timeout_s`` 40 s): once kvtierd continues,
    the engine registers. A handover never expires for the time kvtierd itself did not run,
    and ``Connection(...)`` never fails with a refusal (BAD_MEMORY) the engine did not cause."""
    d = daemon_factory("--lease-s", "60")
    real = DaemonChannel.hand_over
    timers: list[threading.Timer] = []

    def hand_over_then_stop(self, *args, **kw):  # type: ignore[no-untyped-def]
        fd = real(self, *args, **kw)  # the handover is accepted: now kvtierd stops
        os.kill(d.pid, signal.SIGSTOP)
        t = threading.Timer(HANDOVER_TTL_S + 1.5, os.kill, (d.pid, signal.SIGCONT))
        timers.append(t)
        t.start()
        return fd

    monkeypatch.setattr(DaemonChannel, "hand_over", hand_over_then_stop)
    outcomes = []
    try:
        for _ in range(3):  # which of the expiry and the REGISTER kvtierd sees first is a race
            pool = SharedKVPool(SMALL, 8)
            try:
                conn = Connection(
                    pool,
                    model_id="stopped-at-register",
                    config=client_config(d.runtime_dir, request_timeout_s=40.0),
                )
            except KvtierError as err:
                outcomes.append(f"{type(err).__name__}: {err}")
                break
            else:
                outcomes.append("registered")
                conn.close()
            finally:
                for t in timers:
                    t.join(30)
                pool.close()
    finally:
        for t in timers:
            t.cancel()
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
    assert all(o == "registered" for o in outcomes), outcomes


# ------------------------------------------------------------------ tensor-parallel rounds


@pytest.mark.timeout(120)
def test_tp_round_is_not_timed_out_for_the_time_kvtierd_was_stopped(daemon_factory):
    """The two ranks of a TP engine send their LOOKUPs 0.2 s apart, well within
    ``tp_group_timeout_s`` (1 s); kvtierd is stopped between the two for 3 s, so the second
    waits unread in its socket. Once kvtierd continues, both ranks get the pages they both
    hold (the round's minimum), and no round is counted as timed out
    (``tp_round_timeouts``): a round waits ``tp_group_timeout_s`` of kvtierd's own time for
    a rank, never the time kvtierd did not run."""
    d = daemon_factory("--lease-s", "60", "--tp-group-timeout-s", "1")
    n = 4
    pools = [SharedKVPool(SMALL, 16) for _ in range(2)]
    conns: list[Connection] = []
    try:
        for rank in range(2):
            conns.append(
                Connection(
                    pools[rank],
                    model_id="tp-stopped",
                    config=client_config(d.runtime_dir, request_timeout_s=20.0),
                    tp_rank=rank,
                    tp_size=2,
                )
            )
        keys = [c.page_keys(tokens(n * SMALL.page_size, salt=21)) for c in conns]
        for rank in range(2):
            for p in range(n):
                fill_page(pools[rank], p, 10 * rank + p)
            assert conns[rank].store(keys[rank], list(range(n))).wait()
        results = []
        for _ in range(3):
            t0, out0 = _in_thread(lambda: conns[0].lookup(keys[0]).l2)
            time.sleep(0.2)  # rank 0's LOOKUP waits in the round for rank 1
            os.kill(d.pid, signal.SIGSTOP)
            try:
                t1, out1 = _in_thread(lambda: conns[1].lookup(keys[1]).l2)
                time.sleep(3.0)
            finally:
                os.kill(d.pid, signal.SIGCONT)
            t0.join(30)
            t1.join(30)
            timeouts = int(_stats(d)["counters"]["tp_round_timeouts"])
            results.append((out0.get("value"), out1.get("value"), timeouts))
            if results[-1] != (n, n, 0):
                break
        assert results[-1] == (n, n, 0), results
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        for c in conns:
            c.close()
        for p in pools:
            p.close()


# ------------------------------------------------------------------ L3 calls in flight


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("storage_timeout_s", "redis_timeout_s"), [("1", 5.0), ("5", 1.0)], ids=["daemon", "redis"]
)
def test_l3_existence_check_in_flight_is_not_timed_out_by_a_stopped_kvtierd(
    redis_server, daemon_factory, storage_timeout_s, redis_timeout_s
):
    """A LOOKUP's L3 existence check is in flight (Redis busy for 0.3 s, well within
    both the daemon's ``storage_timeout_s`` and the Redis client's own ``timeout_s``, the
    shorter of them 1 s) when kvtierd is stopped for 3 s. Redis answers while kvtierd is
    stopped; once kvtierd continues, the LOOKUP reports the pages L3 holds, no backend
    error is counted (``l3_backend_errors``) and L3 stays healthy: neither timeout bounds
    the time kvtierd itself did not run."""
    flags = _l3_flags(
        "redis",
        {"url": redis_server.url, "timeout_s": redis_timeout_s},
        storage_timeout_s=storage_timeout_s,
        prefetch_threshold="0",
        lease_s="60",
    )
    writer = daemon_factory(*flags, name="writer")
    n = 8
    pool, conn = engine(writer.runtime_dir, model="l3-stopped")
    try:
        keys = conn.page_keys(tokens(n * SMALL.page_size, salt=31))
        for p in range(n):
            fill_page(pool, p, p + 1)
        assert conn.store(keys, list(range(n))).wait()
        _sync(writer)
    finally:
        conn.close()
        pool.close()
    d = daemon_factory(*flags, name="reader")
    pool, conn = engine(d.runtime_dir, model="l3-stopped", request_timeout_s=20.0)
    try:
        assert conn.lookup(keys).l3 == n  # L2 empty here, L3 holds the chain
        redis_server.pause()
        try:
            t, out = _in_thread(lambda: conn.lookup(keys))
            time.sleep(0.3)  # kvtierd's EXISTS waits for Redis
            os.kill(d.pid, signal.SIGSTOP)
        finally:
            redis_server.resume()  # Redis answers; the reply waits in kvtierd's socket
        try:
            time.sleep(3.0)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        t.join(30)
        s = _stats(d)
        got = out.get("value")
        assert (
            got is not None and got.l3 == n,
            int(s["counters"]["l3_backend_errors"]),
            s["l3"]["healthy"],
        ) == (True, 0, True), (got, s["counters"]["l3_backend_errors"], s["l3"], d.log_tail(5))
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        redis_server.resume()
        conn.close()
        pool.close()


# ------------------------------------------------------------------ prefetch and CLAIM


@pytest.mark.timeout(240)
def test_claim_waits_for_its_prefetch_after_kvtierd_was_stopped(daemon_factory, short_tmp):
    """An engine starts a prefetch of a chain L3 holds and claims it at once with
    ``wait_complete`` (bounded by ``prefetch_timeout_max`` = 1 s from the prefetch's
    start); kvtierd is stopped right after the PREFETCH's reply, for 2.5 s, while its reads
    are under way. Once it continues, the CLAIM (waiting in its socket) waits for the
    reads kvtierd had left and reports the whole chain, as it does without the pause: the
    prefetch's deadline counts kvtierd's own time, never the time it did not run."""
    n, chains = 128, 3
    flags = _l3_flags(
        "file",
        {"path": str(short_tmp / "l3")},
        prefetch_threshold="0",
        prefetch_timeout_max="1",
        prefetch_concurrency="1",
        hicache_size="512MiB",
        lease_s="60",
    )
    writer = daemon_factory(*flags, name="writer")
    pool, conn = engine(writer.runtime_dir, BIG, num_pages=n, model="claim-stopped")
    all_keys = []
    try:
        for c in range(chains):
            keys = conn.page_keys(tokens(n * BIG.page_size, salt=40 + c))
            for p in range(0, n, 16):
                fill_page(pool, p, 100 * c + p + 1)
            assert conn.store(keys, list(range(n))).wait(60.0)
            all_keys.append(keys)
        _sync(writer)
    finally:
        conn.close()
        pool.close()
    writer.stop()
    d = daemon_factory(*flags, name="reader")  # L2 empty: the chains are in L3 only
    pool, conn = engine(
        d.runtime_dir, BIG, num_pages=4, model="claim-stopped", request_timeout_s=20.0
    )
    results = []
    try:
        for c, keys in enumerate(all_keys):
            assert conn.lookup(keys).l3 == n
            started = conn.prefetch(keys, request_id=f"r{c}")
            os.kill(d.pid, signal.SIGSTOP)
            try:
                t, out = _in_thread(
                    lambda keys=keys, c=c: conn.claim(
                        keys, policy="wait_complete", request_id=f"r{c}", timeout=20.0
                    )
                )
                time.sleep(2.5)
            finally:
                os.kill(d.pid, signal.SIGCONT)
            t.join(30)
            results.append((started, out.get("value")))
            if results[-1] != (n, n):
                break
        assert results[-1] == (n, n), results
    finally:
        with contextlib.suppress(OSError):
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()
