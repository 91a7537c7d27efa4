"""Page copies over engine memory that its owner may shrink (the ``_guarded`` C extension).

The daemon maps an engine's memfd that is not sealed against shrinking only when these
copies are available: a copy that meets a page gone from under the mapping (SIGBUS) stops
and reports it, instead of ending the process. Without the extension (no C compiler at
install time) such memory is copied with ``pread``/``pwrite`` instead.

The same extension copies one region of a transfer in one call (:func:`copy_strided`), or
several (:func:`copy_regions`: the regions of a layer, or of a whole small transfer, from a
table made once per engine): every index checked, then one ``memcpy`` per page with the GIL
released (or, for a transfer larger than the cache, a copy with non-temporal stores:
``stream``). The daemon uses them for every mapped region, sealed or not; without them,
sealed memory is copied by numpy plans (:class:`~kvtier.kernels.page_copy.CopyPlan`).

The guarded copies of unsealed memory and the region copies are switched separately
(:mod:`kvtier.kernels.native`: ``guarded_copy``, ``region_copy``); :func:`available` and
:func:`strided` say whether each is in use now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from kvtier.kernels import native

try:
    from kvtier.kernels import _guarded
except ImportError:  # built without a C compiler
    _guarded = None  # type: ignore[assignment]

__all__ = [
    "BUILT",
    "available",
    "copy_pages",
    "copy_regions",
    "copy_strided",
    "native_module",
    "strided",
]

BUILT: bool = _guarded is not None
"""Whether the extension is built (whatever the switches say)."""


def available() -> bool:
    """Whether guarded copies (:func:`copy_pages`) are in use: the extension is built and
    ``guarded_copy`` is not turned off."""
    return _guarded is not None and native.enabled("guarded_copy")


def strided() -> bool:
    """Whether :func:`copy_strided` and :func:`copy_regions` are in use: the extension is
    built and ``region_copy`` is not turned off."""
    return _guarded is not None and native.enabled("region_copy")


def native_module() -> Any:
    """The ``_guarded`` extension module (its ``CopyPool``), or None when not built."""
    return _guarded


_NO_REGION_COPY = "region copies are not in use (kvtier.kernels._guarded: check strided())"


def copy_pages(
    dsts: Sequence[int],
    srcs: Sequence[int],
    length: int,
    stream: bool = False,
    yield_bytes: int = 0,
) -> int:
    """``memcpy(dsts[i], srcs[i], length)`` for each page, the GIL released.

    ``stream`` / ``yield_bytes``: as for :func:`copy_strided`.

    Returns:
        Pages copied: all of them, or fewer when a page faulted (its mapping's file shrank);
        the copy stopped there. Pages before the count are whole; a streamed copy, which
        goes four pages at a time, may have written part of the pages after the faulting
        one in its group of four.

    Raises:
        RuntimeError: guarded copies are not in use (check :func:`available` first).
    """
    if _guarded is None or not available():
        raise RuntimeError(
            "guarded copies are not in use (kvtier.kernels._guarded: "
            f"{'turned off' if BUILT else 'not built'})"
        )
    return _guarded.copy_pages(dsts, srcs, length, stream, yield_bytes)


def copy_strided(
    host: int,
    host_nbytes: int,
    offsets: np.ndarray,
    host_add: int,
    engine: int,
    engine_pages: int,
    page_ids: np.ndarray,
    stride: int,
    length: int,
    to_host: bool,
    stream: bool = False,
    yield_bytes: int = 0,
) -> int:
    """Copy one region's pages between the host arena and an engine's memory, in C.

    Page ``page_ids[i]`` of the region (``length`` bytes at ``engine + page_ids[i] *
    stride``) and the bytes at ``host + offsets[i] + host_add`` are copied one way: into
    the arena when ``to_host``, out of it otherwise. Every index is checked before any byte
    moves; the copy itself runs with the GIL released and stops at a page that faults
    (its mapping's file shrank), as :func:`copy_pages` does.

    Args:
        host / host_nbytes: the arena's address and size.
        offsets: int64 arena offsets of the pages' slots; ``page_ids`` int64 page ids of
            the region, same length.
        host_add: the region's offset inside a host page.
        engine / engine_pages / stride: the region's page 0, its pages, the bytes from one
            page to the next (at least ``length``).
        length: bytes of the region in one page.
        to_host: the direction (True: engine → arena).
        stream: write the destination with non-temporal stores, past the cache (faster
            for a transfer larger than the cache holds; the copy ends with a store fence).
        yield_bytes: give the CPU up (``sched_yield``) after every this many bytes (0:
            never), so that a thread that woke up on this CPU runs now rather than at the
            scheduler's next tick; for a copy nobody waits on (a long STORE).

    Returns:
        Pages copied: all of them, or fewer when a page faulted; the copy stopped there.

    Raises:
        ValueError: a page id outside ``[0, engine_pages)``, a slot range outside the arena,
            arrays of different lengths, ``length`` not in ``(0, stride]``, or a negative
            ``yield_bytes``; nothing was copied.
        RuntimeError: region copies are not in use (check :func:`strided` first).
    """
    if _guarded is None or not strided():
        raise RuntimeError(_NO_REGION_COPY)
    return int(
        _guarded.copy_strided(
            host,
            host_nbytes,
            np.ascontiguousarray(offsets, dtype=np.int64),
            host_add,
            engine,
            engine_pages,
            np.ascontiguousarray(page_ids, dtype=np.int64),
            stride,
            length,
            to_host,
            stream,
            yield_bytes,
        )
    )


def copy_regions(
    host: int,
    host_nbytes: int,
    offsets: np.ndarray,
    page_ids: np.ndarray,
    table: np.ndarray,
    to_host: bool,
    stream: bool = False,
    yield_bytes: int = 0,
) -> int:
    """Copy several regions' pages in one call, as :func:`copy_strided` copies one each.

    Args:
        host / host_nbytes: the arena's address and size.
        offsets: int64 arena offsets of the pages' slots; ``page_ids`` int64 page ids, same
            length (the same pages in every region).
        table: a C-contiguous int64 array of rows ``(host_add, engine, engine_pages,
            stride, length)``, one per region, copied in row order.
        to_host / stream / yield_bytes: as for :func:`copy_strided`.

    Returns:
        Pages copied over all rows: ``rows * len(page_ids)`` when all were, fewer when a
        page faulted (it is page ``result % len(page_ids)`` of row ``result //
        len(page_ids)``); the copy stopped there.

    Raises:
        ValueError: a bad row, a page id outside ``[0, engine_pages)`` of a row, or a slot
            range outside the arena; nothing was copied.
        RuntimeError: region copies are not in use (check :func:`strided` first).
    """
    if _guarded is None or not strided():
        raise RuntimeError(_NO_REGION_COPY)
    return int(
        _guarded.copy_regions(
            host,
            host_nbytes,
            np.ascontiguousarray(offsets, dtype=np.int64),  # C reads 8-byte words: an int32
            np.ascontiguousarray(page_ids, dtype=np.int64),  # array would be misread
            np.ascontiguousarray(table, dtype=np.int64),
            to_host,
            stream,
            yield_bytes,
        )
    )
