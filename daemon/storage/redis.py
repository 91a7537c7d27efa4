"""L3 backend on Redis or Valkey: one string value per page, shared by every daemon using it.

Each page is one key holding the self-describing object (96-byte header ‖ payload)::

    key    <prefix>:<namespace fingerprint hex>:<page key hex>
    value  header (magic, version, ns, key, length, xxh3 of payload, xxh3 of header) ‖ payload

Every batch is one pipeline, so one round trip: ``SET`` (with ``PX`` when ``ttl_s`` is set),
``GET`` (``GETEX PX`` with a TTL, so pages that keep being read keep living), one multi-key
``DEL``; the leading run is one ``EVALSHA`` of a five-line script (pipelined ``EXISTS`` where
scripting is disabled). Only plain commands are used, so Valkey and Redis-compatible servers
work too.

Commands are RESP-encoded here and written on a pooled redis-py connection; replies are
parsed by hiredis. This skips redis-py's per-command pipeline bookkeeping (tens of µs per
command) and lets each page's payload go to the socket as a view of the arena slot, right
after its header: a put copies nothing in Python.

Reads verify the header and the payload checksum before copying the payload into the arena
slot; a value that does not verify is a miss and counts in ``stats.corrupt``. Hashing and
copying large batches runs in a worker thread, so the event loop keeps answering.

Faults never raise into the daemon: a refused connection, a timeout or a server error makes
the batch a miss (``False`` / a run of 0), counts once in ``stats.errors`` and is logged on
the first failure after a healthy spell. redis-py reconnects on the next call, and a stale
pooled connection (the server restarted) is retried once, so the backend comes back by
itself when the server does.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as redis_asyncio
from kvtier.config.errors import ConfigError, StorageError
from kvtier.daemon.storage.base import HostArena, StorageBackend, run_to_completion
from kvtier.daemon.storage.objects import HEADER_SIZE, seal_headers, verify_object
from kvtier.daemon.storage.registry import validate_options
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as _ConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import ResponseError as _ResponseError

__all__ = ["RedisBackend", "RedisOptions"]

_log = logging.getLogger(__name__)

_INLINE_BYTES = 1 << 20
"""Batches up to this many payload bytes are hashed and copied on the event loop (cheaper
than a thread hop); larger ones go to a worker thread."""

_READ_SIZE = 1 << 20
"""Socket read size: values are large, so read them in big chunks."""

_EXISTS_SCRIPT = b"""
local n = 0
for i, k in ipairs(KEYS) do
  if redis.call('EXISTS', k) == 0 then break end
  n = i
end
return n
"""
"""Server-side leading run: one round trip, ~3 µs per key (pipelined EXISTS: ~15 µs per key)."""
_EXISTS_SHA = hashlib.sha1(_EXISTS_SCRIPT).hexdigest().encode()
_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


class RedisOptions(BaseModel):
    """Extra-config keys of the ``redis`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(default="redis://127.0.0.1:6379/0")
    """Server URL (``redis://``, ``rediss://`` or ``unix://``); may carry user, password and db."""
    host: str | None = Field(default=None, min_length=1)
    """Server host; with ``port`` and ``db``, an alternative to ``url``."""
    port: int = Field(default=6379, ge=1, le=65535)
    """Server port when ``host`` is given."""
    db: int = Field(default=0, ge=0)
    """Database number when ``host`` is given."""
    prefix: str = Field(default="kvtier", min_length=1, max_length=128, pattern=r"^\S+$")
    """First component of every key; lets several kvtier deployments share a server."""
    timeout_s: float = Field(default=2.0, gt=0, le=3600)
    """Bound on each connect, each socket read or write and each wait for a pooled connection."""
    ttl_s: float | None = Field(default=None, gt=0)
    """Optional expiry of pages, refreshed by every read (sliding); ``None`` keeps them until
    the server evicts them (configure ``maxmemory-policy allkeys-lru`` on the server)."""
    max_connections: int = Field(default=16, ge=1, le=4096)
    """Connections in the pool; concurrent batches beyond it wait up to ``timeout_s``."""

    @model_validator(mode="after")
    def _one_address(self) -> RedisOptions:
        if self.host is not None and "url" in self.model_fields_set:
            raise ValueError("give 'url' or 'host'/'port'/'db', not both")
        if self.host is None and {"port", "db"} & self.model_fields_set:
            raise ValueError("'port' and 'db' need 'host' (or put them in 'url')")
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"'url' must start with redis://, rediss:// or unix://, got {self.url!r}"
            )
        return self

    @property
    def address(self) -> str:
        """The URL the client connects to."""
        if self.host is not None:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"redis://{host}:{self.port}/{self.db}"
        return self.url


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class RedisBackend(StorageBackend):
    """Pages as Redis/Valkey string values; see the module docstring for the layout.

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
        self._prefix = self.options.prefix.encode()
        ttl_s = self.options.ttl_s
        self._ttl_arg = None if ttl_s is None else b"%d" % max(1, int(ttl_s * 1000))
        self._script_sha: bytes | None = _EXISTS_SHA
        self._failing = False

    @property
    def client(self) -> redis_asyncio.Redis | None:
        """The ``redis.asyncio.Redis`` client (for benchmarks and tests); ``None`` unless open."""
        return self._client

    def key_name(self, ns: bytes, key: bytes) -> bytes:
        """Return the Redis key of page ``key`` in ``ns``: ``<prefix>:<ns hex>:<key hex>``."""
        return b"%s:%s:%s" % (self._prefix, ns.hex().encode(), key.hex().encode())

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
        except ValueError as err:
            raise ConfigError(
                f"redis extra config: 'url' = {_redact(opts.address)!r}: {err}"
            ) from err
        self._client = redis_asyncio.Redis.from_pool(pool)
        self._arena = arena
        self._state = _State.OPEN
        if not await self.health():
            await self.close()
            raise StorageError(
                f"redis backend: no answer from {_redact(opts.address)!r} within {opts.timeout_s} s"
            )

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return how many of ``keys``, from the first, are stored.

        One ``EVALSHA`` of a script that walks the keys and stops at the first absent one;
        where scripting is unavailable, one pipeline of ``EXISTS``.
        """
        self._check_open()
        if not keys:
            return 0
        names = [self.key_name(ns, key) for key in keys]
        if self._script_sha is not None:
            run = await self._exists_script(names)
            if run is not None:
                return run
        replies = await self._roundtrip(
            [b"".join(_command(b"EXISTS", name) for name in names)], len(names)
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
        (the last three count in ``stats.corrupt``); a fault reads all ``False``.
        """
        arena = self._check_batch(keys, offsets, length)
        if not keys:
            return []
        if self._ttl_arg is None:
            frames = b"".join(_command(b"GET", self.key_name(ns, key)) for key in keys)
        else:
            frames = b"".join(
                _command(b"GETEX", self.key_name(ns, key), b"PX", self._ttl_arg) for key in keys
            )
        values = await self._roundtrip([frames], len(keys))
        if values is None:
            self.stats.misses += len(keys)
            return [False] * len(keys)
        land = functools.partial(_land, arena.view, ns, keys, offsets, length, values)
        if length * len(keys) <= _INLINE_BYTES:
            flags, missing, corrupt, faults = land()
        else:
            flags, missing, corrupt, faults = await run_to_completion(land)
        del values
        found = sum(flags)
        self.stats.gets += found
        self.stats.get_bytes += found * length
        self.stats.misses += missing + corrupt + len(faults)
        self.stats.corrupt += corrupt
        if faults:
            self._failed(faults[0])
        return flags

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
        self.stats.puts += sum(flags)
        self.stats.put_bytes += sum(flags) * length
        return flags

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Delete the pages with one ``DEL``; return how many existed (0 on a fault)."""
        self._check_open()
        if not keys:
            return 0
        replies = await self._roundtrip(
            [_command(b"DEL", *(self.key_name(ns, key) for key in keys))], 1
        )
        if not replies or not isinstance(replies[0], int):
            if replies:
                self._failed(replies[0])
            return 0
        return int(replies[0])

    async def health(self) -> bool:
        """Return True when the server answers ``PING`` within ``timeout_s``."""
        client = self._client
        if self._state is not _State.OPEN or client is None:
            return False
        try:
            await asyncio.wait_for(client.ping(), self.options.timeout_s)
        except self._errors as err:
            self._note_down(err)
            return False
        self._note_up()
        return True

    async def close(self) -> None:
        """Close every pooled connection; idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
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
        assert len(keys) == len(offsets), "one offset per key"
        assert all(0 <= off and off + length <= arena.size for off in offsets), (
            "offset out of arena"
        )
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
            head, tail = b"*5\r\n$3\r\nSET\r\n", b"\r\n" + _bulk(b"PX") + _bulk(self._ttl_arg)
        headers = bytearray(HEADER_SIZE * len(keys))
        at = range(0, len(headers), HEADER_SIZE)
        seal_headers(headers, at, view, offsets, length, ns, keys)  # one call, GIL released
        for key, off, h in zip(keys, offsets, at):
            chunks.append(
                head + _bulk(self.key_name(ns, key)) + value_head + headers[h : h + HEADER_SIZE]
            )
            chunks.append(view[off : off + length])
            chunks.append(tail)
        return chunks

    async def _exists_script(self, names: list[bytes]) -> int | None:
        """Leading run by the server-side script; ``None`` when scripting is unavailable."""
        assert self._script_sha is not None
        replies = await self._roundtrip(
            [_command(b"EVALSHA", self._script_sha, b"%d" % len(names), *names)], 1
        )
        if replies is None:
            return 0
        reply = replies[0]
        if isinstance(reply, NoScriptError):  # first use on this server: load it by EVAL
            replies = await self._roundtrip(
                [_command(b"EVAL", _EXISTS_SCRIPT, b"%d" % len(names), *names)], 1
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
            try:
                conn = await pool.get_connection()
            except self._errors as err:
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
                    continue
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
        if not self._failing:
            self._failing = True
            _log.warning(
                "redis backend: %s unreachable or failing (%s: %s); L3 reads miss until it answers",
                _redact(self.options.address),
                type(err).__name__,
                err,
            )

    def _note_up(self) -> None:
        if self._failing:
            self._failing = False
            _log.info("redis backend: %s answers again", _redact(self.options.address))


def _bulk(arg: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(arg) for arg in args)


def _land(
    view: memoryview,
    ns: bytes,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    length: int,
    values: Sequence[Any],
) -> tuple[list[bool], int, int, list[BaseException]]:
    """Verify each value and copy its payload into the arena.

    Returns:
        (flags, missing, corrupt, faults): one flag per key, how many keys were absent,
        how many values did not verify, and the per-command errors the server sent.
        Counters go back to the caller, which owns ``stats`` on the event loop.
    """
    flags: list[bool] = []
    missing = corrupt = 0
    faults: list[BaseException] = []
    size = HEADER_SIZE + length
    for key, off, value in zip(keys, offsets, values):
        if value is None:
            missing += 1
            flags.append(False)
            continue
        if isinstance(value, BaseException):
            faults.append(value)
            flags.append(False)
            continue
        data = memoryview(value)
        if len(data) != size or not verify_object(data[:HEADER_SIZE], data[HEADER_SIZE:], ns, key):
            corrupt += 1
            flags.append(False)
            continue
        view[off : off + length] = data[HEADER_SIZE:]
        flags.append(True)
    return flags, missing, corrupt, faults




def _redact(url: str) -> str:
    """Drop a password from a URL before it reaches a log line or an error."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        creds, _, host = rest.rpartition("@")
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"
    return url
