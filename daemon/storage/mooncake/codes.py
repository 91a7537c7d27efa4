"""Return codes of Mooncake Store's batch calls (Mooncake 0.3.13) that the backend tells apart.

A get answers the bytes read, or one of :data:`MISS_CODES` for a miss, one of
:data:`SIZE_MISMATCH` when the object's size differs from the buffers (counted corrupt),
another negative for a fault (``-900``: the master is unreachable). A put answers 0,
:data:`OBJECT_ALREADY_EXISTS` (success), :data:`NO_AVAILABLE_HANDLE` (no space: a
shortfall, not an error) or a fault.
"""

from __future__ import annotations

__all__ = [
    "LEASE_EXPIRED",
    "MISS_CODES",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_NOT_FOUND",
    "REPLICA_NOT_READY",
    "SIZE_MISMATCH",
]

OBJECT_NOT_FOUND = -704
"""No such object (a miss)."""
REPLICA_NOT_READY = -703
"""The object is being written (a miss)."""
LEASE_EXPIRED = -707
"""The read lease ran out (a miss)."""
OBJECT_ALREADY_EXISTS = -705
"""A put of a key already stored: the old object stays (a success for content-named pages)."""
NO_AVAILABLE_HANDLE = -200
"""No space for a put (a shortfall, not an error)."""
SIZE_MISMATCH = (-600, -800)
"""The object's size differs from the buffers given (counted corrupt)."""
MISS_CODES = frozenset((OBJECT_NOT_FOUND, REPLICA_NOT_READY, LEASE_EXPIRED))
"""Codes of a get that are ordinary misses."""
