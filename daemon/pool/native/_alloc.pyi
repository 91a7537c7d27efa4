"""Types of the ``_alloc`` C extension (``daemon/pool/native/_alloc.c``): a STORE's slots
allocated and committed in C, as :mod:`kvtier.daemon.pool.storerun` calls it."""

from typing import Any

def run(*args: Any) -> tuple[int, int, int, int, int] | None:
    """Allocate slots for a STORE's keys from ``start`` on: ``(i, prev, clock, evictions,
    unlogged)``, or None when a key is not a bytes object of at most 32 bytes."""

def commit(*args: Any) -> tuple[int, int] | None:
    """Commit a STORE's filled slots: ``(stop, clock)``, or None (nothing changed) when a
    slot or checksum is refused."""
