"""RESP encoding of the ``redis`` backend's commands, and landing of the values read.

Commands are RESP-encoded here and written on a pooled redis-py connection as they are;
replies are parsed by hiredis. This skips redis-py's per-command pipeline bookkeeping
(tens of µs per command) and lets each page's payload go to the socket as a view of the
arena slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.daemon.storage.objects import HEADER_SIZE, verify_object

__all__ = ["bulk", "command", "land"]


def bulk(arg: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def command(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(arg) for arg in args)


def land(
    view: memoryview,
    ns: bytes,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    length: int,
    values: Sequence[Any],
) -> tuple[list[bool], int, list[int], list[BaseException]]:
    """Verify each value read and copy its payload into the arena.

    Args:
        view: the arena.
        ns, keys, offsets, length: the get batch.
        values: one reply per key: the value, None (absent) or the server's error.

    Returns:
        (flags, missing, corrupt, faults): one flag per key, how many keys were absent,
        the indexes of the values that did not verify, and the per-command errors the
        server sent.
        Counters go back to the caller, which owns ``stats`` on the event loop.
    """
    flags: list[bool] = []
    missing = 0
    corrupt: list[int] = []
    faults: list[BaseException] = []
    size = HEADER_SIZE + length
    for i, (key, off, value) in enumerate(zip(keys, offsets, values)):
        if value is None:
            missing += 1
            flags.append(False)
            continue
        if isinstance(value, BaseException):
            faults.append(value)
            flags.append(False)
            continue
        data = memoryview(value)
        if len(data) != size or not verify_object(data[:HEADER_SIZE], data[HEADER_SIZE:], ns, key):
            corrupt.append(i)
            flags.append(False)
            continue
        view[off : off + length] = data[HEADER_SIZE:]
        flags.append(True)
    return flags, missing, corrupt, faults
