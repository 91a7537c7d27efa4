"""Crashes and damage around the ``file`` L3 store, through real kvtierd processes.

What operators rely on: L3 survives a kvtierd killed in the middle of its writes, a store
left damaged (segments cut short, zeroed or garbage tails, flipped bits) and a store shared
by mistake between two daemons. After a restart no page is ever served with wrong bytes
(a LOAD after a prefetch from L3 is byte-exact, or a miss), undamaged pages are still found,
the store never takes the daemon down, and pages stored under ``write_through`` reach L3.

Not repeated here (see test_file_store_edges.py, test_l3_integrity.py, test_l3_tier.py and
tests/unit/test_file_backend.py): a clean SIGKILL after the writes settled, one flipped
payload/header byte, a truncated segment, a full disk, another user's store directory.
"""

from __future__ import annotations

import os
import random
import resource
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.client.connection.connection import Connection
from kvtier.daemon.storage.file import HEADER_STRIDE, table_bytes
from kvtier.daemon.storage.file.segments import parse_segment_name

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


def segments(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir() if parse_segment_name(p.name) is not None)


def poll(pred, timeout: float) -> bool:
    """Whether ``pred`` became true within ``timeout`` seconds (bounded polling)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


def in_l3(d) -> int:
    c = counters(d)
    return c["l3_write_written_pages"] + c["l3_write_skipped_pages"]


# ------------------------------------------------------------------ write-through + SIGKILL
@pytest.mark.timeout(90)
def test_pages_queued_for_l3_when_kvtierd_is_killed_reach_l3_after_the_restart(
    daemon_factory, short_tmp
):
    """Under ``write_through`` every stored page is written to L3. kvtierd is SIGKILLed
    while its write queue still holds the pages of a STORE (the L3 writes are slow); the
    restarted kvtierd adopts those pages in L2. It writes them to L3 (asking the
    store first, so nothing is written twice), so that once L2 drops them they still come
    back from L3 byte for byte."""
    # the same store and pool for both daemons; the first one's writes take 60 s each
    slow = slow_flags(short_tmp, 0.0, put_delay_s=60.0)
    first = daemon_factory(*slow, name="a", env={"PYTHONPATH": REPO})
    pool, conn = engine(first.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 8)
        wait_for(lambda: counters(first)["l3_write_queued_pages"] == 8, what="8 pages queued")
        assert in_l3(first) == 0  # still being written when the process dies
        conn.close()
        first.kill()
        second = daemon_factory(
            *slow_flags(short_tmp, 0.0, put_delay_s=0.0), name="a", env={"PYTHONPATH": REPO}
        )
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        assert runs(conn, keys) == (8, 0)  # adopted in L2
        assert stats(second)["l3"]["healthy"]
        written = poll(lambda: in_l3(second) >= 8 or stats(second)["l3"]["puts"] >= 8, 10.0)
        c = counters(second)
        assert written, (
            "the pages the killed daemon had queued for L3 were never written by the new "
            f"daemon: queued {c['l3_write_queued_pages']}, written "
            f"{c['l3_write_written_pages']}, L3 puts {stats(second)['l3']['puts']}"
        )
        flush(second, "l2")
        assert runs(conn, keys) == (0, 8)
        assert fetch_back(conn, keys) == 8
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ two daemons, one store
@pytest.mark.timeout(90)
def test_pages_stored_while_another_daemon_held_the_store_reach_it_once_it_is_free(
    daemon_factory, short_tmp
):
    """Two kvtierd (different runtime dirs) pointed at one ``file`` store: the second
    serves L2 only and retries the store (docs/architecture.md). Pages stored on it
    meanwhile under ``write_through`` must reach L3 once the first daemon lets the store
    go and the second opens it; observed: the second daemon opens the store and never
    writes them, so they exist in L2 only."""
    extra = {"path": str(short_tmp / "shared-l3")}
    flags = l3_flags("file", extra, prefetch_threshold="0")
    first = daemon_factory(*flags, name="a")
    second = daemon_factory(*flags, name="b")
    pool, conn = engine(second.runtime_dir)
    try:
        assert stats(first)["l3"]["healthy"] and not stats(second)["l3"]["healthy"]
        keys, expected = store_pages(pool, conn, 8)
        first.stop()
        wait_for(lambda: stats(second)["l3"]["healthy"], what="the second daemon opens L3")
        written = poll(lambda: stats(second)["l3"]["puts"] >= 8, 10.0)
        c = counters(second)
        assert written, (
            "pages stored while the store was held by another daemon never reached it: "
            f"queued {c['l3_write_queued_pages']}, written {c['l3_write_written_pages']}"
        )
        flush(second, "l2")
        assert fetch_back(conn, keys) == 8
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ a huge number of segments
@pytest.mark.timeout(120)
def test_a_store_of_many_segments_leaves_the_daemon_descriptors_to_answer(
    daemon_factory, short_tmp
):
    """The ``file`` store keeps each segment file open, one descriptor each: a store whose
    ``capacity`` / ``segment_bytes`` makes many segments (here one page per segment, under
    a ``LimitNOFILE=256`` as a unit file may set) must not use up the daemon's descriptors.
    Once L3 has grown as far as it can, kvtierd
    still answers HEALTH and STATS and a new engine still connects (L3 may refuse pages,
    counted in its errors)."""
    seg = table_bytes(1) + SMALL.page_bytes
    extra = {"path": str(short_tmp / "l3"), "capacity": 4096 * seg, "segment_bytes": seg}
    d = daemon_factory(*l3_flags("file", extra, prefetch_threshold="0"))
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (256, 256))
    pool, conn = engine(d.runtime_dir, num_pages=320)
    try:
        store_pages(pool, conn, 320)
        # the writer works through the queue; wait until the segment count stops growing
        seen, deadline = -1, time.monotonic() + 30.0
        while time.monotonic() < deadline and d.proc is not None and d.proc.poll() is None:
            now = len(segments(short_tmp / "l3"))
            if now == seen:
                break
            seen = now
            time.sleep(1.0)
        assert d.proc is not None
        died = d.proc.poll()
        assert died is None, (
            f"kvtierd exited with {died} once its L3 store held "
            f"{len(segments(short_tmp / 'l3'))} segments:\n{d.log_tail(5)}"
        )
        try:
            with AdminClient(d.endpoint, timeout_s=5.0) as admin:
                health = admin.health()
                l3 = admin.stats()["l3"]
        except AdminError as err:
            pytest.fail(
                f"kvtierd stopped answering once its L3 store held "
                f"{len(segments(short_tmp / 'l3'))} segments (exit status {d.proc.poll()}): "
                f"{err}\n{d.log_tail(5)}"
            )
        assert health.status in ("ok",) or health.status.startswith("degraded"), health
        assert l3["puts"] > 0
        pool_b, conn_b = engine(d.runtime_dir, model="another")
        conn_b.close()
        pool_b.close()
    finally:
        conn.close()
        pool.close()


# ------------------------------------------------------------------ damage after a crash
def slot_of(store: Path, key: bytes) -> tuple[Path, int, int]:
    """``(segment, header offset, payload offset)`` of the slot whose header names ``key``."""
    for seg in segments(store):
        slot, slots, _ = parse_segment_name(seg.name)  # type: ignore[misc]
        with open(seg, "rb") as f:
            table = f.read(slots * HEADER_STRIDE)
        for i in range(slots):
            if table[i * HEADER_STRIDE + 40 : i * HEADER_STRIDE + 72] == key:
                return seg, i * HEADER_STRIDE, table_bytes(slots) + i * slot
    raise AssertionError("no slot holds the key")


def poke(path: Path, pos: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(data)


@pytest.mark.timeout(120)
def test_a_store_killed_mid_write_then_damaged_serves_exact_bytes_or_misses(
    daemon_factory, short_tmp
):
    """kvtierd SIGKILLed while it writes a chain to L3, then the store damaged as a
    power loss leaves it (a flipped payload bit, a zeroed payload tail, garbage in a
    header, a segment cut in the middle of a payload, a segment deleted). A new kvtierd
    over the store serves every page of an L3 run byte for byte or not at all, finds the
    undamaged pages before and after the damage, and stays healthy."""
    store = short_tmp / "l3"
    seg_bytes = table_bytes(8) + 8 * SMALL.page_bytes  # 8 pages a segment
    extra = {"path": str(store), "segment_bytes": seg_bytes}
    flags = l3_flags("file", extra, prefetch_threshold="0")
    first = daemon_factory(*flags, name="a")
    pool, conn = engine(first.runtime_dir, num_pages=160)
    try:
        keys, expected = store_pages(pool, conn, 48)
        wait_written(first, 48)
        # a second chain, killed while it is being written
        more, more_expected = store_pages(pool, conn, 96, salt=9, seed=5)
        conn.close()
        first.kill()
        rng = random.Random(1)
        seg, _, data = slot_of(store, keys[6])
        poke(seg, data + 777, bytes([rng.randrange(256) ^ 0xFF]))  # one payload byte
        seg, _, data = slot_of(store, keys[14])
        poke(seg, data + SMALL.page_bytes - 4096, bytes(4096))  # a zeroed payload tail
        seg, head, _ = slot_of(store, keys[22])
        poke(seg, head + 8, rng.randbytes(64))  # garbage over the header's ns and key
        seg, _, data = slot_of(store, keys[30])
        os.truncate(seg, data + 1000)  # cut in the middle of the payload
        seg, _, _ = slot_of(store, keys[41])
        seg.unlink()  # a segment lost altogether
        second = daemon_factory(*flags, name="b")
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        assert stats(second)["l3"]["healthy"]
        # each undamaged stretch of the chain: its L3 run ends at the next damage at the
        # latest, and what it brings back is exact
        for a, b in ((0, 6), (7, 14), (15, 22), (23, 30)):
            l3 = runs(conn, keys[a:])[1]
            assert l3 >= b - a, (a, l3)
            got = fetch_back(conn, keys[a:])
            assert got == b - a, (a, got)
            load_and_compare(pool, conn, keys[a:b], expected[a:b], first_page=100)
            flush(second, "l2")
        # the chain killed mid-write: whatever L3 offers comes back exact
        l3 = runs(conn, more)[1]
        got = fetch_back(conn, more)
        assert got <= l3
        if got:
            load_and_compare(pool, conn, more[:got], more_expected[:got], first_page=0)
        l3s = stats(second)["l3"]
        assert l3s["healthy"] and l3s["corrupt"] >= 3, l3s
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_a_damaged_object_found_in_the_file_store_is_logged(daemon_factory, short_tmp):
    """A page found damaged on disk (its payload no longer matches its checksum: a torn
    write after a power loss, a failing disk) is dropped from the store. Kvtierd
    logs it (which store, how many objects), so an operator learns the disk holds damaged
    data from the daemon's log and not only from a counter."""
    store = short_tmp / "l3"
    flags = l3_flags("file", {"path": str(store)}, prefetch_threshold="0")
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 4)
        wait_written(d, 4)
        seg, _, data = slot_of(store, keys[2])
        poke(seg, data + 100, b"\x00\xff\x00\xff")
        before = d.log_path.read_text(errors="replace")
        flush(d, "l2")
        assert fetch_back(conn, keys) == 2  # page 2 is damaged: the run stops there
        load_and_compare(pool, conn, keys[:2], expected[:2])
        assert stats(d)["l3"]["corrupt"] == 1
        time.sleep(0.5)
        new = d.log_path.read_text(errors="replace")[len(before) :]
        words = ("corrupt", "damaged", "checksum", "did not verify")
        lines = [ln for ln in new.splitlines() if any(w in ln.lower() for w in words)]
        assert lines, f"a damaged L3 object was dropped without a log line:\n{new[-2000:]}"
    finally:
        conn.close()
        pool.close()
