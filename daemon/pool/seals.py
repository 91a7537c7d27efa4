"""Row seals in bulk: the xxh3-64 of many page keys at once, as numpy columns.

Adoption checks one seal per READY row (:func:`~kvtier.daemon.pool.layout.seal_of`,
``xxh3_64(key, seed)``); a million rows hashed one ``xxhash`` call each cost seconds of
interpreter time. XXH3 hashes every input of 17 to 32 bytes with the same few 64-bit
steps (two 16-byte mixes, of the first and of the last 16 bytes, then an avalanche), so
rows whose keys have those lengths (page keys are 32-byte digests) are hashed as columns
here; rows with shorter keys go through ``xxhash`` one by one. Only the first ``len``
bytes of a row's key are read, whatever lies past them in the key column.

The constants are XXH3's (xxhash 0.8): ``PRIME64_1``, the first 32 bytes of its default
secret (which a seeded hash of at most 240 bytes uses as it is) and the avalanche
multiplier. :func:`seals` is checked against ``xxhash`` for every length by the tests.
Where the C extension is built (``kvtier.daemon.pool.native._keyprobe.seals``), it hashes the rows of
17 to 32 bytes instead of numpy, several times faster (a million-page pool's adoption
hashes a million rows).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import xxhash

try:
    from kvtier.daemon.pool.native._keyprobe import seals as _native
except ImportError:  # built without a C compiler: numpy hashes the columns
    _native = None  # type: ignore[assignment]

__all__ = ["CHUNK_ROWS", "VECTOR_MIN_LEN", "seals"]

VECTOR_MIN_LEN = 17
"""Shortest key hashed as a column; shorter keys are hashed one by one."""

CHUNK_ROWS = 1 << 15
"""Rows hashed per numpy pass: each temporary column (256 KiB) stays in the CPU's cache
instead of streaming a million rows' worth through memory a dozen times."""

_PRIME64_1 = np.uint64(0x9E3779B185EBCA87)
_AVALANCHE = np.uint64(0x165667919E3779F9)
_SECRET = np.frombuffer(
    bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"), dtype="<u8"
)
_LO32 = np.uint64(0xFFFFFFFF)
_S32, _S37 = np.uint64(32), np.uint64(37)


def seals(keys: np.ndarray, lengths: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Return ``xxh3_64(keys[i, :lengths[i]], seed=seeds[i])`` for every row.

    Args:
        keys: ``(n, w)`` uint8, one key per row (``w`` at least the longest length, at
            most 32 for the column path; bytes past a row's length are ignored).
        lengths: ``(n,)`` key lengths, each at most ``w``.
        seeds: ``(n,)`` uint64 seeds.

    Returns:
        ``(n,)`` uint64 digests, what ``xxhash.xxh3_64_intdigest`` gives for each row.
    """
    n = len(lengths)
    out = np.empty(n, dtype=np.uint64)
    lengths = lengths.astype(np.int64, copy=False)
    vec = (lengths >= VECTOR_MIN_LEN) & (lengths <= min(32, keys.shape[1] if n else 32))
    rows = np.flatnonzero(vec)
    if _native is not None and len(rows) and keys.shape[1] == 32:
        whole = len(rows) == n
        got = out if whole else np.empty(len(rows), dtype=np.uint64)
        _native(
            np.ascontiguousarray(keys if whole else keys[rows]),
            (lengths if whole else lengths[rows]).astype(np.uint8),
            np.ascontiguousarray(seeds if whole else seeds[rows], dtype=np.uint64),
            got,
        )
        if not whole:
            out[rows] = got
    elif n and len(rows) == n:
        for at in range(0, n, CHUNK_ROWS):
            end = at + CHUNK_ROWS
            out[at:end] = _hash_17_to_32(keys[at:end], lengths[at:end], seeds[at:end])
    else:
        for at in range(0, len(rows), CHUNK_ROWS):
            part = rows[at : at + CHUNK_ROWS]
            out[part] = _hash_17_to_32(keys[part], lengths[part], seeds[part])
    digest = xxhash.xxh3_64_intdigest
    for i in np.flatnonzero(~vec).tolist():
        out[i] = digest(keys[i, : int(lengths[i])].tobytes(), int(seeds[i]))
    return out


def _hash_17_to_32(keys: np.ndarray, lengths: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """XXH3_len_17to128_64b for inputs of 17 to 32 bytes, one row per input."""
    head = np.ascontiguousarray(keys[:, :16]).view("<u8")  # (n, 2): bytes 0..15
    first = int(lengths[0])
    if (lengths == first).all():  # the usual case: every key is a 32-byte digest
        tail = np.ascontiguousarray(keys[:, first - 16 : first]).view("<u8")
    else:
        tail_at = (lengths - 16)[:, None] + np.arange(16)
        tail = np.ascontiguousarray(np.take_along_axis(keys, tail_at, axis=1)).view("<u8")
    seeds = seeds.astype(np.uint64, copy=False)
    acc = lengths.astype(np.uint64) * _PRIME64_1
    acc += _mix16(head, _SECRET[0], _SECRET[1], seeds)
    acc += _mix16(tail, _SECRET[2], _SECRET[3], seeds)
    acc ^= acc >> _S37
    acc *= _AVALANCHE
    acc ^= acc >> _S32
    return acc


def _mix16(words: np.ndarray, s0: np.uint64, s1: np.uint64, seeds: np.ndarray) -> np.ndarray:
    """XXH3_mix16B: fold the 128-bit product of the two key words, each keyed."""
    return _mul128_fold64(words[:, 0] ^ (s0 + seeds), words[:, 1] ^ (s1 - seeds))


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Low 64 bits XOR high 64 bits of the 128-bit products ``a * b`` (uint64 columns)."""
    a_lo, a_hi = a & _LO32, a >> _S32
    b_lo, b_hi = b & _LO32, b >> _S32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    cross = (lo_lo >> _S32) + (hi_lo & _LO32) + a_lo * b_hi
    upper = (hi_lo >> _S32) + (cross >> _S32) + a_hi * b_hi
    lower = (cross << _S32) | (lo_lo & _LO32)
    return cast("np.ndarray", lower ^ upper)
