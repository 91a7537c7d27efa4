"""The ``mooncake`` L3 backend against a real mooncake_master on loopback (no mocks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kvtier.config.errors import StorageError
from kvtier.daemon.storage import mooncake_backend
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.mooncake_backend import MooncakeBackend
from kvtier.daemon.storage.objects import HEADER_SIZE, encode_header

from tests.arenas import NS, OTHER_NS, PAGE, SLOTS, arena, fill, key, make_arena, offsets, page  # noqa: F401
from tests.servers import MooncakeMaster, free_port, serve_mooncake_master

store_module = pytest.importorskip(
    "mooncake.store", reason="mooncake-transfer-engine is not installed"
)

pytestmark = pytest.mark.timeout(90)

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
    assert await store.put_from(NS, keys, offsets(range(20)), PAGE) == [True] * 20
    assert await store.get_into(NS, keys, offsets(range(32, 52)), PAGE) == [True] * 20
    assert [page(arena, s) for s in range(32, 52)] == written
    assert (store.stats.puts, store.stats.gets) == (20, 20)
    assert store.stats.put_bytes == store.stats.get_bytes == 20 * PAGE
    assert (store.stats.misses, store.stats.corrupt, store.stats.errors) == (0, 0, 0)
    # putting an existing page again keeps it and reports success
    assert await store.put_from(NS, keys[:2], offsets([0, 1]), PAGE) == [True, True]


async def test_batches_split_into_concurrent_calls(
    mooncake_master: MooncakeMaster, arena: HostArena
) -> None:
    backend = await opened(mooncake_master, arena, sub_batch_keys=3, max_inflight=2)
    try:
        keys = [key(i) for i in range(16)]
        written = [fill(arena, s) for s in range(16)]
        assert await backend.put_from(NS, keys, offsets(range(16)), PAGE) == [True] * 16
        dst = list(range(63, 47, -1))  # reversed slots: results must follow key order
        assert await backend.get_into(NS, keys, offsets(dst), PAGE) == [True] * 16
        assert [page(arena, s) for s in dst] == written
    finally:
        await backend.close()


async def test_exists_is_the_leading_run(store: MooncakeBackend, arena: HostArena) -> None:
    keys = [key(i) for i in range(5)]
    fill(arena, 0)
    assert (
        await store.put_from(NS, [keys[0], keys[1], keys[3]], offsets([0, 0, 0]), PAGE)
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
    assert await store.put_from(NS, [key(1)], [0], PAGE) == [True]
    assert await store.get_into(OTHER_NS, [key(1)], [PAGE], PAGE) == [False]
    assert await store.exists(OTHER_NS, [key(1)]) == 0
    assert await store.get_into(NS, [key(2), key(1)], offsets([1, 2]), PAGE) == [False, True]
    assert store.stats.misses == 2 and store.stats.corrupt == 0 and store.stats.errors == 0


async def test_corrupt_objects_are_misses_counted_and_removed(
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    keys = [key(i) for i in range(4)]
    pages = [fill(arena, s) for s in range(4)]
    assert await store.put_from(NS, keys, offsets(range(4)), PAGE) == [True] * 4
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
    assert await store.get_into(NS, keys, offsets(range(10, 14)), PAGE) == [False] * 4
    # a wrong-size object is a miss either way: Mooncake answers a size mismatch (counted
    # corrupt) or, right after a size-changing upsert, not-found
    assert store.stats.corrupt in (3, 4) and store.stats.misses == 4 and store.stats.errors == 0
    await store.delete(NS, keys[3:])
    # the corrupt objects were removed, so the next put writes good ones
    assert await store.exists(NS, keys) == 0
    assert await store.put_from(NS, keys, offsets(range(4)), PAGE) == [True] * 4
    assert await store.get_into(NS, keys, offsets(range(10, 14)), PAGE) == [True] * 4
    assert [page(arena, s) for s in range(10, 14)] == pages


async def test_two_daemons_share_pages(mooncake_master: MooncakeMaster) -> None:
    arena_a, memory_a = make_arena()
    arena_b, memory_b = make_arena()
    a = await opened(mooncake_master, arena_a)
    b = await opened(mooncake_master, arena_b)
    try:
        keys = [key(i) for i in range(8)]
        written = [fill(arena_a, s) for s in range(8)]
        assert await a.put_from(NS, keys, offsets(range(8)), PAGE) == [True] * 8
        assert await b.exists(NS, keys) == 8
        assert await b.get_into(NS, keys, offsets(range(20, 28)), PAGE) == [True] * 8
        assert [page(arena_b, s) for s in range(20, 28)] == written
        # and the other way round
        more = [key(100 + i) for i in range(3)]
        back = [fill(arena_b, s) for s in range(3)]
        assert await b.put_from(NS, more, offsets(range(3)), PAGE) == [True] * 3
        assert await a.get_into(NS, more, offsets(range(40, 43)), PAGE) == [True] * 3
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
    await store.put_from(NS, [key(1), key(2)], [0, 0], PAGE)
    assert await store.delete(NS, [key(1), key(2), key(3)]) == 2
    assert await store.exists(NS, [key(1), key(2)]) == 0
    assert store.stats.errors == 0


async def test_master_killed_then_restarted(
    mooncake_master: MooncakeMaster, arena: HostArena
) -> None:
    backend = await opened(mooncake_master, arena)
    try:
        keys = [key(i) for i in range(3)]
        written = fill(arena, 0)
        assert await backend.put_from(NS, keys, [0, 0, 0], PAGE) == [True] * 3
        assert await backend.health()
        mooncake_master.kill()
        for _ in range(3):  # the first call finds the master gone, the rest fail fast
            start = time.monotonic()
            assert await backend.exists(NS, keys) == 0
            assert await backend.get_into(NS, keys, offsets([1, 2, 3]), PAGE) == [False] * 3
            assert await backend.put_from(NS, keys, [0, 0, 0], PAGE) == [False] * 3
            assert await backend.delete(NS, keys) == 0
            assert not await backend.health()
            assert time.monotonic() - start < 5
        assert backend.stats.errors >= 4
        # the client reconnects to a master that comes back on the same address
        mooncake_master.restart()
        deadline = time.monotonic() + 30
        while not await backend.health():
            assert time.monotonic() < deadline, "backend did not come back"
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 30
        while await backend.put_from(NS, keys[:1], [0], PAGE) != [True]:
            assert time.monotonic() < deadline, "puts did not come back"
            await asyncio.sleep(0.2)
        assert await backend.get_into(NS, keys[:1], [PAGE], PAGE) == [True]
        assert page(arena, 1) == written
    finally:
        await backend.close()


async def test_a_cancelled_get_waits_for_its_transfer(
    store: MooncakeBackend, arena: HostArena
) -> None:
    keys = [key(i) for i in range(32)]
    written = [fill(arena, s) for s in range(32)]
    assert await store.put_from(NS, keys, offsets(range(32)), PAGE) == [True] * 32
    cancelled = 0
    for delay in (0.0, 0.0005, 0.002):
        task = asyncio.create_task(store.get_into(NS, keys, offsets(range(32, 64)), PAGE))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task  # a short delay may let the get finish first
        except asyncio.CancelledError:
            cancelled += 1
        # every scratch block came back and the store still answers
        assert await store.get_into(NS, keys[:4], offsets(range(40, 44)), PAGE) == [True] * 4
        assert [page(arena, s) for s in range(40, 44)] == written[:4]
    assert cancelled >= 1  # at least the cancel issued without a pause lands mid-flight
    assert store.stats.errors == 0


async def test_open_against_nothing_is_a_storage_error(arena: HostArena) -> None:
    backend = MooncakeBackend(
        {
            "master_server_address": f"127.0.0.1:{free_port()}",
            "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
            "timeout_s": 0.5,
        }
    )
    start = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):
        await backend.open(arena)
    assert time.monotonic() - start < 5
    await backend.close()


async def test_object_layout_is_header_then_payload(
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    data = fill(arena, 0)
    assert await store.put_from(NS, [key(7)], [0], PAGE) == [True]
    raw = RawClient(mooncake_master)
    try:
        value = raw.store.get(store.key_name(NS, key(7)))
    finally:
        raw.close()
    assert len(value) == HEADER_SIZE + PAGE
    assert value[:HEADER_SIZE] == encode_header(NS, key(7), data) and value[HEADER_SIZE:] == data


async def test_objects_match_without_the_ctypes_hash(
    monkeypatch: pytest.MonkeyPatch,
    mooncake_master: MooncakeMaster,
    store: MooncakeBackend,
    arena: HostArena,
) -> None:
    """The python-xxhash and encode_header fallbacks write and verify the same objects."""
    keys = [key(i) for i in range(4)]
    written = [fill(arena, s) for s in range(4)]
    monkeypatch.setattr(mooncake_backend, "_XXH3", None)
    monkeypatch.setattr(mooncake_backend, "_FAST_HEADER", False)
    assert await store.put_from(NS, keys[:1], [0], PAGE) == [True]
    monkeypatch.setattr(mooncake_backend, "_FAST_HEADER", True)
    assert await store.put_from(NS, keys[1:2], offsets([1]), PAGE) == [True]
    assert await store.get_into(NS, keys[:2], offsets(range(10, 12)), PAGE) == [True] * 2
    monkeypatch.undo()
    assert await store.put_from(NS, keys[2:], offsets(range(2, 4)), PAGE) == [True] * 2
    assert await store.get_into(NS, keys, offsets(range(20, 24)), PAGE) == [True] * 4
    assert [page(arena, s) for s in range(20, 24)] == written
    raw = RawClient(mooncake_master)
    try:
        values = [raw.store.get(store.key_name(NS, k)) for k in keys[:3]]
    finally:
        raw.close()
    assert values == [encode_header(NS, k, d) + d for k, d in zip(keys[:3], written[:3])]
    assert store.stats.corrupt == 0 and store.stats.errors == 0
