"""Batch sealing and checking of object headers: the C functions and the pure-Python ones
write the header the object format describes (packed field by field and hashed by the
tests' own XXH3, ``tests/xxh3_reference.py``) and refuse the same objects."""

from __future__ import annotations

import os
import random

import pytest
from kvtier.daemon.storage import objects
from kvtier.daemon.storage.objects import HEADER_SIZE

from tests.xxh3_reference import l3_header


def _impls(python: tuple, native: tuple) -> list:
    """The pure-Python and the C implementation of a pair of functions, as test params."""
    skip = pytest.mark.skipif(
        not objects.HEADERS_BUILT, reason="kvtier.kernels._fileio is not built"
    )
    return [pytest.param(python, id="python"), pytest.param(native, id="native", marks=skip)]


IMPLS = _impls(
    (objects.py_seal_headers, objects.py_check_headers),
    (objects.seal_headers, objects.check_headers),
)

NS = bytes(range(32))


def ids(n: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_the_c_functions_are_built() -> None:
    """`make venv` builds the extension; without it the batch functions run in Python."""
    assert objects.HEADERS_BUILT and objects.native_headers()


@pytest.mark.skipif(not objects.HEADERS_BUILT, reason="kvtier.kernels._fileio is not built")
def test_the_file_io_switch_sends_the_batches_to_the_python_path(native_off, monkeypatch) -> None:
    """With ``file_io`` off (kvtier.kernels.native) the batch calls run in Python, and
    write the same bytes."""
    ran: list[str] = []
    real = objects.py_seal_headers
    monkeypatch.setattr(objects, "py_seal_headers", lambda *a: ran.append("python") or real(*a))
    keys, payload = ids(3), bytes(range(200)) * 3
    on, off = bytearray(3 * HEADER_SIZE), bytearray(3 * HEADER_SIZE)
    heads = [0, HEADER_SIZE, 2 * HEADER_SIZE]
    objects.seal_headers(on, heads, payload, [0, 200, 400], 200, NS, keys)
    assert ran == []  # in C
    native_off("file_io")
    assert not objects.native_headers()
    objects.seal_headers(off, heads, payload, [0, 200, 400], 200, NS, keys)
    assert ran[-1:] == ["python"] and off == on


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length", [1, 95, 96, 4097, 256 * 1024])
def test_sealed_headers_are_the_format_s_in_place(impl: tuple, length: int) -> None:
    """Headers in each slot's headroom (one buffer) match the format byte for byte, and
    nothing outside the headers changes."""
    seal, check = impl
    n, stride = 5, 128 + length
    buf = bytearray(os.urandom(n * stride))
    keys = ids(n)
    payloads = [i * stride + 128 for i in range(n)]
    headers = [p - HEADER_SIZE for p in payloads]
    before = bytes(buf)
    seal(buf, headers, buf, payloads, length, NS, keys)
    for i, (h, p) in enumerate(zip(headers, payloads)):
        assert bytes(buf[h:p]) == l3_header(NS, keys[i], bytes(buf[p : p + length]))
        assert buf[i * stride : h] == before[i * stride : h]
        assert buf[p : p + length] == before[p : p + length]
    assert check(buf, headers, buf, payloads, length, NS, keys) == [True] * n


@pytest.mark.parametrize("impl", IMPLS)
def test_headers_in_another_buffer(impl: tuple) -> None:
    """Headers in scratch, payloads in the arena; the order of slots is free."""
    seal, check = impl
    length, n = 4096, 4
    arena = bytearray(os.urandom(length * n))
    scratch = bytearray(HEADER_SIZE * n)
    keys, payloads = ids(n), [3 * length, 0, 2 * length, length]
    headers = [i * HEADER_SIZE for i in range(n)]
    seal(scratch, headers, arena, payloads, length, NS, keys)
    for i, p in enumerate(payloads):
        want = l3_header(NS, keys[i], bytes(arena[p : p + length]))
        assert scratch[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] == want
    assert check(scratch, headers, arena, payloads, length, NS, keys) == [True] * n


@pytest.mark.parametrize("impl", IMPLS)
def test_any_change_makes_a_miss(impl: tuple) -> None:
    """A flipped byte anywhere in a header or payload, or a reader that expects another
    namespace, key or length, fails only the page concerned."""
    seal, check = impl
    length, n = 512, 3
    buf = bytearray(os.urandom(n * (HEADER_SIZE + length)))
    keys = ids(n)
    headers = [i * (HEADER_SIZE + length) for i in range(n)]
    payloads = [h + HEADER_SIZE for h in headers]
    seal(buf, headers, buf, payloads, length, NS, keys)
    good = bytes(buf)
    for pos in [0, 3, 4, 6, 7, 8, 39, 40, 71, 72, 79, 80, 87, 88, 95, 96, 300, 96 + length - 1]:
        buf[headers[1] + pos] ^= 0x01
        assert check(buf, headers, buf, payloads, length, NS, keys) == [True, False, True], pos
        buf[:] = good
    assert check(buf, headers, buf, payloads, length, bytes(32), keys) == [False] * n
    assert check(buf, headers, buf, payloads, length, NS, keys[::-1]) == [False, True, False]
    assert check(buf, headers, buf, payloads, length - 1, NS, keys) == [False] * n
    assert check(buf, headers, buf, payloads, length, NS, keys) == [True] * n


@pytest.mark.parametrize("impl", IMPLS)
def test_python_and_c_read_each_others_objects(impl: tuple) -> None:
    """Objects sealed by one implementation verify with the other."""
    seal, _ = impl
    length, n = 1000, 4
    buf = bytearray(os.urandom(n * (HEADER_SIZE + length)))
    keys = ids(n, seed=7)
    headers = [i * (HEADER_SIZE + length) for i in range(n)]
    payloads = [h + HEADER_SIZE for h in headers]
    seal(buf, headers, buf, payloads, length, NS, keys)
    for check in (objects.py_check_headers, objects.check_headers):
        assert check(buf, headers, buf, payloads, length, NS, keys) == [True] * n


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"length": 0}, "length = 0"),
        ({"ns": b"x" * 31}, "ns has 31 bytes"),
        ({"keys": [b"k" * 32, b"k" * 33]}, r"keys\[1\] must be 32 bytes"),
        ({"keys": [b"k" * 32, "k" * 32]}, r"keys\[1\] must be 32 bytes"),
        ({"keys": [b"k" * 32]}, "1 keys but 2 headers"),
        ({"headers": [0, 4001]}, r"headers\[1\] = 4001: 96 bytes there do not fit"),
        ({"headers": [-1, 96]}, r"headers\[0\] = -1"),
        ({"payloads": [0, 3585]}, r"payloads\[1\] = 3585: 512 bytes there do not fit"),
    ],
)
def test_bad_arguments_raise_before_anything_is_written(
    impl: tuple, change: dict, message: str
) -> None:
    seal, check = impl
    args = {
        "headers": [0, 96],
        "payloads": [0, 512],
        "length": 512,
        "ns": NS,
        "keys": [b"k" * 32, b"l" * 32],
    }
    args.update(change)
    hbuf, pbuf = bytearray(4096), bytearray(os.urandom(4096))
    for fn in (seal, check):
        with pytest.raises(ValueError, match=message):
            fn(
                hbuf,
                args["headers"],
                pbuf,
                args["payloads"],
                args["length"],
                args["ns"],
                args["keys"],
            )
        assert hbuf == bytes(4096)


def test_sealing_needs_a_writable_header_buffer() -> None:
    with pytest.raises(TypeError):
        objects.seal_headers(bytes(96), [0], bytes(64), [0], 64, NS, [b"k" * 32])


RECORD_IMPLS = _impls(
    (objects.py_write_headers, objects.py_recorded_checksums),
    (objects.write_headers, objects.recorded_checksums),
)


@pytest.mark.parametrize("impl", RECORD_IMPLS)
def test_headers_with_known_checksums_and_reading_them_back(impl: tuple) -> None:
    """write_headers writes header_for's bytes at a stride; recorded_checksums gives back
    each recorded checksum, None for a header that is damaged, of another key or length."""
    write, recorded = impl
    n, stride, length = 4, 128, 1 << 18
    table = bytearray(n * stride)
    keys, sums = ids(n, seed=3), [0, 1, (1 << 64) - 1, 0x1234_5678_9ABC_DEF0]
    at = list(range(0, n * stride, stride))
    write(table, at, length, NS, keys, sums)
    for h, k, c in zip(at, keys, sums):
        assert table[h : h + HEADER_SIZE] == objects.header_for(NS, k, length, c)
        assert table[h + HEADER_SIZE : h + stride] == bytes(stride - HEADER_SIZE)
    assert recorded(table, at, length, NS, keys) == sums
    table[at[2] + 50] ^= 0x80
    assert recorded(table, at, length, NS, keys) == [sums[0], sums[1], None, sums[3]]
    assert recorded(table, at, length, NS, [keys[0], keys[0], keys[2], keys[3]]) == [
        sums[0],
        None,
        None,
        sums[3],
    ]
    assert recorded(table, at, length + 1, NS, keys) == [None] * n
    assert recorded(bytes(n * stride), at, length, NS, keys) == [None] * n


@pytest.mark.parametrize("impl", RECORD_IMPLS)
@pytest.mark.parametrize(
    ("sums", "message"),
    [
        ([1], "2 keys but 1 checksums"),
        ([1, -1], r"checksums\[1\]"),
        ([1, 1 << 64], r"checksums\[1\]"),
        ([None, 1], r"checksums\[0\]"),
    ],
)
def test_write_headers_refuses_bad_checksums(impl: tuple, sums: list, message: str) -> None:
    write, _ = impl
    table = bytearray(256)
    with pytest.raises(ValueError, match=message):
        write(table, [0, 128], 4096, NS, ids(2), sums)
    assert table == bytes(256)
