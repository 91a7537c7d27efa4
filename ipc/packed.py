"""Keys and pages packed for the wire: one byte string each instead of a list of objects.

A LOOKUP, LOAD or STORE of a 128K-token context names 8,192 keys (and a transfer as many
engine pages). As MessagePack lists they are 8,192 objects to encode, decode, check and
hold on both sides; packed they are ``packed_keys`` (32-byte keys back to back) and
``packed_pages`` (little-endian uint32 page indices), which the daemon checks in numpy and
probes its key table with as they came (:mod:`kvtier.ipc.protocol` carries the fields).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator, Sequence
from typing import cast, overload

from kvtier.ipc._packkeys import pack_keys as _pack
from kvtier.ipc.limits import KEY_BYTES, PAGE_INDEX_BYTES

__all__ = ["PackedKeyList", "pack_keys", "pack_pages", "pack_tokens", "split_keys"]


def pack_keys(keys: Sequence[bytes]) -> bytes | None:
    """``packed_keys`` for ``keys`` (page keys, :data:`KEY_BYTES` each), or None when one
    is not a bytes object of exactly :data:`KEY_BYTES` bytes. Packed in C
    (``ipc/_packkeys.c``, a required extension: the one implementation), which checks every
    key, whatever the sequence (a list or a tuple read as it is, any other made a list
    first)."""
    return _pack(keys)


def pack_pages(pages: Sequence[int]) -> bytes | None:
    """``packed_pages`` for ``pages`` (little-endian uint32 each), or None when one is not
    an integer in ``[0, 2**32)`` (send ``pages`` then, which the daemon refuses naming
    the page)."""
    try:
        packed = array.array("I", pages)
    except (OverflowError, TypeError):
        return None
    if packed.itemsize != PAGE_INDEX_BYTES:  # "I" is 4 bytes on every platform kvtier runs on
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as a STORE's ``engine.token_ids`` (little-endian uint32 each).

    Raises:
        ValueError: a token id is not an integer in ``[0, 2**32)``.
    """
    packed = pack_pages(tokens)
    if packed is None:
        raise ValueError("token ids must be integers in [0, 2**32)")
    return packed


class PackedKeyList(Sequence[bytes]):
    """The keys of a packed request as a sequence of bytes objects, made only when asked
    for: the pool's key table probes :attr:`packed` itself (the daemon side).

    Args:
        packed: whole 32-byte keys back to back (the request's ``packed_keys``).
    """

    __slots__ = ("packed",)

    def __init__(self, packed: bytes | memoryview) -> None:
        if len(packed) % KEY_BYTES:
            raise ValueError(f"packed keys of {len(packed)} bytes: not whole {KEY_BYTES}-byte keys")
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // KEY_BYTES

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> PackedKeyList: ...

    def __getitem__(self, i: int | slice) -> bytes | PackedKeyList:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return PackedKeyList(b"".join(self[j] for j in range(start, stop, step)))
            return PackedKeyList(self.packed[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("key index out of range")
        return bytes(self.packed[i * KEY_BYTES : (i + 1) * KEY_BYTES])

    def __iter__(self) -> Iterator[bytes]:
        return iter(split_keys(self.packed))


def split_keys(packed: bytes | memoryview) -> list[bytes]:
    """The keys of ``packed_keys``, one bytes object each (a partial last one is dropped)."""
    import numpy as np  # here, not at import: the control socket binds before numpy loads

    n = len(packed) // KEY_BYTES
    return cast("list[bytes]", np.frombuffer(packed, dtype=f"V{KEY_BYTES}", count=n).tolist())
