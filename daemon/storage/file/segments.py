"""The ``file`` backend's on-disk format: segment files of fixed-size slots.

::

    <path>/kvtier-file.lock              flock'd while a process has the store open
    <path>/seg-<payload_slot>x<slots>-<seq>.kvt

    segment  ┌─────────────────────────────┬─────────────┬─────────────┬─────
             │ header table: 128 B / slot  │ payload 0   │ payload 1   │ ...
             │ (96-byte object headers)    │             │             │
             └─────────────────────────────┴─────────────┴─────────────┴─────
             0                  table_bytes (4 KiB aligned), payload_slot = round_up(len, 4 KiB)

A segment file is preallocated (``posix_fallocate``) at creation; a slot's header is
:mod:`~kvtier.daemon.storage.objects`' self-describing header, unchanged. A deleted
object's payload slot is given back to the file system (:func:`punch_hole`: a flush frees
disk space; the file keeps its size and the slot is reused later, its blocks allocated
again by the write). This module names, opens and scans segments; it keeps no state of its
own.
"""

from __future__ import annotations

import ctypes
import errno
import contextlib
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtier.config.errors import StorageError
from kvtier.daemon.storage.objects import HEADER_SIZE, MAGIC, check_header

__all__ = [
    "ALIGN",
    "HEADER_STRIDE",
    "LOCK_NAME",
    "Segment",
    "Slot",
    "check_store_dir",
    "close_fds",
    "fresh_slots",
    "open_segment",
    "parse_segment_name",
    "payload_slot",
    "punch_hole",
    "scan_segment",
    "table_bytes",
]

ALIGN = 4096
"""Alignment of header tables and payload slots (the page-cache page)."""
HEADER_STRIDE = 128
"""Bytes of a header-table entry (one 96-byte object header, padded)."""
LOCK_NAME = "kvtier-file.lock"
"""The lock file a process holds (``flock``) while it has the store open."""
_SEGMENT_RE = re.compile(r"seg-(\d+)x(\d+)-(\d+)\.kvt")
_U64 = struct.Struct("<Q")
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give ``length`` bytes at ``offset`` of a file back to the file system (its size and
    the other bytes unchanged; the range reads as zeros).

    Returns:
        True when punched; False where the file system (or the C library) cannot punch
        holes: the bytes then stay allocated, which is only a waste of space.

    Raises:
        OSError: any other failure of ``fallocate``.
    """
    if _fallocate is None or length <= 0:
        return False
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


def payload_slot(length: int) -> int:
    """Return the slot size, in a segment's payload area, of a ``length``-byte payload."""
    return -(-length // ALIGN) * ALIGN


def table_bytes(slots: int) -> int:
    """Return the size of a segment's header table (``HEADER_STRIDE`` per slot, 4 KiB aligned)."""
    return -(-slots * HEADER_STRIDE // ALIGN) * ALIGN


@dataclass(eq=False, slots=True)
class Segment:
    """One open segment file: ``slots`` slots of ``payload_slot`` bytes, open as ``fd``."""

    seq: int
    payload_slot: int
    slots: int
    fd: int

    @property
    def size(self) -> int:
        """The file's size: header table plus payload area."""
        return table_bytes(self.slots) + self.slots * self.payload_slot


@dataclass(eq=False, slots=True)
class Slot:
    """One slot, created once per segment; named by ``ident`` while in the index."""

    seg: Segment
    hpos: int  # header offset in the segment file
    dpos: int  # payload offset
    ident: tuple[bytes, bytes] | None = None
    length: int = 0
    ready: bool = False  # False while written: invisible to exists/get, not evictable
    gen: int = 0  # bumped at every allocation, so a stale reader never frees a new object
    dirty: bool = False  # its header may verify: zero it before the payload is overwritten


def parse_segment_name(name: str) -> tuple[int, int, int] | None:
    """Return ``(payload_slot, slots, seq)`` of a segment file's name; None for any other
    file (a name that does not match, or a slot size that is not a multiple of 4 KiB)."""
    m = _SEGMENT_RE.fullmatch(name)
    if m is None:
        return None
    slot, slots, seq = int(m[1]), int(m[2]), int(m[3])
    return (slot, slots, seq) if slot > 0 and slot % ALIGN == 0 and slots > 0 else None


def check_store_dir(path: Path) -> None:
    """Refuse a store directory another user could have written: every tenant's pages are
    read back from it and served to engines, and a header's checksums are no signature.

    Raises:
        StorageError: ``path`` is a symlink or not a directory, belongs to a uid other than
            this process's and root, or its group or every user may write it.
    """
    st = os.lstat(path)
    euid = os.geteuid()
    what = f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
    if stat.S_ISLNK(st.st_mode):
        why = "is a symlink; name the directory it points to"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid not in (euid, 0):
        why = f"belongs to another user ({what}); kvtierd runs as uid {euid}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"may be written by other users ({what}); make it 0700"
    else:
        return
    raise StorageError(f"file backend: path={str(path)!r} {why}")


def segment_name(slot: int, slots: int, seq: int) -> str:
    """The file name of segment ``seq`` of ``slots`` payload slots of ``slot`` bytes."""
    return f"seg-{slot}x{slots}-{seq:06d}.kvt"


def open_segment(
    directory: Path, seq: int, slot: int, slots: int, create: bool, durable: bool
) -> Segment:
    """Open (or, with ``create``, create and preallocate) a segment file.

    Args:
        directory: the store directory.
        seq, slot, slots: the segment's sequence number, payload slot size and slot count.
        create: create the file (it must not exist); else open an existing one.
        durable: after creating, ``fsync`` the file and the directory.

    Returns:
        The open segment (its size restored by ``posix_fallocate`` if it was truncated; the
        holes a flush punched in an existing segment stay holes).

    Raises:
        OSError: the file cannot be opened, created or preallocated (a file this call
            created is removed again).
    """
    path = directory / segment_name(slot, slots, seq)
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)  # every tenant's pages: the daemon's user only
    if not create:
        st = os.fstat(fd)
        # a file someone else made (or a second name of one) is not a segment of this store
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_nlink != 1:
            os.close(fd)
            raise PermissionError(
                errno.EPERM,
                f"segment {path.name} is not a file of this store's user "
                f"(owner uid {st.st_uid}, {st.st_nlink} links)",
            )
        with contextlib.suppress(OSError):  # readable by its user alone
            os.fchmod(fd, 0o600)
    seg = Segment(seq, slot, slots, fd)
    try:
        have = 0 if create else os.fstat(fd).st_size
        if have < seg.size:  # a new segment, or a truncated one: (re)allocate the rest
            try:
                os.posix_fallocate(fd, have, seg.size - have)
            except OSError as err:
                if create or err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # a full disk: the rest stays a hole (reads as free slots; a write there
                # fails as a write to a full disk does), the store opens anyway
                os.ftruncate(fd, seg.size)
        if create and durable:
            os.fsync(fd)
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException:
        os.close(fd)
        if create:
            path.unlink(missing_ok=True)
        raise
    return seg


def fresh_slots(seg: Segment) -> list[Slot]:
    """Return the slots of a segment just created (all free)."""
    base = table_bytes(seg.slots)
    return [Slot(seg, i * HEADER_STRIDE, base + i * seg.payload_slot) for i in range(seg.slots)]


def scan_segment(seg: Segment) -> list[Slot]:
    """Read a segment's header table in one call; a slot whose header verifies is named.

    Raises:
        OSError: the table cannot be read.
    """
    table = memoryview(os.pread(seg.fd, seg.slots * HEADER_STRIDE, 0))
    slots = fresh_slots(seg)
    for slot in slots:
        hdr = table[slot.hpos : slot.hpos + HEADER_SIZE]
        slot.dirty = hdr[:4] == MAGIC  # whatever looks like a header is zeroed before reuse
        if len(hdr) == HEADER_SIZE and slot.dirty:
            ns, key, (length,) = bytes(hdr[8:40]), bytes(hdr[40:72]), _U64.unpack_from(hdr, 72)
            if (
                length > 0
                and payload_slot(length) == seg.payload_slot
                and check_header(hdr, ns, key, length) is not None
            ):
                slot.ident, slot.length, slot.ready = (ns, key), length, True
    return slots


def close_fds(fds: list[int]) -> None:
    """Close and remove every fd of ``fds`` (emptied in place; safe from a finalizer)."""
    while fds:
        os.close(fds.pop())
