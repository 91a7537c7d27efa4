"""Shared-memory segments: named files (under /dev/shm or a runtime dir), mapped once.

The creator owns a segment: it pre-faults the memory at creation (first touch of fresh
shared memory runs at a fraction of memcpy speed, so it must not happen on the hot path)
and removes the file when it closes the segment. Others open a segment by name.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from kvtier.config.errors import KvtierError

if TYPE_CHECKING:
    from typing import Self


class SharedMemoryError(KvtierError):
    """A segment could not be created or opened (the message names the path)."""


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedMemorySegment:
    """A mapped shared-memory file.

    Create with :meth:`create` (owner) or :meth:`open` (peer). ``view`` is a writable
    memoryview of the whole segment (read-only for a read-only open); ``address`` its base
    address in this process. The owner's file is removed by :meth:`close`, or at garbage
    collection / interpreter exit if the user forgets (with a ``ResourceWarning``).
    """

    __slots__ = ("__weakref__", "_finalizer", "_mm", "address", "owner", "path", "size", "view")

    def __init__(self, path: str, size: int, mm: mmap.mmap, owner: bool, writable: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm) if writable else memoryview(mm).toreadonly()
        if writable:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        else:
            self.address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        self._finalizer = weakref.finalize(self, _leak, path if owner else None)

    @classmethod
    def create(cls, path: str | Path, size: int, prefault: bool = True, mode: int = 0o660,
               exist_ok: bool = False) -> SharedMemorySegment:
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
            raise SharedMemoryError(f"cannot size shared memory {path!r} to {size} bytes: {err}") from err
        os.close(fd)
        return cls(path, size, mm, owner=True, writable=True)

    @classmethod
    def open(cls, path: str | Path, size: int | None = None, writable: bool = True,
             populate: bool = False) -> SharedMemorySegment:
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

    def array(self, dtype: np.dtype | type = np.uint8, offset: int = 0, count: int = -1) -> np.ndarray:
        """Return a numpy array over the segment (no copy)."""
        assert self._mm is not None, f"segment {self.path!r} is closed"
        return np.frombuffer(self._mm, dtype=dtype, offset=offset, count=count)

    def tensor(self, offset: int = 0, nbytes: int | None = None):  # -> torch.Tensor
        """Return a uint8 torch tensor over ``[offset, offset + nbytes)`` (no copy)."""
        import torch

        assert self._mm is not None, f"segment {self.path!r} is closed"
        nbytes = self.size - offset if nbytes is None else nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers warn; we never write them
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
        if self.owner if unlink is None else unlink:
            _unlink_quietly(self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leak(path: str | None) -> None:
    if path is not None:
        warnings.warn(f"shared memory {path!r} was not closed; removing it", ResourceWarning, stacklevel=1)
        _unlink_quietly(path)
