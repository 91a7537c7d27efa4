"""Page copies over engine memory that its owner may shrink (the ``_guarded`` C extension).

The daemon maps an engine's memfd that is not sealed against shrinking only when these
copies are available: a copy that meets a page gone from under the mapping (SIGBUS) stops
and reports it, instead of ending the process. Without the extension (no C compiler at
install time) such memory is copied with ``pread``/``pwrite`` instead.

``KVTIER_NO_GUARDED_COPY=1`` turns the guarded copies off (the positional I/O path then
serves; tests use it to cover both).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

__all__ = ["AVAILABLE", "copy_pages"]

CopyPages = Callable[[Sequence[int], Sequence[int], int], int]


def _load() -> CopyPages | None:
    if os.environ.get("KVTIER_NO_GUARDED_COPY", "") not in ("", "0"):
        return None
    try:
        from kvtier.kernels import _guarded  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _guarded.copy_pages


_copy = _load()
AVAILABLE: bool = _copy is not None
"""Whether guarded copies are available (the extension built and not turned off)."""


def copy_pages(dsts: Sequence[int], srcs: Sequence[int], length: int) -> int:
    """``memcpy(dsts[i], srcs[i], length)`` for each page, the GIL released.

    Returns:
        Pages copied: all of them, or fewer when a page faulted (its mapping's file shrank);
        the copy stopped there.

    Raises:
        RuntimeError: the extension is not available (check :data:`AVAILABLE` first).
    """
    if _copy is None:
        raise RuntimeError("guarded copies are not available (kvtier.kernels._guarded)")
    return _copy(dsts, srcs, length)
