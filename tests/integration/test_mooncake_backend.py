"""The ``mooncake`` L3 backend against a real mooncake_master on loopback (no mocks).

Every test that takes the ``arena`` fixture runs twice: over an arena whose slots have
headroom (as the daemon's host pool gives them: each page moves as one buffer, header
right before the payload) and over one without (header in scratch, two buffers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.config.errors import StorageError
from kvtier.daemon.pool.layout import SLOT_HEADROOM
from kvtier.daemon.storage import objects
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.mooncake import MooncakeBackend
from kvtier.daemon.storage.mooncake import jobs as mooncake_jobs
from kvtier.daemon.storage.objects import HEADER_SIZE, encode_header

from tests.arenas import NS, OTHER_NS, PAGE, SLOTS, key
from tests.servers import MooncakeMaster, free_port, serve_mooncake_master
from tests.xxh3_reference import l3_header

store_module = pytest.importorskip(
    "mooncake.store", reason="mooncake-transfer-engine is not installed"
)

pytestmark = pytest.mark.timeout(90)

LEAD = SLOT_HEADROOM
"""Headroom of a slot in the host pool of a daemon configured with this backend."""


def make_arena(headroom: int = 0) -> tuple[HostArena, mmap.mmap]:
    """An arena of ``SLOTS`` slots of ``headroom + PAGE`` bytes (payload last), and the
    mapping behind it."""
    memory = mmap.mmap(-1, SLOTS * (headroom + PAGE))
    anchor = ctypes.c_char.from_buffer(memory)
    address = ctypes.addressof(anchor)
    del anchor  # a live ctypes export would keep the mmap from closing
    view = memoryview(memory)
    return HostArena(view=view, address=address, size=len(memory), headroom=headroom), memory


@pytest.fixture(params=[LEAD, 0], ids=["headroom", "no-headroom"])
def arena(request: pytest.FixtureRequest) -> Iterator[HostArena]:
    """A fresh arena, with or without slot headroom, released after the test."""
    arena, memory = make_arena(request.param)
    yield arena
    arena.view.release()
    memory.close()


def at(arena: HostArena, slot: int) -> int:
    """Arena offset of the payload of ``slot``."""
    return slot * (arena.headroom + PAGE) + arena.headroom


def offsets(arena: HostArena, slots: range | list[int]) -> list[int]:
    """Arena offsets of ``slots``."""
    return [at(arena, s) for s in slots]


def fill(arena: HostArena, slot: int) -> bytes:
    """Write random bytes into ``slot`` and return them."""
    data = os.urandom(PAGE)
    arena.view[at(arena, slot) : at(arena, slot) + PAGE] = data
    return data


def page(arena: HostArena, slot: int) -> bytes:
    """The bytes of ``slot``."""
    return bytes(arena.view[at(arena, slot) : at(arena, slot) + PAGE])


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    yield from serve_mooncake_master()


async def opened(master: MooncakeMaster, arena: HostArena, **extra: Any) -> MooncakeBackend:
    backend = MooncakeBackend(master.extra_config(retry_interval_s=0.2, **extra))
    await backend.open(arena)
    return backend


@pytest.fixture
async def store(
    mooncake_master: MooncakeMaster, arena: HostArena
) -> AsyncIterator[MooncakeBackend]:
    backend = await opened(mooncake_master, arena)
    yield backend
    await backend.close()


class RawClient:
    """A plain Mooncake client (no kvtier) that writes whatever bytes it is given."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.store = store_module.MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1",
            master.metadata_server,
            16 << 20,
            16 << 20,
            "tcp",
            "",
            master.master_server_address,
        )
        assert rc == 0

    def upsert(self, name: str, value: bytes) -> None:
        assert self.store.upsert(name, value) == 0

    def close(self) -> None:
        self.store.close()


async def test_put_then_get_returns_identical_bytes(
    store: MooncakeBackend, arena: HostArena
) -> None:
    keys = [key(i) for i in range(20)]
    written = [fill(arena, s) for s in range(20)]
    assert await store.put_from(NS, keys, offsets(arena, range(20)), PAGE) == [True] * 20
    assert await store.get_into(NS, keys, offsets(arena, range(32, 52)), PAGE) == [True] * 20
    assert [page(arena, s) for s in range(32, 52)] == written
    assert (store.stats.puts, store.stats.gets) == (20, 20)
    assert store.stats.put_bytes == store.stats.get_bytes == 20 * PAGE
    assert (store.stats.misses, store.stats.corrupt, store.stats.errors) == (0, 0, 0)
    # putting an existing page again keeps it and reports success
    assert await store.put_from(NS, keys[:2], offsets(arena, [0, 1]), PAGE) == [True, True]


async def test_batches_split_into_concurrent_calls(
    mooncake_master: MooncakeMaster, arena: HostArena
) -> None:
    backend = await opened(mooncake_master, arena, sub_batch_keys=3, max_inflight=2)
    try:
        keys = [key(i) for i in range(16)]
        written = [fill(arena, s) for s in range(16)]
        assert await backend.put_from(NS, keys, offsets(arena, range(16)), PAGE) == [True] * 16
        dst = list(range(63, 47, -1))  # reversed slots: results must follow key order
        assert await backend.get_into(NS, keys, offsets(arena, dst), PAGE) == [True] * 16
        assert [page(arena, s) for s in dst] == written
    finally:
        await backend.close()


async def test_exists_is_the_leading_run(store: MooncakeBackend, arena: HostArena) -> None:
    keys = [key(i) for i in range(5)]
    fill(arena, 0)
    assert (
        await store.put_from(NS, [keys[0], keys[1], keys[3]], offsets(arena, [0, 0, 0]), PAGE)
        == [True] * 3
    )
    assert await store.exists(NS, keys) == 2
    assert await store.exists(NS, keys[3:]) == 1
    assert await store.exists(NS, keys[2:]) == 0
    assert await store.exists(NS, []) == 0


async def test_wrong_namespace_or_missing_key_is_a_miss(
    store: MooncakeBackend, arena: HostArena
) -> None:
    fill(arena, 0)
    assert await store.put_from(NS, [key(1)], offsets(arena, [0]), PAGE) == [True]
    assert await store.get_into(OTHER_NS, [key(1)], offsets(arena, [1]), PAGE) == [False]
    assert await store.exists(OTHER_NS, [key(1)]) == 0
    assert await store.get_into(NS, [key(2), key(1)], offsets(arena, [1, 2]), PAGE) == [False, True]
    assert store.stats.misses == 2 and store.stats.corrupt == 0 and store.stats.errors == 0


async def test_corrupt_objects_are_misses_counted_and_removed(
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    keys = [key(i) for i in range(4)]
    pages = [fill(arena, s) for s in range(4)]
    assert await store.put_from(NS, keys, offsets(arena, range(4)), PAGE) == [True] * 4
    names = [store.key_name(NS, k) for k in keys]
    flipped = bytearray(pages[0])
    flipped[1000] ^= 0xFF
    bad_header = bytearray(encode_header(NS, keys[1], pages[1]))
    bad_header[50] ^= 0x01  # inside the page key: the header checksum fails
    raw = RawClient(mooncake_master)
    try:
        raw.upsert(names[0], encode_header(NS, keys[0], pages[0]) + bytes(flipped))
        raw.upsert(names[1], bytes(bad_header) + pages[1])
        raw.upsert(names[2], encode_header(NS, keys[0], pages[0]) + pages[0])  # page 0's object
        raw.upsert(names[3], encode_header(NS, keys[3], pages[3]) + pages[3][:-8])  # too short
    finally:
        raw.close()
    assert await store.get_into(NS, keys, offsets(arena, range(10, 14)), PAGE) == [False] * 4
    # a wrong-size object is a miss either way: Mooncake answers a size mismatch (counted
    # corrupt) or, right after a size-changing upsert, not-found
    assert store.stats.corrupt in (3, 4) and store.stats.misses == 4 and store.stats.errors == 0
    await store.delete(NS, keys[3:])
    # the corrupt objects were removed, so the next put writes good ones
    assert await store.exists(NS, keys) == 0
    assert await store.put_from(NS, keys, offsets(arena, range(4)), PAGE) == [True] * 4
    assert await store.get_into(NS, keys, offsets(arena, range(10, 14)), PAGE) == [True] * 4
    assert [page(arena, s) for s in range(10, 14)] == pages


async def test_two_daemons_share_pages(mooncake_master: MooncakeMaster) -> None:
    """Also: objects written from slots with headroom (one buffer) read into slots without
    (two buffers), and the other way round."""
    arena_a, memory_a = make_arena(LEAD)
    arena_b, memory_b = make_arena(0)
    a = await opened(mooncake_master, arena_a)
    b = await opened(mooncake_master, arena_b)
    try:
        keys = [key(i) for i in range(8)]
        written = [fill(arena_a, s) for s in range(8)]
        assert await a.put_from(NS, keys, offsets(arena_a, range(8)), PAGE) == [True] * 8
        assert await b.exists(NS, keys) == 8
        assert await b.get_into(NS, keys, offsets(arena_b, range(20, 28)), PAGE) == [True] * 8
        assert [page(arena_b, s) for s in range(20, 28)] == written
        # and the other way round
        more = [key(100 + i) for i in range(3)]
        back = [fill(arena_b, s) for s in range(3)]
        assert await b.put_from(NS, more, offsets(arena_b, range(3)), PAGE) == [True] * 3
        assert await a.get_into(NS, more, offsets(arena_a, range(40, 43)), PAGE) == [True] * 3
        assert [page(arena_a, s) for s in range(40, 43)] == back
        assert await b.delete(NS, keys[:2]) == 2
        assert await a.exists(NS, keys) == 0
    finally:
        await a.close()
        await b.close()
        for arena, memory in ((arena_a, memory_a), (arena_b, memory_b)):
            arena.view.release()
            memory.close()


async def test_delete_counts_removed_keys(store: MooncakeBackend, arena: HostArena) -> None:
    fill(arena, 0)
    await store.put_from(NS, [key(1), key(2)], offsets(arena, [0, 0]), PAGE)
    assert await store.delete(NS, [key(1), key(2), key(3)]) == 2
    assert await store.exists(NS, [key(1), key(2)]) == 0
    assert store.stats.errors == 0


async def test_master_killed_then_restarted(
    mooncake_master: MooncakeMaster, arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await opened(mooncake_master, arena)
    try:
        keys = [key(i) for i in range(3)]
        written = fill(arena, 0)
        assert await backend.put_from(NS, keys, offsets(arena, [0, 0, 0]), PAGE) == [True] * 3
        assert await backend.health()
        reached: list[str] = []  # the calls that went to the Mooncake client
        call = backend._call

        async def call_spy(fn: Any, *args: Any) -> Any:
            reached.append(getattr(fn, "__name__", repr(fn)))
            return await call(fn, *args)

        monkeypatch.setattr(backend, "_call", call_spy)
        # The breaker's clock (its injection point for tests) stands still while the master
        # is gone, so a cool-down that starts now does not end however slow the calls are.
        held = [time.monotonic()]
        monkeypatch.setattr(
            backend._breaker, "_clock", lambda: held[0] if held else time.monotonic()
        )
        mooncake_master.kill()
        for _ in range(3):
            assert await backend.exists(NS, keys) == 0
            assert await backend.get_into(NS, keys, offsets(arena, [1, 2, 3]), PAGE) == [False] * 3
            assert await backend.put_from(NS, keys, offsets(arena, [0, 0, 0]), PAGE) == [False] * 3
            assert await backend.delete(NS, keys) == 0
            assert not await backend.health()
        # the first call finds the master gone (unless the client noticed first); every later
        # one is refused by the breaker without going to Mooncake and its RPC timeouts
        assert len(reached) <= 1, reached
        assert backend.stats.errors >= 4
        held.clear()  # the clock runs again: a cool-down ends and lets one call try the master
        # the client reconnects to a master that comes back on the same address
        mooncake_master.restart()
        deadline = time.monotonic() + 30
        while not await backend.health():
            assert time.monotonic() < deadline, "backend did not come back"
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 30
        while await backend.put_from(NS, keys[:1], offsets(arena, [0]), PAGE) != [True]:
            assert time.monotonic() < deadline, "puts did not come back"
            await asyncio.sleep(0.2)
        assert await backend.get_into(NS, keys[:1], offsets(arena, [1]), PAGE) == [True]
        assert page(arena, 1) == written
    finally:
        await backend.close()


async def test_a_cancelled_get_waits_for_its_transfer(
    store: MooncakeBackend, arena: HostArena
) -> None:
    keys = [key(i) for i in range(32)]
    written = [fill(arena, s) for s in range(32)]
    assert await store.put_from(NS, keys, offsets(arena, range(32)), PAGE) == [True] * 32
    cancelled = 0
    for delay in (0.0, 0.0005, 0.002):
        task = asyncio.create_task(store.get_into(NS, keys, offsets(arena, range(32, 64)), PAGE))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task  # a short delay may let the get finish first
        except asyncio.CancelledError:
            cancelled += 1
        # every scratch block came back and the store still answers
        assert await store.get_into(NS, keys[:4], offsets(arena, range(40, 44)), PAGE) == [True] * 4
        assert [page(arena, s) for s in range(40, 44)] == written[:4]
    assert cancelled >= 1  # at least the cancel issued without a pause lands mid-flight
    assert store.stats.errors == 0


async def test_open_against_nothing_is_a_storage_error(
    arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = MooncakeBackend(
        {
            "master_server_address": f"127.0.0.1:{free_port()}",
            "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
            "timeout_s": 0.5,
        }
    )

    def no_client() -> None:
        pytest.fail("a Mooncake client was made for a master that refuses (its setup retries)")

    # refused at once by the backend's own reachability check, before any Mooncake client
    # exists (this one fails the test where one would be made)
    monkeypatch.setattr(store_module, "MooncakeDistributedStore", no_client)
    refused = r"master_server_address = '.*' is unreachable: ConnectionRefusedError"
    with pytest.raises(StorageError, match=refused):
        await backend.open(arena)
    await backend.close()


async def test_object_layout_is_header_then_payload(
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    data = fill(arena, 0)
    assert await store.put_from(NS, [key(7)], offsets(arena, [0]), PAGE) == [True]
    raw = RawClient(mooncake_master)
    try:
        value = raw.store.get(store.key_name(NS, key(7)))
    finally:
        raw.close()
    assert len(value) == HEADER_SIZE + PAGE
    assert value[:HEADER_SIZE] == l3_header(NS, key(7), data) and value[HEADER_SIZE:] == data


async def test_objects_match_without_the_c_header_functions(
    monkeypatch: pytest.MonkeyPatch,
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    """The pure-Python header functions write and verify the same objects as the C ones:
    pages put by one are read by the other, both ways."""
    keys = [key(i) for i in range(4)]
    written = [fill(arena, s) for s in range(4)]
    assert objects.native_headers(), "the C extension is built by `make venv`"
    monkeypatch.setattr(mooncake_jobs, "seal_headers", objects.py_seal_headers)
    assert await store.put_from(NS, keys[:2], offsets(arena, [0, 1]), PAGE) == [True] * 2
    monkeypatch.undo()
    assert await store.put_from(NS, keys[2:], offsets(arena, range(2, 4)), PAGE) == [True] * 2
    monkeypatch.setattr(mooncake_jobs, "check_headers", objects.py_check_headers)
    assert await store.get_into(NS, keys, offsets(arena, range(10, 14)), PAGE) == [True] * 4
    monkeypatch.undo()
    assert await store.get_into(NS, keys, offsets(arena, range(20, 24)), PAGE) == [True] * 4
    assert [page(arena, s) for s in range(10, 14)] == written
    assert [page(arena, s) for s in range(20, 24)] == written
    raw = RawClient(mooncake_master)
    try:
        values = [raw.store.get(store.key_name(NS, k)) for k in keys[:3]]
    finally:
        raw.close()
    assert values == [l3_header(NS, k, d) + d for k, d in zip(keys[:3], written[:3])]
    assert store.stats.corrupt == 0 and store.stats.errors == 0


def _nice_of_threads() -> dict[int, int]:
    """Nice value of each thread of this process, by native thread id (from /proc)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out


async def test_workers_poll_at_a_lower_priority_than_mooncakes_own_threads(
    mooncake_master: MooncakeMaster,
) -> None:
    """The threads that call (and busy-poll) Mooncake run ``worker_nice`` below the daemon;
    the threads Mooncake starts, which move the bytes, keep the daemon's priority, also
    after transfers have run."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    arena, memory = make_arena(LEAD)
    before = set(_nice_of_threads())
    store = await opened(mooncake_master, arena, worker_nice=7)
    try:
        keys = [key(i) for i in range(8)]
        assert await store.put_from(NS, keys, offsets(arena, range(8)), PAGE) == [True] * 8
        assert await store.get_into(NS, keys, offsets(arena, range(8, 16)), PAGE) == [True] * 8
        pool = store._pool
        assert pool is not None
        workers = {t.native_id for t in pool._threads}  # type: ignore[attr-defined]
        nice = _nice_of_threads()
        assert workers and all(nice[w] == min(19, base + 7) for w in workers), (nice, workers)
        python = {t.native_id for t in threading.enumerate()}
        native = set(nice) - before - workers - python
        assert native, "Mooncake started no threads of its own"
        assert all(nice[t] == base for t in native), {t: nice[t] for t in native}
    finally:
        await store.close()
        arena.view.release()
        memory.close()


async def test_with_headroom_a_page_moves_with_its_header_in_front(
    mooncake_master: MooncakeMaster,
) -> None:
    """Slots with headroom: a put writes the header right before the payload, a get lands
    it there; nothing else of the slot's headroom or its neighbours changes. An arena whose
    headroom cannot hold a header keeps the two-buffer path."""
    arena, memory = make_arena(LEAD)
    small, small_memory = make_arena(HEADER_SIZE - 32)  # too little: header in scratch
    backend = await opened(mooncake_master, arena)
    other = await opened(mooncake_master, small)
    try:
        keys = [key(i) for i in range(4)]
        written = [fill(arena, s) for s in range(4)]
        assert await backend.put_from(NS, keys, offsets(arena, range(4)), PAGE) == [True] * 4
        for k, s, data in zip(keys, range(4), written):
            off = at(arena, s)
            assert bytes(arena.view[off - HEADER_SIZE : off]) == l3_header(NS, k, data)
        sentinel = b"\x5a" * (LEAD - HEADER_SIZE)
        for s in range(8, 12):
            arena.view[at(arena, s) - LEAD : at(arena, s) - HEADER_SIZE] = sentinel
        whole = bytes(arena.view)
        assert await backend.get_into(NS, keys, offsets(arena, range(8, 12)), PAGE) == [True] * 4
        assert [page(arena, s) for s in range(8, 12)] == written
        after = bytearray(arena.view)
        for s in range(8, 12):  # what a get may write: each object's header and payload
            after[at(arena, s) - HEADER_SIZE : at(arena, s) + PAGE] = whole[
                at(arena, s) - HEADER_SIZE : at(arena, s) + PAGE
            ]
        assert after == whole
        for s in range(8, 12):
            assert bytes(arena.view[at(arena, s) - LEAD : at(arena, s) - HEADER_SIZE]) == sentinel
        # the same objects through an arena without (enough) headroom
        assert await other.get_into(NS, keys, offsets(small, range(4)), PAGE) == [True] * 4
        assert [page(small, s) for s in range(4)] == written
        assert bytes(small.view[: at(small, 0)]) == bytes(at(small, 0))  # headroom unused
        assert backend.stats.corrupt == other.stats.corrupt == 0
    finally:
        await backend.close()
        await other.close()
        for a, m in ((arena, memory), (small, small_memory)):
            a.view.release()
            m.close()


async def test_each_page_of_a_batch_gets_its_own_result(
    mooncake_master: MooncakeMaster, store: MooncakeBackend, arena: HostArena
) -> None:
    """A batch reports every page on its own: two corrupt objects and two missing keys in
    the middle are misses, the pages around them land intact (with and without headroom)."""
    n = 18
    mid = n // 2
    keys = [key(100 + i) for i in range(n)]
    pages = [fill(arena, s) for s in range(n)]
    absent = {mid - 1, mid}
    stored = [i for i in range(n) if i not in absent]
    flags = await store.put_from(NS, [keys[i] for i in stored], offsets(arena, stored), PAGE)
    assert flags == [True] * len(stored)
    corrupt = (1, n - 2)
    raw = RawClient(mooncake_master)
    try:
        for i in corrupt:
            flipped = bytearray(pages[i])
            flipped[PAGE // 2] ^= 0x10
            raw.upsert(
                store.key_name(NS, keys[i]), encode_header(NS, keys[i], pages[i]) + bytes(flipped)
            )
    finally:
        raw.close()
    dst = list(range(32, 32 + n))
    got = await store.get_into(NS, keys, offsets(arena, dst), PAGE)
    assert got == [i not in absent and i not in corrupt for i in range(n)]
    for i, s in enumerate(dst):
        if got[i]:
            assert page(arena, s) == pages[i]
    assert store.stats.corrupt == len(corrupt)
    assert store.stats.misses == len(corrupt) + len(absent)


async def test_opening_leaves_the_process_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch, mooncake_master: MooncakeMaster, arena: HostArena
) -> None:
    # the transfer engine reads its TCP bind address from the environment during setup;
    # the backend must not leave it (or anything else) behind for the rest of the process
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    before = dict(os.environ)
    backend = MooncakeBackend(mooncake_master.extra_config(retry_interval_s=0.2))
    assert dict(os.environ) == before
    await backend.open(arena)
    try:
        assert dict(os.environ) == before
        written = fill(arena, 0)
        assert await backend.put_from(NS, [key(1)], offsets(arena, [0]), PAGE) == [True]
        assert await backend.get_into(NS, [key(1)], offsets(arena, [5]), PAGE) == [True]
        assert page(arena, 5) == written
    finally:
        await backend.close()
    assert dict(os.environ) == before


async def test_pages_outside_the_arena_are_a_storage_error(
    store: MooncakeBackend, arena: HostArena
) -> None:
    # raw pointers go to Mooncake: checked always, not by an assert that python -O removes
    low = HEADER_SIZE if arena.headroom else 0  # a page's header goes right before it
    past_end = arena.size - PAGE + 1
    with pytest.raises(StorageError, match=f"offset {past_end} of {PAGE} bytes .*{arena.size}"):
        await store.put_from(NS, [key(1)], [past_end], PAGE)
    with pytest.raises(StorageError, match=f"offset {low - 1} .*\\[{low}, "):
        await store.get_into(NS, [key(1)], [low - 1], PAGE)
    with pytest.raises(StorageError, match="2 keys but 1 offsets"):
        await store.put_from(NS, [key(1), key(2)], offsets(arena, [0]), PAGE)
    assert store.stats.errors == 0


async def test_mooncake_cannot_list_its_objects(store: MooncakeBackend, arena: HostArena) -> None:
    fill(arena, 0)
    assert await store.put_from(NS, [key(1)], offsets(arena, [0]), PAGE) == [True]
    assert await store.list_keys() is None
    assert await store.list_keys({NS}) is None
