"""The self-describing object format every L3 backend stores.

One object is one page::

    offset  size  field
    0       4     magic            b"KVTP"
    4       2     format version   (u16, little-endian)
    6       2     reserved         (0)
    8       32    namespace fingerprint
    40      32    page key
    72      8     payload length   (u64)
    80      8     payload checksum (xxh3-64 of the payload)
    88      8     header checksum  (xxh3-64 of bytes 0..88)
    96      ...   payload

A reader verifies magic, version, namespace, key, length and both checksums; any
mismatch means the object is a miss (and is counted as corrupt), never data.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVTP"
FORMAT_VERSION = 1
HEADER_SIZE = 96
_HEAD = struct.Struct("<4sHH32s32sQQ")  # 88 bytes
_U64 = struct.Struct("<Q")


def payload_checksum(payload: memoryview | bytes) -> int:
    """Return the xxh3-64 checksum of ``payload`` (runs without copying it)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(ns: bytes, key: bytes, payload: memoryview | bytes) -> bytes:
    """Return the 96-byte header for ``payload`` stored under (``ns``, ``key``)."""
    return header_for(ns, key, len(payload), payload_checksum(payload))


def header_for(ns: bytes, key: bytes, length: int, checksum: int) -> bytes:
    """Return the 96-byte header of a ``length``-byte payload whose xxh3-64 is ``checksum``
    (computed by the caller, e.g. while copying the payload)."""
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, ns, key, length, checksum)
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def check_header(header: memoryview | bytes, ns: bytes, key: bytes, length: int) -> int | None:
    """Verify a header against what the reader expects.

    Returns:
        The payload checksum recorded in the header when magic, version, header
        checksum, namespace, key and length all match; ``None`` otherwise.
    """
    if len(header) < HEADER_SIZE:
        return None
    head = bytes(header[:88])
    (stored_sum,) = _U64.unpack_from(header, 88)
    if xxhash.xxh3_64_intdigest(head) != stored_sum:
        return None
    magic, version, _, h_ns, h_key, h_len, p_sum = _HEAD.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if h_ns != ns or h_key != key or h_len != length:
        return None
    return int(p_sum)


def verify_object(header: memoryview | bytes, payload: memoryview | bytes, ns: bytes, key: bytes) -> bool:
    """Return True when ``header`` describes ``payload`` under (``ns``, ``key``) and it verifies."""
    expected = check_header(header, ns, key, len(payload))
    return expected is not None and payload_checksum(payload) == expected
