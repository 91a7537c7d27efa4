"""Checksums, seals and L3 headers against known answers, not against the code under test.

The expected values are fixed: xxHash's published XXH3 vectors of its sanity buffer (which
also pin ``tests/xxh3_reference.py``, the tests' own XXH3) and an L3 header packed by hand
and pinned as bytes. Each production path that computes them (Python, numpy, C) is held to
these, so a wrong rule in one of them cannot hide behind another that shares it.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.daemon.pool.layout import page_checksum, page_checksums, seal_of
from kvtier.daemon.storage import objects
from kvtier.daemon.storage.objects import (
    HEADER_SIZE,
    check_header,
    encode_header,
    header_for,
    payload_checksum,
)

from tests.xxh3_reference import PRIME64, XXH3_VECTORS, l3_header, sanity_buffer, xxh3_64

BUF = sanity_buffer(max(n for n, _ in XXH3_VECTORS))
NS = bytes(range(32))
KEY = bytes(range(32, 64))
HEADER_2048 = bytes.fromhex(
    "4b56545001000000"  # magic b"KVTP", version 1, reserved 0
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"  # namespace NS
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"  # key KEY
    "0008000000000000"  # payload length 2048
    "e038f0a5c3e259dd"  # payload checksum: XXH3_VECTORS[(2048, 0)]
    "e6fb94864600cfa9"
)  # header checksum
"""The header of the first 2048 bytes of the sanity buffer stored under (NS, KEY)."""


@pytest.mark.parametrize(("length", "seed"), sorted(XXH3_VECTORS))
def test_the_reference_gives_xxhash_s_own_vectors(length: int, seed: int) -> None:
    assert xxh3_64(BUF[:length], seed) == XXH3_VECTORS[(length, seed)]


def test_the_pinned_header_is_the_reference_s_and_the_format_s() -> None:
    assert l3_header(NS, KEY, BUF[:2048]) == HEADER_2048
    assert HEADER_2048[80:88] == XXH3_VECTORS[(2048, 0)].to_bytes(8, "little")
    assert len(HEADER_2048) == HEADER_SIZE


def test_page_checksums_of_known_pages() -> None:
    lengths = [n for n, seed in sorted(XXH3_VECTORS) if seed == 0]
    stride = 4096
    arena = np.zeros(stride * len(lengths), dtype=np.uint8)
    for i, n in enumerate(lengths):
        arena[i * stride : i * stride + n] = np.frombuffer(BUF[:n], dtype=np.uint8)
    for i, n in enumerate(lengths):  # one length at a time: page_checksums takes one size
        assert page_checksums(arena, [i * stride], n) == [XXH3_VECTORS[(n, 0)]]
        assert page_checksum(BUF[:n]) == payload_checksum(BUF[:n]) == XXH3_VECTORS[(n, 0)]
    pages = [i * stride for i, n in enumerate(lengths) if n >= 2048]
    assert page_checksums(arena, pages, 2048) == [XXH3_VECTORS[(2048, 0)]] * len(pages)


def test_a_row_seal_is_xxh3_of_the_key_seeded_by_checksum_and_namespace() -> None:
    # seal_of(key, ns, checksum) = xxh3_64(key, seed=checksum ^ ns): with checksum ^ ns =
    # PRIME64 the seal of the sanity buffer's first 24 bytes is a published vector
    ns = 5
    assert seal_of(BUF[:24], ns, PRIME64 ^ ns) == XXH3_VECTORS[(24, PRIME64)]
    assert seal_of(BUF[:24], ns, ns) == XXH3_VECTORS[(24, 0)]


def test_encode_header_and_header_for_write_the_pinned_bytes() -> None:
    assert encode_header(NS, KEY, BUF[:2048]) == HEADER_2048
    assert header_for(NS, KEY, 2048, XXH3_VECTORS[(2048, 0)]) == HEADER_2048
    assert check_header(HEADER_2048, NS, KEY, 2048) == XXH3_VECTORS[(2048, 0)]
    for byte in (0, 4, 8, 40, 72, 80, 88, 95):  # any bit changed: refused
        bad = bytearray(HEADER_2048)
        bad[byte] ^= 0x10
        assert check_header(bytes(bad), NS, KEY, 2048) is None


@pytest.mark.parametrize("impl", ["native", "python"])
def test_sealed_headers_are_the_pinned_bytes(impl: str) -> None:
    """The batch sealer (C, and Python page by page) writes the known header and leaves
    the payload as it was."""
    if impl == "native" and not objects.native_headers():
        pytest.skip("kvtier.kernels._fileio is not built: the Python sealer is in use")
    seal = objects.seal_headers if impl == "native" else objects.py_seal_headers
    buf = bytearray(3 * 4096)
    payloads = [128, 4096 + 128, 2 * 4096 + 128]
    for p in payloads:
        buf[p : p + 2048] = BUF[:2048]
    seal(buf, [p - HEADER_SIZE for p in payloads], buf, payloads, 2048, NS, [KEY] * 3)
    for p in payloads:
        assert bytes(buf[p - HEADER_SIZE : p]) == HEADER_2048
        assert bytes(buf[p : p + 2048]) == BUF[:2048]
