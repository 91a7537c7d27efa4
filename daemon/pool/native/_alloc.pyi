"""Types of the ``_alloc`` C extension (``daemon/pool/native/_alloc.c``): a STORE's slots
allocated and committed in C, as :mod:`kvtier.daemon.pool.page_steps` calls it."""

from typing import Any

def run(*args: Any) -> tuple[int, int] | None:
    """Allocate slots for a STORE's keys: ``(stop, prev)`` (the clock, a one-item list,
    advanced in place), or None when a key is not a bytes object of at most 32 bytes."""

def commit(*args: Any) -> tuple[int, int] | None:
    """Commit a STORE's filled slots: ``(stop, clock)``, or None (nothing changed) when a
    slot or checksum is refused."""

def release(*args: Any) -> int:
    """Free READY or WRITING pages, in order: how many were (the first refused stops it)."""

def offsets(offset_of: Any, slots: list[int], out: Any) -> int | None:
    """Write the payload offset of each of ``slots`` into ``out`` (int64): None, or the
    index of the first slot outside ``offset_of`` or whose offset there is -1."""

class Reuse:
    """The ``reuse`` eviction policy's targets, counts and ghosts (``_reuse.h``)."""

    share: float
    capacity: int
    t2: int
    ghosts: int
    evicted: list[int]
    def __init__(self, ghost_factor: float, shadow: float, floor: float) -> None: ...
    def returning(self, ns: int, key: bytes) -> bool:
        """Whether the key is a ghost (dropping it, adapting the targets)."""
    def record_eviction(self, k: int, ns: int, key: bytes, resident: int) -> None:
        """Record an eviction from T1 (0) or T2 (1)."""
    def victim_list(self, resident: int) -> int:
        """The list the next victim comes from (0: T1, 1: T2); before the first eviction it
        sets T1's target to T1's share of the ``resident`` pages."""
    def ghost_list(self) -> list[tuple[int, int]]:
        """The ghosts, oldest first: ``(hash, 2 x that list's evictions then + list)``."""
