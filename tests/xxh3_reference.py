"""XXH3-64 written from its specification, for the tests' expected checksums and headers.

kvtier checksums pages with XXH3-64 (``xxhash.xxh3_64_intdigest`` in Python, libxxhash or
its own code in the C extensions). A test that takes its expected values from those same
functions cannot catch a wrong rule (the wrong bytes hashed, a wrong seed, fields packed in
the wrong order): the reference would repeat it. This is a second implementation, in
Python and numpy, sharing no code with them; :data:`XXH3_VECTORS` (xxHash's own sanity
vectors, from ``cli/xsum_sanity_check.c``) pin it, and ``tests/unit/test_known_answers.py``
holds it to them.

Not fast (numpy per 1 KiB block), and meant for pages of a few KiB to a few hundred KiB.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PRIME32", "PRIME64", "XXH3_VECTORS", "l3_header", "sanity_buffer", "xxh3_64"]

M64 = (1 << 64) - 1
PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
PRIME64_4, PRIME64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1, PRIME_MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
PRIME32, PRIME64 = 2654435761, 11400714785074694797
"""The sanity test's seeds (and its buffer generator's constants)."""

SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
"""XXH3's default secret (192 bytes)."""

XXH3_VECTORS: dict[tuple[int, int], int] = {
    (0, 0): 0x2D06800538D394C2,
    (0, PRIME64): 0xA8A6B918B2F0364A,
    (1, 0): 0xC44BDFF4074EECDB,
    (1, PRIME64): 0x032BE332DD766EF8,
    (6, 0): 0x27B56A84CD2D7325,
    (6, PRIME64): 0x84589C116AB59AB9,
    (12, 0): 0xA713DAF0DFBB77E7,
    (12, PRIME64): 0xE7303E1B2336DE0E,
    (24, 0): 0xA3FE70BF9D3510EB,
    (24, PRIME64): 0x850E80FC35BDD690,
    (48, 0): 0x397DA259ECBA1F11,
    (48, PRIME64): 0xADC2CBAA44ACC616,
    (80, 0): 0xBCDEFBBB2C47C90A,
    (80, PRIME64): 0xC6DD0CB699532E73,
    (195, 0): 0xCD94217EE362EC3A,
    (195, PRIME64): 0xBA68003D370CB3D9,
    (403, 0): 0xCDEB804D65C6DEA4,
    (403, PRIME64): 0x6259F6ECFD6443FD,
    (512, 0): 0x617E49599013CB6B,
    (512, PRIME64): 0x3CE457DE14C27708,
    (2048, 0): 0xDD59E2C3A5F038E0,
    (2048, PRIME64): 0x66F81670669ABABC,
    (2099, 0): 0xC6B9D9B3FC9AC765,
    (2099, PRIME64): 0x184F316843663974,
    (2240, 0): 0x6E73A90539CF2948,
    (2240, PRIME64): 0x757BA8487D1B5247,
    (2367, 0): 0xCB37AEB9E5D361ED,
    (2367, PRIME64): 0xD2DB3415B942B42A,
}
"""XXH3_64bits_withSeed of the first ``length`` bytes of :func:`sanity_buffer`, by
``(length, seed)``: xxHash's published test vectors (``XSUM_XXH3_testdata``)."""


def sanity_buffer(n: int) -> bytes:
    """xxHash's sanity-test input: byte ``i`` is the top byte of ``PRIME32 * PRIME64**i``
    (mod 2**64)."""
    out = bytearray(n)
    gen = PRIME32
    for i in range(n):
        out[i] = gen >> 56
        gen = (gen * PRIME64) & M64
    return bytes(out)


def _r64(b: bytes, i: int) -> int:
    return int.from_bytes(b[i : i + 8], "little")


def _r32(b: bytes, i: int) -> int:
    return int.from_bytes(b[i : i + 4], "little")


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _fold(a: int, b: int) -> int:
    m = a * b
    return (m ^ (m >> 64)) & M64


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * PRIME_MX1) & M64
    return h ^ (h >> 32)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * PRIME64_2) & M64
    h ^= h >> 29
    h = (h * PRIME64_3) & M64
    return h ^ (h >> 32)


def _rrmxmx(h: int, n: int) -> int:
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h = (h * PRIME_MX2) & M64
    h ^= (h >> 35) + n
    h = (h * PRIME_MX2) & M64
    return h ^ (h >> 28)


def _mix16(b: bytes, i: int, s: int, seed: int) -> int:
    return _fold(
        _r64(b, i) ^ ((_r64(SECRET, s) + seed) & M64),
        _r64(b, i + 8) ^ ((_r64(SECRET, s + 8) - seed) & M64),
    )


def _short(b: bytes, seed: int) -> int:
    """Inputs of at most 240 bytes."""
    n = len(b)
    if n == 0:
        return _xxh64_avalanche(seed ^ _r64(SECRET, 56) ^ _r64(SECRET, 64))
    if n <= 3:
        combined = (b[0] << 16) | (b[n >> 1] << 24) | b[n - 1] | (n << 8)
        return _xxh64_avalanche(combined ^ (((_r32(SECRET, 0) ^ _r32(SECRET, 4)) + seed) & M64))
    if n <= 8:
        lo = seed & 0xFFFFFFFF
        seed ^= int.from_bytes(lo.to_bytes(4, "little"), "big") << 32
        keyed = (_r32(b, n - 4) + (_r32(b, 0) << 32)) ^ (
            ((_r64(SECRET, 8) ^ _r64(SECRET, 16)) - seed) & M64
        )
        return _rrmxmx(keyed, n)
    if n <= 16:
        lo = _r64(b, 0) ^ (((_r64(SECRET, 24) ^ _r64(SECRET, 32)) + seed) & M64)
        hi = _r64(b, n - 8) ^ (((_r64(SECRET, 40) ^ _r64(SECRET, 48)) - seed) & M64)
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _fold(lo, hi)) & M64)
    acc = n * PRIME64_1
    if n <= 128:
        for k in range((n - 1) // 32, -1, -1):  # the outer pairs first, as the spec adds them
            acc += _mix16(b, 16 * k, 32 * k, seed) + _mix16(b, n - 16 * (k + 1), 32 * k + 16, seed)
        return _avalanche(acc & M64)
    for k in range(8):
        acc += _mix16(b, 16 * k, 16 * k, seed)
    acc = _avalanche(acc & M64)
    for k in range(8, n // 16):
        acc += _mix16(b, 16 * k, 16 * (k - 8) + 3, seed)
    acc += _mix16(b, n - 16, 136 - 17, seed)
    return _avalanche(acc & M64)


def _long(b: bytes, seed: int) -> int:
    """Inputs over 240 bytes: stripes of 64 bytes, blocks of 16 stripes."""
    secret = SECRET
    if seed:
        secret = b"".join(
            (_r64(SECRET, i) + seed & M64).to_bytes(8, "little")
            + (_r64(SECRET, i + 8) - seed & M64).to_bytes(8, "little")
            for i in range(0, 192, 16)
        )
    keys = np.frombuffer(secret, dtype="<u8")
    key_at = np.frombuffer(secret, dtype=np.uint8)
    acc = np.array(
        [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1],
        dtype=np.uint64,
    )
    swap = np.array([1, 0, 3, 2, 5, 4, 7, 6])
    # the secret as read by stripe s: bytes 8s .. 8s + 64
    stripe_keys = np.stack([key_at[8 * s : 8 * s + 64].view("<u8") for s in range(16)])

    def accumulate(data: np.ndarray, skeys: np.ndarray) -> None:  # data: stripes x 8 words
        with np.errstate(over="ignore"):
            dk = data ^ skeys
            acc[:] += ((dk & np.uint64(0xFFFFFFFF)) * (dk >> np.uint64(32))).sum(
                axis=0, dtype=np.uint64
            )
            acc[:] += data[:, swap].sum(axis=0, dtype=np.uint64)

    def scramble() -> None:
        with np.errstate(over="ignore"):
            acc[:] ^= acc >> np.uint64(47)
            acc[:] ^= keys[16:24]
            acc[:] *= np.uint64(PRIME32_1)

    n = len(b)
    words = np.frombuffer(b[: n - n % 8], dtype="<u8")
    blocks = (n - 1) // 1024
    for k in range(blocks):
        accumulate(words[128 * k : 128 * (k + 1)].reshape(16, 8), stripe_keys)
        scramble()
    stripes = ((n - 1) - 1024 * blocks) // 64
    if stripes:
        accumulate(
            words[128 * blocks : 128 * blocks + 8 * stripes].reshape(stripes, 8),
            stripe_keys[:stripes],
        )
    last = np.frombuffer(b[n - 64 :], dtype="<u8").reshape(1, 8)
    accumulate(last, key_at[192 - 64 - 7 : 192 - 7].view("<u8").reshape(1, 8))
    a = [int(x) for x in acc]
    result = n * PRIME64_1
    for i in range(4):
        result += _fold(
            a[2 * i] ^ _r64(secret, 11 + 16 * i), a[2 * i + 1] ^ _r64(secret, 19 + 16 * i)
        )
    return _avalanche(result & M64)


def xxh3_64(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """XXH3-64 of ``data`` with ``seed`` (``XXH3_64bits_withSeed``)."""
    b = bytes(data)
    return _short(b, seed & M64) if len(b) <= 240 else _long(b, seed & M64)


def l3_header(ns: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The 96-byte header of an L3 object, packed field by field from the format table of
    ``daemon/storage/objects.py`` (magic, version 1, reserved, namespace, key, payload
    length, payload checksum, header checksum) with :func:`xxh3_64`."""
    assert len(ns) == 32 and len(key) == 32
    head = (
        b"KVTP"
        + (1).to_bytes(2, "little")
        + bytes(2)
        + ns
        + key
        + len(payload).to_bytes(8, "little")
        + xxh3_64(payload).to_bytes(8, "little")
    )
    return head + xxh3_64(head).to_bytes(8, "little")
