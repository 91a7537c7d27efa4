"""Page keys: a SHA-256 chain over full pages of tokens (ARCHITECTURE §4).

``k0 = H(ns_fingerprint ‖ tokens[0:P])``, ``ki = H(k(i-1) ‖ tokens[iP:(i+1)P])``, tokens as
uint32 little-endian. Only full pages are keyed. No process-local seed enters a key, so
every process, rank and restart computes the same keys.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
from kvtier.kernels._pagekeys import chain as _chain

MAX_PAGE_TOKENS = 1 << 28
"""The largest page :func:`page_keys` keys (1 GiB of uint32 tokens; engines' pages hold tens
to hundreds of tokens)."""


def page_keys(seed: bytes, tokens: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """Return the keys of the full pages of ``tokens``.

    Hashed in C (``kernels/_pagekeys.c``, a required extension: the one implementation;
    the CPU's SHA extensions where it has them, else portable C, the same bytes as
    hashlib's SHA-256). A list or tuple of plain ints is read by C itself; any other form
    (a range, a numpy array, a list holding numpy integers) is converted to uint32 first.

    Args:
        seed: the namespace fingerprint for a chain that starts at token 0, or the key of
            the page just before ``tokens[0]`` to continue a chain.
        tokens: token ids (each < 2**32).
        page_size: tokens per page.

    Returns:
        ``len(tokens) // page_size`` keys of 32 bytes.

    Raises:
        ValueError: ``page_size`` outside ``[1, MAX_PAGE_TOKENS]``, a token outside
            ``[0, 2**32)``, or token ids that are not integers (floats would be truncated
            into another prompt's ids, and so its keys).
    """
    if not 0 < page_size <= MAX_PAGE_TOKENS:
        raise ValueError(f"page_size must be in [1, {MAX_PAGE_TOKENS}], got {page_size!r}")
    if isinstance(tokens, list | tuple):
        read = _chain(seed, tokens, page_size * 4)  # reads and checks plain ints itself
        if read is not None:
            return read
    if isinstance(tokens, range):  # no list of Python ints on the way
        arr = np.arange(tokens.start, tokens.stop, tokens.step, dtype=np.int64)
    else:
        arr = np.asarray(tokens)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.dtype.kind not in "iub":
            raise ValueError(f"tokens must be integer token ids, got an array of {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("tokens must be in [0, 2**32)")
    n = arr.size // page_size
    pages = arr[: n * page_size].astype("<u4")
    return cast("list[bytes]", _chain(seed, pages, page_size * 4))  # None: lists only


def token_ids(tokens: Iterable[object]) -> list[int]:
    """``tokens`` as a list of Python ints: numpy and torch integers are taken, anything
    that is not an integer (a float) raises ValueError, never truncated into another id."""
    try:
        return [operator.index(t) for t in tokens]  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(f"tokens must be integer token ids: {err}") from None
