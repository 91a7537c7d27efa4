"""Page keys: a SHA-256 chain over full pages of tokens (ARCHITECTURE §4).

``k0 = H(ns_fingerprint ‖ tokens[0:P])``, ``ki = H(k(i-1) ‖ tokens[iP:(i+1)P])``, tokens as
uint32 little-endian. Only full pages are keyed. No process-local seed enters a key, so
every process, rank and restart computes the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def page_keys(seed: bytes, tokens: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """Return the keys of the full pages of ``tokens``.

    Args:
        seed: the namespace fingerprint for a chain that starts at token 0, or the key of
            the page just before ``tokens[0]`` to continue a chain.
        tokens: token ids (each < 2**32).
        page_size: tokens per page.

    Returns:
        ``len(tokens) // page_size`` keys of 32 bytes.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size!r}")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("tokens must be in [0, 2**32)")
    n = arr.size // page_size
    raw = arr[: n * page_size].astype("<u4").tobytes()
    step = page_size * 4
    keys: list[bytes] = []
    prev = seed
    sha = hashlib.sha256
    for i in range(n):
        h = sha(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
