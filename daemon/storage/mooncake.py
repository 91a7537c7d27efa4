"""L3 backend on Mooncake Store: pages move zero-copy between the arena and the cluster's segments.

One page is ONE Mooncake object: its 96-byte header, then its payload::

    object <prefix>:<ns hex>:<key hex>  =  header (96 B)  ‖  payload (length B)

When the arena gives every slot headroom (``HostArena.headroom >= 96``: kvtierd's host pool
does when this backend is configured), the header is written into the slot's own headroom,
right before the payload, and the page moves as ONE contiguous registered buffer::

    arena   ... | headroom ... | header | payload (offset .. offset + length) | ...
                               ^ offset - 96: one buffer of 96 + length bytes

    put: header into arena[offset - 96 : offset] → batch_put_from(keys, [ptr], [96 + length])
    get: batch_get_into(keys, [ptr], [96 + length]) → check header, xxh3 of the payload

Without headroom (or when one batch names a slot twice) the header goes to a registered
scratch slot and the object is assembled from two buffers in one transfer
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` with ``[[hdr, slot]]``).
The object's bytes are the same either way, so a store written by one path reads with the
other. One buffer is worth the headroom over TCP: there every buffer is a separate
acknowledged request, so a separate header costs a round trip per page.

Why one object rather than two (``<key>.h`` and ``<key>``): it is one key per page in the
master (half the metadata and lookups), the header and payload are written and evicted
together (a store that evicts silently can never leave a header without its payload or
pair an old header with a new payload), and it costs no copy: the payload is read from and
written to the arena slot directly.

A batch is one job (batches beyond ``sub_batch_keys`` are split into concurrent jobs), run in
the backend's own pool of ``max_inflight`` threads, never on the event loop. A job seals (put)
or checks (get) all its headers in one call of :func:`~kvtier.daemon.storage.objects.seal_headers`
/ :func:`~kvtier.daemon.storage.objects.check_headers`, which hash with the GIL released, so
hashing in one worker does not stall the event loop or the other workers. Mooncake's batch
calls busy-poll their calling thread until the transfer is done, so the workers run at a
lower priority (``worker_nice``): on a node whose cores are all busy the poll then gives way
to the threads that move the bytes.

Store semantics this relies on (Mooncake 0.3.13): ``put`` of an existing key keeps the old
object and reports success, which is right for content-named pages; a full store evicts
old objects silently, so not-found is an ordinary miss. An object that does not verify is
removed (force) so that the next put can write a good one.

Return codes: a get answers the bytes read, ``-704`` (not found), ``-703`` (replica not
ready) or ``-707`` (lease expired) for a miss, ``-600`` / ``-800`` when the object's size
differs from the buffers (counted corrupt), other negatives for faults (``-900`` the master
is unreachable). A put answers 0, ``-705`` (already there, success), ``-200`` (no space,
a shortfall, not an error) or a fault.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import functools
import ipaddress
import logging
import mmap
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from kvtier.config.errors import StorageError
from kvtier.config.sizes import ByteSize
from kvtier.daemon.storage.base import HostArena, StorageBackend, run_to_completion
from kvtier.daemon.storage.objects import HEADER_SIZE, check_headers, seal_headers
from kvtier.daemon.storage.registry import validate_options
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MooncakeBackend", "MooncakeOptions"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

OBJECT_NOT_FOUND = -704
REPLICA_NOT_READY = -703
LEASE_EXPIRED = -707
OBJECT_ALREADY_EXISTS = -705
NO_AVAILABLE_HANDLE = -200
SIZE_MISMATCH = (-600, -800)
_MISS_CODES = frozenset((OBJECT_NOT_FOUND, REPLICA_NOT_READY, LEASE_EXPIRED))


class MooncakeOptions(BaseModel):
    """Extra-config keys of the ``mooncake`` backend (the first six as SGLang's Mooncake config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    master_server_address: str = Field(default="127.0.0.1:50051", min_length=1)
    """``host:port`` of mooncake_master's RPC server."""
    metadata_server: str = Field(default="http://127.0.0.1:8080/metadata", min_length=1)
    """Metadata service: the master's HTTP metadata server URL (or etcd / ``P2PHANDSHAKE``)."""
    local_hostname: str = Field(default="127.0.0.1", min_length=1)
    """Address this daemon's segment is advertised at; also its TCP bind address when it is
    an IP literal and ``MC_TCP_BIND_ADDRESS`` is not set."""
    global_segment_size: ByteSize = Field(default=1 << 30, ge=0)
    """Memory this daemon contributes to the cluster store (``"4GiB"`` style or bytes); 0 = none."""
    local_buffer_size: ByteSize = Field(default=16 << 20, ge=0)
    """Mooncake's client-side staging buffer (zero-copy transfers do not use it)."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer protocol."""
    device_name: str = ""
    """RDMA device list for ``protocol = "rdma"``; empty for TCP."""
    prefix: str = Field(default="kvtier", min_length=1, max_length=128, pattern=r"^\S+$")
    """First component of every object key."""
    max_inflight: int = Field(default=4, ge=1, le=64)
    """Mooncake calls in flight at once, over all batches (worker threads of this backend)."""
    sub_batch_keys: int = Field(default=256, ge=1, le=4096)
    """Most keys in one Mooncake call; a larger batch is split into calls that run concurrently.
    Concurrent transfers to one peer over TCP slow each other down (measured: a 64-key batch
    as 4 concurrent calls moved ~40 % less than as one), so a typical batch stays one call."""
    timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """Bound on reaching the master and the HTTP metadata server at open (checked before
    Mooncake's own setup, which retries for about 90 s against an address that refuses)."""
    retry_interval_s: float = Field(default=1.0, gt=0, le=3600)
    """After a fault, operations fail fast (as misses) for this long, then one is let through
    to try the store again; calls to an unreachable master can otherwise block for seconds."""
    worker_nice: int = Field(default=10, ge=0, le=19)
    """How much lower than the daemon's the priority (nice value) of this backend's worker
    threads is. A Mooncake batch call busy-polls in its calling thread until the transfer
    completes; at a lower priority that poll gives way to the transfer's own threads (and to
    the rest of the daemon) when the CPUs are all busy, instead of taking a core from them.
    Mooncake's own threads keep the daemon's priority. 0 leaves the workers as they are."""


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class _Scratch:
    """Registered memory for headers: ``max_inflight`` blocks of ``sub_batch_keys`` × 96 bytes."""

    def __init__(self, blocks: int, keys_per_block: int) -> None:
        self.block_bytes = keys_per_block * HEADER_SIZE
        self.size = max(mmap.PAGESIZE, blocks * self.block_bytes)
        self.memory = mmap.mmap(-1, self.size)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.memory)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self.memory)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for block in range(blocks):
            self.free.put_nowait(block * self.block_bytes)

    def release(self) -> None:
        self.view.release()
        self._anchor = None
        self.memory.close()


class MooncakeBackend(StorageBackend):
    """Pages as Mooncake Store objects, moved zero-copy; see the module docstring.

    Args:
        extra_config: keys of :class:`MooncakeOptions`.

    Raises:
        ConfigError: a key is unknown or its value is invalid.
    """

    name = "mooncake"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        super().__init__(extra_config)
        self.options = validate_options(MooncakeOptions, extra_config, self.name)
        """The validated extra config."""
        self._state = _State.NEW
        self._store: Any = None  # mooncake.store.MooncakeDistributedStore, imported lazily
        self._arena: HostArena | None = None
        self._scratch: _Scratch | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._prefix = self.options.prefix
        self._probe_key = f"{self._prefix}:health"
        self._failing = False
        self._retry_at = 0.0

    @property
    def store(self) -> Any:
        """The ``MooncakeDistributedStore`` (for benchmarks and tests); ``None`` unless open."""
        return self._store

    def key_name(self, ns: bytes, key: bytes) -> str:
        """Return the object key of page ``key`` in ``ns``: ``<prefix>:<ns hex>:<key hex>``."""
        return f"{self._prefix}:{ns.hex()}:{key.hex()}"

    def _names(self, ns: bytes, keys: Sequence[bytes]) -> list[str]:
        """:meth:`key_name` of each key (the namespace part built once)."""
        head = f"{self._prefix}:{ns.hex()}:"
        return [head + key.hex() for key in keys]

    async def open(self, arena: HostArena) -> None:
        """Set up the client, mount this daemon's segment and register the arena for zero-copy.

        Raises:
            StorageError: Mooncake is not installed, the backend was opened before, the
                master or metadata server is unreachable, or a registration failed.
        """
        if self._state is not _State.NEW:
            raise StorageError(f"mooncake backend: open() called in state {self._state.value}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as err:
            raise StorageError(
                f"mooncake backend needs mooncake-transfer-engine (pip install 'kvtier[mooncake]'; "
                f"Debian also needs libibverbs1): {err}"
            ) from err
        opts = self.options
        for what, address in (
            ("master_server_address", opts.master_server_address),
            ("metadata_server", opts.metadata_server),
        ):
            problem = await _unreachable(address, opts.timeout_s)
            if problem is not None:
                raise StorageError(
                    f"mooncake backend: {what} = {address!r} is unreachable: {problem}"
                )
        # The transfer engine reads its bind address from the environment; without it a TCP
        # segment is advertised on whatever interface it picks.
        if _is_ip(opts.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", opts.local_hostname)
        self._pool = ThreadPoolExecutor(
            opts.max_inflight + 1, thread_name_prefix="kvtier-mooncake",
            initializer=_lower_priority, initargs=(opts.worker_nice,),
        )  # fmt: skip
        self._scratch = _Scratch(opts.max_inflight, opts.sub_batch_keys)
        self._arena = arena
        store = MooncakeDistributedStore()
        self._store = store
        self._state = _State.OPEN
        try:
            # Setup and registration run on the loop's executor, not on the lowered workers:
            # the threads Mooncake starts here inherit the priority of the one that starts them.
            rc = await self._setup_call(
                store.setup,
                opts.local_hostname,
                opts.metadata_server,
                opts.global_segment_size,
                opts.local_buffer_size,
                opts.protocol,
                opts.device_name,
                opts.master_server_address,
            )
            if rc != 0:
                raise StorageError(
                    f"mooncake backend: setup failed ({rc}) with master_server_address="
                    f"{opts.master_server_address!r}, metadata_server={opts.metadata_server!r}"
                )
            for what, address, size in (
                ("arena", arena.address, arena.size),
                ("header scratch", self._scratch.address, self._scratch.size),
            ):
                rc = await self._setup_call(store.register_buffer, address, size)
                if rc != 0:
                    raise StorageError(
                        f"mooncake backend: register_buffer of the {what} ({size} B) failed ({rc})"
                    )
        except BaseException:
            await self.close()
            raise

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return how many of ``keys``, from the first, are stored (one ``batch_is_exist``)."""
        self._check_open()
        if not keys or not self._admit():
            return 0
        names = self._names(ns, keys)
        answers: list[int] = await self._call(self._store.batch_is_exist, names)
        run = 0
        for answer in answers:
            if answer != 1:
                if answer < 0:
                    self._failed(answer)
                    return run
                break
            run += 1
        self._note_up()
        return run

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Read each page's object into its arena slot (header into the slot's headroom,
        or into scratch) and verify it.

        ``True`` only when the object had the expected size, its header names this namespace,
        key and length and the slot's xxh3 matches the header. Objects that do not verify
        count in ``stats.corrupt`` and are removed from the store.
        """
        self._check_batch(keys, offsets, length)
        if not keys:
            return []
        if not self._admit():
            self.stats.misses += len(keys)
            return [False] * len(keys)
        names = self._names(ns, keys)
        results = await self._sub_batches(self._get_job, names, ns, keys, offsets, length)
        flags: list[bool] = []
        corrupt_names: list[str] = []
        fault = 0
        for name, (code, ok) in zip(names, results):
            flags.append(ok)
            if ok:
                continue
            self.stats.misses += 1
            if code == HEADER_SIZE + length or code in SIZE_MISMATCH:
                self.stats.corrupt += 1
                corrupt_names.append(name)
            elif code < 0 and code not in _MISS_CODES:
                fault = fault or code
        found = sum(flags)
        self.stats.gets += found
        self.stats.get_bytes += found * length
        if fault:
            self._failed(fault)
        elif found:
            self._note_up()
        if corrupt_names:
            _log.warning(
                "mooncake backend: %d object(s) failed verification; removing them",
                len(corrupt_names),
            )
            await self._call(self._store.batch_remove, corrupt_names, True)
        return flags

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Write each page as one object (header ‖ arena slot); one flag per key.

        A key already in the store reads ``True`` and keeps its object; no space (``-200``)
        reads ``False`` without counting an error.
        """
        self._check_batch(keys, offsets, length)
        if not keys:
            return []
        if not self._admit():
            return [False] * len(keys)
        names = self._names(ns, keys)
        results = await self._sub_batches(self._put_job, names, ns, keys, offsets, length)
        flags: list[bool] = []
        fault = 0
        for code, _ in results:
            ok = code in (0, OBJECT_ALREADY_EXISTS)
            flags.append(ok)
            if not ok and code != NO_AVAILABLE_HANDLE:
                fault = fault or code
        self.stats.puts += sum(flags)
        self.stats.put_bytes += sum(flags) * length
        if fault:
            self._failed(fault)
        elif any(flags):
            self._note_up()
        return flags

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Remove the pages (force: ignores read leases); return how many were removed."""
        self._check_open()
        if not keys or not self._admit():
            return 0
        names = self._names(ns, keys)
        codes: list[int] = await self._call(self._store.batch_remove, names, True)
        fault = next((c for c in codes if c < 0 and c != OBJECT_NOT_FOUND), 0)
        if fault:
            self._failed(fault)
        return sum(1 for code in codes if code == 0)

    async def health(self) -> bool:
        """Return True when the client is healthy and the master answers a lookup."""
        if self._state is not _State.OPEN:
            return False
        if not self._admit(count=False):
            return False
        answer: list[int] = await self._call(self._store.batch_is_exist, [self._probe_key])
        if answer and answer[0] >= 0:
            self._note_up()
            return True
        self._note_down(f"code {answer[0] if answer else None}")
        return False

    async def close(self) -> None:
        """Unregister buffers, unmount the segment and close the client; idempotent.

        With the master gone, Mooncake's own teardown waits for its RPC timeouts (about
        ten seconds) before it returns.
        """
        if self._state is _State.CLOSED:
            return
        was_open = self._state is _State.OPEN
        self._state = _State.CLOSED
        store, self._store = self._store, None
        arena, self._arena = self._arena, None
        scratch, self._scratch = self._scratch, None
        pool, self._pool = self._pool, None

        def teardown() -> None:
            if store is not None and was_open:
                if arena is not None:
                    store.unregister_buffer(arena.address)
                if scratch is not None:
                    store.unregister_buffer(scratch.address)
                store.close()

        if pool is not None:
            # earlier jobs finish first: shutdown waits for them, and teardown runs after
            await run_to_completion(functools.partial(_shutdown_then, pool, teardown), None)
        if scratch is not None:
            scratch.release()

    # -- jobs (worker threads) -------------------------------------------------------

    def _put_job(
        self,
        names: list[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
        block: int,
    ) -> list[tuple[int, bool]]:
        """Hash each slot into its header, then one put: of one buffer per page (header in
        the slot's headroom, see the module docstring) or of two (header in scratch)."""
        arena = self._arena
        assert arena is not None
        in_place, hview, hbase, hpos = self._header_room(offsets, block)
        seal_headers(hview, hpos, arena.view, offsets, length, ns, keys)
        if in_place:
            codes = self._store.batch_put_from(
                names, [hbase + at for at in hpos], [HEADER_SIZE + length] * len(hpos)
            )
        else:
            codes = self._store.batch_put_from_multi_buffers(
                names, [[hbase + at, arena.address + off] for at, off in zip(hpos, offsets)],
                [[HEADER_SIZE, length]] * len(hpos),
            )  # fmt: skip
        return [(int(code), code == 0) for code in codes]

    def _get_job(
        self,
        names: list[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
        block: int,
    ) -> list[tuple[int, bool]]:
        """One get of each object into its slot (header into the slot's headroom) or into
        a scratch header and the slot; then verify each."""
        arena = self._arena
        assert arena is not None
        whole = HEADER_SIZE + length
        in_place, hview, hbase, hpos = self._header_room(offsets, block)
        if in_place:
            codes = self._store.batch_get_into(
                names, [hbase + at for at in hpos], [whole] * len(hpos)
            )
        else:
            codes = self._store.batch_get_into_multi_buffers(
                names, [[hbase + at, arena.address + off] for at, off in zip(hpos, offsets)],
                [[HEADER_SIZE, length]] * len(hpos),
            )  # fmt: skip
        landed = [i for i, code in enumerate(codes) if code == whole]
        verified = check_headers(
            hview, [hpos[i] for i in landed], arena.view, [offsets[i] for i in landed], length,
            ns, [keys[i] for i in landed],
        )  # fmt: skip
        ok = [False] * len(codes)
        for i, good in zip(landed, verified):
            ok[i] = good
        return [(int(code), flag) for code, flag in zip(codes, ok)]

    def _header_room(
        self, offsets: Sequence[int], block: int
    ) -> tuple[bool, memoryview, int, list[int]]:
        """Where a batch's headers go: ``(in_place, view, base address, positions)``, in
        the slots' headroom right before each payload when :func:`_one_buffer` allows,
        else in the scratch ``block``, one after another."""
        arena, scratch = self._arena, self._scratch
        assert arena is not None and scratch is not None
        if _one_buffer(arena, offsets):
            return True, arena.view, arena.address, [off - HEADER_SIZE for off in offsets]
        positions = [block + i * HEADER_SIZE for i in range(len(offsets))]
        return False, scratch.view, scratch.address, positions

    # -- internals ---------------------------------------------------------------------

    async def _sub_batches(
        self,
        job: Callable[..., list[tuple[int, bool]]],
        names: Sequence[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
    ) -> list[tuple[int, bool]]:
        """Run ``job`` over sub-batches concurrently; results in key order."""
        step = self.options.sub_batch_keys
        spans = [(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        if len(spans) == 1:
            return await self._with_block(job, names, ns, keys, offsets, length)
        parts = await asyncio.gather(
            *(
                self._with_block(job, names[a:b], ns, keys[a:b], offsets[a:b], length)
                for a, b in spans
            ),
            return_exceptions=True,
        )
        results: list[tuple[int, bool]] = []
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            results.extend(part)
        return results

    async def _with_block(
        self,
        job: Callable[..., list[tuple[int, bool]]],
        names: Sequence[str],
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
    ) -> list[tuple[int, bool]]:
        scratch = self._scratch
        assert scratch is not None
        block = await scratch.free.get()
        try:
            return await self._call(job, names, ns, keys, offsets, length, block)
        finally:
            scratch.free.put_nowait(block)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await run_to_completion(functools.partial(fn, *args), self._pool)

    async def _setup_call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await run_to_completion(functools.partial(fn, *args), None)

    def _check_open(self) -> HostArena:
        if self._state is not _State.OPEN or self._arena is None:
            raise StorageError(f"mooncake backend: used in state {self._state.value}")
        return self._arena

    def _check_batch(self, keys: Sequence[bytes], offsets: Sequence[int], length: int) -> None:
        arena = self._check_open()
        assert len(keys) == len(offsets), "one offset per key"
        low = HEADER_SIZE if arena.headroom >= HEADER_SIZE else 0  # the header's room
        assert all(low <= off and off + length <= arena.size for off in offsets), (
            "offset out of arena"
        )

    def _admit(self, count: bool = True) -> bool:
        """Whether an operation may reach the store now (a circuit breaker).

        Refused while the client itself reports the master unreachable, and for
        ``retry_interval_s`` after a fault; then one operation at a time is let through
        per interval until one succeeds. A refused operation counts as an error.
        """
        healthy = self._store.health_check() == 0
        now = time.monotonic()
        if healthy and now >= self._retry_at:
            if self._failing:
                self._retry_at = now + self.options.retry_interval_s
            return True
        if count:
            self.stats.errors += 1
        if not healthy:
            self._note_down("client reports the master unreachable")
        return False

    def _failed(self, code: int) -> None:
        self.stats.errors += 1
        self._note_down(f"code {code}")

    def _note_down(self, why: str) -> None:
        self._retry_at = time.monotonic() + self.options.retry_interval_s
        if not self._failing:
            self._failing = True
            _log.warning(
                "mooncake backend: master %s unreachable or failing (%s); L3 reads miss meanwhile",
                self.options.master_server_address,
                why,
            )

    def _note_up(self) -> None:
        if self._failing:
            self._failing = False
            self._retry_at = 0.0
            _log.info(
                "mooncake backend: master %s answers again", self.options.master_server_address
            )


def _lower_priority(nice: int) -> None:
    """Initializer of the worker threads: raise this thread's nice value by ``nice`` (Linux
    gives each thread its own); a refusal is logged and the thread runs as it is."""
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as err:
        _log.warning("mooncake backend: could not lower a worker's priority: %s", err)


def _one_buffer(arena: HostArena, offsets: Sequence[int]) -> bool:
    """Whether a batch's headers can go in its slots' headroom: the arena has room for one
    and no slot appears twice (two headers in one headroom would overwrite each other)."""
    return arena.headroom >= HEADER_SIZE and len(set(offsets)) == len(offsets)


async def _unreachable(address: str, timeout_s: float) -> str | None:
    """Why a TCP connection to ``address`` (``host:port`` or an http URL) fails; ``None`` if it
    connects or the address has another form (etcd lists, ``P2PHANDSHAKE``: setup decides)."""
    if address.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(address)
        host = parts.hostname
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as err:
            return str(err)
    else:
        host_text, _, port_text = address.rpartition(":")
        if not host_text or not port_text.isdigit() or "://" in address:
            return None
        host, port = host_text.strip("[]"), int(port_text)
    if not host:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as err:
        return f"{type(err).__name__}: {err}" if str(err) else f"no connection within {timeout_s} s"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:  # the peer reset first: it answered, which is all this checks
        pass
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _shutdown_then(pool: ThreadPoolExecutor, then: Callable[[], None]) -> None:
    pool.shutdown(wait=True)
    then()
