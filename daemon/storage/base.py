"""The L3 storage backend interface.

Every backend moves whole pages between the daemon's host pool (one shared-memory
arena) and a store, zero-copy where the store allows it. Pages are addressed in the
arena by byte offset; a batch always belongs to one namespace.

::

    arena (HostArena)   ┌────────┬────────┬────────┬─────
                        │ slot 0 │ slot 1 │ slot 2 │ ...
                        └────────┴────────┴────────┴─────
    get_into(keys=[k0, k1], offsets=[o1, o0], length=L) fills arena[o1:o1+L], arena[o0:o0+L]

Objects in a store are self-describing (see :mod:`kvtier.daemon.storage.objects`):
a read whose header or checksum does not verify is a miss, never data.

Backends are async. Blocking client libraries run their calls in a worker thread
(``asyncio.to_thread``) so the daemon's event loop keeps answering.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.config.errors import StorageError

_T = TypeVar("_T")


class BackendState(enum.Enum):
    """A remote backend's lifecycle: NEW → OPEN (after ``open``) → CLOSED (after ``close``)."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class HostArena:
    """The host pool's memory as a backend sees it.

    Attributes:
        view: a writable memoryview (format ``B``) over the whole arena.
        address: the arena's base virtual address in this process (for libraries
            that take raw pointers, e.g. Mooncake's ``register_buffer``).
        size: the arena's size in bytes.
        headroom: bytes right before every page offset a backend is given that belong to
            that page's slot (the host pool's slot headroom; 0: none). While a backend
            holds a page (writing it, or filling a slot it was given) it may use
            ``arena[offset - headroom : offset]`` as scratch, e.g. to move an object
            header and the payload as one contiguous buffer.
    """

    view: memoryview
    address: int
    size: int
    headroom: int = 0


@dataclass(slots=True)
class BackendStats:
    """Counters every backend keeps; the daemon exports them as metrics.

    Attributes:
        puts / put_bytes: objects and payload bytes written.
        gets / get_bytes: objects and payload bytes read and verified.
        misses: keys asked for and not found.
        corrupt: objects found whose header or checksum did not verify (counted as misses too).
        errors: operations that failed on the backend's side (I/O error, connection lost).
    """

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0


class StorageBackend(abc.ABC):
    """An L3 store of pages named by (namespace fingerprint, page key).

    Lifecycle: construct with the parsed extra config, ``await open(arena)`` once,
    use, ``await close()``. All batch methods take one namespace fingerprint
    (32 bytes) and keys of 32 bytes each. Methods never raise for a miss or for a
    backend fault: a fault counts in ``stats.errors`` and reads as a miss
    (``False`` / a shorter run).
    """

    name: str = "abstract"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        self.extra_config = dict(extra_config)
        self.stats = BackendStats()
        self.delete_faults = 0
        """:meth:`delete` calls that failed on the backend's side (each also counts in
        ``stats.errors``): what a FLUSH reads to tell its own failed delete from a fault of
        another batch running meanwhile."""
        self.on_drop: Callable[[], None] | None = None
        """Set by the owner; a store that learns of drops outside its batches (a server's
        notification) calls it from the event loop, and the owner then calls
        :meth:`dropped`."""
        self.on_suspect: Callable[[], None] | None = None
        """Set by the owner; a store that sees a sign its server may have been replaced (a
        broken connection) calls it from the event loop, and the owner then checks its
        :meth:`health` (and :meth:`replaced`) soon."""

    @abc.abstractmethod
    async def open(self, arena: HostArena) -> None:
        """Connect, register the arena where the store supports zero-copy, load indexes."""

    @abc.abstractmethod
    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` present in the store."""

    @abc.abstractmethod
    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Read each key's payload (``length`` bytes) into ``arena[offset:offset+length]``.

        Returns one flag per key: ``True`` only when the object was found, its header
        matched (namespace, key, length) and its checksum verified. A ``False`` slot's
        bytes are unspecified; the caller discards them.
        """

    @abc.abstractmethod
    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Write each page ``arena[offset:offset+length]`` under its key; one flag per key."""

    @abc.abstractmethod
    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Delete the keys; return how many were present. A fault adds one to
        :attr:`delete_faults` (and to ``stats.errors``)."""

    async def list_keys(
        self, namespaces: AbstractSet[bytes] | None = None
    ) -> list[tuple[bytes, bytes]] | None:
        """Every ``(namespace, key)`` the store holds, of ``namespaces`` (None: of all).

        Returns:
            The pairs, in no particular order; ``None`` when the store cannot list its
            objects (the caller then knows only what it wrote itself).
        """
        return None

    async def release_space(self) -> int:
        """Give the space of deleted objects back to the system (after a FLUSH).

        Deleting keeps a store's space for the next writes, as a preallocated store wants;
        an operator's flush asks for it back. Returns the bytes released (0: nothing to
        give back, the default for stores that free space as they delete).
        """
        return 0

    def dropped(self) -> list[tuple[bytes, bytes]]:
        """``(namespace, key)`` of the objects the store dropped on its own since the last
        call: evicted to make room, discarded as damaged (not those :meth:`delete` removed).

        Called from the event loop after each batch and after :attr:`on_drop`, so it must be
        cheap and must not block.
        The default, for stores that cannot tell (their evictions happen out of sight), is
        an empty list.
        """
        return []

    def replaced(self) -> bool:
        """Whether the store may have lost everything it held since the last call (its
        server restarted without its data, or another took its place), as found by
        :meth:`health`; the owner then takes none of its objects as present any more.

        The default, for stores that cannot tell, is False.
        """
        return False

    health_cause: str | None = None
    """Why the last :meth:`health` check said False, when the backend can tell (HEALTH shows
    it as ``down: CAUSE``); None otherwise."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """Return True when the store answers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release everything; idempotent."""


def check_pages(
    backend: str,
    arena: HostArena,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    length: int,
    low: int = 0,
) -> None:
    """Check that a batch names one arena page per key, each inside the arena.

    Backends that hand raw pointers to a library (or slice the arena) call this before
    touching memory: it holds under ``python -O`` too, unlike an ``assert``.

    Args:
        backend: the backend's name, for the message.
        arena: the arena the offsets point into.
        keys, offsets, length: the batch.
        low: the lowest offset a page may start at (e.g. room for a header before it).

    Raises:
        StorageError: the counts differ, ``length`` is negative, or a page
            ``[offset, offset + length)`` starts below ``low`` or ends past ``arena.size``;
            the message names the values.
    """
    if len(keys) != len(offsets):
        raise StorageError(f"{backend} backend: {len(keys)} keys but {len(offsets)} offsets")
    if length < 0:
        raise StorageError(f"{backend} backend: page length {length} is negative")
    for off in offsets:
        if off < low or off + length > arena.size:
            raise StorageError(
                f"{backend} backend: page at arena offset {off} of {length} bytes is outside "
                f"the arena [{low}, {arena.size})"
            )


async def run_to_completion(fn: Callable[[], _T], executor: Executor | None = None) -> _T:
    """Run ``fn`` in ``executor`` (default: the loop's) and wait for it even when cancelled.

    A worker that reads or writes arena slots must finish before the caller can reuse those
    slots, so this coroutine never ends before the worker does; a cancellation that arrives
    meanwhile is re-raised once the worker has finished.
    """
    future = asyncio.get_running_loop().run_in_executor(executor, fn)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
