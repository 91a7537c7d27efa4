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
    """The ``reuse`` eviction policy's lifetime, re-use distances, counts and ghosts
    (``_reuse.h``)."""

    life: int
    capacity: int
    t2: int
    ghosts: int
    evicted: list[int]
    def __init__(self, ghost_factor: float, quantile: float) -> None: ...
    def returning(self, ns: int, key: bytes, clock: int) -> bool:
        """Whether the key is a ghost, stored again at tick ``clock`` (dropping it, counting
        the ticks since its page's last use as a re-use distance)."""
    def record_eviction(self, k: int, ns: int, key: bytes, stamp: int, resident: int) -> None:
        """Record an eviction from T1 (0) or T2 (1) of a page last used at tick ``stamp``."""
    def pick(self, stamp1: int | None, stamp2: int | None, clock: int, resident: int) -> int:
        """The list the next victim comes from (0: T1, 1: T2), given the stamps of each
        list's coldest evictable page (None: it has none)."""
    def used(self, stamp: Any, slots: list[int], clock: int) -> None:
        """The pages ``slots`` (stamps in the int64 buffer ``stamp``) are used again at tick
        ``clock``: count their re-use distances (every slot checked first)."""
    def restore(self, life: int) -> None:
        """Take a lifetime estimated before a restart (1 to 9e18 ticks)."""
    def lifetime(self, resident: int) -> int:
        """The lifetime now (before the first estimate, 4 x ``resident``)."""
    def histogram(self) -> list[int]:
        """The re-use distances counted in ``[2^b, 2^(b+1))``, by ``b`` (64 counts)."""
    def ghost_list(self) -> list[tuple[int, int]]:
        """The ghosts, oldest first: ``(hash, 2 x its page's last access tick + list)``."""
