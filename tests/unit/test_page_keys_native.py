"""The page-key chain in C (``kernels/_pagekeys.c``, a required extension: the one
implementation of :func:`~kvtier.client.page_keys.page_keys`) against the spec's hashlib
chain.

Every key an engine computes must be the bytes the spec defines (``tests/key_chain.py``:
hashlib over the pages' little-endian uint32 tokens), whichever way the tokens come (a list,
a tuple, a range, a numpy array), whatever the seed's length (a namespace fingerprint or a
parent key), and on either compression path: the CPU's SHA extensions and the portable C.
Message lengths around the SHA-256 block and padding boundaries (55, 56, 64 bytes) are
covered by the page and seed sizes drawn.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.client.page_keys import page_keys, token_ids

from tests.key_chain import spec_page_keys

tokens_st = st.lists(st.integers(0, (1 << 32) - 1), max_size=300)


@settings(max_examples=300, deadline=None)
@given(seed=st.binary(max_size=80), tokens=tokens_st, page_size=st.integers(1, 40))
def test_the_c_chain_is_the_spec_chain_for_every_form_of_tokens(seed, tokens, page_size):
    want = spec_page_keys(seed, tokens, page_size)
    assert page_keys(seed, tokens, page_size) == want
    assert page_keys(seed, tuple(tokens), page_size) == want
    assert page_keys(seed, np.asarray(tokens, dtype=np.int64), page_size) == want
    assert page_keys(seed, np.asarray(tokens, dtype="<u4"), page_size) == want


@settings(max_examples=200, deadline=None)
@given(seed=st.binary(max_size=80), tokens=tokens_st, page_size=st.integers(1, 40))
def test_the_portable_compression_gives_the_same_keys(seed, tokens, page_size):
    from kvtier.kernels import _pagekeys

    n = len(tokens) // page_size
    raw = np.asarray(tokens[: n * page_size], dtype="<u4").tobytes()
    fast = _pagekeys.chain(seed, raw, page_size * 4)
    assert _pagekeys.chain(seed, raw, page_size * 4, True) == fast
    assert fast == spec_page_keys(seed, tokens, page_size)


def test_a_range_is_keyed_as_its_list():
    r = range(5, 5 + 16 * 9 + 3, 1)
    assert page_keys(b"\x01" * 32, r, 16) == spec_page_keys(b"\x01" * 32, list(r), 16)
    stepped = range(1 << 31, (1 << 31) + 700, 7)
    assert page_keys(b"", stepped, 4) == spec_page_keys(b"", list(stepped), 4)


def test_a_long_prompt_chains_through_every_page():
    tokens = list(range(16 * 2048))
    keys = page_keys(b"\x00" * 32, tokens, 16)
    assert len(keys) == 2048
    last = hashlib.sha256(keys[-2] + np.asarray(tokens[-16:], dtype="<u4").tobytes()).digest()
    assert keys[-1] == last
    assert keys == spec_page_keys(b"\x00" * 32, tokens, 16)


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, 3, -1], [1, 2, 3, 1 << 32], [0] * 8 + [1 << 70], [1 << 32, 0, 0, 0]],
    ids=["negative", "2**32", "huge-in-a-partial-page", "first"],
)
def test_a_token_out_of_range_is_refused_even_in_a_partial_page(tokens):
    for form in (tokens, tuple(tokens)):
        with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*32\)"):
            page_keys(b"", form, 3)


def test_items_that_are_not_plain_ints_are_keyed_as_numpy_reads_them():
    """A numpy integer or a bool in a list: the C reader leaves the list to numpy (their
    ``__index__`` is Python code, which must not run while C holds the list's items)."""
    mixed = [np.int64(5), True, 3, np.uint32(7)]
    assert page_keys(b"s", mixed, 2) == spec_page_keys(b"s", [5, 1, 3, 7], 2)
    with pytest.raises(ValueError):
        page_keys(b"s", [1, "a"], 1)


def test_the_extension_refuses_bad_shapes_naming_them():
    from kvtier.kernels import _pagekeys

    with pytest.raises(ValueError, match=r"page_bytes = 6 must be a positive multiple of 4"):
        _pagekeys.chain(b"", b"\x00" * 12, 6)
    with pytest.raises(ValueError, match=r"page_bytes = 0 must be a positive multiple of 4"):
        _pagekeys.chain(b"", b"", 0)
    with pytest.raises(ValueError, match=r"page_bytes = 8 does not divide the tokens' 12 bytes"):
        _pagekeys.chain(b"", b"\x00" * 12, 8)
    with pytest.raises(TypeError):
        _pagekeys.chain(b"", 12, 8)
    assert _pagekeys.chain(b"", b"", 4) == []
    assert isinstance(_pagekeys.sha_extensions(), bool)


@pytest.mark.parametrize(
    "tokens", [[1.5, 2.0], np.array([1.5, 2.0]), np.array([1, 2], dtype=np.float32)]
)
def test_token_ids_that_are_not_integers_are_refused_never_truncated(tokens):
    """Floats would be truncated into other token ids (1.5 into 1), so another prompt's
    keys: refused naming the tokens, by both the keying and the cache manager's reading."""
    with pytest.raises(ValueError, match="tokens must be integer token ids"):
        page_keys(b"s", tokens, 1)
    with pytest.raises(ValueError, match="tokens must be integer token ids"):
        token_ids(tokens)
    assert token_ids([np.int64(3), True, 4]) == [3, 1, 4]
