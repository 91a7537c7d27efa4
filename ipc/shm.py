"""Shared-memory segments: named files (the daemon's pool) or anonymous memfds, mapped once.

The creator owns a segment: it pre-faults the memory at creation (first touch of fresh
shared memory runs at a fraction of memcpy speed, so it must not happen on the hot path)
and removes the file when it closes the segment. Others open a named segment by name.

A memfd segment (:meth:`SharedMemorySegment.create_memfd`) has no name anywhere: it is
reached only through its descriptor, which the creator keeps (``fd``) and passes to whom
it chooses (SCM_RIGHTS, :mod:`kvtier.ipc.fdpass`). It is sealed against shrinking and
growing, so nobody holding the descriptor can pull pages from under another's mapping
(a mapped page past the end of a file is a SIGBUS). A peer maps it with :meth:`from_fd`.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from kvtier.config.errors import KvtierError
import contextlib

if TYPE_CHECKING:
    from typing import Self

    import torch


class SharedMemoryError(KvtierError):
    """A segment could not be created or opened (the message names the path)."""


SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""The seals that fix a memfd's size (no shrink, no grow)."""
F_SEAL_FUTURE_WRITE = 0x0010
"""Linux >= 5.1: no new writable mapping (mappings made before stay writable)."""


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none). Read as bytes:
    no codec is looked up (a process whose module path it cannot read still gets it)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def seal_size(fd: int, future_write: bool = False) -> None:
    """Seal a memfd's size for good: F_SEAL_SHRINK | F_SEAL_GROW, then F_SEAL_SEAL.

    Args:
        fd: a memfd created with ``MFD_ALLOW_SEALING``.
        future_write: also forbid new writable mappings (where the kernel has
            F_SEAL_FUTURE_WRITE; silently skipped where it has not).

    Raises:
        SharedMemoryError: the descriptor cannot be sealed.
    """
    try:
        if future_write:
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
            except OSError:
                pass  # an older kernel: the size seals below are what safety needs
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    except OSError as err:
        raise SharedMemoryError(f"cannot seal memfd {fd}: {err}") from err


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedMemorySegment:
    """A mapped shared-memory file.

    Create with :meth:`create` (owner) or :meth:`open` (peer). ``view`` is a writable
    memoryview of the whole segment (read-only for a read-only open); ``address`` its base
    address in this process. The owner's file is removed by :meth:`close`, or at garbage
    collection / interpreter exit if the user forgets (with a ``ResourceWarning``).
    """

    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_mm",
        "address",
        "fd",
        "owner",
        "path",
        "size",
        "view",
    )

    def __init__(
        self,
        path: str,
        size: int,
        mm: mmap.mmap,
        owner: bool,
        writable: bool,
        fd: int | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self.fd = fd
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm) if writable else memoryview(mm).toreadonly()
        if writable:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        else:
            self.address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        self._finalizer = weakref.finalize(self, _leak, path if owner and fd is None else None, fd)

    @classmethod
    def create(
        cls,
        path: str | Path,
        size: int,
        prefault: bool = True,
        mode: int = 0o660,
        exist_ok: bool = False,
    ) -> SharedMemorySegment:
        """Create a segment of ``size`` bytes at ``path`` and map it.

        Args:
            path: the file to create (e.g. ``/dev/shm/kvtier-...``).
            size: bytes; > 0.
            prefault: reserve and map every page now (``posix_fallocate`` + ``MAP_POPULATE``).
            mode: file permission bits (group access lets engines in the group map it).
            exist_ok: replace an existing file at ``path`` instead of failing.
        """
        path = str(path)
        if size <= 0:
            raise SharedMemoryError(f"segment {path!r}: size must be > 0, got {size!r}")
        if exist_ok:
            _unlink_quietly(path)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, mode)
        except OSError as err:
            raise SharedMemoryError(f"cannot create shared memory {path!r}: {err}") from err
        try:
            os.fchmod(fd, mode)
            if prefault:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:
            os.close(fd)
            _unlink_quietly(path)
            raise SharedMemoryError(
                f"cannot size shared memory {path!r} to {size} bytes: {err}"
            ) from err
        os.close(fd)
        return cls(path, size, mm, owner=True, writable=True)

    @classmethod
    def create_memfd(
        cls, name: str, size: int, prefault: bool = True, future_write: bool = False
    ) -> SharedMemorySegment:
        """Create an anonymous, size-sealed memfd of ``size`` bytes and map it read-write.

        The segment keeps the descriptor (``fd``, close-on-exec) until :meth:`close`; it
        has no file name, so nothing is ever left behind.

        Args:
            name: a label (shown in ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``).
            size: bytes; > 0.
            prefault: reserve every page now (``posix_fallocate`` + ``MAP_POPULATE``).
            future_write: once mapped here, forbid any new writable mapping or write()
                (F_SEAL_FUTURE_WRITE, where the kernel has it): for memory others only read.

        Returns:
            The segment; its ``path`` is ``memfd:<name>``.

        Raises:
            SharedMemoryError: the memfd cannot be created, sized, mapped or sealed, or
                ``prefault`` asks for more than the memory available (reserving it would
                have the kernel kill a process for memory).
        """
        if size <= 0:
            raise SharedMemoryError(f"memfd {name!r}: size must be > 0, got {size!r}")
        available = available_memory() if prefault else None
        if available is not None and size > available:
            raise SharedMemoryError(
                f"memfd {name!r}: {size} bytes asked for, more than the {available} bytes of "
                "memory available"
            )
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:
            raise SharedMemoryError(f"cannot create memfd {name!r}: {err}") from err
        try:
            if prefault:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                seal_size(fd, future_write=future_write)
            except SharedMemoryError:
                mm.close()
                raise
        except (OSError, SharedMemoryError) as err:
            os.close(fd)
            raise SharedMemoryError(f"cannot size memfd {name!r} to {size} bytes: {err}") from err
        return cls(f"memfd:{name}", size, mm, owner=True, writable=True, fd=fd)

    @classmethod
    def from_fd(
        cls,
        fd: int,
        size: int,
        writable: bool = True,
        label: str = "fd",
        populate: bool = False,
        offset: int = 0,
    ) -> SharedMemorySegment:
        """Map ``size`` bytes of a descriptor someone handed over (the caller keeps ``fd``).

        The caller checks the descriptor first (kind, size, seals): this only maps it.

        Args:
            fd: the descriptor.
            size: bytes to map, from ``offset``.
            writable: map read-write (else read-only).
            label: the segment's ``path``, for messages.
            populate: pre-fault the mapping (``MAP_POPULATE``).
            offset: where the mapping starts in the file (a multiple of
                ``mmap.ALLOCATIONGRANULARITY``); ``address`` is that byte's.

        Raises:
            SharedMemoryError: the mapping failed (e.g. a read-only descriptor mapped
                writable, or a memfd sealed against writing).
        """
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mflags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            mm = mmap.mmap(fd, size, flags=mflags, prot=prot, offset=offset)
        except (OSError, ValueError) as err:
            raise SharedMemoryError(f"cannot map {label}: {err}") from err
        return cls(label, size, mm, owner=False, writable=writable)

    @classmethod
    def open(
        cls,
        path: str | Path,
        size: int | None = None,
        writable: bool = True,
        populate: bool = False,
    ) -> SharedMemorySegment:
        """Map an existing segment.

        Args:
            path: the segment's file; symlinks are refused.
            size: the size the caller expects; a file of another size is refused.
            writable: map read-write (else read-only).
            populate: pre-fault the mapping (``MAP_POPULATE``).
        """
        path = str(path)
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW)
        except OSError as err:
            raise SharedMemoryError(f"cannot open shared memory {path!r}: {err}") from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedMemoryError(f"shared memory {path!r} is not a regular file")
            if size is not None and st.st_size != size:
                raise SharedMemoryError(
                    f"shared memory {path!r} has {st.st_size} bytes, expected {size}"
                )
            if st.st_size == 0:
                raise SharedMemoryError(f"shared memory {path!r} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mflags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, st.st_size, flags=mflags, prot=prot)
        except OSError as err:
            raise SharedMemoryError(f"cannot map shared memory {path!r}: {err}") from err
        finally:
            os.close(fd)
        return cls(path, st.st_size, mm, owner=False, writable=writable)

    def array(
        self, dtype: np.dtype | type = np.uint8, offset: int = 0, count: int = -1
    ) -> np.ndarray:
        """Return a numpy array over the segment (no copy).

        Raises:
            SharedMemoryError: the segment is closed.
        """
        if self._mm is None:
            raise SharedMemoryError(f"segment {self.path!r} is closed")
        return np.frombuffer(self._mm, dtype=dtype, offset=offset, count=count)

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Return a uint8 torch tensor over ``[offset, offset + nbytes)`` (no copy).

        Raises:
            SharedMemoryError: the segment is closed.
        """
        import torch

        if self._mm is None:
            raise SharedMemoryError(f"segment {self.path!r} is closed")
        nbytes = self.size - offset if nbytes is None else nbytes
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", UserWarning
            )  # read-only buffers warn; we never write them
            return torch.frombuffer(self._mm, dtype=torch.uint8, offset=offset, count=nbytes)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._mm is None

    def close(self, unlink: bool | None = None) -> None:
        """Unmap (when no array still uses it) and, for the owner, remove the file.

        Args:
            unlink: remove the file; default: only if this process created it.
        """
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        self._finalizer.detach()
        self.view.release()
        try:
            mm.close()
        except BufferError:
            pass  # arrays still reference it; the mapping goes with the last of them
        fd, self.fd = self.fd, None
        # a file kept open (a pool file's lock) is removed before its descriptor closes
        remove = (self.owner and fd is None) if unlink is None else unlink
        if remove and not self.path.startswith("memfd:"):
            _unlink_quietly(self.path)
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leak(path: str | None, fd: int | None = None) -> None:
    if fd is not None:
        warnings.warn(
            f"descriptor {fd} of shared memory was not closed; closing it",
            ResourceWarning,
            stacklevel=1,
        )
        try:
            os.close(fd)
        except OSError:
            pass  # closed by someone else meanwhile
    if path is not None:
        warnings.warn(
            f"shared memory {path!r} was not closed; removing it", ResourceWarning, stacklevel=1
        )
        _unlink_quietly(path)
