"""The pool file on disk: opened or created as the daemon's alone, mapped from the checked fd.

The pool file's name is predictable (``<pool_dir>/kvtier-pool-<hash of the runtime dir>``),
so another user of the machine may have made it first. A file is therefore mapped only
when it is the daemon's alone, checked on the open file descriptor that is then mapped (no
window between the check and the mapping)::

    regular file (no symlink: lstat, then O_NOFOLLOW and fstat of the same inode)
    owned by the daemon's effective uid
    mode exactly 0600 (no group or other bits)
    one link (no second name someone else could open it by)

A file that fails, and the daemon owns, is discarded (unlinked) and recreated. A file that
fails and someone else owns (or a symlink, or not a regular file) is refused: the daemon
stops with an error naming the path, owner and mode (a daemon that is not root cannot remove
another user's file from a sticky ``/dev/shm``; ``kvtier pools --remove PATH``, run by the
file's owner or root, can). A new file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and
mode 0600.

Creating the file checks the free space of its directory first (``os.statvfs``) when the
memory is to be reserved (``prefault``), and an ENOSPC/ENOMEM while reserving it becomes a
:class:`PoolSpaceError` naming ``hicache_size``, its value, the directory and its free space.

The file also records which runtime directory it belongs to (:func:`write_owner_tag`), in
the header region past the header proper: outside the header's checksum, so writing it
never changes adoption and needs no format version. ``kvtier pools`` reads it.

The daemon holds an exclusive ``flock`` on the pool file for as long as it maps it (the
descriptor stays open with the mapping): the runtime directory's lock is what keeps a second
daemon away, and a runtime directory removed and made again under a running daemon gives a
new, free lock with the same pool file name. A file another process holds is refused
(:class:`PoolFileError`), never adopted, discarded or resized.

An existing file is mapped without ``MAP_POPULATE`` at a restart (its pages are resident):
:func:`populate` builds the page tables later, on a thread, while the daemon serves.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.config.errors import ConfigError, KvtierError
from kvtier.config.sizes import format_size
from kvtier.ipc.shm import SharedMemorySegment
import contextlib

__all__ = [
    "MADV_POPULATE_WRITE",
    "OWNER_TAG_MAGIC",
    "OWNER_TAG_MAX",
    "OWNER_TAG_OFFSET",
    "POPULATE_STEP",
    "PoolFileError",
    "PoolSettingError",
    "PoolSpaceError",
    "Refusal",
    "check_pool_stat",
    "create_pool_segment",
    "discard_pool_file",
    "free_bytes",
    "memory_limit",
    "open_pool_segment",
    "populate",
    "read_owner_tag",
    "remove_pool_file_of",
    "reserve_pool_file",
    "total_bytes",
    "write_owner_tag",
]

POOL_MODE = 0o600
"""The only permission bits a pool file may have."""

OWNER_TAG_OFFSET = 1024
"""Offset in the pool file of the runtime-directory tag (inside the 4 KiB header region,
past the header proper, outside its checksum)."""

OWNER_TAG_MAGIC = b"KVTRDIR\x00"
"""First bytes of the runtime-directory tag."""

OWNER_TAG_MAX = 2048
"""Most bytes of a runtime directory's path the tag holds (longer paths are not recorded)."""

_TAG_LEN = struct.Struct("<H")
_HEAD_READ = 4096  # bytes read to explain a mis-sized file, and by kvtier pools


class PoolFileError(KvtierError):
    """The pool file cannot be used: someone else's, a symlink, not a regular file, or
    it cannot be opened, created or mapped (the message names the path)."""


class PoolSpaceError(PoolFileError):
    """Not enough room for a new pool file (the message names ``hicache_size``, the
    directory and its free space)."""


class PoolSettingError(PoolSpaceError, ConfigError):
    """A pool no start can create: ``hicache_size`` larger than the whole file system of
    ``pool_dir``, or a ``pool_dir`` that does not exist. A :class:`ConfigError` (kvtierd
    exits 2, which systemd does not restart), where too little *free* space is not: others
    may free it."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an existing pool file is not mapped as it is.

    Attributes:
        reason: one phrase for the log line and the error.
        ours: the daemon owns the file (a regular file or a symlink), so it may discard it.
    """

    reason: str
    ours: bool


def describe_stat(st: os.stat_result) -> str:
    """``owner uid U, mode 0MMM, N links`` of a stat result, for messages."""
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} links"


def check_pool_stat(st: os.stat_result, euid: int | None = None) -> Refusal | None:
    """Return why a file with stat ``st`` may not be mapped as the pool, or None when it may.

    Args:
        st: ``lstat``/``fstat`` of the file.
        euid: the daemon's effective uid (default ``os.geteuid()``).
    """
    euid = os.geteuid() if euid is None else euid
    ours = st.st_uid == euid
    if stat.S_ISLNK(st.st_mode):
        return Refusal("is a symlink", ours)
    if not stat.S_ISREG(st.st_mode):
        return Refusal("is not a regular file", False)
    if not ours:
        return Refusal(f"is owned by uid {st.st_uid}, not by this daemon's uid {euid}", False)
    if stat.S_IMODE(st.st_mode) != POOL_MODE:
        return Refusal(f"has mode {stat.S_IMODE(st.st_mode):04o}, not {POOL_MODE:04o}", True)
    if st.st_nlink != 1:
        return Refusal(f"has {st.st_nlink} links, not 1", True)
    return None


def discard_pool_file(path: str | Path, refusal: Refusal, st: os.stat_result) -> str:
    """Remove a refused pool file the daemon owns, or raise naming it.

    Args:
        path: the pool file.
        refusal: from :func:`check_pool_stat`.
        st: its ``lstat``.

    Returns:
        The reason to log (``pool file <path> <reason>: discarded``).

    Raises:
        PoolFileError: the file is not the daemon's (it is left alone), or cannot be removed.
    """
    path = str(path)
    hint = (
        f"remove it as its owner or root (`kvtier pools --remove {path}`), or set another pool_dir"
    )
    if not refusal.ours:
        raise PoolFileError(
            f"refusing the pool file {path}: it {refusal.reason} ({describe_stat(st)}); {hint}"
        )
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise PoolFileError(
            f"cannot remove the refused pool file {path} (it {refusal.reason}, "
            f"{describe_stat(st)}): {err.strerror}; {hint}"
        ) from err
    return f"pool file {path} {refusal.reason}: discarded"


def open_pool_segment(
    path: str | Path,
    size: int,
    *,
    populate: bool,
    explain: Callable[[bytes, int], str] | None = None,
) -> tuple[SharedMemorySegment | None, str | None]:
    """Map the existing pool file at ``path`` if it is the daemon's alone and ``size`` bytes.

    A file that fails a check and is the daemon's is removed; one of another size is left
    for :func:`create_pool_segment` (``replace``) to replace once the new file is sure to
    fit, so that a start refused for its size keeps the warm pool.

    Args:
        path: the pool file.
        size: the size the layout needs; a file of another size is not mapped.
        populate: pre-fault the mapping (``MAP_POPULATE``).
        explain: ``explain(first bytes, file size)`` says why a file of another size
            cannot be adopted (default: the two sizes).

    Returns:
        ``(segment, None)`` when mapped; ``(None, why)`` when there is no usable file (none,
        discarded because it failed a check, or of another size: the caller creates one,
        ``why`` says why for the log); the segment is a peer (closing it keeps the file).

    Raises:
        PoolFileError: the file is someone else's, a symlink not ours, not a regular file,
            or cannot be reached, opened or mapped.
        PoolSettingError: ``pool_dir`` is not a directory.
    """
    path = str(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, "no pool file (first start)"
    except NotADirectoryError as err:
        raise PoolSettingError(
            f"pool_dir {os.path.dirname(path) or '.'!r} is not a directory: cannot keep the "
            "pool file there"
        ) from err
    except OSError as err:
        raise PoolFileError(f"cannot reach the pool file {path}: {err.strerror}") from err
    refusal = check_pool_stat(st)
    if refusal is not None:
        return None, discard_pool_file(path, refusal, st)
    try:  # O_NONBLOCK: whatever replaced the file meanwhile, opening it must not hang
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "no pool file (first start)"
    except OSError as err:
        raise PoolFileError(f"cannot open the pool file {path}: {err.strerror}") from err
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise PoolFileError(f"the pool file {path} was replaced while being opened")
        refusal = check_pool_stat(fst)
        if refusal is not None:
            os.close(fd)
            fd = -1
            return None, discard_pool_file(path, refusal, fst)
        _lock(fd, path)  # before the size check: another daemon's file is never removed
        if fst.st_size != size:
            why = f"pool file has {fst.st_size} bytes, expected {size}"
            if explain is not None:
                why = explain(os.pread(fd, _HEAD_READ, 0), fst.st_size)
            return None, why  # replaced by create_pool_segment once a new one is sure to fit
        seg = _map(fd, path, size, populate, owner=False)
        fd = -1  # the segment keeps it, and the lock with it, until it is closed
        return seg, None
    finally:
        if fd >= 0:
            os.close(fd)


def create_pool_segment(
    path: str | Path,
    size: int,
    *,
    capacity: int,
    prefault: bool,
    replace: bool = False,
) -> SharedMemorySegment:
    """Create the pool file exclusively (mode 0600, this uid) and map it.

    Args:
        path: the pool file; nothing may exist there (a refused file is removed first),
            unless ``replace``.
        size: bytes of the file (metadata region plus ``capacity``).
        capacity: ``hicache_size``, for the messages.
        prefault: reserve the memory now (``posix_fallocate``) and pre-fault the mapping.
            Either way the directory's free space is checked first: a sparse file larger
            than the room left would fail its copies later, one page at a time.

    Returns:
        The mapped segment, as a peer (closing it keeps the file).

    Raises:
        PoolSpaceError: the directory has no room for ``size`` bytes.
        PoolFileError: the file exists already or cannot be created or mapped.
    """
    path = str(path)
    old = _replaced(path) if replace else 0
    free = free_bytes(Path(path).parent)
    if free is not None:
        free += old  # the room the file replaced gives back
    total = total_bytes(Path(path).parent)
    if total is not None and total < size:
        raise PoolSettingError(
            _space_message(path, size, capacity, free, f"{format_size(total)} in all")
        )
    if free is not None and free < size:
        raise PoolSpaceError(_space_message(path, size, capacity, free, "too little space"))
    limit = memory_limit()
    if limit is not None and limit[0] < size:
        raise PoolSettingError(
            f"cannot create the host pool: hicache_size = {format_size(capacity)} needs a "
            f"{format_size(size)} pool file, charged to kvtierd's memory cgroup, whose limit "
            f"is {format_size(limit[0])} ({limit[1]}); lower hicache_size or raise the limit"
        )
    if replace:  # only now that the new file fits: a refused start keeps the warm pool
        _unlink_quietly(path)
    try:
        fd = os.open(
            path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, POOL_MODE
        )
    except FileNotFoundError as err:
        raise PoolSettingError(
            f"pool_dir {os.path.dirname(path) or '.'!r} does not exist: cannot create the "
            "pool file there"
        ) from err
    except OSError as err:
        raise PoolFileError(f"cannot create the pool file {path}: {err.strerror}") from err
    try:
        _lock(fd, path)
        os.fchmod(fd, POOL_MODE)  # the umask may have cleared bits; it never adds any
        try:
            if prefault:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
                raise PoolSpaceError(
                    _space_message(
                        path,
                        size,
                        capacity,
                        free_bytes(Path(path).parent),
                        err.strerror or str(err),
                    )
                ) from err
            raise PoolFileError(
                f"cannot size the pool file {path} to {size} bytes: {err.strerror}"
            ) from err
        seg = _map(fd, path, size, prefault, owner=False)
        fd = -1  # the segment keeps it, and the lock with it, until it is closed
        return seg
    except BaseException:
        os.close(fd)
        fd = -1
        _unlink_quietly(path)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def memory_limit(proc_cgroup: str | Path = "/proc/self/cgroup") -> tuple[int, str] | None:
    """The memory limit of this process's cgroup: the smallest set on its path up (cgroup
    v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and the file that sets it; None
    without one. A pool file's pages (tmpfs) are charged to the cgroup of the process that
    touches them first: in a container with a memory limit (a Kubernetes pod), a pool
    larger than it would have kvtierd killed by the kernel, without a word."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in parts[1].split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        where = Path(parts[2])
        for d in (where, *where.parents):
            f = root / str(d).lstrip("/") / name
            try:
                value = int(f.read_text().strip())
            except (OSError, ValueError):  # none here, or "max"
                continue
            if value < _UNLIMITED and (best is None or value < best[0]):
                best = (value, str(f))
    return best


def total_bytes(directory: str | Path) -> int | None:
    """Bytes of the whole file system ``directory`` is on (None if unknown, or unbounded:
    a file system that reports no blocks at all, such as hugetlbfs mounted without
    ``size=``)."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return None
    return vfs.f_blocks * vfs.f_frsize if vfs.f_blocks else None


def free_bytes(directory: str | Path) -> int | None:
    """Bytes an unprivileged file may still take in ``directory`` (None if unknown, or
    unbounded, as for :func:`total_bytes`)."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize if vfs.f_blocks else None


def write_owner_tag(view: memoryview, runtime_dir: str | Path) -> None:
    """Record ``runtime_dir`` in the pool file's header region (``kvtier pools`` shows it).

    Args:
        view: a writable view of the pool file from its first byte.
        runtime_dir: the daemon's runtime directory (an absolute path is recorded).
    """
    raw = os.fsencode(os.path.abspath(runtime_dir))
    if len(raw) > OWNER_TAG_MAX:
        raw = b""
    end = OWNER_TAG_OFFSET + len(OWNER_TAG_MAGIC) + _TAG_LEN.size
    view[end : end + len(raw)] = raw
    _TAG_LEN.pack_into(view, OWNER_TAG_OFFSET + len(OWNER_TAG_MAGIC), len(raw))
    view[OWNER_TAG_OFFSET : OWNER_TAG_OFFSET + len(OWNER_TAG_MAGIC)] = OWNER_TAG_MAGIC


def read_owner_tag(head: bytes) -> Path | None:
    """Return the runtime directory recorded in ``head`` (the file's first bytes), or None:
    also for a tag no daemon writes (not an absolute path, a control character, not UTF-8), as anyone
    may write a file of this name into a shared ``/dev/shm``."""
    start = OWNER_TAG_OFFSET + len(OWNER_TAG_MAGIC)
    if len(head) < start + _TAG_LEN.size or head[OWNER_TAG_OFFSET:start] != OWNER_TAG_MAGIC:
        return None
    (n,) = _TAG_LEN.unpack_from(head, start)
    raw = head[start + _TAG_LEN.size : start + _TAG_LEN.size + n]
    if n == 0 or n > OWNER_TAG_MAX or len(raw) != n or b"\0" in raw or raw[:1] != b"/":
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text):  # no daemon's directory
        return None
    return Path(text)


_libc = ctypes.CDLL(None, use_errno=True)
MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14): fault the range in, writable, without touching it."""
POPULATE_STEP = 64 << 20
"""Bytes :func:`populate` pre-faults per ``madvise`` call (it checks its stop flag between)."""


RESERVE_STEP = 1 << 30
"""Bytes one ``fallocate`` of :func:`reserve_pool_file` reserves (a stop is asked between)."""

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


def reserve_pool_file(
    seg: SharedMemorySegment, stopped: Callable[[], bool] | None = None
) -> str | None:
    """Give the holes of an adopted pool file memory, as a new file gets it when created
    with ``prefault``: a file a daemon with ``prefault = false`` left sparse would
    otherwise fault on the pages its file system cannot back.

    ``fallocate(2)`` itself, :data:`RESERVE_STEP` bytes at a time (``stopped`` asked
    before each), never glibc's ``posix_fallocate`` fallback, which writes a byte per
    block where the file system cannot reserve and would race the daemon's copies into the
    pool. Runs without the GIL (ctypes releases it).

    Returns:
        None when every page is backed (or the reservation was stopped); else why not
        (``pool_dir`` is short of space, or its file system cannot reserve).
    """
    fd = seg.fd
    if fd is None:
        return None
    st = os.fstat(fd)
    if st.st_blocks * 512 >= st.st_size:  # no hole (the usual case: nothing to do)
        return None
    if _fallocate is None:
        return "the C library has no fallocate"
    for at in range(0, st.st_size, RESERVE_STEP):
        if stopped is not None and stopped():
            return None
        if _fallocate(fd, 0, at, min(RESERVE_STEP, st.st_size - at)) != 0:
            err = ctypes.get_errno()
            return (
                f"{format_size(st.st_size - os.fstat(fd).st_blocks * 512)} of the pool file "
                f"could not be reserved: {os.strerror(err)}"
            )
    return None


def populate(seg: SharedMemorySegment, stopped: Callable[[], bool] | None = None) -> bool:
    """Build the page tables of ``seg``'s whole mapping (what ``MAP_POPULATE`` does at
    ``mmap``), ``POPULATE_STEP`` bytes per ``madvise(MADV_POPULATE_WRITE)``.

    Runs without the GIL (ctypes releases it), so the event loop keeps serving meanwhile.
    The pages themselves are not written.

    Args:
        seg: a mapped segment (it must stay mapped until this returns).
        stopped: asked before each step; True stops there (e.g. ``threading.Event.is_set``).

    Returns:
        True when the whole mapping was done; False when stopped, or when the kernel has
        no ``MADV_POPULATE_WRITE`` (older than 5.14: the copies fault pages in instead).
    """
    for start in range(0, seg.size, POPULATE_STEP):
        if stopped is not None and stopped():
            return False
        n = min(POPULATE_STEP, seg.size - start)
        if (
            _libc.madvise(
                ctypes.c_void_p(seg.address + start), ctypes.c_size_t(n), MADV_POPULATE_WRITE
            )
            != 0
        ):
            return False
    return True


def _lock(fd: int, path: str) -> None:
    """Take the pool file's exclusive lock, or refuse the file another process holds."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        raise PoolFileError(
            f"the pool file {path} is held by another running kvtierd (its runtime directory "
            "was removed or replaced while it ran?): stop that daemon first, or give this "
            "one another runtime_dir"
        ) from err
    except OSError as err:
        raise PoolFileError(f"cannot lock the pool file {path}: {err.strerror}") from err


def _map(fd: int, path: str, size: int, populate: bool, *, owner: bool) -> SharedMemorySegment:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as err:
        raise PoolFileError(
            f"cannot map the pool file {path} ({size} bytes): {err.strerror}"
        ) from err
    return SharedMemorySegment(path, size, mm, owner=owner, writable=True, fd=fd)


def _space_message(path: str, size: int, capacity: int, free: int | None, what: str) -> str:
    where = os.path.dirname(path) or "."
    room = "unknown free space" if free is None else f"{format_size(free)} ({free} bytes) free"
    return (
        f"cannot create the host pool: hicache_size = {format_size(capacity)} ({capacity} "
        f"bytes) needs a {format_size(size)} pool file in pool_dir {where}, which has "
        f"{room} ({what}); lower hicache_size or point pool_dir at a larger filesystem"
    )


def remove_pool_file_of(path: str | Path, runtime_dir: str | Path) -> bool:
    """Remove the pool file at ``path`` when it is the one a daemon of ``runtime_dir`` left
    there: a regular file of this uid, mode 0600, one link, its header naming
    ``runtime_dir``, and no process holding its lock. Whether it was removed (a file that
    fails any of these is left alone).

    For a pool file left in a ``pool_dir`` the daemon no longer uses, or one older than the
    file it last served from: its pages must never be adopted again.
    """
    path = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if check_pool_stat(st) is not None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a running daemon's: kept
        except OSError:
            return False
        if read_owner_tag(os.pread(fd, _HEAD_READ, 0)) != Path(runtime_dir).absolute():
            return False
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _replaced(path: str) -> int:
    """Bytes the file at ``path`` (this daemon's, of another size) holds, which its
    replacement gives back: 0 when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
