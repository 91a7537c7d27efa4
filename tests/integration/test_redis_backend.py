"""The ``redis`` L3 backend against a real redis-server on loopback (no mocks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from redis.asyncio.connection import Connection as RedisConnection
from kvtier.config.errors import StorageError
from kvtier.daemon.storage.base import HostArena
from kvtier.daemon.storage.objects import HEADER_SIZE
from kvtier.daemon.storage.redis import RedisBackend

from tests import arenas
from tests.arenas import NS, OTHER_NS, PAGE, SLOTS, fill, key, make_arena, offsets, page  # noqa: F401
from tests.servers import RedisServer, free_port, serve_redis
import contextlib

pytestmark = pytest.mark.timeout(60)
EXPIRY_BOUND_S = 30.0
"""How long a page stored with a 0.3 s TTL may take to be seen gone before a test fails."""
arena = arenas.arena  # the shared fixture, bound here so the tests below can request it by name


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


async def opened(server: RedisServer, arena: HostArena, **extra: Any) -> RedisBackend:
    backend = RedisBackend({"url": server.url, "timeout_s": 1.0, **extra})
    await backend.open(arena)
    return backend


class Tries:
    """What redis-py's TCP connections do in a test: each connection try (None when it
    connected, else its exception) and each failed read of a reply (its exception). The real
    methods run, wrapped to record; the record starts empty at :meth:`clear`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.connects: list[BaseException | None] = []
        self.failed_reads: list[BaseException] = []
        self.read_timeouts: list[float | None] = []  # the socket timeout of each failed read
        connect, read_response = RedisConnection._connect, RedisConnection.read_response

        async def connect_spy(conn: RedisConnection) -> None:
            try:
                await connect(conn)
            except BaseException as err:
                self.connects.append(err)
                raise
            self.connects.append(None)

        async def read_spy(conn: RedisConnection, *args: Any, **kwargs: Any) -> Any:
            try:
                return await read_response(conn, *args, **kwargs)
            except BaseException as err:
                self.failed_reads.append(err)
                self.read_timeouts.append(conn.socket_timeout)
                raise

        monkeypatch.setattr(RedisConnection, "_connect", connect_spy)
        monkeypatch.setattr(RedisConnection, "read_response", read_spy)

    def clear(self) -> None:
        self.connects.clear()
        self.failed_reads.clear()
        self.read_timeouts.clear()

    def refused_at_once(self) -> bool:
        """Whether the connection tries were one and at most the one immediate retry, each
        refused by the OS, and no read waited out ``timeout_s``."""
        return (
            1 <= len(self.connects) <= 2
            and all(isinstance(err, ConnectionRefusedError) for err in self.connects)
            and not any(isinstance(err, redis.TimeoutError) for err in self.failed_reads)
        )


@pytest.fixture
def tries(monkeypatch: pytest.MonkeyPatch) -> Tries:
    return Tries(monkeypatch)


@pytest.fixture
async def store(redis_server: RedisServer, arena: HostArena) -> AsyncIterator[RedisBackend]:
    backend = await opened(redis_server, arena)
    yield backend
    await backend.close()


async def test_put_then_get_returns_identical_bytes(store: RedisBackend, arena: HostArena) -> None:
    # 20 pages = 1.25 MiB: hashed and landed in a worker thread; 2 pages: on the event loop
    for count in (2, 20):
        keys = [key(1000 * count + i) for i in range(count)]
        written = [fill(arena, s) for s in range(count)]
        assert await store.put_from(NS, keys, offsets(range(count)), PAGE) == [True] * count
        dst = list(range(32, 32 + count))
        assert await store.get_into(NS, keys, offsets(dst), PAGE) == [True] * count
        assert [page(arena, s) for s in dst] == written
    assert (store.stats.puts, store.stats.gets) == (22, 22)
    assert store.stats.put_bytes == store.stats.get_bytes == 22 * PAGE
    assert (store.stats.misses, store.stats.corrupt, store.stats.errors) == (0, 0, 0)


async def test_exists_is_the_leading_run(store: RedisBackend, arena: HostArena) -> None:
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


async def test_exists_without_scripting_falls_back_to_pipelined_exists(arena: HostArena) -> None:
    serving = serve_redis("--rename-command", "EVAL", "", "--rename-command", "EVALSHA", "")
    server = next(serving)
    try:
        backend = await opened(server, arena)
        keys = [key(i) for i in range(4)]
        fill(arena, 0)
        await backend.put_from(NS, keys[:3], offsets([0, 0, 0]), PAGE)
        assert await backend.exists(NS, keys) == 3
        assert await backend.exists(NS, keys[1:]) == 2
        assert backend.stats.errors == 0
        await backend.close()
    finally:
        serving.close()


async def test_wrong_namespace_or_missing_key_is_a_miss(
    store: RedisBackend, arena: HostArena
) -> None:
    fill(arena, 0)
    assert await store.put_from(NS, [key(1)], [0], PAGE) == [True]
    assert await store.get_into(OTHER_NS, [key(1)], [PAGE], PAGE) == [False]
    assert await store.exists(OTHER_NS, [key(1)]) == 0
    assert await store.get_into(NS, [key(2), key(1)], offsets([1, 2]), PAGE) == [False, True]
    assert store.stats.misses == 2 and store.stats.corrupt == 0


async def test_corrupt_values_are_misses_and_counted(
    store: RedisBackend, arena: HostArena, redis_server: RedisServer
) -> None:
    keys = [key(i) for i in range(4)]
    for s in range(4):
        fill(arena, s)
    assert await store.put_from(NS, keys, offsets(range(4)), PAGE) == [True] * 4
    names = [store.key_name(NS, k) for k in keys]
    with redis.Redis.from_url(redis_server.url) as plain:
        flipped = bytearray(plain.get(names[0]))
        flipped[HEADER_SIZE + 1000] ^= 0xFF  # a payload byte
        plain.set(names[0], bytes(flipped))
        header_hit = bytearray(plain.get(names[1]))
        header_hit[50] ^= 0x01  # inside the page key field of the header
        plain.set(names[1], bytes(header_hit))
        plain.set(names[2], plain.get(names[2])[:-1])  # truncated
        plain.set(names[3], plain.get(store.key_name(NS, keys[0])))  # another page's object
    dst = list(range(10, 14))
    assert await store.get_into(NS, keys, offsets(dst), PAGE) == [False] * 4
    assert store.stats.corrupt == 4 and store.stats.misses == 4 and store.stats.errors == 0
    # a put overwrites, which repairs the object
    assert await store.put_from(NS, keys[:1], [0], PAGE) == [True]
    assert await store.get_into(NS, keys[:1], [10 * PAGE], PAGE) == [True]
    assert page(arena, 10) == page(arena, 0)


async def test_two_daemons_share_pages(redis_server: RedisServer) -> None:
    arena_a, memory_a = make_arena()
    arena_b, memory_b = make_arena()
    a = await opened(redis_server, arena_a)
    b = await opened(redis_server, arena_b)
    try:
        keys = [key(i) for i in range(6)]
        written = [fill(arena_a, s) for s in range(6)]
        assert await a.put_from(NS, keys, offsets(range(6)), PAGE) == [True] * 6
        assert await b.exists(NS, keys) == 6
        assert await b.get_into(NS, keys, offsets(range(20, 26)), PAGE) == [True] * 6
        assert [page(arena_b, s) for s in range(20, 26)] == written
        assert await b.delete(NS, keys[:2]) == 2
        assert await a.exists(NS, keys) == 0
    finally:
        await a.close()
        await b.close()
        for arena, memory in ((arena_a, memory_a), (arena_b, memory_b)):
            arena.view.release()
            memory.close()


async def test_prefixes_keep_deployments_apart(redis_server: RedisServer, arena: HostArena) -> None:
    blue = await opened(redis_server, arena, prefix="blue")
    green = await opened(redis_server, arena, prefix="green")
    try:
        fill(arena, 0)
        assert await blue.put_from(NS, [key(1)], [0], PAGE) == [True]
        assert await green.exists(NS, [key(1)]) == 0
        assert await blue.exists(NS, [key(1)]) == 1
    finally:
        await blue.close()
        await green.close()


async def test_delete_counts_present_keys(store: RedisBackend, arena: HostArena) -> None:
    fill(arena, 0)
    await store.put_from(NS, [key(1), key(2)], [0, 0], PAGE)
    assert await store.delete(NS, [key(1), key(2), key(3)]) == 2
    assert await store.exists(NS, [key(1)]) == 0
    assert await store.delete(NS, []) == 0


async def test_ttl_is_set_on_store_and_renewed_by_a_read(
    redis_server: RedisServer, arena: HostArena
) -> None:
    """With ``ttl_s`` a stored page carries that expiry on the server (``SET ... PX``), and a
    read sets it back to ``ttl_s`` (``GETEX ... PX``). The expiry is read from the server
    (``PTTL``), and the TTL is long enough that nothing expires during the test, so no check
    depends on how fast the steps ran."""
    backend = await opened(redis_server, arena, ttl_s=60)
    try:
        assert backend.client is not None
        name = backend.key_name(NS, key(1))
        fill(arena, 0)
        assert await backend.put_from(NS, [key(1)], [0], PAGE) == [True]
        assert 0 < await backend.client.pttl(name) <= 60_000
        assert await backend.client.pexpire(name, 3_600_000)  # an hour: the read must undo it
        assert await backend.get_into(NS, [key(1)], [PAGE], PAGE) == [True]
        assert 0 < await backend.client.pttl(name) <= 60_000
        assert page(arena, 1) == page(arena, 0)
    finally:
        await backend.close()


async def test_ttl_expires_pages(redis_server: RedisServer, arena: HostArena) -> None:
    """A page stored with a short ``ttl_s`` is gone once the server expires it. The test
    waits for the expiry (polling ``exists``, failing only after a generous bound), rather
    than sleeping a fixed time and hoping the server got there."""
    backend = await opened(redis_server, arena, ttl_s=0.3)
    try:
        fill(arena, 0)
        assert await backend.put_from(NS, [key(1)], [0], PAGE) == [True]
        deadline = time.monotonic() + EXPIRY_BOUND_S
        while await backend.exists(NS, [key(1)]) != 0:
            assert time.monotonic() < deadline, "the page never expired"
            await asyncio.sleep(0.01)
    finally:
        await backend.close()


async def test_server_killed_then_restarted(
    redis_server: RedisServer, arena: HostArena, tries: Tries
) -> None:
    backend = await opened(redis_server, arena)
    try:
        keys = [key(i) for i in range(3)]
        fill(arena, 0)
        assert await backend.put_from(NS, keys, [0, 0, 0], PAGE) == [True] * 3
        assert await backend.health()
        redis_server.kill()
        calls = [
            (lambda: backend.exists(NS, keys), 0),
            (lambda: backend.get_into(NS, keys, offsets([1, 2, 3]), PAGE), [False] * 3),
            (lambda: backend.put_from(NS, keys, [0, 0, 0], PAGE), [False] * 3),
            (lambda: backend.delete(NS, keys), 0),
            (backend.health, False),
        ]
        for i, (call, answer) in enumerate(calls):
            tries.clear()
            assert await call() == answer, i
            # each call fails on the refused connection, not after a retry loop or a timeout
            assert tries.refused_at_once(), (i, tries.connects, tries.failed_reads)
        assert backend.stats.errors >= 4
        # the server comes back (empty: nothing is persisted); so does the backend
        redis_server.restart()
        assert await backend.health()
        assert await backend.exists(NS, keys) == 0
        written = fill(arena, 5)
        assert await backend.put_from(NS, keys[:1], [5 * PAGE], PAGE) == [True]
        assert await backend.get_into(NS, keys[:1], [6 * PAGE], PAGE) == [True]
        assert page(arena, 6) == written
    finally:
        await backend.close()


async def test_a_frozen_server_times_out_and_recovers(
    redis_server: RedisServer, arena: HostArena, tries: Tries
) -> None:
    backend = await opened(redis_server, arena, timeout_s=0.5)
    try:
        fill(arena, 0)
        assert await backend.put_from(NS, [key(1)], [0], PAGE) == [True]
        redis_server.pause()
        try:
            # each call waits out one read timeout (timeout_s) and gives up: a timeout is
            # not retried (a call that never times out is ended by the test's timeout)
            tries.clear()
            assert await backend.get_into(NS, [key(1)], [PAGE], PAGE) == [False]
            assert [type(err) for err in tries.failed_reads] == [redis.TimeoutError]
            assert tries.read_timeouts == [0.5]  # the read waited timeout_s, not longer
            tries.clear()
            assert await backend.exists(NS, [key(1)]) == 0
            assert [type(err) for err in tries.failed_reads] == [redis.TimeoutError]
            assert tries.read_timeouts == [0.5]
            assert backend.stats.errors >= 2
        finally:
            redis_server.resume()
        assert await backend.get_into(NS, [key(1)], [PAGE], PAGE) == [True]
        assert page(arena, 1) == page(arena, 0)
    finally:
        await backend.close()


async def test_a_cancelled_get_leaves_no_stale_replies(
    store: RedisBackend, arena: HostArena
) -> None:
    keys = [key(i) for i in range(32)]
    for s in range(32):
        fill(arena, s)
    assert await store.put_from(NS, keys, offsets(range(32)), PAGE) == [True] * 32
    for delay in (0.0, 0.0005, 0.002):
        task = asyncio.create_task(store.get_into(NS, keys, offsets(range(32, 64)), PAGE))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # the next requests on the pool read their own replies, not the cancelled ones
        assert await store.exists(NS, keys[:3]) == 3
        assert await store.get_into(NS, keys[5:6], [40 * PAGE], PAGE) == [True]
        assert page(arena, 40) == page(arena, 5)


async def test_open_against_nothing_is_a_storage_error(arena: HostArena, tries: Tries) -> None:
    backend = RedisBackend({"host": "127.0.0.1", "port": free_port(), "timeout_s": 0.5})
    with pytest.raises(StorageError, match=r"did not answer PING: .*(refused|Connect)"):
        await backend.open(arena)
    assert tries.refused_at_once(), (tries.connects, tries.failed_reads)  # not after retries
    await backend.close()


async def test_list_keys_scans_this_prefix(redis_server: RedisServer, arena: HostArena) -> None:
    # a prefix with glob characters must match only itself: "k*" would also match "kv:..."
    mine = await opened(redis_server, arena, prefix="k*[1]")
    other = await opened(redis_server, arena, prefix="kx[1]")
    try:
        fill(arena, 0)
        small = 256  # bytes per page: 1500 pages in one pipeline
        ns_keys = [key(i) for i in range(1500)]  # more than one SCAN step
        assert await mine.put_from(NS, ns_keys, [0] * len(ns_keys), small) == [True] * 1500
        assert await mine.put_from(OTHER_NS, [key(7)], [0], small) == [True]
        assert await other.put_from(NS, [key(8)], [0], small) == [True]
        with redis.Redis.from_url(redis_server.url) as plain:
            plain.set(b"k*[1]:not-a-page", b"x")  # under the prefix, not a page name
        everything = {(NS, k) for k in ns_keys} | {(OTHER_NS, key(7))}
        listed = await mine.list_keys()
        assert listed is not None and len(listed) == len(everything)
        assert set(listed) == everything
        assert set(await mine.list_keys({OTHER_NS}) or ()) == {(OTHER_NS, key(7))}
        assert set(await mine.list_keys({NS, OTHER_NS}) or ()) == everything
        assert await mine.list_keys(set()) == []
        assert await other.list_keys() == [(NS, key(8))]
        assert await mine.delete(NS, ns_keys[:1000]) == 1000
        assert len(await mine.list_keys({NS}) or ()) == 500
        assert mine.stats.errors == 0
    finally:
        await mine.close()
        await other.close()


async def test_list_keys_on_a_fault_is_none_and_counted(
    redis_server: RedisServer, arena: HostArena
) -> None:
    backend = await opened(redis_server, arena, timeout_s=0.5)
    try:
        fill(arena, 0)
        assert await backend.put_from(NS, [key(1)], [0], PAGE) == [True]
        redis_server.stop()
        assert await backend.list_keys() is None
        assert backend.stats.errors == 1
    finally:
        await backend.close()


async def test_pages_outside_the_arena_are_a_storage_error(
    store: RedisBackend, arena: HostArena
) -> None:
    # checked always, not by an assert that python -O removes
    with pytest.raises(StorageError, match=f"offset {arena.size - PAGE + 1} .*{arena.size}"):
        await store.put_from(NS, [key(1)], [arena.size - PAGE + 1], PAGE)
    with pytest.raises(StorageError, match="offset -1"):
        await store.get_into(NS, [key(1)], [-1], PAGE)
    with pytest.raises(StorageError, match="2 keys but 1 offsets"):
        await store.put_from(NS, [key(1), key(2)], [0], PAGE)
    assert store.stats.errors == 0
