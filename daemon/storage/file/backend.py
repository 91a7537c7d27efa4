"""The ``file`` backend: the lifecycle and batches of a store in local segment files.

See the package docstring (:mod:`kvtier.daemon.storage.file`) for the design. This module
plans each batch under one lock (the index: :mod:`.index`), then runs its I/O outside it
(:mod:`.batch_io`) in a worker thread (:mod:`.gate`).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import resource
import threading
import time
import weakref
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvtier.config.errors import StorageError
from kvtier.daemon.storage.base import HostArena, StorageBackend
from kvtier.daemon.storage.file.batch_io import (
    free_payloads,
    read_runs,
    wipe_headers,
    write_runs,
)
from kvtier.daemon.storage.file.config import FileBackendConfig
from kvtier.daemon.storage.file.gate import WorkerGate
from kvtier.daemon.storage.file.index import STRIPES, SlotIndex
from kvtier.daemon.storage.file.segments import (
    LOCK_NAME,
    Segment,
    Slot,
    check_store_dir,
    close_fds,
    fresh_slots,
    open_segment,
    parse_segment_name,
    payload_slot,
    scan_segment,
    segment_name,
)
from kvtier.daemon.storage.options import validate_options

__all__ = ["FileBackend"]

_ID_BYTES = 32
PUNCH_WAIT_S = 1.0

DAMAGE_LOG_S = 60.0
"""Least time between two log lines about damaged objects found in the store."""

SEGMENT_FD_SHARE = 4
"""The store opens at most 1/this of the daemon's descriptor limit (``RLIMIT_NOFILE``) as
segments, each of which keeps its file open: the rest is for engines' memory and sockets."""


def _segment_limit() -> int:
    """The most segments the store keeps open (:data:`SEGMENT_FD_SHARE`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(1, limit // SEGMENT_FD_SHARE)


"""How long a put short of free slots waits, at a time, for a release_space pass to give
the slots it is punching back (rather than evict while slots are free)."""
_log = logging.getLogger("kvtier.daemon")


class FileBackend(StorageBackend):
    """The ``file`` L3 backend: pages in preallocated segment files on a local disk.

    Methods never raise for a miss or an I/O fault (``stats.errors``, read as a miss);
    malformed batches (ids not 32 bytes, offsets outside the arena) raise ``ValueError``.
    After ``close()`` every batch method answers as a miss. A cancelled call's worker
    thread still finishes its batch, so the arena slots it names stay in use until then.

    Attributes:
        config: the validated extra config.
        rebuild_seconds: how long ``open`` took to open the segments and rebuild the index.
    """

    name = "file"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        """Validate the extra config (see :class:`FileBackendConfig`); touches no file.

        Raises:
            ConfigError: an unknown key, a missing ``path`` or a bad value, named with it.
        """
        super().__init__(extra_config)
        self.config = validate_options(FileBackendConfig, extra_config, self.name)
        self.rebuild_seconds = 0.0
        self._lock = threading.Lock()  # guards self._slots
        self._punched = threading.Condition(self._lock)  # a release_space pass ended
        self._punching = 0  # release_space passes holding free slots
        self._gate = WorkerGate()
        self._arena: HostArena | None = None
        self._fds: list[int] = []  # every open fd: closed by close(), or at collection
        # a segment keeps a descriptor open: at most a share of the daemon's limit, so that
        # a store of many segments never leaves it none to answer engines with
        self._slots = SlotIndex(
            self.config.capacity,
            self.config.segment_bytes,
            _segment_limit(),
        )
        # why a segment could not be created for want of disk (ENOSPC, EDQUOT), until one
        # is created or a health check finds room (logged once per spell): meanwhile a
        # store holding no segment is unhealthy, one holding some evicts to write (health)
        self._disk_full: str | None = None
        self._damage_logged = -DAMAGE_LOG_S  # when damaged objects were last logged
        self._damage_held = 0  # damaged objects found since then
        weakref.finalize(self, close_fds, self._fds)

    # -- lifecycle -------------------------------------------------------------------------
    async def open(self, arena: HostArena) -> None:
        """Lock the directory, open its segments and rebuild the index from their headers.

        Raises:
            StorageError: the directory cannot be created or opened, or another process
                has the store open.
        """
        if self._arena is not None or self._gate.closed:
            raise StorageError("file backend: open() called twice")
        await asyncio.to_thread(self._open_sync)
        self._arena = arena

    def _open_sync(self) -> None:
        start, path = time.perf_counter(), self.config.path
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)  # tenants' pages: owner only
            check_store_dir(path)
            self._fds.append(
                os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            )
            fcntl.flock(self._fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            left = 0
            for name in sorted(os.listdir(path)):
                parsed = parse_segment_name(name)
                if parsed is not None:  # anything else is not ours
                    limit = self._slots.max_segments
                    slot, slots, seq = parsed
                    if limit is not None and len(self._slots.segments) >= limit:
                        left += 1  # kept on disk, not opened: its objects are misses
                        self._slots.note_seq(seq)  # a new segment never takes its name
                        continue
                    seg = self._open_segment(seq, slot, slots, create=False)
                    found = scan_segment(seg)
                    with self._lock:
                        self._slots.add_segment(seg, found, reserved=False)
            if left:
                _log.warning(
                    "file backend: %s holds %d segments more than the %d this daemon opens "
                    "(a quarter of its descriptor limit, RLIMIT_NOFILE): their pages are "
                    "misses; raise LimitNOFILE or segment_bytes",
                    path,
                    left,
                    self._slots.max_segments,
                )
        except OSError as err:
            close_fds(self._fds)
            with self._lock:
                self._slots.clear()
            why = "is in use by another process" if isinstance(err, BlockingIOError) else str(err)
            raise StorageError(f"file backend: path={str(path)!r}: {why}") from err
        self.rebuild_seconds = time.perf_counter() - start

    async def close(self) -> None:
        """Wait for the batches in flight, then close every file; idempotent."""
        if not self._gate.closed:
            await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        self._gate.close()
        close_fds(self._fds)

    async def health(self) -> bool:
        """Return True while open, the store directory is writable and a put can find room:
        the file system had room for the segment the store last needed, has room for one
        now, or the store holds segments whose objects it can evict instead (a full disk
        under a store that holds pages is a full cache, not a broken one; were it taken as
        unhealthy, no put would run to find that room)."""
        if self._arena is None or self._gate.closed:
            self.health_cause = "closed"
            return False
        where = str(self.config.path)
        if self._disk_full is not None:
            try:
                vfs = os.statvfs(self.config.path)
            except OSError as err:
                self.health_cause = f"path={where!r}: {err.strerror or err}"
                return False
            if vfs.f_bavail * vfs.f_frsize >= self.config.segment_bytes:
                self._disk_full = None  # room again: the next put creates its segment
            elif not self._slots.segments:  # nothing to evict either (read without the lock)
                self.health_cause = (
                    f"path={where!r}: no room for a segment of {self.config.segment_bytes} "
                    f"bytes ({self._disk_full})"
                )
                return False
        if not os.access(self.config.path, os.W_OK | os.X_OK):
            self.health_cause = f"path={where!r}: the directory is not writable"
            return False
        self.health_cause = None
        return True

    # -- segments --------------------------------------------------------------------------
    def _open_segment(self, seq: int, slot: int, slots: int, create: bool) -> Segment:
        seg = open_segment(
            self.config.path, seq, slot, slots, create, durable=self.config.fsync == "batch"
        )
        self._fds.append(seg.fd)
        return seg

    def _retire(self, seg: Segment) -> None:
        """Remove a segment :meth:`SlotIndex.reclaim` gave up: its file is emptied and
        unlinked, its descriptor closed (a read in flight through it fails its checks: a
        miss)."""
        with self._lock:
            self._fds.remove(seg.fd)
        try:
            os.ftruncate(seg.fd, 0)
            os.unlink(self.config.path / segment_name(seg.payload_slot, seg.slots, seg.seq))
        except OSError as err:
            _log.warning("file backend: cannot remove a reclaimed segment: %s", err)
        finally:
            os.close(seg.fd)

    def _grow(self, slot: int, reservation: tuple[int, int]) -> bool:
        """Create a reserved segment (outside the lock) and free its slots; False on failure."""
        seq, count = reservation
        try:
            seg = self._open_segment(seq, slot, count, create=True)
        except OSError as err:
            with self._lock:
                self._slots.unreserve(slot, count)
                self.stats.errors += 1
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                if self._disk_full is None:
                    _log.warning(
                        "file backend: path=%r: cannot create a segment of %d bytes: %s",
                        str(self.config.path),
                        count * slot,
                        err.strerror,
                    )
                self._disk_full = err.strerror or str(err)
            return False
        self._disk_full = None
        with self._lock:
            self._slots.add_segment(seg, fresh_slots(seg), reserved=True)
        return True

    # -- batches ---------------------------------------------------------------------------
    def _check(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> HostArena:
        arena = self._arena
        if arena is None:
            raise StorageError("file backend: used before open()")
        if len(ns) != _ID_BYTES or len(keys) != len(offsets) or length <= 0:
            raise ValueError(
                f"bad batch: ns of {len(ns)} bytes, {len(keys)} keys, "
                f"{len(offsets)} offsets, length {length}"
            )
        for key, off in zip(keys, offsets):
            if len(key) != _ID_BYTES or off < 0 or off + length > arena.size:
                raise ValueError(f"bad page: key of {len(key)} bytes at arena offset {off}")
        return arena

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` in the index (no I/O).

        Runs on the event loop without the lock, which a put batch's thread holds while it
        plans: single dict look-ups are atomic, and an object a batch is writing meanwhile
        is not ready yet, so it reads as absent, as it would a moment earlier."""
        if self._gate.closed:
            return 0
        index = self._slots.index
        for run, key in enumerate(keys):
            slot = index.get((ns, key))
            if slot is None or not slot.ready:
                return run
        return len(keys)

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Store each page ``arena[offset:offset+length]`` under its key; one flag per key.

        A key already stored is touched, not rewritten (``True``); a key another batch is
        writing at this moment is skipped (``False``). When the store is full and room could
        only come from evicting a key of this very batch, the rest of the batch is refused
        (``False``): a stored prefix is worth more than its tail.
        """
        arena = self._check(ns, keys, offsets, length)
        args = (arena, ns, keys, offsets, length)
        return await self._gate.run(self._put_sync, [False] * len(keys), *args)

    def _put_sync(
        self,
        arena: HostArena,
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
    ) -> list[bool]:
        done, size = [False] * len(keys), payload_slot(length)
        batch = {(ns, key) for key in keys}
        plan: list[tuple[int, Slot]] = []  # (key index, slot this batch writes)
        slots = self._slots
        with self._lock:
            cls = slots.size_class(size)
            for i in range(len(keys) - 1, -1, -1):  # touch stored keys first, so none is evicted
                slot = slots.index.get((ns, keys[i]))
                if slot is not None and slot.ready and slot.length == length:
                    cls.lru.move_to_end(slot)
                    done[i] = True
        pending = [i for i in range(len(keys)) if not done[i]][::-1]  # popped from the end
        may_grow = True
        limit = _segment_limit()  # as the limit stands now (an operator may change it)
        with self._lock:
            slots.max_segments = limit
        mine: Segment | None = None  # the segment this batch writes to now
        touched: list[Segment] = []  # segments this batch counts itself a writer of
        while pending:
            reservation = retired = None
            with self._lock:
                while pending:
                    ident = (ns, keys[pending[-1]])
                    other = slots.index.get(ident)
                    if other is not None:  # stored meanwhile, or being written by another batch
                        done[pending.pop()] = other.ready and other.length == length
                        continue
                    slot = cls.take(mine, shared=False)
                    if (
                        slot is None
                        and may_grow
                        and len(cls.free) < STRIPES
                        and (reservation := slots.reserve_segment(size))
                    ):
                        break
                    slot = slot or cls.take(mine, shared=True)
                    while slot is None and self._punching:  # free slots are being punched
                        self._punched.wait(PUNCH_WAIT_S)
                        slot = cls.take(mine, shared=True)
                    slot = slot or slots.evict(cls, batch)
                    if slot is None and (retired := slots.reclaim(size)) is not None:
                        may_grow = True  # another size's segment gave its bytes back
                        break
                    if slot is None:
                        pending.clear()  # full: refuse the tail rather than evict its prefix
                        break
                    if slot.seg is not mine:
                        mine = slot.seg
                        touched.append(mine)
                        cls.enter(mine)
                    slot.ident, slot.length, slot.ready = ident, length, False
                    slot.gen += 1
                    slots.index[ident] = slot
                    plan.append((pending.pop(), slot))
            if retired is not None:
                self._retire(retired)
            if reservation is not None:
                may_grow = self._grow(size, reservation)
        written = self._write(arena, ns, keys, offsets, length, plan)
        planned = dict(plan)
        with self._lock:
            for seg in touched:
                cls.leave(seg)
            for i in range(len(keys) - 1, -1, -1):  # k0 ends most recent: the tail goes first
                slot = planned.get(i)
                if slot is not None and written[i]:
                    slot.ready = done[i] = True
                    cls.lru[slot] = None
                    self.stats.puts += 1
                    self.stats.put_bytes += length
                elif slot is not None:
                    del slots.index[slot.ident]  # type: ignore[arg-type]
                    slots.release([slot])
                    self.stats.errors += 1
                elif done[i] and (slot := slots.index.get((ns, keys[i]))) and slot.ready:
                    cls.lru.move_to_end(slot)
        return done

    def _write(
        self,
        arena: HostArena,
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
        plan: list[tuple[int, Slot]],
    ) -> dict[int, bool]:
        """Write the planned objects (see :func:`.batch_io.write_runs`)."""
        return write_runs(
            arena.view, ns, keys, offsets, length, plan, durable=self.config.fsync == "batch"
        )

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Read each key's payload into ``arena[offset:offset+length]``; one flag per key.

        ``True`` only when the header matched (namespace, key, length) and both checksums
        verified. A damaged object is a miss counted in ``stats.corrupt``; its slot is freed.
        """
        arena = self._check(ns, keys, offsets, length)
        args = (arena, ns, keys, offsets, length)
        return await self._gate.run(self._get_sync, [False] * len(keys), *args)

    def _get_sync(
        self,
        arena: HostArena,
        ns: bytes,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        length: int,
    ) -> list[bool]:
        slots = self._slots
        with self._lock:
            plan = [
                (i, slot, slot.gen)
                for i, key in enumerate(keys)
                if (slot := slots.index.get((ns, key))) is not None
                and slot.ready
                and slot.length == length
            ]
        found, bad, errors = read_runs(
            arena.view, ns, keys, offsets, length, [(i, slot) for i, slot, _ in plan]
        )
        by_index = {i: (slot, gen) for i, slot, gen in plan}
        with self._lock:
            for i, slot, gen in reversed(plan):
                if found[i] and slot.gen == gen and slot.ready:
                    slots.classes[slot.seg.payload_slot].lru.move_to_end(slot)
            # a slot reallocated since we looked was overwritten under us: a plain miss
            damaged = slots.detach(
                [slot for slot, gen in map(by_index.__getitem__, bad) if slot.gen == gen]
            )
            slots.dropped.extend(slot.ident for slot in damaged)  # type: ignore[misc]
            hits = sum(found)
            self.stats.gets += hits
            self.stats.get_bytes += hits * length
            self.stats.misses += len(keys) - hits
            self.stats.corrupt += len(damaged)
            self.stats.errors += errors
            if damaged:
                self._damage_seen(damaged)
        self._wipe(damaged)
        return found

    def _damage_seen(self, damaged: Sequence[Slot]) -> None:
        """Log objects found damaged (their payload or header no longer verifies): at once,
        then at most once per :data:`DAMAGE_LOG_S` with the count of those not logged."""
        now = time.monotonic()
        self._damage_held += len(damaged)
        if now - self._damage_logged < DAMAGE_LOG_S:
            return
        segs = sorted({segment_name(s.seg.payload_slot, s.seg.slots, s.seg.seq) for s in damaged})
        _log.warning(
            "file backend: %d damaged objects in %s dropped (they no longer verify; segments "
            "%s): misses, recomputed by the engines",
            self._damage_held,
            self.config.path,
            ", ".join(segs[:4]) + (", ..." if len(segs) > 4 else ""),
        )
        self._damage_logged, self._damage_held = now, 0

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Delete the keys; return how many were stored.

        Their headers are zeroed on disk and their slots freed; the slots keep their disk
        blocks (the next writes overwrite them at full speed) until :meth:`release_space`."""
        return await self._gate.run(self._delete_sync, 0, ns, keys)

    def _delete_sync(self, ns: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            victims = self._slots.detach(
                [slot for key in keys if (slot := self._slots.index.get((ns, key)))]
            )
        if self._wipe(victims):
            with self._lock:
                self.delete_faults += 1
        return len(victims)

    async def release_space(self) -> int:
        """Punch every free slot's payload out of the segment files (``fallocate`` hole
        punching): after a FLUSH the store keeps only its header tables and live objects
        on disk. Returns the payload bytes released (0 where the file system cannot punch).
        """
        return await self._gate.run(self._release_sync, 0)

    def _release_sync(self) -> int:
        with self._lock:
            free = self._slots.take_free()
            self._punching += 1  # a put short of slots waits for these, never evicts
        try:
            errors = free_payloads(free)
        finally:
            with self._lock:
                self._slots.release(free)
                self._punching -= 1
                self._punched.notify_all()
        with self._lock:
            self.stats.errors += errors
        return sum(slot.seg.payload_slot for slot in free)

    def _wipe(self, slots: list[Slot]) -> int:
        """Zero detached slots' headers, so they stay gone after a restart; then free them.
        Returns the headers that could not be zeroed."""
        errors = wipe_headers(slots)
        with self._lock:
            self.stats.errors += errors
            self._slots.release(slots)
        return errors

    # -- introspection ---------------------------------------------------------------------
    async def list_keys(
        self, namespaces: AbstractSet[bytes] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """Every ``(namespace, key)`` stored, of ``namespaces`` (None: of all), from the
        in-memory index (no I/O); empty once closed."""
        if self._gate.closed:
            return []
        with self._lock:
            return [
                ident
                for ident, slot in self._slots.index.items()
                if slot.ready and (namespaces is None or ident[0] in namespaces)
            ]

    def dropped(self) -> list[tuple[bytes, bytes]]:
        """``(namespace, key)`` of the objects evicted for room or discarded as damaged
        since the last call (at most :data:`~.index.DROP_LOG`)."""
        with self._lock:
            return self._slots.take_dropped()

    @property
    def evictions(self) -> int:
        """Objects evicted to make room."""
        return self._slots.evictions

    @property
    def allocated_bytes(self) -> int:
        """Bytes of segment files created (at most ``config.capacity``, bar a reopen)."""
        return self._slots.allocated

    def entries(self) -> list[tuple[bytes, bytes, int]]:
        """Return a snapshot of the stored objects as (namespace, key, payload length)."""
        with self._lock:
            return [
                (*ident, slot.length) for ident, slot in self._slots.index.items() if slot.ready
            ]
