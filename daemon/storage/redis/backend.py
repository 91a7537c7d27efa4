"""The ``redis`` backend: pipelined batches on pooled connections (see the package docstring)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import redis.asyncio as redis_asyncio
from kvtier.config.errors import ConfigError, StorageError
from kvtier.daemon.pauses import WATCH
from kvtier.daemon.storage.base import BackendState as _State
from kvtier.daemon.storage.base import HostArena, StorageBackend, check_pages, run_to_completion
from kvtier.daemon.storage.breaker import Breaker
from kvtier.daemon.storage.keys import ObjectNames
from kvtier.daemon.storage.objects import HEADER_SIZE, MAGIC, seal_headers
from kvtier.daemon.storage.options import validate_options
from kvtier.daemon.storage.redis.drops import DropWatch
from kvtier.daemon.storage.options import redact_url as redact
from kvtier.daemon.storage.redis.options import RedisOptions
from kvtier.daemon.storage.redis.resp import bulk, command, land
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as _ConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, ReadOnlyError, RedisError
from redis.exceptions import ResponseError as _ResponseError
from redis.exceptions import TimeoutError as _RedisTimeout

__all__ = ["RedisBackend"]

_log = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 20
"""Batches up to this many payload bytes are hashed and copied on the event loop (cheaper
than a thread hop); larger ones go to a worker thread."""

_READ_SIZE = 1 << 20
"""Socket read size: values are large, so read them in big chunks."""

_SCAN_COUNT = 1000
"""Keys a ``SCAN`` step asks the server to look at (a hint; one round trip per step)."""

_EXISTS_SCRIPT = b"""
local n = 0
for i, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 0 then break end
  n = i
end
return n
"""
"""Server-side leading run: one round trip, a few times cheaper per key than pipelined EXISTS."""
_EXISTS_SHA = hashlib.sha1(_EXISTS_SCRIPT).hexdigest().encode()
_DROP_DAMAGED_SCRIPT = b"""
local n = 0
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and redis.sha1hex(v) == ARGV[i] then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
"""
"""Deletes each damaged value read, unless it changed since (its SHA-1 is the one read): a
good copy written meanwhile, by this daemon or another sharing the server, stays."""
_DELETE_PAGES_SCRIPT = b"""
local n = 0
for i, k in ipairs(KEYS) do
  if redis.call('TYPE', k).ok == 'string' and redis.call('GETRANGE', k, 0, 3) == ARGV[1] then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
"""
"""Deletes each key that holds a page object (a string starting with the object header's
magic), so that another application's key that merely has a page's name stays."""
_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


def _timed_out_in_pause(err: BaseException, mark: float) -> bool:
    """Whether ``err`` is a timeout of a call that began when :data:`WATCH` had counted
    ``mark`` seconds of pauses and kvtierd was paused since (stopped, starved): the reply
    may have waited in the socket while redis-py's own timer counted the pause, so the call
    is tried once more rather than counted as a fault. Every call sent again is idempotent;
    a delete sent again counts only the objects the first one left."""
    return isinstance(err, (_RedisTimeout, asyncio.TimeoutError)) and WATCH.catch_up() > mark


_REFUSED_WRITES = (OutOfMemoryError, ReadOnlyError)
"""How a server that answers but stores nothing refuses a write (``maxmemory`` with
``noeviction``; a replica after a failover): L3 is unhealthy until it takes one again."""


class RedisBackend(StorageBackend):
    """Pages as Redis/Valkey string values; see the package docstring for the layout.

    Args:
        extra_config: keys of :class:`RedisOptions`.

    Raises:
        ConfigError: a key is unknown or its value is invalid.
    """

    name = "redis"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        super().__init__(extra_config)
        self.options = validate_options(RedisOptions, extra_config, self.name)
        """The validated extra config."""
        self._state = _State.NEW
        self._client: redis_asyncio.Redis | None = None
        self._errors = _ERRORS
        self._arena: HostArena | None = None
        self._names = ObjectNames(self.options.prefix)
        self._drops: DropWatch | None = None
        self._damaged: list[tuple[bytes, bytes]] = []  # deleted after a failed verification
        self._run_id: bytes | None = None  # the server's, to tell a restart (health checks)
        self._write_fault: str | None = None  # a refused write (OOM, READONLY), until one is taken
        self._replaced = False
        ttl_s = self.options.ttl_s
        self._ttl_arg = None if ttl_s is None else b"%d" % max(1, int(ttl_s * 1000))
        self._script_sha: bytes | None = _EXISTS_SHA
        self._breaker = Breaker(
            f"redis backend: {redact(self.options.address)}", cooldown_s=0.0, log=_log
        )  # redis-py reconnects by itself: track, never refuse

    @property
    def client(self) -> redis_asyncio.Redis | None:
        """The ``redis.asyncio.Redis`` client (for benchmarks and tests); ``None`` unless open."""
        return self._client

    def key_name(self, ns: bytes, key: bytes) -> bytes:
        """Return the Redis key of page ``key`` in ``ns``: ``<prefix>:<ns hex>:<key hex>``."""
        return self._names.name(ns, key).encode()

    async def open(self, arena: HostArena) -> None:
        """Connect and check the server answers ``PING``.

        Raises:
            StorageError: redis-py is not installed, the backend was opened before, or the
                server does not answer within ``timeout_s``.
        """
        if self._state is not _State.NEW:
            raise StorageError(f"redis backend: open() called in state {self._state.value}")
        opts = self.options
        try:
            pool = redis_asyncio.BlockingConnectionPool.from_url(
                opts.address,
                max_connections=opts.max_connections,
                timeout=opts.timeout_s,
                socket_timeout=opts.timeout_s,
                socket_connect_timeout=opts.timeout_s,
                socket_read_size=_READ_SIZE,
                # one immediate retry on a broken connection: after a server restart every
                # pooled connection is stale and the retry reconnects; timeouts are not retried
                retry=Retry(NoBackoff(), 1, (_ConnectionError,)),
            )
        except ValueError as err:  # its text may quote a password: not shown
            raise ConfigError(
                f"redis extra config: 'url' = {redact(opts.address)!r} is not a redis URL "
                "(percent-encode '@', ':' and '/' in a user name or password)"
            ) from err
        self._client = redis_asyncio.Redis.from_pool(pool)
        self._arena = arena
        self._state = _State.OPEN
        try:  # not through the breaker: the L3 guard reports a backend that cannot open
            await asyncio.wait_for(self._client.ping(), opts.timeout_s)
        except self._errors as err:
            await self.close()
            cause = (
                f"no answer within {opts.timeout_s} s"
                if isinstance(err, asyncio.TimeoutError)
                else str(err) or type(err).__name__
            )
            raise StorageError(
                f"redis backend: {redact(opts.address)!r} did not answer PING: {cause}"
            ) from err
        self._run_id = await self._server_run_id()
        if opts.watch_drops:
            db = int(pool.connection_kwargs.get("db", 0) or 0)
            self._drops = DropWatch(self._client, self._names, db, self._dropping)
            await self._drops.start(opts.timeout_s)

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return how many of ``keys``, from the first, are stored.

        One ``EVALSHA`` of a script that walks the keys and stops at the first absent one;
        where scripting is unavailable, one pipeline of ``EXISTS``.
        """
        self._check_open()
        if not keys:
            return 0
        names = self._names.encoded(ns, keys)
        if self._script_sha is not None:
            run = await self._exists_script(names)
            if run is not None:
                return run
        replies = await self._roundtrip(
            [b"".join(command(b"EXISTS", name) for name in names)], len(names)
        )
        run = 0
        for reply in replies or ():
            if reply != 1:
                if isinstance(reply, BaseException):
                    self._failed(reply)
                break
            run += 1
        return run

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Read, verify and copy each page into ``arena[offset:offset+length]``.

        One pipeline of ``GET`` (``GETEX`` with a TTL). A missing key, a value of the wrong
        size, a header naming another namespace or key, or a checksum mismatch reads ``False``
        (the last three count in ``stats.corrupt``); a fault reads all ``False``. A value that
        did not verify is deleted (unless it changed since it was read) and reported by
        :meth:`dropped`: while it stayed, it would read as present to every ``exists`` and
        the next write of the page would skip it.
        """
        arena = self._check_batch(keys, offsets, length)
        if not keys:
            return []
        names = self._names.encoded(ns, keys)
        if self._ttl_arg is None:
            frames = b"".join(command(b"GET", name) for name in names)
        else:
            frames = b"".join(command(b"GETEX", name, b"PX", self._ttl_arg) for name in names)
        values = await self._roundtrip([frames], len(keys))
        if values is None:
            self.stats.misses += len(keys)
            return [False] * len(keys)
        landing = functools.partial(
            land, arena.view, ns, keys, offsets, length, values, arena.address
        )
        if length * len(keys) <= _INLINE_BYTES:
            flags, missing, corrupt, faults = landing()
        else:
            flags, missing, corrupt, faults = await run_to_completion(landing)
        damaged = [(i, hashlib.sha1(values[i]).hexdigest().encode()) for i in corrupt]
        del values
        found = sum(flags)
        self.stats.gets += found
        self.stats.get_bytes += found * length
        self.stats.misses += missing + len(corrupt) + len(faults)
        self.stats.corrupt += len(corrupt)
        if faults:
            self._failed(faults[0])
        if damaged:
            await self._drop_damaged(ns, keys, damaged)
        return flags

    async def _drop_damaged(
        self, ns: bytes, keys: Sequence[bytes], damaged: list[tuple[int, bytes]]
    ) -> None:
        """Delete the values of ``keys`` that failed verification (index, SHA-1 of the value
        read), each only if it still holds what was read; report them as dropped. Where
        scripting is unavailable they are deleted unconditionally."""
        names = [self._names.encoded(ns, [keys[i]])[0] for i, _ in damaged]
        if self._script_sha is not None:
            frames = command(
                b"EVAL",
                _DROP_DAMAGED_SCRIPT,
                b"%d" % len(names),
                *names,
                *(digest for _, digest in damaged),
            )
        else:
            frames = command(b"DEL", *names)
        replies = await self._roundtrip([frames], 1)
        if replies is None or isinstance(replies[0], BaseException):
            _log.warning(
                "redis backend: deleting %d damaged values failed: %s",
                len(names),
                "no answer" if replies is None else replies[0],
            )
            return
        self._damaged.extend((ns, keys[i]) for i, _ in damaged)

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Write each page ``arena[offset:offset+length]`` as header ‖ payload (pipelined ``SET``).

        The payload goes to the socket straight from the arena (no copy); only the 96-byte
        header is built. An existing value is overwritten, which also repairs a corrupt one.
        """
        arena = self._check_batch(keys, offsets, length)
        if not keys:
            return []
        build = functools.partial(self._set_frames, arena.view, ns, keys, offsets, length)
        chunks = build() if length * len(keys) <= _INLINE_BYTES else await run_to_completion(build)
        replies = await self._roundtrip(chunks, len(keys))
        del chunks
        if replies is None:
            return [False] * len(keys)
        flags = [reply == b"OK" for reply in replies]
        fault = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if fault is not None:
            self._failed(fault)
            if isinstance(fault, _REFUSED_WRITES):  # the server answers, writes nothing
                self._write_fault = f"{type(fault).__name__}: {fault}"
        elif any(flags):
            self._write_fault = None
        self.stats.puts += sum(flags)
        self.stats.put_bytes += sum(flags) * length
        return flags

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Delete the pages (each key only if it holds a page object; one ``DEL`` where
        scripting is unavailable); return how many were deleted (0 on a fault)."""
        self._check_open()
        if not keys:
            return 0
        names = self._names.encoded(ns, keys)
        replies = None
        if self._script_sha is not None:
            frames = command(b"EVAL", _DELETE_PAGES_SCRIPT, b"%d" % len(names), *names, MAGIC)
            replies = await self._roundtrip([frames], 1)
            if replies and isinstance(replies[0], _ResponseError):  # no scripting here
                _log.info("redis backend: scripting unavailable (%s); delete uses DEL", replies[0])
                self._script_sha = None
                replies = None
        if self._script_sha is None:
            replies = await self._roundtrip([command(b"DEL", *names)], 1)
        if not replies or not isinstance(replies[0], int):
            if replies:
                self._failed(replies[0])
            self.delete_faults += 1
            return 0
        return int(replies[0])

    async def list_keys(
        self, namespaces: AbstractSet[bytes] | None = None
    ) -> list[tuple[bytes, bytes]] | None:
        """Every ``(namespace, key)`` stored under this prefix, of ``namespaces`` (None: of
        all), by ``SCAN MATCH <prefix>:*`` (``<prefix>:<ns hex>:*`` per namespace).

        Keys under the prefix that are not page names are skipped. SCAN visits keys
        present for its whole run at least once; keys written or deleted meanwhile may be
        listed or not.

        Returns:
            The pairs; None on a fault (counted in ``stats.errors``): the caller then knows
            only what it wrote itself.

        Raises:
            StorageError: the backend is not open.
        """
        self._check_open()
        client = self._client
        assert client is not None
        patterns = (
            [self._names.pattern()]
            if namespaces is None
            else [self._names.pattern(ns) for ns in sorted(namespaces)]
        )
        found: dict[tuple[bytes, bytes], None] = {}  # SCAN may return a key twice
        try:
            for pattern in patterns:
                cursor = 0
                while True:
                    mark = WATCH.catch_up()
                    try:
                        cursor, names = await client.scan(cursor, match=pattern, count=_SCAN_COUNT)
                    except self._errors as err:
                        if not _timed_out_in_pause(err, mark):
                            raise
                        cursor, names = await client.scan(cursor, match=pattern, count=_SCAN_COUNT)
                    for name in names:
                        ident = self._names.parse(name)
                        if ident is not None:
                            found[ident] = None
                    if not cursor:
                        break
        except self._errors as err:
            self._failed(err)
            return None
        self._note_up()
        return list(found)

    async def health(self) -> bool:
        """Return True when the server answers ``PING`` within ``timeout_s`` and, after a
        write it refused (out of memory, a read-only replica), takes a probe write again;
        :attr:`health_cause` says why not (a refused login, a refused write, no answer)."""
        client = self._client
        if self._state is not _State.OPEN or client is None:
            return False
        try:
            mark = WATCH.catch_up()
            try:
                await self._probe(client)
            except self._errors as err:
                if not _timed_out_in_pause(err, mark):
                    raise
                await self._probe(client)
        except self._errors as err:
            self._note_down(err)
            cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            if isinstance(err, _REFUSED_WRITES):
                self._write_fault = cause
            self.health_cause = f"writes refused: {cause}" if self._write_fault else cause
            return False
        self.health_cause = None
        self._note_up()
        run_id = await self._server_run_id()
        if run_id is not None:
            if self._run_id is not None and run_id != self._run_id:
                _log.warning(
                    "redis backend: %s restarted or was replaced (its run_id changed): the "
                    "pages it held are taken as gone",
                    redact(self.options.address),
                )
                self._replaced = True
                if self._drops is not None:  # its configuration is its own
                    await self._drops.ensure_notify()
            self._run_id = run_id
        return True

    async def _probe(self, client: redis_asyncio.Redis) -> None:
        """``PING``, and after a refused write a probe write (clearing the fault)."""
        await asyncio.wait_for(client.ping(), self.options.timeout_s)
        if self._write_fault is not None:  # cleared once the server takes a write again
            await asyncio.wait_for(
                client.set(f"{self.options.prefix}:health-probe", b"1", px=1000),
                self.options.timeout_s,
            )
            self._write_fault = None

    def replaced(self) -> bool:
        """Whether a health check found another server process since the last call (its
        ``run_id`` changed: a restart, which may have lost every value, or another server)."""
        replaced, self._replaced = self._replaced, False
        return replaced

    async def _server_run_id(self) -> bytes | None:
        """The server's ``run_id`` (``INFO server``); None when it cannot tell (a fault, or
        a compatible server without one)."""
        client = self._client
        if client is None:
            return None
        try:
            info = await asyncio.wait_for(client.info("server"), self.options.timeout_s)
        except self._errors as err:
            _log.debug("redis backend: INFO server: %s", err)
            return None
        run_id = info.get("run_id") if isinstance(info, dict) else None
        return str(run_id).encode() if run_id else None

    def _dropping(self) -> None:
        if self.on_drop is not None:
            self.on_drop()

    def dropped(self) -> list[tuple[bytes, bytes]]:
        """Pages deleted as damaged, and those the server evicted or expired (known with
        ``watch_drops`` only), since the last call."""
        damaged, self._damaged = self._damaged, []
        return damaged + (self._drops.take() if self._drops is not None else [])

    async def close(self) -> None:
        """Close every pooled connection; idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        drops, self._drops = self._drops, None
        if drops is not None:
            await drops.close()
        client, self._client = self._client, None
        self._arena = None
        if client is not None:
            try:
                await client.aclose()
            except self._errors as err:  # closing a dead connection: nothing left to release
                _log.debug("redis backend: close: %s", err)

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> HostArena:
        if self._state is not _State.OPEN or self._arena is None:
            raise StorageError(f"redis backend: used in state {self._state.value}")
        return self._arena

    def _check_batch(self, keys: Sequence[bytes], offsets: Sequence[int], length: int) -> HostArena:
        arena = self._check_open()
        check_pages(self.name, arena, keys, offsets, length)
        return arena

    def _set_frames(
        self,
        view: memoryview,
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
    ) -> list[bytes | memoryview]:
        """Encode ``SET name <header ‖ payload> [PX ttl]`` per page; payloads stay arena views."""
        chunks: list[bytes | memoryview] = []
        value_head = b"$%d\r\n" % (HEADER_SIZE + length)
        if self._ttl_arg is None:
            head, tail = b"*3\r\n$3\r\nSET\r\n", b"\r\n"
        else:
            head, tail = b"*5\r\n$3\r\nSET\r\n", b"\r\n" + bulk(b"PX") + bulk(self._ttl_arg)
        headers = bytearray(HEADER_SIZE * len(keys))
        at = range(0, len(headers), HEADER_SIZE)
        seal_headers(headers, at, view, offsets, length, ns, keys)  # one call, GIL released
        for name, off, h in zip(self._names.encoded(ns, keys), offsets, at):
            chunks.append(head + bulk(name) + value_head + headers[h : h + HEADER_SIZE])
            chunks.append(view[off : off + length])
            chunks.append(tail)
        return chunks

    async def _exists_script(self, names: list[bytes]) -> int | None:
        """Leading run by the server-side script; ``None`` when scripting is unavailable."""
        assert self._script_sha is not None
        replies = await self._roundtrip(
            [command(b"EVALSHA", self._script_sha, b"%d" % len(names), *names)], 1
        )
        if replies is None:
            return 0
        reply = replies[0]
        if isinstance(reply, NoScriptError):  # first use on this server: load it by EVAL
            replies = await self._roundtrip(
                [command(b"EVAL", _EXISTS_SCRIPT, b"%d" % len(names), *names)], 1
            )
            if replies is None:
                return 0
            reply = replies[0]
        if isinstance(reply, int):
            return reply
        _log.info("redis backend: scripting unavailable (%s); exists uses pipelined EXISTS", reply)
        self._script_sha = None
        return None

    async def _roundtrip(self, chunks: list[bytes | memoryview], count: int) -> list[Any] | None:
        """Send pre-encoded commands on one pooled connection and read ``count`` replies.

        This is a pipeline without redis-py's per-command bookkeeping: large payloads are
        written as they are, replies are parsed by hiredis. Server error replies come back
        as exception objects in the list. A connection that turns out to be broken (the
        server restarted) is dropped and the batch is sent once more on a fresh one; any
        other fault returns ``None`` and counts one error.
        """
        assert self._client is not None
        pool = self._client.connection_pool
        for attempt in (1, 2):
            mark = WATCH.catch_up()
            try:
                conn = await pool.get_connection()
            except self._errors as err:
                if attempt == 1 and _timed_out_in_pause(err, mark):
                    continue
                self._failed(err)
                return None
            try:
                await conn.send_packed_command(chunks, check_health=False)
                replies: list[Any] = []
                for _ in range(count):
                    try:
                        replies.append(await conn.read_response(disable_decoding=True))
                    except _ResponseError as err:
                        replies.append(err)
            except BaseException as err:
                # unread replies would answer the next user of this connection
                await conn.disconnect(nowait=True)
                if attempt == 1 and isinstance(err, _ConnectionError):
                    if self.on_suspect is not None:  # the server may have restarted: its
                        self.on_suspect()  # owner checks its health (and run_id) soon
                    continue
                if attempt == 1 and _timed_out_in_pause(err, mark):
                    continue  # the commands are idempotent: sent again on a new connection
                if isinstance(err, self._errors):
                    self._failed(err)
                    return None
                raise
            finally:
                await pool.release(conn)
            self._note_up()
            return replies
        raise AssertionError("unreachable")

    def _failed(self, err: BaseException) -> None:
        self.stats.errors += 1
        self._note_down(err)

    def _note_down(self, err: BaseException) -> None:
        self._breaker.failed(f"{type(err).__name__}: {err}")

    def _note_up(self) -> None:
        self._breaker.succeeded()
