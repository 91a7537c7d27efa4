"""Row seals in bulk: the xxh3-64 of many page keys at once.

Adoption checks one seal per READY row (:func:`~kvtier.daemon.pool.layout.seal_of`,
``xxh3_64(key, seed)``); a million rows hashed one ``xxhash`` call each cost seconds of
interpreter time. XXH3 hashes every input of 17 to 32 bytes with the same few 64-bit
steps (two 16-byte mixes, of the first and of the last 16 bytes, then an avalanche), so
rows whose keys have those lengths (page keys are 32-byte digests) are hashed in one C
call (``daemon/pool/native/_keyprobe.c``: ``seals``); rows with shorter keys go through
``xxhash`` one by one. Only the first ``len`` bytes of a row's key are read, whatever lies
past them in the key column. :func:`seals` is checked against the tests' own XXH3 for
every length.
"""

from __future__ import annotations

import numpy as np
import xxhash
from kvtier.daemon.pool.layout import KEY_BYTES

from kvtier.daemon.pool.native import _keyprobe

__all__ = ["VECTOR_MIN_LEN", "seals"]

VECTOR_MIN_LEN = 17
"""Shortest key hashed in C; shorter keys are hashed one by one."""


def seals(keys: np.ndarray, lengths: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Return ``xxh3_64(keys[i, :lengths[i]], seed=seeds[i])`` for every row.

    Args:
        keys: ``(n, 32)`` uint8, one key row per key (bytes past a row's length are
            ignored).
        lengths: ``(n,)`` key lengths, each at most 32.
        seeds: ``(n,)`` uint64 seeds.

    Returns:
        ``(n,)`` uint64 digests, what ``xxhash.xxh3_64_intdigest`` gives for each row.

    Raises:
        ValueError: ``keys`` is not ``(n, 32)``, or a length is over 32.
    """
    n = len(lengths)
    if keys.shape != (n, KEY_BYTES) or (n and int(lengths.max()) > KEY_BYTES):
        raise ValueError(
            f"key rows of shape {keys.shape} for {n} keys of at most {KEY_BYTES} bytes"
        )
    out = np.empty(n, dtype=np.uint64)
    lengths = lengths.astype(np.int64, copy=False)
    vec = lengths >= VECTOR_MIN_LEN
    rows = np.flatnonzero(vec)
    if len(rows):
        whole = len(rows) == n
        got = out if whole else np.empty(len(rows), dtype=np.uint64)
        _keyprobe.seals(
            np.ascontiguousarray(keys if whole else keys[rows], dtype=np.uint8),
            (lengths if whole else lengths[rows]).astype(np.uint8),
            np.ascontiguousarray(seeds if whole else seeds[rows], dtype=np.uint64),
            got,
        )
        if not whole:
            out[rows] = got
    digest = xxhash.xxh3_64_intdigest
    for i in np.flatnonzero(~vec).tolist():
        out[i] = digest(keys[i, : int(lengths[i])].tobytes(), int(seeds[i]))
    return out
