"""The runtime directory is one daemon's alone: checked, locked, swept, and its socket owned.

The runtime directory holds the control socket (``kvtierd.sock``), the engines' completion
blocks (``completion-<epoch>-<session>``) and the lock (``kvtierd.lock``). At start, in this
order, before the pool file or the socket is touched (:func:`claim_runtime_dir`):

1. :func:`prepare_runtime_dir`: created with mode 0750 when missing (systemd's
   ``RuntimeDirectoryMode=0750`` makes the same); an existing one is refused when it is a
   symlink, not a directory, writable by every user, or owned by another uid than the
   daemon's. A directory owned by root is accepted: only root can make one, and a service
   manager (systemd, tmpfiles.d) or an administrator may prepare it for the daemon's user.
2. :class:`DaemonLock`: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``kvtierd.lock``, held for
   the daemon's life, the holder's pid written in it. A second daemon fails at once with
   ``another kvtierd (pid N) is running on <dir>`` (:class:`DaemonRunningError`); the lock
   file is never removed (removing a lock file races a daemon that opened it).
3. :func:`remove_stale_files`: completion blocks an earlier daemon left (it was killed,
   or its engines never said goodbye) and the sockets a killed daemon could not remove,
   only entries of the daemon's own naming and uid.

At stop the socket is removed only if it is still the one this daemon bound
(:class:`SocketFile`: same device and inode), never a socket another process put there.

:func:`lock_holder` tells, without taking the lock, whether a daemon holds a runtime
directory (``kvtier pools`` uses it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.config.errors import ConfigError, KvtierError

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "LOCK_NAME",
    "POOL_RECORD",
    "RUNTIME_DIR_MODE",
    "STALE_PATTERN",
    "STALE_SOCKETS",
    "DaemonLock",
    "DaemonRunningError",
    "RuntimeDirError",
    "RuntimeDirRefused",
    "SocketFile",
    "claim_runtime_dir",
    "last_pool_file",
    "lock_holder",
    "lock_path",
    "prepare_runtime_dir",
    "record_pool_file",
    "remove_stale_files",
]

RUNTIME_DIR_MODE = 0o750
"""Mode of a runtime directory the daemon creates (group members, the engines, may enter)."""

LOCK_NAME = "kvtierd.lock"
"""The lock file's name in the runtime directory."""

STALE_PATTERN = re.compile(r"completion-[0-9a-f]+-[0-9]+")
"""Names of the regular files (completion blocks) an earlier daemon left and a later one
removes."""

STALE_SOCKETS = frozenset({"kvtierd.sock", "kvtierd-mem.sock"})
"""Names of the sockets (control, memory handover) an earlier daemon left bound; under the
lock no other daemon uses them, so they are removed before binding anew."""

POOL_RECORD = "kvtierd.pool"
"""The file in the runtime directory naming the pool file the daemon last served from: a
pool file elsewhere (a ``pool_dir`` changed since) is older, and never adopted."""

_PROC_LOCKS = "/proc/locks"


class RuntimeDirError(KvtierError):
    """The runtime directory cannot be used (the message names the path and why)."""


class RuntimeDirRefused(RuntimeDirError, ConfigError):
    """The runtime directory is one kvtierd must not use (a symlink, not a directory,
    another user's, writable by every user): a setting to change, which a restart cannot
    fix (``kvtierd`` exits 2, as for a bad configuration)."""


class DaemonRunningError(RuntimeDirError):
    """Another kvtierd holds the runtime directory's lock."""

    def __init__(self, rdir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "pid unknown"
        super().__init__(f"another kvtierd ({who}) is running on {rdir}")
        self.pid = pid


def lock_path(rdir: str | Path) -> Path:
    """Return the lock file of runtime directory ``rdir``."""
    return Path(rdir) / LOCK_NAME


def prepare_runtime_dir(rdir: str | Path, mode: int = RUNTIME_DIR_MODE) -> Path:
    """Create ``rdir`` (mode ``mode``) when missing, and check that it is the daemon's.

    Args:
        rdir: the runtime directory.
        mode: permission bits of a directory created here (the umask does not apply).

    Returns:
        ``rdir`` as a Path.

    Raises:
        RuntimeDirError: it cannot be created or reached.
        RuntimeDirRefused: it is a symlink or not a directory, is writable by every
            user, or is owned by a uid other than this one and root.
    """
    rdir = Path(rdir)
    try:
        st = os.lstat(rdir)
    except FileNotFoundError:
        st = _make_dir(rdir, mode)
    except OSError as err:
        raise RuntimeDirError(f"cannot reach the runtime directory {rdir}: {err.strerror}") from err
    euid = os.geteuid()
    what = f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirRefused(
            f"the runtime directory {rdir} is a symlink; use the directory "
            "it points to, or remove the link"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirRefused(f"the runtime directory {rdir} is not a directory")
    if st.st_uid not in (euid, 0):
        raise RuntimeDirRefused(
            f"the runtime directory {rdir} belongs to another user ({what}); "
            f"this daemon runs as uid {euid}: choose another runtime_dir"
        )
    if st.st_mode & stat.S_IWOTH:
        raise RuntimeDirRefused(
            f"the runtime directory {rdir} is writable by every user ({what});"
            f" make it {RUNTIME_DIR_MODE:04o} or choose another runtime_dir"
        )
    return rdir


def _make_dir(rdir: Path, mode: int) -> os.stat_result:
    try:
        rdir.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(rdir, mode)
    except FileExistsError:
        pass  # made meanwhile by someone else: checked like any existing directory
    except OSError as err:
        raise RuntimeDirError(
            f"cannot create the runtime directory {rdir}: {err.strerror}"
        ) from err
    else:
        os.chmod(rdir, mode)  # the umask may have cleared bits
    return os.lstat(rdir)


class DaemonLock:
    """The runtime directory's lock, held from :meth:`acquire` until :meth:`release`.

    Args:
        rdir: the runtime directory (checked by :func:`prepare_runtime_dir` first).
    """

    def __init__(self, rdir: str | Path) -> None:
        self.rdir = Path(rdir)
        self.path = lock_path(rdir)
        self._fd = -1

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd >= 0

    def acquire(self) -> Self:
        """Take the lock without waiting and write this process's pid into the file.

        Returns:
            self.

        Raises:
            DaemonRunningError: another process holds it (the message names its pid).
            RuntimeDirError: the lock file cannot be opened or written, or is not a regular
                file.
        """
        assert self._fd < 0, "the lock is held already"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise RuntimeDirError(f"cannot open the lock file {self.path}: {err.strerror}") from err
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RuntimeDirError(f"the lock file {self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DaemonRunningError(self.rdir, _read_pid(fd)) from None
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as err:  # a full file system, a quota
                raise RuntimeDirError(
                    f"cannot write the lock file {self.path}: {err.strerror}"
                ) from err
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the pid and let the lock go (the file stays). Idempotent."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_holder(rdir: str | Path) -> int | None:
    """Return the pid of the daemon that holds ``rdir``'s lock, 0 when one holds it but
    its pid is unknown, or None when none does (no lock file, or it is free).

    Looked up in ``/proc/locks`` without taking the lock, so asking never makes a daemon
    that starts at that moment fail; without ``/proc/locks`` a shared lock is tried and
    let go at once.

    Raises:
        OSError: the lock file exists but cannot be read (e.g. PermissionError: the
            runtime directory is not reachable by this user).
    """
    path = lock_path(rdir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        held = _held_in_proc_locks(st)
        if held is None:  # no /proc/locks here: probe
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                held = True
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                held = False
        return (_read_pid(fd) or 0) if held else None
    finally:
        os.close(fd)


def _held_in_proc_locks(st: os.stat_result) -> bool | None:
    """Whether ``/proc/locks`` lists an flock on the file of ``st`` (None: unreadable)."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open(_PROC_LOCKS, encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            return True
    return False


def last_pool_file(rdir: str | Path) -> Path | None:
    """The pool file the daemon of ``rdir`` last served from (:func:`record_pool_file`), or
    None when none is recorded (a first start) or the record is not a daemon's (not one
    absolute path, not this uid's file)."""
    path = Path(rdir) / POOL_RECORD
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 4096:
            return None
        text = os.read(fd, 4097).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    if not text.startswith("/") or "\n" in text or "\0" in text:
        return None
    return Path(text)


def record_pool_file(rdir: str | Path, pool_file: str | Path) -> None:
    """Record ``pool_file`` as the one the daemon of ``rdir`` serves from (replaced
    atomically, mode 0640: ``kvtier pools`` of the group reads it).

    Raises:
        OSError: the runtime directory cannot be written.
    """
    path = Path(rdir) / POOL_RECORD
    tmp = path.with_name(f".{POOL_RECORD}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{Path(pool_file).absolute()}\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_files(rdir: str | Path) -> list[Path]:
    """Remove what earlier daemons left in ``rdir``: completion blocks of their sessions
    and the sockets a killed daemon could not remove (handover leftovers).

    Only entries named as a daemon names them (regular files matching
    :data:`STALE_PATTERN`, sockets named in :data:`STALE_SOCKETS`) and owned by this uid
    are removed; call it while holding the lock (no other daemon uses them then).

    Args:
        rdir: the runtime directory.

    Returns:
        The files removed.
    """
    euid = os.geteuid()
    removed = []
    with os.scandir(rdir) as entries:
        for entry in entries:
            want = (
                stat.S_ISSOCK
                if entry.name in STALE_SOCKETS
                else stat.S_ISREG
                if STALE_PATTERN.fullmatch(entry.name)
                else None
            )
            if want is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if want(st.st_mode) and st.st_uid == euid:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
            except FileNotFoundError:
                continue
    return removed


@contextlib.contextmanager
def claim_runtime_dir(rdir: str | Path, mode: int = RUNTIME_DIR_MODE) -> Iterator[DaemonLock]:
    """Make ``rdir`` this daemon's for the ``with`` block: check it, lock it, sweep it.

    Args:
        rdir: the runtime directory.
        mode: permission bits of a directory created here.

    Yields:
        The held lock (released when the block ends).

    Raises:
        DaemonRunningError: another daemon holds the directory.
        RuntimeDirError: the directory cannot be used (see :func:`prepare_runtime_dir`).
    """
    rdir = prepare_runtime_dir(rdir, mode)
    with DaemonLock(rdir) as lock:
        remove_stale_files(rdir)
        yield lock


@dataclass(frozen=True, slots=True)
class SocketFile:
    """The control socket this daemon bound, by device and inode.

    Record it right after binding (:meth:`record`); at stop, :meth:`remove` unlinks the
    path only if it still names that socket.

    Attributes:
        path: the socket's path.
        dev, ino: its device and inode when recorded.
    """

    path: Path
    dev: int
    ino: int

    @classmethod
    def record(cls, path: str | Path) -> SocketFile:
        """Remember the socket at ``path`` (just bound by this process).

        Raises:
            RuntimeDirError: nothing, or something other than a socket, is at ``path``.
        """
        path = Path(path)
        try:
            st = os.lstat(path)
        except OSError as err:
            raise RuntimeDirError(
                f"the control socket {path} is missing after bind: {err.strerror}"
            ) from err
        if not stat.S_ISSOCK(st.st_mode):
            raise RuntimeDirError(f"{path} is not a socket after bind")
        return cls(path, st.st_dev, st.st_ino)

    def remove(self) -> bool:
        """Unlink the path if it is still the recorded socket.

        Returns:
            True when removed; False when it is gone or is another file now.
        """
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True
