"""L3 faults through real kvtierd processes: corrupt and truncated objects read as misses,
a Redis that dies, freezes or is not there at start makes misses (never errors) while L2
keeps serving, a session that goes away mid-prefetch frees its slots, and a stop writes
the queued pages to L3 first."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.connection import Connection
from kvtier.daemon.storage.file import HEADER_STRIDE, payload_slot, table_bytes

from tests.engines import SMALL, client_config, engine
from tests.integration.test_l3_tier import (
    REPO,
    counters,
    fetch_back,
    flush,
    l3_flags,
    load_and_compare,
    runs,
    slow_flags,
    stats,
    store_pages,
    wait_for,
    wait_written,
)
from tests.servers import RedisServer, serve_redis

_SEGMENT = re.compile(r"seg-(\d+)x(\d+)-(\d+)\.kvt")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


def object_places(store: Path) -> dict[bytes, tuple[Path, int]]:
    """Where each stored page's payload lies: key -> (segment file, payload offset)."""
    places = {}
    for seg in store.glob("seg-*.kvt"):
        m = _SEGMENT.fullmatch(seg.name)
        assert m is not None
        slot_bytes, slots = int(m[1]), int(m[2])
        table = seg.read_bytes()[: slots * HEADER_STRIDE]
        for i in range(slots):
            header = table[i * HEADER_STRIDE : i * HEADER_STRIDE + 96]
            if header[:4] == b"KVTP":
                places[bytes(header[40:72])] = (seg, table_bytes(slots) + i * slot_bytes)
    return places


@pytest.mark.timeout(90)
def test_corrupt_and_truncated_objects_are_misses(daemon_factory, short_tmp):
    state = short_tmp / "state"
    flags = l3_flags("file", state_dir=str(state), prefetch_threshold="0")
    first = daemon_factory(*flags, name="a")
    pool, conn = engine(first.runtime_dir)
    try:
        keys_a, expected_a = store_pages(pool, conn, 8, salt=1, seed=1)
        wait_written(first, 8)
        keys_b, expected_b = store_pages(pool, conn, 8, salt=2, seed=2)
        wait_written(first, 16)
        conn.close()
        first.stop()
        places = object_places(state / "l3")
        assert set(keys_a + keys_b) <= set(places)
        seg_a3, at_a3 = places[keys_a[3]]
        with open(seg_a3, "r+b") as fh:  # flip one payload byte of chain A's page 3
            fh.seek(at_a3 + 100)
            byte = fh.read(1)
            fh.seek(at_a3 + 100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        seg_b5, at_b5 = places[keys_b[5]]
        later = [k for k in keys_a + keys_b[:5] if places[k][0] == seg_b5 and places[k][1] > at_b5]
        assert not later, "chain B's page 5 is not after the others in its segment"
        os.truncate(seg_b5, at_b5 + payload_slot(SMALL.page_bytes) // 2)  # cuts B5 and after
        second = daemon_factory(*flags, name="b")
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        assert runs(conn, keys_a) == (0, 8)  # headers verify: found, until read
        assert fetch_back(conn, keys_a) == 3
        assert fetch_back(conn, keys_b) == 5
        load_and_compare(pool, conn, keys_a[:3], expected_a[:3])
        load_and_compare(pool, conn, keys_b[:5], expected_b[:5], first_page=40)
        c, l3 = counters(second), stats(second)["l3"]
        assert l3["corrupt"] >= 2 and l3["healthy"]
        assert c["l3_prefetch_failed_pages"] == (8 - 3) + (8 - 5)
        assert c["l3_prefetch_completed_pages"] == 3 + 5
        assert stats(second)["pool"]["pages_writing"] == 0
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_redis_going_down_makes_misses_and_l2_keeps_serving(redis_server, daemon_factory):
    d = daemon_factory(
        *l3_flags(
            "redis",
            {"url": redis_server.url, "timeout_s": 1.0},
            prefetch_threshold="0",
            storage_timeout_s="0.3",
        )
    )
    pool, conn = engine(d.runtime_dir, num_pages=96)
    try:
        keys_a, _ = store_pages(pool, conn, 4, salt=1, seed=1)
        wait_written(d, 4)
        flush(d, "l2")  # chain A: only in L3
        keys_b, expected_b = store_pages(pool, conn, 4, salt=2, seed=2)
        wait_written(d, 8)
        redis_server.kill()
        assert runs(conn, keys_b) == (4, 0)
        assert runs(conn, keys_a) == (0, 0)  # a miss, not an error
        assert conn.prefetch(keys_a) == 0 and conn.claim(keys_a) == 0
        load_and_compare(pool, conn, keys_b, expected_b)
        keys_c, expected_c = store_pages(pool, conn, 4, salt=3, seed=3)
        load_and_compare(pool, conn, keys_c, expected_c, first_page=50)
        wait_for(lambda: not stats(d)["l3"]["healthy"], what="L3 marked down")
        wait_for(
            lambda: (
                counters(d)["l3_write_failed_pages"] + counters(d)["l3_write_dropped_pages"] >= 4
            ),
            what="chain C's writes given up",
        )
        assert counters(d)["l3_backend_errors"] + stats(d)["l3"]["errors"] > 0
        redis_server.restart()  # empty: chain A is gone for good, new pages go to L3 again
        wait_for(lambda: stats(d)["l3"]["healthy"], what="L3 healthy again")
        keys_d, expected_d = store_pages(pool, conn, 4, salt=4, seed=4)
        wait_for(lambda: counters(d)["l3_write_written_pages"] >= 12, what="chain D in L3")
        flush(d, "l2")
        assert runs(conn, keys_a) == (0, 0)
        assert fetch_back(conn, keys_d) == 4
        load_and_compare(pool, conn, keys_d, expected_d, first_page=60)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_a_frozen_redis_delays_no_lookup_past_the_storage_timeout(redis_server, daemon_factory):
    timeout_s = 0.3
    d = daemon_factory(
        *l3_flags(
            "redis",
            {"url": redis_server.url, "timeout_s": 1.0},
            prefetch_threshold="0",
            storage_timeout_s=str(timeout_s),
        )
    )
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 4)
        wait_written(d, 4)
        longer = keys + conn.page_keys([1] * 2 * SMALL.page_size, parent=keys[-1])
        logged = d.log_path.stat().st_size
        redis_server.pause()
        try:
            assert runs(conn, longer) == (4, 0)  # L2 answers; the frozen L3 counts as a miss
            # the guard's storage_timeout_s cut the L3 part of that lookup short (and marked
            # L3 down); without it the lookup would wait for the Redis client's own timeout_s
            with open(d.log_path, "rb") as log:
                log.seek(logged)
                spell = log.read().decode(errors="replace")
            cut = f"L3 backend redis: exists timed out after {timeout_s:g} s (storage_timeout_s)"
            assert cut in spell, spell
            assert conn.prefetch(longer) == 0
            load_and_compare(pool, conn, keys, expected)
            assert not stats(d)["l3"]["healthy"]
        finally:
            redis_server.resume()
        wait_for(lambda: stats(d)["l3"]["healthy"], what="L3 healthy again")
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_a_backend_down_at_start_is_opened_once_it_answers(redis_server, daemon_factory):
    redis_server.kill()
    d = daemon_factory(
        *l3_flags("redis", {"url": redis_server.url, "timeout_s": 0.5}, prefetch_threshold="0")
    )
    pool, conn = engine(d.runtime_dir)
    try:
        assert not stats(d)["l3"]["healthy"]
        keys, expected = store_pages(pool, conn, 3)  # L2 serves meanwhile
        load_and_compare(pool, conn, keys, expected)
        redis_server.restart()
        wait_for(lambda: stats(d)["l3"]["healthy"], what="the backend to open")
        keys, _ = store_pages(pool, conn, 3, salt=7)
        wait_written(d, 3)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_a_session_gone_mid_prefetch_frees_its_slots(daemon_factory, short_tmp):
    d = daemon_factory(*slow_flags(short_tmp, 0.5), env={"PYTHONPATH": REPO})
    pool, conn = engine(d.runtime_dir, num_pages=128)
    try:
        keys, _ = store_pages(pool, conn, 64)
        wait_written(d, 64)
        flush(d, "l2")
        assert conn.prefetch(keys) == 64
    finally:
        conn.close()  # the session ends with its prefetch in flight
        pool.close()
    wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, what="the fill to end")
    c, pool_stats = counters(d), stats(d)["pool"]
    assert pool_stats["pages_writing"] == pool_stats["pages_ready"] == 0
    assert c["l3_prefetch_cancelled_pages"] == 64
    assert c["l3_prefetch_started_pages"] == 64


@pytest.mark.timeout(90)
def test_a_stop_writes_the_queued_pages_to_l3_first(daemon_factory, short_tmp):
    state = short_tmp / "slow-l3"
    first = daemon_factory(
        *slow_flags(short_tmp, 0.0, put_delay_s=0.3), name="a", env={"PYTHONPATH": REPO}
    )
    pool, conn = engine(first.runtime_dir, num_pages=256)
    try:
        keys, expected = store_pages(pool, conn, 200)  # 4 write batches, 2 at a time
        conn.close()
        assert first.stop() == 0
        assert state.is_dir()
        second = daemon_factory(*slow_flags(short_tmp, 0.0), name="b", env={"PYTHONPATH": REPO})
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        assert runs(conn, keys) == (0, 200)
        assert fetch_back(conn, keys) == 200
        load_and_compare(pool, conn, keys[:50], expected[:50], first_page=200)
    finally:
        conn.close()
        pool.close()
