"""The default L3 backend, ``file``: a local disk store in preallocated segment files.

Not one file per page (creating, opening and closing a file per 256 KiB page costs more
than the copy). Pages live in slots of a few large segment files, preallocated with
``posix_fallocate``; one segment holds one slot size::

    <path>/kvtier-file.lock            flock'd while a process has the store open
    <path>/seg-<slot_bytes>x<slots>-<seq>.kvt

    segment   ┌───────────────────────┬───────────────────────┬─────
              │ slot 0                │ slot 1                │ ...
              │ header(96) │ payload  │ header(96) │ payload  │
              └───────────────────────┴───────────────────────┴─────
    slot_bytes = round_up(96 + payload length, 4096)

A put is one ``os.pwritev([header, payload])`` per object straight from the arena; a get
is one ``os.preadv([header, arena slot])`` straight into the arena. Checksumming runs
while the 256 KiB are hot in cache: before the write (``encode_header``), right after the
read. A batch is one worker-thread hop.

Crash safety: every read verifies the header (magic, version, namespace, key, length,
header checksum) and the payload checksum the header records; anything else is a miss
counted in ``stats.corrupt`` whose slot is wiped and freed. Overwriting a slot in place
needs no separate invalidation: whatever mixture of old and new bytes a crash (or a
racing write) leaves, the surviving header either describes its payload exactly or fails
its checksum. An index entry becomes visible only after its write completes. Deleted and
corrupt slots get a zeroed header so they do not come back at the next open.

Durability (``fsync``): ``"never"`` leaves writes in the page cache, which survives a crash
of the daemon but not a power loss (pages written in the last seconds then read as misses,
never as wrong data). ``"batch"`` runs ``fdatasync`` on the touched segments before a put
batch reports success: durable, at roughly a tenth of the write bandwidth.

Index: an in-memory dict (namespace, key) -> slot record, rebuilt at open by reading the
96-byte header of every slot (the payload is verified on read). Eviction is LRU per slot
size, tail first: a put batch (a prefix chain k0..kn) enters and touches the LRU in reverse
order, so kn is evicted before k0. One lock guards the bookkeeping; I/O runs outside it.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import re
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvtier.config.errors import ConfigError, StorageError
from kvtier.daemon.storage.base import HostArena, StorageBackend
from kvtier.daemon.storage.objects import (
    HEADER_SIZE,
    MAGIC,
    check_header,
    encode_header,
    payload_checksum,
)

_T = TypeVar("_T")
_ALIGN = 4096
_ID_BYTES = 32
_LOCK_NAME = "kvtier-file.lock"
_SEGMENT_RE = re.compile(r"seg-(\d+)x(\d+)-(\d+)\.kvt")
_SIZE_RE = re.compile(r"\s*(\d+)\s*([A-Za-z]*)\s*")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_U64 = struct.Struct("<Q")
_ZERO_HEADER = bytes(HEADER_SIZE)
_DEFAULT_CAPACITY = 16 * 2**30
_DEFAULT_SEGMENT = 256 * 2**20


def slot_size(length: int) -> int:
    """Return the slot size for a payload of ``length`` bytes: header + payload, 4 KiB aligned."""
    return -(-(HEADER_SIZE + length) // _ALIGN) * _ALIGN


def _parse_size(key: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.fullmatch(value)) and m[2].lower() in _UNITS:
        size = int(m[1]) * _UNITS[m[2].lower()]
    else:
        raise ConfigError(f"file backend: {key}={value!r} is not a size (bytes, or e.g. '16GiB')")
    if size < _ALIGN:
        raise ConfigError(f"file backend: {key}={value!r} must be at least {_ALIGN} bytes")
    return size


@dataclass(frozen=True, slots=True)
class FileBackendConfig:
    """The ``file`` backend's extra config, validated.

    Attributes:
        path: the store directory (key ``path``, required); created if missing.
        capacity: most bytes of segment files (key ``capacity``: int bytes or a string
            such as ``"16GiB"``); segments are created lazily up to it, then LRU evicts.
        segment_bytes: size of one segment file (key ``segment_bytes``, default 256 MiB).
        fsync: ``"never"`` (page cache only: survives a process crash, not a power loss)
            or ``"batch"`` (``fdatasync`` the touched segments after each put batch).
    """

    path: Path
    capacity: int = _DEFAULT_CAPACITY
    segment_bytes: int = _DEFAULT_SEGMENT
    fsync: Literal["never", "batch"] = "never"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> FileBackendConfig:
        """Validate ``extra``; raise :class:`ConfigError` naming any bad or unknown key and value."""
        for key, value in extra.items():
            if key not in ("path", "capacity", "segment_bytes", "fsync"):
                raise ConfigError(f"file backend: unknown extra-config key {key!r} (value {value!r})")
        path = extra.get("path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"file backend: path={path!r} must name a directory")
        fsync = extra.get("fsync", "never")
        if fsync not in ("never", "batch"):
            raise ConfigError(f"file backend: fsync={fsync!r} must be 'never' or 'batch'")
        return cls(
            path=Path(path),
            capacity=_parse_size("capacity", extra.get("capacity", _DEFAULT_CAPACITY)),
            segment_bytes=_parse_size("segment_bytes", extra.get("segment_bytes", _DEFAULT_SEGMENT)),
            fsync=fsync,
        )


@dataclass(eq=False, slots=True)
class _Segment:
    seq: int
    slot_bytes: int
    slots: int
    fd: int


@dataclass(eq=False, slots=True)
class _Slot:
    """One slot, allocated once per segment; in the index when ``ident`` is set."""

    seg: _Segment
    pos: int
    ident: tuple[bytes, bytes] | None = None
    length: int = 0
    ready: bool = False  # False while being written: invisible to exists/get
    gen: int = 0  # bumped at every allocation, so a stale reader never frees a new object


@dataclass(eq=False, slots=True)
class _SizeClass:
    free: list[_Slot] = field(default_factory=list)
    lru: OrderedDict[_Slot, None] = field(default_factory=OrderedDict)  # oldest first


def _close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class FileBackend(StorageBackend):
    """The ``file`` L3 backend: pages in preallocated segment files on a local disk.

    Methods never raise for a miss or an I/O fault (``stats.errors``, read as a miss);
    malformed arguments (ids not 32 bytes, offsets outside the arena) raise ``ValueError``.
    After ``close()`` every batch method answers as a miss. A cancelled call's worker
    thread still finishes its batch, so the arena slots it names stay in use until then.

    Attributes:
        config: the validated extra config.
        evictions: objects evicted to make room.
        rebuild_seconds: how long ``open`` took to rebuild the index.
    """

    name = "file"

    def __init__(self, extra_config: dict[str, Any]) -> None:
        super().__init__(extra_config)
        self.config = FileBackendConfig.from_extra(extra_config)
        self.evictions = 0
        self.rebuild_seconds = 0.0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._closed = False
        self._arena: HostArena | None = None
        self._fds: list[int] = []  # every open fd, closed by close() or at collection
        self._segments: list[_Segment] = []
        self._classes: dict[int, _SizeClass] = {}
        self._index: dict[tuple[bytes, bytes], _Slot] = {}
        self._allocated = 0
        self._next_seq = 0
        weakref.finalize(self, _close_fds, self._fds)

    # -- lifecycle ---------------------------------------------------------------------
    async def open(self, arena: HostArena) -> None:
        """Lock the directory, open its segments and rebuild the index from their headers.

        Raises:
            StorageError: the directory cannot be created or another process holds it.
        """
        if self._arena is not None or self._closed:
            raise StorageError("file backend: open() called twice")
        await asyncio.to_thread(self._open_sync)
        self._arena = arena

    def _open_sync(self) -> None:
        start, path = time.perf_counter(), self.config.path
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._fds.append(os.open(path / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
            fcntl.flock(self._fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            for name in sorted(os.listdir(path)):
                m = _SEGMENT_RE.fullmatch(name)
                if m is None or int(m[1]) % _ALIGN or int(m[1]) <= HEADER_SIZE or int(m[2]) < 1:
                    continue
                seg = self._open_segment(int(m[3]), int(m[1]), int(m[2]), create=False)
                self._add_segment(seg, self._scan(seg))
        except OSError as err:
            _close_fds(self._fds)
            self._segments.clear()
            self._classes.clear()
            self._index.clear()
            self._allocated = self._next_seq = 0
            busy = isinstance(err, BlockingIOError)
            raise StorageError(f"file backend: path={str(path)!r} "
                               + ("is in use by another process" if busy else f"cannot be opened: {err}")) from err
        self.rebuild_seconds = time.perf_counter() - start

    async def close(self) -> None:
        """Wait for batches in flight, then close every file; idempotent."""
        if not self._closed:
            await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        with self._idle:
            self._closed = True
            while self._busy:
                self._idle.wait()
        _close_fds(self._fds)

    async def health(self) -> bool:
        """Return True while open and the store directory is writable."""
        return self._arena is not None and not self._closed and os.access(self.config.path, os.W_OK | os.X_OK)

    # -- segments ------------------------------------------------------------------------
    def _open_segment(self, seq: int, slot_bytes: int, slots: int, create: bool) -> _Segment:
        path = self.config.path / f"seg-{slot_bytes}x{slots}-{seq:06d}.kvt"
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            os.posix_fallocate(fd, 0, slot_bytes * slots)  # also restores a truncated segment's size
            if create and self.config.fsync == "batch":
                os.fsync(fd)
                dfd = os.open(self.config.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        self._fds.append(fd)
        return _Segment(seq, slot_bytes, slots, fd)

    def _scan(self, seg: _Segment) -> list[_Slot]:
        """Read every written slot's header; a slot whose header verifies is named by it.

        Only slots in the segment's data ranges (``SEEK_DATA``) are read: never-written
        preallocated space reads as a hole, so a fresh store opens without touching it.
        """
        slots = [_Slot(seg, i * seg.slot_bytes) for i in range(seg.slots)]
        os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_RANDOM)  # readahead would read whole slots
        for i in self._data_slots(seg):
            hdr = os.pread(seg.fd, HEADER_SIZE, slots[i].pos)
            if len(hdr) == HEADER_SIZE and hdr[:4] == MAGIC:
                ns, key, (length,) = hdr[8:40], hdr[40:72], _U64.unpack_from(hdr, 72)
                if slot_size(length) == seg.slot_bytes and check_header(hdr, ns, key, length) is not None:
                    slots[i].ident, slots[i].length, slots[i].ready = (ns, key), length, True
        os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_NORMAL)
        return slots

    @staticmethod
    def _data_slots(seg: _Segment) -> Iterator[int]:
        """Yield the slots whose first byte lies in data (all of them where holes are unknown)."""
        pos, size = 0, seg.slots * seg.slot_bytes
        while pos < size:
            try:
                pos = os.lseek(seg.fd, pos, os.SEEK_DATA)
            except OSError as err:
                if err.errno == errno.ENXIO:  # nothing but holes from here on
                    return
                raise
            end = min(os.lseek(seg.fd, pos, os.SEEK_HOLE), size)
            yield from range(-(-pos // seg.slot_bytes), -(-end // seg.slot_bytes))
            pos = end

    def _add_segment(self, seg: _Segment, slots: list[_Slot], reserved: bool = False) -> None:
        with self._lock:
            self._segments.append(seg)
            self._next_seq = max(self._next_seq, seg.seq + 1)
            self._allocated += 0 if reserved else seg.slot_bytes * seg.slots
            cls = self._classes.setdefault(seg.slot_bytes, _SizeClass())
            for slot in reversed(slots):  # the free list pops slot 0 first
                if slot.ident is not None and slot.ident not in self._index:
                    self._index[slot.ident] = slot
                    cls.lru[slot] = None
                else:  # free, or a duplicate of an object already indexed
                    slot.ident, slot.ready = None, False
                    cls.free.append(slot)

    def _reserve_segment(self, slot_bytes: int) -> tuple[int, int] | None:
        """Under the lock: reserve capacity for one more segment; (seq, slots) or None."""
        slots = min(max(1, self.config.segment_bytes // slot_bytes),
                    (self.config.capacity - self._allocated) // slot_bytes)
        if slots == 0:
            return None
        self._allocated += slots * slot_bytes
        self._next_seq += 1
        return self._next_seq - 1, slots

    # -- batches -------------------------------------------------------------------------
    def _check(self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int) -> HostArena:
        arena = self._arena
        if arena is None:
            raise StorageError("file backend: used before open()")
        if len(ns) != _ID_BYTES or len(keys) != len(offsets) or length <= 0:
            raise ValueError(f"bad batch: ns of {len(ns)} bytes, {len(keys)} keys, "
                             f"{len(offsets)} offsets, length {length}")
        for key, off in zip(keys, offsets):
            if len(key) != _ID_BYTES or off < 0 or off + length > arena.size:
                raise ValueError(f"bad page: key of {len(key)} bytes at arena offset {off}")
        return arena

    async def _run(self, fn: Callable[..., _T], default: _T, *args: Any) -> _T:
        """Run one batch in a worker thread; counted so close() waits for it."""
        def guarded() -> _T:
            with self._lock:
                if self._closed:
                    return default
                self._busy += 1
            try:
                return fn(*args)
            finally:
                with self._idle:
                    self._busy -= 1
                    if not self._busy:
                        self._idle.notify_all()
        return await asyncio.to_thread(guarded)

    async def exists(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Return the length of the leading run of ``keys`` in the index (no I/O)."""
        with self._lock:
            if self._closed:
                return 0
            for run, key in enumerate(keys):
                slot = self._index.get((ns, key))
                if slot is None or not slot.ready:
                    return run
            return len(keys)

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Store each page ``arena[offset:offset+length]`` under its key; one flag per key.

        A key already stored is touched, not rewritten (``True``); a key another batch is
        writing at this moment is skipped (``False``). When space runs out and eviction would
        have to take a key of this batch, the rest of the batch is refused (``False``).
        """
        arena = self._check(ns, keys, offsets, length)
        return await self._run(self._put_sync, [False] * len(keys), arena, ns, keys, offsets, length)

    def _put_sync(self, arena: HostArena, ns: bytes, keys: Sequence[bytes],
                  offsets: Sequence[int], length: int) -> list[bool]:
        done = [False] * len(keys)
        batch = {(ns, key) for key in keys}
        plan: list[tuple[int, _Slot]] = []  # (key index, slot this batch writes)
        with self._lock:
            cls = self._classes.setdefault(slot_size(length), _SizeClass())
            for i in range(len(keys) - 1, -1, -1):  # touch stored keys first, tail first
                slot = self._index.get((ns, keys[i]))
                if slot is not None and slot.ready and slot.length == length:
                    cls.lru.move_to_end(slot)
                    done[i] = True
        pending = [i for i in range(len(keys)) if not done[i]]
        grow: tuple[int, int] | None = None
        while pending:
            with self._lock:
                while pending:
                    ident = (ns, keys[pending[0]])
                    if (other := self._index.get(ident)) is not None:  # stored meanwhile, or in flight
                        done[pending[0]] = other.ready and other.length == length
                        pending.pop(0)
                        continue
                    if cls.free:
                        slot = cls.free.pop()
                    elif grow is None and (grow := self._reserve_segment(slot_size(length))):
                        break
                    elif cls.lru and next(iter(cls.lru)).ident not in batch:
                        slot, _ = cls.lru.popitem(last=False)
                        del self._index[slot.ident]  # type: ignore[arg-type]
                        self.evictions += 1
                    else:
                        pending.clear()  # full: refuse the tail rather than evict its prefix
                        break
                    slot.ident, slot.length, slot.ready, slot.gen = ident, length, False, slot.gen + 1
                    self._index[ident] = slot
                    plan.append((pending.pop(0), slot))
            if pending and grow is not None:
                try:
                    seg = self._open_segment(grow[0], slot_size(length), grow[1], create=True)
                except OSError:
                    with self._lock:
                        self._allocated -= grow[1] * slot_size(length)
                        self.stats.errors += 1
                    grow = (-1, 0)  # no more growth in this batch; evict instead
                else:
                    self._add_segment(seg, [_Slot(seg, i * seg.slot_bytes) for i in range(seg.slots)], True)
                    grow = None
        written = self._write(arena, ns, keys, offsets, length, plan)
        mine = dict(plan)
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):  # k0 ends most recent: the tail goes first
                slot = mine.get(i)
                if slot is not None and written[i]:
                    slot.ready = done[i] = True
                    cls.lru[slot] = None
                    self.stats.puts += 1
                    self.stats.put_bytes += length
                elif slot is not None:
                    del self._index[slot.ident]  # type: ignore[arg-type]
                    slot.ident = None
                    cls.free.append(slot)
                    self.stats.errors += 1
                elif done[i] and (slot := self._index.get((ns, keys[i]))) is not None and slot.ready:
                    cls.lru.move_to_end(slot)
        return done

    def _write(self, arena: HostArena, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int],
               length: int, plan: list[tuple[int, _Slot]]) -> dict[int, bool]:
        written: dict[int, bool] = {}
        for i, slot in plan:
            payload = arena.view[offsets[i]:offsets[i] + length]
            try:  # encode_header checksums the payload, leaving it hot for the copy
                n = os.pwritev(slot.seg.fd, [encode_header(ns, keys[i], payload), payload], slot.pos)
                written[i] = n == HEADER_SIZE + length
            except OSError:
                written[i] = False
        if self.config.fsync == "batch":
            for seg in {id(s.seg): s.seg for _, s in plan}.values():
                try:
                    os.fdatasync(seg.fd)
                except OSError:
                    written.update((i, False) for i, s in plan if s.seg is seg)
        return written

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        """Read each key's payload into ``arena[offset:offset+length]``; one flag per key.

        ``True`` only when the header matched (namespace, key, length) and both checksums
        verified. A damaged object is a miss counted in ``stats.corrupt``; its slot is freed.
        """
        arena = self._check(ns, keys, offsets, length)
        return await self._run(self._get_sync, [False] * len(keys), arena, ns, keys, offsets, length)

    def _get_sync(self, arena: HostArena, ns: bytes, keys: Sequence[bytes],
                  offsets: Sequence[int], length: int) -> list[bool]:
        found = [False] * len(keys)
        with self._lock:
            plan = [(i, slot, slot.gen) for i, key in enumerate(keys)
                    if (slot := self._index.get((ns, key))) is not None
                    and slot.ready and slot.length == length]
        header, bad, errors = bytearray(HEADER_SIZE), [], 0
        for i, slot, gen in plan:
            dst = arena.view[offsets[i]:offsets[i] + length]
            try:
                n = os.preadv(slot.seg.fd, [header, dst], slot.pos)
            except OSError:
                errors += 1
                continue
            expected = check_header(header, ns, keys[i], length) if n == HEADER_SIZE + length else None
            if expected is not None and payload_checksum(dst) == expected:
                found[i] = True
            else:
                bad.append((slot, gen))
        with self._lock:
            for i, slot, gen in reversed(plan):
                if found[i] and slot.gen == gen and slot.ready:
                    self._classes[slot.seg.slot_bytes].lru.move_to_end(slot)
            # a slot reused since we looked was overwritten under us: a plain miss
            damaged = self._detach([slot for slot, gen in bad if slot.gen == gen])
            hits = sum(found)
            self.stats.gets += hits
            self.stats.get_bytes += hits * length
            self.stats.misses += len(keys) - hits
            self.stats.corrupt += len(damaged)
            self.stats.errors += errors
        self._wipe(damaged)
        return found

    async def delete(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """Delete the keys (their headers are zeroed on disk); return how many were stored."""
        return await self._run(self._delete_sync, 0, ns, keys)

    def _delete_sync(self, ns: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            victims = self._detach([slot for key in keys if (slot := self._index.get((ns, key)))])
        self._wipe(victims)
        return len(victims)

    def _detach(self, slots: list[_Slot]) -> list[_Slot]:
        """Under the lock: take ready slots out of the index and LRU; return those taken.

        They are not free yet: ``_wipe`` zeroes their headers first, so no writer can
        claim a slot whose old header is still being erased.
        """
        taken = []
        for slot in slots:
            if slot.ready:
                del self._index[slot.ident]  # type: ignore[arg-type]
                del self._classes[slot.seg.slot_bytes].lru[slot]
                slot.ready = False
                taken.append(slot)
        return taken

    def _wipe(self, slots: list[_Slot]) -> None:
        """Zero detached slots' headers so they stay gone after a restart, then free them."""
        for slot in slots:
            try:
                os.pwrite(slot.seg.fd, _ZERO_HEADER, slot.pos)
            except OSError:
                with self._lock:
                    self.stats.errors += 1
        with self._lock:
            for slot in slots:
                slot.ident = None
                self._classes[slot.seg.slot_bytes].free.append(slot)

    # -- introspection -------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        """Bytes of segment files created so far (at most ``config.capacity``, bar a reopen)."""
        return self._allocated

    def entries(self) -> list[tuple[bytes, bytes, int]]:
        """Return a snapshot of the stored objects as (namespace, key, payload length)."""
        with self._lock:
            return [(*ident, slot.length) for ident, slot in self._index.items() if slot.ready]
