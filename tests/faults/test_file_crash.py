"""Crash tests of the ``file`` L3 backend: kill -9 mid-write, torn overwrites.

A child process writes pages in a loop (evicting and overwriting slots in place) and logs
each key once its put returned. The test kills it with SIGKILL at random moments, then
opens the store and reads every logged key and every indexed key: each one verifies with
the exact bytes derived from its key, or is a miss. Never wrong bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend, table_bytes
from kvtier.daemon.storage.objects import encode_header

pytestmark = pytest.mark.timeout(120)

NS = hashlib.sha256(b"crash namespace").digest()
PAGE = 64 * 1024  # one page per payload slot
SEGMENT = table_bytes(8) + 8 * PAGE
EXTRA = {"capacity": 4 * SEGMENT, "segment_bytes": SEGMENT}  # 4 segments of 8 slots: evictions

CHILD = r"""
import asyncio, hashlib, mmap, os, sys, time
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.file import FileBackend

store_dir, log_path, round_ = sys.argv[1], sys.argv[2], int(sys.argv[3])
ns, page, extra = bytes.fromhex(sys.argv[4]), int(sys.argv[5]), eval(sys.argv[6])

def key(r, i):
    return hashlib.sha256(f"{r}-{i}".encode()).digest()

async def main():
    mm = mmap.mmap(-1, 4 * page)
    backend = FileBackend({"path": store_dir, **extra})
    await backend.open(HostArena(memoryview(mm), 0, len(mm)))
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    deadline = time.monotonic() + 30  # bounded even if nobody kills us
    i = 0
    while time.monotonic() < deadline:
        # mostly new chains; every third batch re-puts an older chain (touch + rewrite)
        r, start = (round_, i) if i % 3 or round_ == 0 else (round_ - 1, i % 24)
        keys = [key(r, start + j) for j in range(4)]
        for j, k in enumerate(keys):
            mm[j * page:(j + 1) * page] = hashlib.shake_256(k).digest(page)
        done = await backend.put_from(ns, keys, [j * page for j in range(4)], page)
        os.write(log, b"".join(k.hex().encode() + b"\n" for k, ok in zip(keys, done) if ok))
        i += 4

asyncio.run(main())
"""


def expected(key: bytes, length: int) -> bytes:
    return hashlib.shake_256(key).digest(length)


def patch(segment: Path, pos: int, data: bytes) -> None:
    with open(segment, "r+b") as f:
        f.seek(pos)
        f.write(data)


def logged_keys(log: Path) -> set[bytes]:
    if not log.exists():
        return set()
    lines = log.read_bytes().split(b"\n")
    return {bytes.fromhex(line.decode()) for line in lines if len(line) == 64}


async def verify_store(path: Path, claimed: set[bytes]) -> tuple[int, int]:
    """Read every claimed and every indexed key; return (hits, misses). Fails on wrong bytes."""
    mm = mmap.mmap(-1, PAGE)
    view = memoryview(mm)
    backend = FileBackend({"path": str(path), **EXTRA})
    try:
        await backend.open(HostArena(view, 0, len(mm)))
        indexed = {key: length for ns, key, length in backend.entries() if ns == NS}
        assert all(length == PAGE for length in indexed.values())
        hits = 0
        for key in sorted(claimed | indexed.keys()):
            view[:PAGE] = bytes(PAGE)
            if (await backend.get_into(NS, [key], [0], PAGE))[0]:
                assert bytes(view[:PAGE]) == expected(key, PAGE), f"wrong bytes for {key.hex()}"
                hits += 1
        return hits, len(claimed | indexed.keys()) - hits
    finally:
        await backend.close()
        view.release()
        mm.close()


def run_child(path: Path, log: Path, round_: int) -> subprocess.Popen[bytes]:
    args = [str(path), str(log), str(round_), NS.hex(), str(PAGE), repr(EXTRA)]
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stderr=subprocess.PIPE)


async def test_kill_9_mid_writes_never_yields_wrong_bytes(tmp_path: Path) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    store, log = tmp_path / "l3", tmp_path / "claimed.log"
    total_hits = 0
    for round_ in range(5):
        before = len(logged_keys(log))
        child = run_child(store, log, round_)
        try:
            deadline = time.monotonic() + 20
            while len(logged_keys(log)) < before + 8:  # let it get into its stride
                assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
                assert time.monotonic() < deadline, f"child wrote nothing (seed {seed})"
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.0, 0.25))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            if child.stderr:
                child.stderr.close()
        assert child.returncode == -signal.SIGKILL, f"child exited by itself (seed {seed})"
        hits, _ = await verify_store(store, logged_keys(log))
        assert hits >= 1, f"nothing survived round {round_} (seed {seed})"
        total_hits += hits
    assert total_hits >= 5


async def test_torn_objects_are_misses_after_restart(tmp_path: Path) -> None:
    """What a power loss can leave (the page cache writes pages back in any order).

    Slot 0: a new header over half of its new payload. Slot 1: an old header over a
    payload that was half overwritten by the next object.
    """
    store = tmp_path / "l3"
    mm = mmap.mmap(-1, 2 * PAGE)
    view = memoryview(mm)
    keys = [hashlib.sha256(name).digest() for name in (b"a", b"b", b"new")]
    backend = FileBackend({"path": str(store), **EXTRA})
    await backend.open(HostArena(view, 0, len(mm)))
    view[:PAGE], view[PAGE:] = expected(keys[0], PAGE), expected(keys[1], PAGE)
    assert await backend.put_from(NS, keys[:2], [0, PAGE], PAGE) == [True, True]
    await backend.close()

    (segment,) = store.glob("seg-*.kvt")
    new = expected(keys[2], PAGE)
    base = table_bytes(8)
    patch(segment, 0, encode_header(NS, keys[2], new))  # slot 0's header
    patch(segment, base, new[: PAGE // 2])  # slot 0's payload
    patch(segment, base + PAGE, new[: PAGE // 2])  # slot 1's payload

    backend = FileBackend({"path": str(store), **EXTRA})
    await backend.open(HostArena(view, 0, len(mm)))
    assert {key for _, key, _ in backend.entries()} == {keys[2], keys[1]}  # headers verify
    assert await backend.get_into(NS, [keys[2], keys[1]], [0, PAGE], PAGE) == [False, False]
    assert await backend.get_into(NS, [keys[0]], [0], PAGE) == [False]
    assert (backend.stats.corrupt, backend.entries()) == (2, [])
    view[:PAGE] = new
    assert await backend.put_from(NS, [keys[2]], [0], PAGE) == [True]  # slots usable again
    assert await backend.get_into(NS, [keys[2]], [PAGE], PAGE) == [True]
    assert bytes(view[PAGE:]) == new
    await backend.close()
    view.release()
    mm.close()
