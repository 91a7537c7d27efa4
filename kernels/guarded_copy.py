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

``KVTIER_NO_GUARDED_COPY=1`` turns the guarded copies of unsealed memory off (the
positional I/O path then serves); ``KVTIER_NO_NATIVE_COPY=1`` turns :func:`copy_strided`
and :func:`copy_regions` off (the numpy path then serves). Tests use them to cover every path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "STRIDED", "copy_pages", "copy_regions", "copy_strided"]

CopyPages = Callable[[Sequence[int], Sequence[int], int, bool], int]


def _off(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _load() -> Any:
    try:
        from kvtier.kernels import _guarded
    except ImportError:
        return None
    return _guarded


_native = _load()
_copy: CopyPages | None = (None if _native is None or _off("KVTIER_NO_GUARDED_COPY")
                           else _native.copy_pages)
_strided = None if _native is None or _off("KVTIER_NO_NATIVE_COPY") else _native.copy_strided
_regions = None if _strided is None else _native.copy_regions
AVAILABLE: bool = _copy is not None
"""Whether guarded copies are available (the extension built and not turned off)."""
STRIDED: bool = _strided is not None
"""Whether :func:`copy_strided` is available (the extension built and not turned off)."""


def copy_pages(dsts: Sequence[int], srcs: Sequence[int], length: int,
               stream: bool = False) -> int:
    """``memcpy(dsts[i], srcs[i], length)`` for each page, the GIL released.

    ``stream``: copy with non-temporal stores (see :func:`copy_strided`).

    Returns:
        Pages copied: all of them, or fewer when a page faulted (its mapping's file shrank);
        the copy stopped there.

    Raises:
        RuntimeError: the extension is not available (check :data:`AVAILABLE` first).
    """
    if _copy is None:
        raise RuntimeError("guarded copies are not available (kvtier.kernels._guarded)")
    return _copy(dsts, srcs, length, stream)


def copy_strided(host: int, host_nbytes: int, offsets: np.ndarray, host_add: int, engine: int,
                 engine_pages: int, page_ids: np.ndarray, stride: int, length: int,
                 to_host: bool, stream: bool = False) -> int:
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

    Returns:
        Pages copied: all of them, or fewer when a page faulted; the copy stopped there.

    Raises:
        ValueError: a page id outside ``[0, engine_pages)``, a slot range outside the arena,
            arrays of different lengths, or ``length`` not in ``(0, stride]``; nothing was
            copied.
        RuntimeError: the extension is not available (check :data:`STRIDED` first).
    """
    if _strided is None:
        raise RuntimeError("native copies are not available (kvtier.kernels._guarded)")
    return int(_strided(host, host_nbytes, np.ascontiguousarray(offsets, dtype=np.int64),
                        host_add, engine, engine_pages,
                        np.ascontiguousarray(page_ids, dtype=np.int64), stride, length, to_host,
                        stream))


def copy_regions(host: int, host_nbytes: int, offsets: np.ndarray, page_ids: np.ndarray,
                 table: np.ndarray, to_host: bool, stream: bool = False) -> int:
    """Copy several regions' pages in one call, as :func:`copy_strided` copies one each.

    Args:
        host / host_nbytes: the arena's address and size.
        offsets: int64 arena offsets of the pages' slots; ``page_ids`` int64 page ids, same
            length (the same pages in every region).
        table: a C-contiguous int64 array of rows ``(host_add, engine, engine_pages,
            stride, length)``, one per region, copied in row order.
        to_host / stream: as for :func:`copy_strided`.

    Returns:
        Pages copied over all rows: ``rows * len(page_ids)`` when all were, fewer when a
        page faulted (it is page ``result % len(page_ids)`` of row ``result //
        len(page_ids)``); the copy stopped there.

    Raises:
        ValueError: a bad row, a page id outside ``[0, engine_pages)`` of a row, or a slot
            range outside the arena; nothing was copied.
        RuntimeError: the extension is not available (check :data:`STRIDED` first).
    """
    if _regions is None:
        raise RuntimeError("native copies are not available (kvtier.kernels._guarded)")
    return int(_regions(host, host_nbytes, offsets, page_ids, table, to_host, stream))
