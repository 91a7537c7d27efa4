"""Checksummed page I/O between a buffer (the host pool's arena) and a file.

Two calls, one per direction, each for a batch of pages of one length::

    write_pages(fd, buf, offsets, length, positions) -> [xxh3-64 | None, ...]
    read_pages(fd, buf, offsets, length, positions)  -> [xxh3-64 | None, ...]

Page ``i`` is ``buf[offsets[i] : offsets[i] + length]`` and lives at ``positions[i]`` in the
file. Each page is copied (``pwrite`` / ``pread``, restarted on short transfers and EINTR)
and then hashed right away, while its bytes are still in cache; ``None`` marks a page whose
I/O failed (or, reading, came back short). A bad argument raises before any I/O.

The native implementation (:mod:`kvtier.kernels._fileio`, C, built at install when a
compiler and the xxHash header are present) runs a whole batch with the GIL released. The
pure-Python one below does the same page by page and releases the GIL twice per page (the
syscall, the hash): with several I/O threads and the daemon's event loop that means taking
turns for the GIL at every page, which leaves the threads idle much of the time. :func:`in_use`
says which one runs; turning the ``file_io`` kernel off (:mod:`kvtier.kernels.native`)
selects the Python one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import xxhash
from kvtier.kernels import native

try:
    from kvtier.kernels import _fileio
except ImportError:  # built without a C compiler or the xxHash header
    _fileio = None  # type: ignore[assignment]

__all__ = ["BUILT", "in_use", "py_read_pages", "py_write_pages", "read_pages", "write_pages"]

Buffer = memoryview | bytearray


def _check(buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int]) -> None:
    if length <= 0:
        raise ValueError(f"length = {length} must be > 0")
    if len(offsets) != len(positions):
        raise ValueError(f"{len(offsets)} offsets but {len(positions)} positions")
    size = memoryview(buf).nbytes
    for i, (off, pos) in enumerate(zip(offsets, positions)):
        if off < 0 or off > size - length:
            raise ValueError(
                f"offsets[{i}] = {off}: the page does not fit in the buffer of {size} bytes"
            )
        if pos < 0:
            raise ValueError(f"positions[{i}] = {pos} must be >= 0")


def _full(fn: Callable[[memoryview, int], int], page: memoryview, pos: int) -> bool:
    done = 0
    while done < len(page):
        try:
            n = fn(page[done:], pos + done)
        except InterruptedError:
            continue
        except OSError:
            return False
        if n == 0:
            return False
        done += n
    return True


def _pages(
    fd: int,
    buf: Buffer,
    offsets: Sequence[int],
    length: int,
    positions: Sequence[int],
    io: Callable[[memoryview, int], int],
) -> list[int | None]:
    _check(buf, offsets, length, positions)
    view = memoryview(buf).cast("B")
    sums: list[int | None] = []
    for off, pos in zip(offsets, positions):
        page = view[off : off + length]
        sums.append(xxhash.xxh3_64_intdigest(page) if _full(io, page, pos) else None)
    return sums


def py_write_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int]
) -> list[int | None]:
    """The pure-Python :func:`write_pages` (same results, the GIL taken page by page)."""
    return _pages(fd, buf, offsets, length, positions, lambda b, p: os.pwrite(fd, b, p))


def py_read_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int]
) -> list[int | None]:
    """The pure-Python :func:`read_pages` (same results, the GIL taken page by page)."""
    return _pages(fd, buf, offsets, length, positions, lambda b, p: os.preadv(fd, [b], p))


BUILT: bool = _fileio is not None
"""Whether the C implementation is built (whatever the ``file_io`` switch says)."""


def in_use() -> bool:
    """Whether the C implementation (the GIL released per batch) runs the calls now."""
    return _fileio is not None and native.enabled("file_io")


def write_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int]
) -> list[int | None]:
    """Write each page of ``buf`` to its file position; its checksum, or None on failure."""
    if _fileio is not None and native.enabled("file_io"):
        return _fileio.write_pages(fd, buf, offsets, length, positions)
    return py_write_pages(fd, buf, offsets, length, positions)


def read_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int]
) -> list[int | None]:
    """Read each page into ``buf`` from its file position; its checksum, or None on failure."""
    if _fileio is not None and native.enabled("file_io"):
        return _fileio.read_pages(fd, buf, offsets, length, positions)
    return py_read_pages(fd, buf, offsets, length, positions)
