"""Page keys: a SHA-256 chain over full pages of tokens (ARCHITECTURE §4).

``k0 = H(ns_fingerprint ‖ tokens[0:P])``, ``ki = H(k(i-1) ‖ tokens[iP:(i+1)P])``, tokens as
uint32 little-endian. Only full pages are keyed. No process-local seed enters a key, so
every process, rank and restart computes the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import numpy as np

try:  # the chain in C (built at install; optional): SHA-NI where the CPU has it
    from kvtier.kernels._pagekeys import chain as _chain
except ImportError:  # pragma: no cover - no C compiler at install
    _chain = None  # type: ignore[assignment]
NATIVE = _chain is not None
"""Whether :func:`page_keys` hashes in C (``kernels/_pagekeys.c``); the keys are the same
bytes either way."""


def page_keys(
    seed: bytes, tokens: Sequence[int] | np.ndarray, page_size: int, native: bool = True
) -> list[bytes]:
    """Return the keys of the full pages of ``tokens``.

    Args:
        seed: the namespace fingerprint for a chain that starts at token 0, or the key of
            the page just before ``tokens[0]`` to continue a chain.
        tokens: token ids (each < 2**32).
        page_size: tokens per page.
        native: hash in C where it is built (:data:`NATIVE`); False hashes with hashlib
            in Python (the same keys, several times slower: the baseline ``kvtier bench l2``
            measures against).

    Returns:
        ``len(tokens) // page_size`` keys of 32 bytes.

    Raises:
        ValueError: ``page_size`` not positive, or a token outside ``[0, 2**32)``.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size!r}")
    if native and _chain is not None and isinstance(tokens, list | tuple):
        read = _chain(seed, tokens, page_size * 4)  # reads and checks plain ints itself
        if read is not None:
            return read
    if isinstance(tokens, range):  # no list of Python ints on the way
        arr = np.arange(tokens.start, tokens.stop, tokens.step, dtype=np.int64)
    else:
        arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("tokens must be in [0, 2**32)")
    n = arr.size // page_size
    pages = arr[: n * page_size].astype("<u4")
    if native and _chain is not None:
        return cast("list[bytes]", _chain(seed, pages, page_size * 4))  # None: lists only
    raw = pages.tobytes()
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
