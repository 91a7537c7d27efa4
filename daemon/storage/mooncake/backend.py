"""The ``mooncake`` backend: lifecycle, batches and fault handling (see the package docstring)."""

from __future__ import annotations

import asyncio
import functools
import secrets
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.config.errors import StorageError
from kvtier.daemon.storage.base import BackendState as _State
from kvtier.daemon.storage.base import HostArena, StorageBackend, check_pages, run_to_completion
from kvtier.daemon.storage.breaker import Breaker
from kvtier.daemon.storage.keys import ObjectNames
from kvtier.daemon.storage.mooncake.codes import (
    MISS_CODES,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    SIZE_MISMATCH,
)
from kvtier.daemon.storage.mooncake.connect import setup_with_bind_address, unreachable
from kvtier.daemon.storage.mooncake.jobs import Jobs
from kvtier.daemon.storage.mooncake.options import MooncakeOptions
from kvtier.daemon.storage.mooncake.scratch import Scratch
from kvtier.daemon.storage.mooncake.workers import shutdown_then, worker_pool
from kvtier.daemon.storage.objects import HEADER_SIZE
from kvtier.daemon.storage.options import redact_url, validate_options

__all__ = ["MooncakeBackend"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


class MooncakeBackend(StorageBackend):
    """Pages as Mooncake Store objects, moved zero-copy; see the package docstring.

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
        self._scratch: Scratch | None = None
        self._jobs: Jobs | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._object_names = ObjectNames(self.options.prefix)
        self._probe_key = f"{self.options.prefix}:health"
        # an object of this open's own: a master that restarted without its data lacks it
        self._epoch_key = f"{self.options.prefix}:epoch:{secrets.token_hex(8)}"
        self._epoch_put = False
        self._replaced = False
        self._set_up = False  # setup() ran: close() must close the client
        self._registered: list[int] = []  # buffers to unregister at close()
        self._breaker = Breaker(
            f"mooncake backend: master {redact_url(self.options.master_server_address)}",
            cooldown_s=self.options.retry_interval_s,
            log=_log,
        )

    @property
    def store(self) -> Any:
        """The ``MooncakeDistributedStore`` (for benchmarks and tests); ``None`` unless open."""
        return self._store

    def key_name(self, ns: bytes, key: bytes) -> str:
        """Return the object key of page ``key`` in ``ns``: ``<prefix>:<ns hex>:<key hex>``."""
        return self._object_names.name(ns, key)

    def _names(self, ns: bytes, keys: Sequence[bytes]) -> list[str]:
        """:meth:`key_name` of each key (the namespace part built once)."""
        return self._object_names.names(ns, keys)

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
            problem = await unreachable(address, opts.timeout_s)
            if problem is not None:
                raise StorageError(
                    f"mooncake backend: {what} = {redact_url(address)!r} is unreachable: {problem}"
                )
        self._pool = worker_pool(opts.max_inflight + 1, opts.worker_nice)
        self._scratch = scratch = Scratch(opts.max_inflight, opts.sub_batch_keys)
        self._arena = arena
        store = MooncakeDistributedStore()
        self._store = store
        self._jobs = Jobs(store, arena, scratch)
        self._state = _State.OPEN
        setup = functools.partial(
            store.setup,
            opts.local_hostname,
            opts.metadata_server,
            opts.global_segment_size,
            opts.local_buffer_size,
            opts.protocol,
            opts.device_name,
            opts.master_server_address,
        )
        try:
            # Setup and registration run on the loop's executor, not on the lowered workers:
            # the threads Mooncake starts here inherit the priority of the one that starts them.
            # The transfer engine's TCP bind address is set for the setup call only.
            rc = await self._setup_call(setup_with_bind_address, setup, opts.local_hostname)
            self._set_up = True
            if rc != 0:
                raise StorageError(
                    f"mooncake backend: setup failed ({rc}) with master_server_address="
                    f"{redact_url(opts.master_server_address)!r}, "
                    f"metadata_server={redact_url(opts.metadata_server)!r}"
                )
            for what, buf_address, size in (
                ("arena", arena.address, arena.size),
                ("header scratch", scratch.address, scratch.size),
            ):
                rc = await self._setup_call(store.register_buffer, buf_address, size)
                if rc != 0:
                    raise StorageError(
                        f"mooncake backend: register_buffer of the {what} ({size} B) failed ({rc})"
                    )
                self._registered.append(buf_address)
            self._epoch_put = await self._setup_call(store.put, self._epoch_key, b"1") == 0
        except BaseException:
            await self.close()
            raise

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return how many of ``keys``, from the first, are stored (one ``batch_is_exist``)."""
        self._check_open()
        if not keys or not self._admit():
            return 0
        names = self._names(ns, keys)
        answers: list[int] = await self._ask(self._store.batch_is_exist, names)
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
        results = await self._sub_batches(self._open_jobs().get, names, ns, keys, offsets, length)
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
            elif code < 0 and code not in MISS_CODES:
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
            await self._ask(self._store.batch_remove, corrupt_names, True)
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
        results = await self._sub_batches(self._open_jobs().put, names, ns, keys, offsets, length)
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
        if not keys:
            return 0
        if not self._admit():
            self.delete_faults += 1
            return 0
        names = self._names(ns, keys)
        codes: list[int] = await self._ask(self._store.batch_remove, names, True)
        fault = next((c for c in codes if c < 0 and c != OBJECT_NOT_FOUND), 0)
        if fault:
            self.delete_faults += 1
            self._failed(fault)
        return sum(1 for code in codes if code == 0)

    async def health(self) -> bool:
        """Return True when the client is healthy and the master answers a lookup.

        The answer also tells whether the master still has this open's epoch object: one
        that lost it restarted without its data (or was replaced), which :meth:`replaced`
        reports once; the object is then put again. An object Mooncake evicted for room
        reads the same way, which costs rewrites only (nothing is taken as present that
        is not)."""
        if self._state is not _State.OPEN:
            return False
        if not self._admit(count=False):
            return False
        answer: list[int] = await self._ask(
            self._store.batch_is_exist, [self._probe_key, self._epoch_key]
        )
        if not answer or answer[0] < 0:
            self._breaker.failed(f"code {answer[0] if answer else None}")
            return False
        self._note_up()
        if len(answer) > 1 and answer[1] == 0:
            self._replaced = self._replaced or self._epoch_put
            self._epoch_put = await self._ask(self._store.put, self._epoch_key, b"1") == 0
        return True

    def replaced(self) -> bool:
        """Whether a health check found the master without this open's epoch object since
        the last call (a restart that lost its data, or another master)."""
        replaced, self._replaced = self._replaced, False
        return replaced

    async def close(self) -> None:
        """Unregister buffers, unmount the segment and close the client; idempotent.

        With the master gone, Mooncake's own teardown waits for its RPC timeouts (about
        ten seconds) before it returns.
        """
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        set_up, self._set_up = self._set_up, False
        registered, self._registered = self._registered, []
        epoch_put, epoch_key = self._epoch_put, self._epoch_key
        store, self._store = self._store, None
        self._arena = None
        scratch, self._scratch = self._scratch, None
        pool, self._pool = self._pool, None
        self._jobs = None

        def teardown() -> None:  # only what setup() made: on a client never set up these
            if store is not None and set_up:  # calls crash the process
                if epoch_put:
                    store.remove(epoch_key)
                for address in registered:
                    store.unregister_buffer(address)
                store.close()

        if pool is not None:
            # earlier jobs finish first: shutdown waits for them, and teardown runs after
            await run_to_completion(functools.partial(shutdown_then, pool, teardown), None)
        if scratch is not None:
            scratch.release()

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

    async def _ask(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a call that touches no arena memory (lookups, removals) on the workers; the
        caller may stop waiting for it (a stalled master holds the worker, not the caller)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args)
        )

    async def _setup_call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await run_to_completion(functools.partial(fn, *args), None)

    def _check_open(self) -> HostArena:
        if self._state is not _State.OPEN or self._arena is None:
            raise StorageError(f"mooncake backend: used in state {self._state.value}")
        return self._arena

    def _check_batch(self, keys: Sequence[bytes], offsets: Sequence[int], length: int) -> None:
        """Raise StorageError unless every page, and the header room before it when the
        arena has headroom, lies inside the registered arena (raw pointers go to Mooncake)."""
        arena = self._check_open()
        low = HEADER_SIZE if arena.headroom >= HEADER_SIZE else 0  # the header's room
        check_pages(self.name, arena, keys, offsets, length, low)

    def _open_jobs(self) -> Jobs:
        jobs = self._jobs
        if jobs is None:  # _check_batch passed, so only a close() since can get here
            raise StorageError(f"mooncake backend: used in state {self._state.value}")
        return jobs

    def _admit(self, count: bool = True) -> bool:
        """Whether an operation may reach the store now (the circuit breaker).

        Refused while the client itself reports the master unreachable, and for
        ``retry_interval_s`` after a fault; then one operation at a time is let through
        per interval until one succeeds. A refused operation counts as an error.
        """
        healthy = self._store.health_check() == 0
        if healthy and self._breaker.admit():
            return True
        if count:
            self.stats.errors += 1
        if not healthy:
            self._breaker.failed("client reports the master unreachable")
        return False

    def _failed(self, code: int) -> None:
        self.stats.errors += 1
        self._breaker.failed(f"code {code}")

    def _note_up(self) -> None:
        self._breaker.succeeded()
