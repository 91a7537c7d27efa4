"""Types of the ``_pins`` C extension (``daemon/pool/native/_pins.c``): pin and unpin a run of
pages, and move a LOAD's pages to T2."""

from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

def pin(
    pins: Buffer,
    stamp: Buffer,
    children: Buffer,
    slots: list[int],
    clock: int,
    lists: tuple[Any, ...],
) -> tuple[int, int]:
    """Pin ``slots`` (the pages pinned first and childless leave the evictable ``lists``):
    ``(clock, newly pinned)``."""

def unpin(
    pins: Buffer,
    state: Buffer,
    children: Buffer,
    slots: list[int],
    ready: int,
    lists: tuple[Any, ...],
) -> int | None:
    """Unpin ``slots`` (the pages now unpinned, ready and childless enter the evictable
    ``lists``): how many were unpinned, or None (nothing changed) when one is refused."""

def mark_used(tier: Buffer, flags: Buffer | None, slots: list[int], bit: int) -> int:
    """Put ``slots`` in T2 (``tier`` 1, ``bit`` set in ``flags``): how many were not."""
