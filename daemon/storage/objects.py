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

Backends that keep header and payload in separate places (a header in a slot's headroom or
in scratch, the payload in its arena slot) seal and check whole batches with
:func:`seal_headers` / :func:`check_headers`: one C call per batch (the GIL released, XXH3's
AVX2 build where the CPU has it) when :mod:`kvtier.kernels._fileio` is built, else the same
in Python page by page (:func:`native_headers` says which; the ``file_io`` switch of
:mod:`kvtier.kernels.native` turns the C calls off).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import xxhash
from kvtier.kernels import native

MAGIC = b"KVTP"
FORMAT_VERSION = 1
HEADER_SIZE = 96
HEADROOM_BYTES = 128
"""Headroom a backend that moves header and payload as one buffer asks of each host-pool
slot: :data:`HEADER_SIZE` rounded up to whole 64-byte cache lines, and a multiple of the
pool's 128-byte slot alignment."""
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


def verify_object(
    header: memoryview | bytes, payload: memoryview | bytes, ns: bytes, key: bytes
) -> bool:
    """Return True when ``header`` describes ``payload`` under (``ns``, ``key``) and it verifies."""
    expected = check_header(header, ns, key, len(payload))
    return expected is not None and payload_checksum(payload) == expected


Buffer = Any  # a buffer-protocol object: memoryview, bytearray, mmap


def _check_batch(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer | None,
    payloads: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
) -> tuple[memoryview, memoryview]:
    """The arguments of a batch call checked (the same errors as the C functions); no
    payloads to check when ``pbuf`` is None."""
    if length <= 0:
        raise ValueError(f"length = {length} must be > 0")
    if len(ns) != 32:
        raise ValueError(f"ns has {len(ns)} bytes, not 32")
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != 32:
            raise ValueError(f"keys[{i}] must be 32 bytes")
    hv, pv = memoryview(hbuf).cast("B"), memoryview(b"" if pbuf is None else pbuf).cast("B")
    checks = [("headers", headers, HEADER_SIZE, hv.nbytes)]
    if pbuf is not None:
        checks.append(("payloads", payloads, length, pv.nbytes))
    for name, offs, span, size in checks:
        if len(offs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(offs)} {name}")
        for i, off in enumerate(offs):
            if off < 0 or off > size - span:
                raise ValueError(
                    f"{name}[{i}] = {off}: {span} bytes there do not fit in the "
                    f"buffer of {size} bytes"
                )
    return hv, pv


def py_seal_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
) -> None:
    """The pure-Python :func:`seal_headers` (same bytes, page by page)."""
    hv, pv = _check_batch(hbuf, headers, pbuf, payloads, length, ns, keys)
    for h, p, key in zip(headers, payloads, keys):
        hv[h : h + HEADER_SIZE] = header_for(ns, key, length, payload_checksum(pv[p : p + length]))


def py_check_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
) -> list[bool]:
    """The pure-Python :func:`check_headers` (same answers, page by page)."""
    hv, pv = _check_batch(hbuf, headers, pbuf, payloads, length, ns, keys)
    return [
        verify_object(hv[h : h + HEADER_SIZE], pv[p : p + length], ns, key)
        for h, p, key in zip(headers, payloads, keys)
    ]


def py_write_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
    checksums: Sequence[int],
) -> None:
    """The pure-Python :func:`write_headers`."""
    hv, _ = _check_batch(hbuf, headers, None, (), length, ns, keys)
    if len(checksums) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(checksums)} checksums")
    for i, c in enumerate(checksums):
        if not isinstance(c, int) or not 0 <= c < 1 << 64:
            raise ValueError(f"checksums[{i}] must be an int of 64 bits")
    for h, key, checksum in zip(headers, keys, checksums):
        hv[h : h + HEADER_SIZE] = header_for(ns, key, length, checksum)


def py_recorded_checksums(
    hbuf: Buffer, headers: Sequence[int], length: int, ns: bytes, keys: Sequence[bytes]
) -> list[int | None]:
    """The pure-Python :func:`recorded_checksums`."""
    hv, _ = _check_batch(hbuf, headers, None, (), length, ns, keys)
    return [check_header(hv[h : h + HEADER_SIZE], ns, key, length) for h, key in zip(headers, keys)]


def _native_headers() -> tuple[Any, Any, Any, Any] | None:
    """The C batch functions when built and writing exactly :func:`header_for`'s bytes."""
    try:
        from kvtier.kernels import _fileio

        fns = (
            _fileio.seal_headers,
            _fileio.check_headers,
            _fileio.write_headers,
            _fileio.recorded_checksums,
        )
    except (ImportError, AttributeError):
        return None
    seal, check, write, recorded = fns
    payload = bytes(range(251)) * 5
    ns, key = bytes(range(32)), bytes(range(32, 64))
    want = encode_header(ns, key, payload)
    sealed, written = bytearray(HEADER_SIZE), bytearray(HEADER_SIZE)
    try:  # an extension built from other sources may take other arguments: fall back
        seal(sealed, [0], payload, [0], len(payload), ns, [key])
        write(written, [0], len(payload), ns, [key], [payload_checksum(payload)])
        same = (
            bytes(sealed) == want
            and bytes(written) == want
            and check(want, [0], payload, [0], len(payload), ns, [key]) == [True]
            and recorded(want, [0], len(payload), ns, [key]) == [payload_checksum(payload)]
        )
    except (TypeError, ValueError, OverflowError):
        return None
    return fns if same else None


_headers_c = _native_headers()
HEADERS_BUILT: bool = _headers_c is not None
"""Whether the C batch functions are built and write :func:`header_for`'s bytes (whatever
the ``file_io`` switch of :mod:`kvtier.kernels.native` says)."""


def native_headers() -> bool:
    """Whether :func:`seal_headers` / :func:`check_headers` run in C now (the GIL released
    per batch): built, and the ``file_io`` kernel not turned off."""
    return _headers_c is not None and native.enabled("file_io")


def seal_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
) -> None:
    """For each page, hash ``pbuf[payloads[i] : payloads[i] + length]`` and write its header
    at ``hbuf[headers[i]:]``. A bad argument raises ValueError (TypeError or OverflowError
    for one of the wrong type or size) before anything is written."""
    if _headers_c is not None and native.enabled("file_io"):
        _headers_c[0](hbuf, headers, pbuf, payloads, length, ns, keys)
    else:
        py_seal_headers(hbuf, headers, pbuf, payloads, length, ns, keys)


def check_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
) -> list[bool]:
    """For each page, whether the header at ``hbuf[headers[i]:]`` names ``ns``, ``keys[i]``
    and ``length``, verifies, and records the xxh3-64 of the payload at ``pbuf[payloads[i]:]``."""
    if _headers_c is not None and native.enabled("file_io"):
        return _headers_c[1](hbuf, headers, pbuf, payloads, length, ns, keys)
    return py_check_headers(hbuf, headers, pbuf, payloads, length, ns, keys)


def write_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    length: int,
    ns: bytes,
    keys: Sequence[bytes],
    checksums: Sequence[int],
) -> None:
    """:func:`seal_headers` for payloads the caller already hashed (e.g. while copying them):
    the header of ``keys[i]`` recording ``checksums[i]`` at ``hbuf[headers[i]:]``."""
    if _headers_c is not None and native.enabled("file_io"):
        _headers_c[2](hbuf, headers, length, ns, keys, checksums)
    else:
        py_write_headers(hbuf, headers, length, ns, keys, checksums)


def recorded_checksums(
    hbuf: Buffer, headers: Sequence[int], length: int, ns: bytes, keys: Sequence[bytes]
) -> list[int | None]:
    """For each header, the payload checksum it records when it verifies and names ``ns``,
    ``keys[i]`` and ``length`` (:func:`check_header` for a batch); None otherwise."""
    if _headers_c is not None and native.enabled("file_io"):
        return _headers_c[3](hbuf, headers, length, ns, keys)
    return py_recorded_checksums(hbuf, headers, length, ns, keys)
