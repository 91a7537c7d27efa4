"""L2 survives a kvtierd restart: the pool file and its index outlive the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engine_child import BIG, CHAIN_PAGES, chain_tokens, seed_of
from tests.engines import SMALL, engine, fill_page, page_bytes, tokens

REPO = Path(__file__).resolve().parents[2]


def stored_pages(d, n=8, **cfg):
    pool, conn = engine(d.runtime_dir, **{"request_timeout_s": 5.0, **cfg})
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=3))
    for p in range(n):
        fill_page(pool, p, seed=500 + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return pool, conn, keys, expected


def adopt_info(d) -> dict:
    with AdminClient(d.endpoint) as admin:
        return dict(admin.stats()["adopt"])


def check_loads(pool, conn, keys, expected, first_page=32):
    dst = list(range(first_page, first_page + len(keys)))
    h = conn.load(keys, dst)
    assert h.count == len(keys) and h.wait()
    assert [page_bytes(pool, p) for p in dst] == expected


@pytest.mark.parametrize("flags", [(), ("--verify-on-adopt",)], ids=["trusted", "verified"])
def test_sigkill_then_restart_serves_the_pages_from_l2(daemon_factory, flags):
    d = daemon_factory(*flags)
    pool, conn, keys, expected = stored_pages(d)
    try:
        epoch = conn.epoch
        d.kill()
        d2 = daemon_factory(*flags)
        # the engine's connection notices the new epoch and registers again by itself
        assert conn.lookup(keys).l2 == len(keys)
        assert conn.epoch != epoch
        info = adopt_info(d2)
        assert info["adopted"] and info["pages_adopted"] == len(keys), info
        check_loads(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


def test_a_handle_from_before_a_restart_leaves_the_new_sessions_slots_alone(daemon_factory):
    """A handle of the old registration ends after the connection registered again: the
    slot number it held now belongs to a transfer of the new session, which keeps it."""
    d = daemon_factory()
    pool, conn, keys, expected = stored_pages(d)
    try:
        old = conn.load(keys, list(range(16, 24)))  # never waited before the restart
        assert old.count == len(keys) and not old.done
        d.kill()
        daemon_factory()
        # registers again, in this call or already from the heartbeat thread: a fresh slot
        # table, whose first free slot is the old handle's (kept from a transfer that took
        # another number from the old table before it registered again)
        loads = [(24, conn.load(keys, list(range(24, 32))))]
        if loads[0][1].slot != old.slot:
            loads.append((32, conn.load(keys, list(range(32, 40)))))
        new = loads[-1][1]
        assert all(h.count == len(keys) for _, h in loads)
        assert new.slot == old.slot  # the new session's transfer has the old one's number
        assert not old.wait()  # its registration is over: a miss
        other = conn.load(keys, list(range(40, 48)))
        assert other.count == len(keys)
        assert other.slot != new.slot, "an old handle gave away a slot a transfer still uses"
        loads.append((40, other))
        assert all(h.wait() for _, h in loads)
        for start, _ in loads:
            assert [page_bytes(pool, p) for p in range(start, start + len(keys))] == expected
    finally:
        conn.close()
        pool.close()


def test_sigterm_then_restart_serves_the_pages_from_l2(daemon_factory):
    d = daemon_factory()
    pool, conn, keys, expected = stored_pages(d)
    try:
        assert d.stop() == 0
        d2 = daemon_factory()
        assert conn.lookup(keys).l2 == len(keys)
        assert adopt_info(d2)["pages_adopted"] == len(keys)
        check_loads(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


def test_a_pool_from_another_config_is_discarded(daemon_factory):
    d = daemon_factory()
    pool, conn, keys, _ = stored_pages(d)
    try:
        d.kill()
        d2 = daemon_factory("--hicache-size", "32MiB")
        info = adopt_info(d2)
        assert not info["adopted"] and info["pages_adopted"] == 0
        assert "capacity" in info["reason"] or "size" in info["reason"], info
        assert conn.lookup(keys).l2 == 0
        assert info["reason"] in d2.log_tail()
    finally:
        conn.close()
        pool.close()


def test_cold_start_discards_on_purpose(daemon_factory):
    d = daemon_factory()
    pool, conn, keys, _ = stored_pages(d)
    try:
        d.kill()
        d2 = daemon_factory("--cold-start")
        info = adopt_info(d2)
        assert not info["adopted"] and "cold" in info["reason"], info
        assert conn.lookup(keys).l2 == 0
    finally:
        conn.close()
        pool.close()


@pytest.mark.parametrize("flags", [(), ("--verify-on-adopt",)], ids=["trusted", "verified"])
def test_sigkill_in_the_middle_of_stores_never_adopts_a_bad_page(daemon_factory, flags):
    d = daemon_factory("--hicache-size", "64MiB", "--extent-size", "16MiB", *flags)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.engine_child", "store", str(d.runtime_dir), "6"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert child.stdout is not None
        lines = []
        while not any(x.startswith("storing 2") for x in lines):
            line = child.stdout.readline()
            assert line, f"engine exited early: {lines}"
            lines.append(line.strip())
        d.kill()  # the daemon dies while chain 2 (at least) is being copied
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        completed = {int(x.split()[1]) for x in lines if x.startswith("stored ")}
        d2 = daemon_factory("--hicache-size", "64MiB", "--extent-size", "16MiB", *flags)
        assert adopt_info(d2)["adopted"]
        pool, conn = engine(d2.runtime_dir, BIG, num_pages=CHAIN_PAGES + 1, model="fault")
        try:
            scratch = CHAIN_PAGES
            for chain in range(6):
                keys = conn.page_keys(chain_tokens(chain))
                n = conn.lookup(keys).l2
                if chain in completed:
                    assert n == CHAIN_PAGES, f"chain {chain} was stored before the kill"
                if n == 0:
                    continue
                h = conn.load(keys, list(range(n)))
                assert h.count == n and h.wait()
                for p in range(n):
                    got = page_bytes(pool, p)
                    fill_page(pool, scratch, seed_of(chain, p))
                    assert got == page_bytes(pool, scratch), f"chain {chain} page {p} is wrong"
        finally:
            conn.close()
            pool.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        # the engine died while no daemon knew it: nobody else will remove its KV segment
        for leftover in Path("/dev/shm").glob(f"kvtier-engine-{child.pid}-*"):
            leftover.unlink(missing_ok=True)


def test_a_transfer_sent_as_the_session_expired_keeps_its_slot(daemon_factory):
    """The same daemon forgets an expired session (its lease ran out while the engine
    sent nothing): the next LOAD registers again, into a fresh slot table, and goes out
    in the slot it took from the old one; that slot stays its own in the new table."""
    d = daemon_factory("--lease-s", "1")
    pool, conn, keys, expected = stored_pages(d, heartbeat_interval_s=60.0)  # no renewals
    try:
        old = conn.load(keys, list(range(8, 16)))  # slot 0, never waited
        epoch = conn.epoch
        deadline = time.monotonic() + 30
        while stats_sessions(d):  # the lease runs out
            assert time.monotonic() < deadline, "the session did not expire"
            time.sleep(0.1)
        first = conn.load(keys, list(range(16, 24)))  # registers again, then sent in slot 1
        assert conn.epoch == epoch and first.count == len(keys)
        second = conn.load(keys, list(range(24, 32)))
        third = conn.load(keys, list(range(32, 40)))
        slots = [first.slot, second.slot, third.slot]
        assert len(set(slots)) == 3, f"two transfers in one slot: {slots}"
        assert first.wait() and second.wait() and third.wait()
        for start in (16, 24, 32):
            assert [page_bytes(pool, p) for p in range(start, start + len(keys))] == expected
        assert not old.wait()  # its session is gone
    finally:
        conn.close()
        pool.close()


def stats_sessions(d) -> int:
    with AdminClient(d.endpoint) as admin:
        return len(admin.stats()["sessions"])
