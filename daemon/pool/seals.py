"""Row seals in bulk: the xxh3-64 of many page keys at once.

Adoption checks one seal per READY row (:func:`~kvtier.daemon.pool.layout.seal_of`,
``xxh3_64(key, seed)``); a million rows hashed one ``xxhash`` call each cost seconds of
interpreter time. XXH3 hashes an input of at most 32 bytes in a few 64-bit steps chosen by
its length (0, 1-3, 4-8, 9-16, 17-32 bytes), so every row, whatever its key's length, is
hashed in one C call (``daemon/pool/native/_keyprobe.c``: ``seals``). Only the first
``len`` bytes of a row's key are read, whatever lies past them in the key column.
:func:`seals` is checked against the tests' own XXH3 and the ``xxhash`` package for every
length.
"""

from __future__ import annotations

import numpy as np
from kvtier.daemon.pool.layout import KEY_BYTES

from kvtier.daemon.pool.native import _keyprobe

__all__ = ["seals"]


def seals(keys: np.ndarray, lengths: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Return ``xxh3_64(keys[i, :lengths[i]], seed=seeds[i])`` for every row.

    Args:
        keys: ``(n, 32)`` uint8, one key row per key (bytes past a row's length are
            ignored).
        lengths: ``(n,)`` key lengths, each from 0 to 32.
        seeds: ``(n,)`` uint64 seeds.

    Returns:
        ``(n,)`` uint64 digests, what ``xxhash.xxh3_64_intdigest`` gives for each row.

    Raises:
        ValueError: ``keys`` is not ``(n, 32)``, or a length is outside 0 to 32.
    """
    n = len(lengths)
    if keys.shape != (n, KEY_BYTES) or (
        n and (int(lengths.max()) > KEY_BYTES or int(lengths.min()) < 0)
    ):
        raise ValueError(f"key rows of shape {keys.shape} for {n} keys of 0 to {KEY_BYTES} bytes")
    out = np.empty(n, dtype=np.uint64)
    _keyprobe.seals(
        np.ascontiguousarray(keys, dtype=np.uint8),
        lengths.astype(np.uint8),
        np.ascontiguousarray(seeds, dtype=np.uint64),
        out,
    )
    return out
