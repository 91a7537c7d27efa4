"""The ``mooncake`` L3 backend through real kvtierd processes and a real mooncake_master:
a master that stalls or restarts empty while kvtierd runs, and options it cannot take."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engines import SMALL, engine
from tests.integration.test_l3_tier import (
    fetch_back,
    flush,
    l3_flags,
    load_and_compare,
    runs,
    stats,
    store_pages,
    wait_for,
    wait_written,
)
from tests.servers import MooncakeMaster, serve_mooncake_master

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")

ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
WRITE_BACK = ("--hicache-write-policy", "write_back")


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    yield from serve_mooncake_master()


def _master_signal(master: MooncakeMaster, sig: signal.Signals) -> None:
    proc = master._process.proc
    assert proc is not None and proc.poll() is None
    proc.send_signal(sig)


def _timed_lookup(conn, keys: list[bytes]) -> tuple[float, object]:
    t0 = time.monotonic()
    try:
        answer: object = runs(conn, keys)
    except Exception as err:  # a client-side timeout: the answer never came in time
        answer = err
    return time.monotonic() - t0, answer


STALL_TIMEOUT_S = 0.3
"""``storage_timeout_s`` of the stalled-master tests."""


def _stall_daemon(mooncake_master, daemon_factory):
    """A kvtierd on ``mooncake_master`` that gives up on L3 after :data:`STALL_TIMEOUT_S`."""
    return daemon_factory(
        *l3_flags(
            "mooncake",
            mooncake_master.extra_config(retry_interval_s=0.5),
            prefetch_threshold="0",
            storage_timeout_s=str(STALL_TIMEOUT_S),
        ),
        env=ENV,
    )


@pytest.mark.timeout(90)
def test_a_stalled_master_delays_no_lookup_past_the_storage_timeout(
    mooncake_master, daemon_factory
):
    """A mooncake_master that stops answering (SIGSTOP) costs a LOOKUP at most about
    ``storage_timeout_s``: the L2 run is answered and the L3 part counts as a miss."""
    timeout_s = STALL_TIMEOUT_S
    d = _stall_daemon(mooncake_master, daemon_factory)
    pool, conn = engine(d.runtime_dir, request_timeout_s=45.0)
    stalled = False
    try:
        keys, _ = store_pages(pool, conn, 4)
        wait_written(d, 4)
        longer = keys + conn.page_keys([1] * 2 * SMALL.page_size, parent=keys[-1])
        _master_signal(mooncake_master, signal.SIGSTOP)
        stalled = True
        took, answer = _timed_lookup(conn, longer)
        assert answer == (4, 0) and took < 2.0, (
            f"LOOKUP answered {answer!r} after {took:.1f} s with the master stalled "
            f"(storage_timeout_s = {timeout_s})"
        )
    finally:
        if stalled:
            _master_signal(mooncake_master, signal.SIGCONT)
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_a_stalled_master_leaves_other_engines_lookups_fast(mooncake_master, daemon_factory):
    """While one engine's LOOKUP waits on a stalled mooncake_master, another engine's LOOKUP
    (of another model) is answered within about ``storage_timeout_s``."""
    timeout_s = STALL_TIMEOUT_S
    d = _stall_daemon(mooncake_master, daemon_factory)
    pool, conn = engine(d.runtime_dir, request_timeout_s=45.0)
    pool_b, conn_b = engine(d.runtime_dir, model="other", request_timeout_s=45.0)
    stalled = False
    waiter: threading.Thread | None = None
    first: list[object] = []
    try:
        keys, _ = store_pages(pool, conn, 4)
        keys_b, _ = store_pages(pool_b, conn_b, 4, salt=9, seed=9)
        wait_written(d, 8)
        longer = keys + conn.page_keys([1] * 2 * SMALL.page_size, parent=keys[-1])
        longer_b = keys_b + conn_b.page_keys([2] * 2 * SMALL.page_size, parent=keys_b[-1])
        _master_signal(mooncake_master, signal.SIGSTOP)
        stalled = True
        waiter = threading.Thread(target=lambda: first.append(_timed_lookup(conn, longer)))
        waiter.start()
        time.sleep(0.1)  # engine A's LOOKUP is at the store
        took_b, answer_b = _timed_lookup(conn_b, longer_b)
        assert answer_b == (4, 0) and took_b < 2.0, (
            f"engine B's LOOKUP answered {answer_b!r} after {took_b:.1f} s while engine A's "
            f"waited on the stalled master (storage_timeout_s = {timeout_s})"
        )
    finally:
        if stalled:
            _master_signal(mooncake_master, signal.SIGCONT)
        if waiter is not None:
            waiter.join(60)
        for c in (conn, conn_b):
            c.close()
        for p in (pool, pool_b):
            p.close()


@pytest.mark.timeout(90)
def test_sync_after_the_master_restarts_empty_writes_the_l2_pages_again(
    mooncake_master, daemon_factory
):
    """A mooncake_master that restarts keeps nothing: the daemon takes none of its L2 pages
    as in L3 any more (as it does when a Redis server restarts), so the next SYNC writes them
    all again and, once L2 is flushed, they come back from L3 byte for byte."""
    d = daemon_factory(
        *WRITE_BACK,
        *l3_flags(
            "mooncake",
            mooncake_master.extra_config(retry_interval_s=0.2),
            prefetch_threshold="0",
        ),
        env=ENV,
    )
    pool, conn = engine(d.runtime_dir, num_pages=96)
    try:
        keys, expected = store_pages(pool, conn, 6)
        with AdminClient(d.endpoint, timeout_s=20.0) as admin:
            rep = admin.sync(30.0)
            assert (rep.pages, rep.written, rep.failed, rep.left) == (6, 6, 0, 0)
            mooncake_master.restart()  # on the same ports, empty
            # writes reach the new master: a fresh chain is written by a SYNC
            probe_salt = [100]

            def new_chain_synced() -> bool:
                probe_salt[0] += 1
                store_pages(pool, conn, 2, salt=probe_salt[0], seed=probe_salt[0])
                r = admin.sync(10.0)
                return r.written >= 2 and r.failed == 0 and r.left == 0

            wait_for(new_chain_synced, timeout=45.0, what="writes to reach the new master")
            assert stats(d)["l3"]["healthy"]
            again = admin.sync(30.0)
        assert runs(conn, keys) == (6, 0)  # in L2; L2 covers the chain
        flush(d, "l2")
        back = fetch_back(conn, keys)
        assert back == 6, (
            f"after the master restart and a SYNC, {back} of 6 pages came back from L3 "
            f"(that SYNC wrote {again.written} pages of {again.pages})"
        )
        load_and_compare(pool, conn, keys, expected, first_page=40)
    finally:
        conn.close()
        pool.close()


def _kvtierd_start(rdir, extra: dict[str, object]) -> tuple[int | None, str]:
    """Run kvtierd with the mooncake backend and ``extra``; (exit status, output), or
    (None, output so far) when it is still running after 20 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("NOTIFY_SOCKET", None)
    argv = [
        sys.executable,
        "-m",
        "kvtier.daemon",
        "--runtime-dir",
        str(rdir),
        "--state-dir",
        str(rdir / "state"),
        "--hicache-size",
        "64MiB",
        "--extent-size",
        "4MiB",
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
    ]
    try:
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as err:
        parts = (err.stdout, err.stderr)
        out = "".join(
            p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in parts
        )
        return None, out
    return r.returncode, r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_a_global_segment_size_mooncake_cannot_take_stops_the_start_naming_it(
    mooncake_master, short_tmp
):
    """A ``global_segment_size`` larger than Mooncake can take (its setup takes a 64-bit
    size) ends the start with exit status 2 and a message naming ``global_segment_size``."""
    rc, out = _kvtierd_start(
        short_tmp / "rt", mooncake_master.extra_config(global_segment_size="100000000TiB")
    )
    tail = out[-1500:]
    assert rc == 2, f"kvtierd exit status {rc} (-11: SIGSEGV):\n{tail}"
    assert "global_segment_size" in out and "Traceback" not in out, tail


@pytest.mark.timeout(60)
def test_a_master_server_address_without_a_port_stops_the_start_naming_it(
    mooncake_master, short_tmp
):
    """``master_server_address`` is ``host:port``: one without a port ends the start at once
    with exit status 2 and a message naming ``master_server_address``."""
    t0 = time.monotonic()
    rc, out = _kvtierd_start(
        short_tmp / "rt", mooncake_master.extra_config(master_server_address="127.0.0.1")
    )
    took = time.monotonic() - t0
    tail = out[-1500:]
    assert rc == 2, f"kvtierd exit status {rc} after {took:.1f} s (None: still starting):\n{tail}"
    assert "master_server_address" in out and "Traceback" not in out, tail
