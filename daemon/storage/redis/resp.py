"""RESP encoding of the ``redis`` backend's commands, and landing of the values read.

Commands are RESP-encoded here and written on a pooled redis-py connection as they are;
replies are parsed by hiredis. This skips redis-py's per-command pipeline bookkeeping
(tens of µs per command) and lets each page's payload go to the socket as a view of the
arena slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from kvtier.daemon.storage.objects import HEADER_SIZE, verify_object
from kvtier.kernels import guarded_copy

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
    address: int | None = None,
) -> tuple[list[bool], int, list[int], list[BaseException]]:
    """Verify each value read and copy its payload into the arena.

    Args:
        view: the arena.
        ns, keys, offsets, length: the get batch.
        values: one reply per key: the value, None (absent) or the server's error.
        address: the arena's address: the payloads are then copied by the guarded copy
            (:func:`~kvtier.kernels.guarded_copy.copy_pages`) when it is in use, so that
            an arena page its file system cannot back (a pool not pre-faulted whose
            ``pool_dir`` filled up) is a miss, not the daemon's end by SIGBUS.

    Returns:
        (flags, missing, corrupt, faults): one flag per key, how many keys were absent
        (or could not land in the arena), the indexes of the values that did not verify, and the per-command errors the
        server sent.
        Counters go back to the caller, which owns ``stats`` on the event loop.
    """
    flags: list[bool] = []
    missing = 0
    corrupt: list[int] = []
    faults: list[BaseException] = []
    size = HEADER_SIZE + length
    guarded = address is not None and guarded_copy.available()
    copies: list[tuple[int, int, bytes]] = []  # (key index, arena offset, value), guarded
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
        if guarded:
            copies.append((i, off, value))
            flags.append(False)  # set once copied
            continue
        view[off : off + length] = data[HEADER_SIZE:]
        flags.append(True)
    if copies:
        assert address is not None
        srcs = [np.frombuffer(v, dtype=np.uint8).ctypes.data + HEADER_SIZE for _, _, v in copies]
        done = guarded_copy.copy_pages([address + off for _, off, _ in copies], srcs, length)
        for i, _, _ in copies[:done]:  # a page that faulted, and those after it, are misses
            flags[i] = True
        missing += len(copies) - done
    return flags, missing, corrupt, faults
