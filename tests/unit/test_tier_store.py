"""The L3 tier in-process (no daemon process): a real :class:`TierStore` over a real host pool
and an anonymous-memory arena, with the real ``file`` backend in a tmp dir, built the way
the daemon builds them. Also :func:`open_rig`, which the writer and prefetcher tests share.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvtier.config import DaemonConfig
from kvtier.daemon.counters import Counters
from kvtier.daemon.pool.host_pool import HostPool
from kvtier.daemon.storage.base import HostArena, StorageBackend
from kvtier.daemon.storage.file import FileBackend
from kvtier.daemon.storage.registry import slot_headroom
from kvtier.daemon.tier.prefetch import MAX_READ_BATCH, PrefetchJob
from kvtier.daemon.tier.rank_groups import Member
from kvtier.daemon.tier.tier import TierStore
from kvtier.ipc.protocol import Geometry

pytestmark = pytest.mark.timeout(30)

GEOMETRY = Geometry(num_layers=2, page_size=16, kv_heads=2, head_dim=64, dtype="float16")
"""16 KiB pages of 16 tokens."""

FINGERPRINT = hashlib.sha256(b"tier rig namespace").digest()


def chain(n: int, salt: str = "") -> list[bytes]:
    """``n`` page keys (32 bytes each)."""
    return [hashlib.sha256(f"{salt}page {i}".encode()).digest() for i in range(n)]


@dataclass(eq=False)
class RigSession:
    """A session as the tier sees it (:class:`~kvtier.daemon.tier.session.TierSession`)."""

    ns_id: int
    ns_fingerprint: bytes
    owner: int
    class_id: int
    geometry: Geometry = GEOMETRY
    prefetches: dict[str | bytes, PrefetchJob] = field(default_factory=dict)
    member: Member | None = None
    open: bool = True

    def is_open(self) -> bool:
        """Whether the session still accepts requests."""
        return self.open


@dataclass(eq=False)
class Rig:
    """One in-process tier and what it stands on."""

    cfg: DaemonConfig
    pool: HostPool
    counters: Counters
    tier: TierStore
    arena: HostArena
    l3_dir: Path
    session: RigSession

    @property
    def backend(self) -> FileBackend:
        """The open file backend (its own stats count puts and gets)."""
        backend = self.tier.l3.backend
        assert isinstance(backend, FileBackend)
        return backend

    def payload(self, slot: int) -> bytes:
        """The bytes of a pool slot's page."""
        off = self.pool.slot_offset(slot)
        return bytes(self.arena.view[off : off + GEOMETRY.page_bytes])

    def store(self, keys: list[bytes], parent: bytes | None = None) -> list[bytes]:
        """Put ``keys`` in L2 with random payloads, READY (as a STORE commits them).

        Returns:
            The payloads, one per key.
        """
        s = self.session
        pairs = self.pool.allocate(s.ns_id, s.owner, s.class_id, keys, parent)
        assert len(pairs) == len(keys), "the rig's pool is full"
        out = []
        for _, slot in pairs:
            data = os.urandom(GEOMETRY.page_bytes)
            off = self.pool.slot_offset(slot)
            self.arena.view[off : off + len(data)] = data
            out.append(data)
        self.pool.commit([slot for _, slot in pairs])
        return out

    def slots(self, keys: list[bytes]) -> list[int]:
        """Slots of the leading READY run of ``keys`` (pinned for a moment to find them)."""
        got = self.pool.pin(self.session.ns_id, keys)
        if got:
            self.pool.unpin(got)
        return got


async def until(pred: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Let the event loop run until ``pred()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


class UnlistedFileBackend(FileBackend):
    """The file backend as a store that cannot list its objects (loaded as ``dynamic``)."""

    list_keys = StorageBackend.list_keys  # the interface's default: None, cannot list


UNLISTED = {"module_path": __name__, "class_name": UnlistedFileBackend.__name__}
"""Extra config of a ``dynamic`` backend that is :class:`UnlistedFileBackend`."""


@contextlib.asynccontextmanager
async def open_rig(
    tmp_path: Path,
    *,
    run: bool = True,
    backend: str = "file",
    extra: dict[str, object] | None = None,
    **cfg: object,
) -> AsyncIterator[Rig]:
    """A tier over a 4 MiB pool with a file store in ``tmp_path/l3``.

    Args:
        tmp_path: where the store and the runtime directory go.
        run: run the tier (the writer and the backend's health checks) meanwhile.
        backend / extra: the backend's name and extra config beyond the file store's.
        cfg: more :class:`DaemonConfig` fields.
    """
    l3_dir = tmp_path / "l3"
    config = DaemonConfig(
        hicache_size=4 << 20,
        extent_size=1 << 20,
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "state",
        hicache_storage_backend=backend,  # type: ignore[arg-type]
        hicache_storage_backend_extra_config=json.dumps(
            {"path": str(l3_dir), "capacity": 64 << 20, "segment_bytes": 1 << 20, **(extra or {})}
        ),
        prefetch_threshold=0,
        **cfg,
    )  # type: ignore[arg-type]
    pool = HostPool.from_config(config, slot_headroom(backend))
    layout = pool.layout
    memory = mmap.mmap(-1, layout.capacity_bytes)
    anchor = ctypes.c_char.from_buffer(memory)
    address = ctypes.addressof(anchor)
    del anchor  # a live ctypes export would keep the mmap from closing
    view = memoryview(memory)
    arena = HostArena(
        view=view, address=address, size=layout.capacity_bytes, headroom=layout.headroom
    )
    counters = Counters()
    tier = TierStore(config, pool, counters, tmp_path / "run")
    await tier.open(arena)
    ns_id = pool.namespace_id(FINGERPRINT)
    owner = pool.owner_id("tenant")
    class_id = pool.register_class(GEOMETRY.page_bytes)
    tier.register(ns_id, FINGERPRINT, "tenant", class_id, GEOMETRY.page_bytes)
    rig = Rig(
        config, pool, counters, tier, arena, l3_dir, RigSession(ns_id, FINGERPRINT, owner, class_id)
    )
    task = asyncio.get_running_loop().create_task(tier.run()) if run else None
    try:
        yield rig
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await tier.prefetcher.close(5.0)
        await tier.close()
        view.release()
        memory.close()


async def written_to_l3(rig: Rig, keys: list[bytes]) -> None:
    """Queue ``keys`` (READY in L2) for L3 as a STORE commit does, and wait until written."""
    rig.tier.stored(rig.session, keys)
    pages, written, failed, left = await rig.tier.writer.sync(10.0)
    assert (failed, left) == (0, 0) and written == pages


# ---------------------------------------------------------------------------------- tests
async def test_prefetch_fetches_only_the_keys_after_skip(tmp_path: Path) -> None:
    """PREFETCH.skip: the leading ``skip`` keys are the caller's (in L2, it says); only the
    L3 run after them is fetched, even when those keys are not in L2 here."""
    async with open_rig(tmp_path) as rig:
        keys = chain(8)
        payloads = rig.store(keys)
        await written_to_l3(rig, keys)
        assert rig.pool.flush(rig.session.ns_id) == 8
        s = rig.session
        assert await rig.tier.prefetch(s, keys, "", skip=3) == 5
        assert await rig.tier.claim(s, keys, "", "wait_complete") == 0  # keys[:3] are not here
        assert rig.pool.resident_run(s.ns_id, keys[3:]) == 5
        assert [rig.payload(x) for x in rig.slots(keys[3:])] == payloads[3:]
        assert rig.counters.l3_prefetch_started_pages == 5
        # skip = len(keys): nothing to fetch; skip = 0 fetches from the L2 run's end
        assert await rig.tier.prefetch(s, keys, "", skip=8) == 0
        assert await rig.tier.prefetch(s, keys, "", skip=0) == 3
        assert await rig.tier.claim(s, keys, "", "wait_complete") == 8


async def test_write_through_commits_reach_l3_and_come_back(tmp_path: Path) -> None:
    """A committed STORE is written to L3 by the writer; after an L2 flush a prefetch and a
    claim bring the same bytes back."""
    async with open_rig(tmp_path) as rig:
        keys = chain(6)
        payloads = rig.store(keys)
        await written_to_l3(rig, keys)
        assert rig.backend.stats.puts == 6
        rig.pool.flush(rig.session.ns_id)
        assert await rig.tier.lookup_l3(rig.session, keys, 0) == (0, 6)
        assert await rig.tier.prefetch(rig.session, keys, "") == 6
        assert await rig.tier.claim(rig.session, keys, "", "wait_complete") == 6
        assert [rig.payload(x) for x in rig.slots(keys)] == payloads


async def test_flush_of_l3_deletes_what_the_store_lists(tmp_path: Path) -> None:
    """A restarted daemon (it wrote none of the pages) flushes them all: the store lists
    them (``list_keys``)."""
    keys = chain(6)
    async with open_rig(tmp_path) as rig:
        rig.store(keys)
        await written_to_l3(rig, keys)
    async with open_rig(tmp_path) as rig:
        assert await rig.tier.l3_run(FINGERPRINT, keys) == 6
        assert await rig.tier.flush([hashlib.sha256(b"another").digest()]) == (0, None)
        assert await rig.tier.flush([FINGERPRINT]) == (6, None)
        assert await rig.tier.l3_run(FINGERPRINT, keys) == 0
        assert rig.counters.l3_flushed_pages == 6


async def test_flush_of_an_unlistable_store_deletes_what_this_daemon_wrote(tmp_path: Path) -> None:
    theirs, mine = chain(4, salt="theirs "), chain(3, salt="mine ")
    async with open_rig(tmp_path, backend="dynamic", extra=UNLISTED) as rig:
        rig.store(theirs)
        await written_to_l3(rig, theirs)
    async with open_rig(tmp_path, backend="dynamic", extra=UNLISTED) as rig:
        assert isinstance(rig.backend, UnlistedFileBackend)
        rig.store(mine)
        await written_to_l3(rig, mine)
        assert await rig.tier.flush(None) == (3, None)
        assert await rig.tier.l3_run(FINGERPRINT, mine) == 0
        assert await rig.tier.l3_run(FINGERPRINT, theirs) == 4


async def test_a_prefetch_tells_each_batchs_evictions_before_the_next_batch(
    tmp_path: Path,
) -> None:
    """A prefetch into a full pool evicts as it allocates, batch by batch: what each batch
    evicted is told (to the KV event publisher) before the next batch is allocated, so that
    no page the fill commits meanwhile is announced before the removals that made room."""
    async with open_rig(tmp_path, prefetch_concurrency=1) as rig:
        s = rig.session
        keys = chain(2 * MAX_READ_BATCH)  # two read batches
        rig.store(keys)
        await written_to_l3(rig, keys)
        assert rig.pool.flush(s.ns_id) == len(keys)
        filler = chain(1024, salt="filler")  # more than the 4 MiB pool holds
        for i in range(0, len(filler), 16):  # L2 full of other chains
            got = rig.pool.allocate(s.ns_id, s.owner, s.class_id, filler[i : i + 16], None)
            rig.pool.commit([slot for _, slot in got])
        assert rig.pool.stats().pages_writing == 0
        rig.pool.drain_evicted()
        told: list[int] = []
        rig.tier.on_evicted = lambda pages: told.append(len(pages))
        assert await rig.tier.prefetch(s, keys, "") == len(keys)
        assert len(told) == 2 and sum(told) == len(keys), told  # one call per batch
        assert await rig.tier.claim(s, keys, "", "wait_complete") == len(keys)


async def test_a_shutdown_drain_writes_while_a_flush_holds_the_writer(tmp_path: Path) -> None:
    """A daemon stopping while a FLUSH holds the L3 writer paused (the FLUSH never ends
    now): the shutdown's drain still writes what is queued, before its deadline, and does
    not hold the event loop meanwhile."""
    async with open_rig(tmp_path) as rig:
        keys = chain(6)
        rig.store(keys)
        writer = rig.tier.writer
        with writer.paused():
            rig.tier.stored(rig.session, keys)
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticker = asyncio.create_task(tick())
            try:
                await writer.drain(time.monotonic() + 5.0)
            finally:
                ticker.cancel()
        assert writer.queued == 0 and rig.backend.stats.puts == 6
        assert await rig.tier.l3_run(rig.session.ns_fingerprint, keys) == 6
