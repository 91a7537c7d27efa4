"""Page keys and namespace fingerprints against the spec and pinned known answers.

The pinned digests were computed once with hashlib over the byte strings written out below
(not with kvtier's code). A change to either derivation changes every key: pages cached by
an older daemon, in L2 or in L3, would silently stop matching, so it must be deliberate.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from kvtier.client.page_keys import page_keys
from kvtier.ipc import protocol as P
from kvtier.ipc.namespace import namespace_fingerprint

from tests.engines import MLA, SMALL
from tests.key_chain import spec_fingerprint, spec_fingerprint_json, spec_page_keys

SEED = bytes(range(32))
# two full pages of 4 tokens (one with a token that needs all 32 bits, one with a byte order
# that shows), then a partial page that gets no key
TOKENS = [0, 1, 2, 3, 0xFFFFFFFF, 0x01020304, 7, 8, 9]
PAGE_BYTES_HEX = ["00000000010000000200000003000000", "ffffffff040302010700000008000000"]
KEYS_HEX = [
    "9042001fd4171e3d07043769dcd26fa03685417d40e036b1159ed596b228f8d4",
    "f20479f5009686102676e67c486163113b065621f38bfe82c796d43596a28b43",
]

MHA_JSON = (
    '{"attention":"mha","cache_salt":"","dtype":"float32","head_dim":32,"kv_heads":2,'
    '"layout":"layer_first","layout_version":1,"model_id":"m","num_layers":4,'
    '"page_size":16,"revision":"","tenant":"b","tp_rank":0,"tp_size":1}'
)
MHA_FP_HEX = "d2152b4c8ab2bb1f63cc82782e802ce791a61d197c613558e9fb613df7eaafcb"
MLA_JSON = (
    '{"attention":"mla","cache_salt":"s","dtype":"float16","head_dim":64,"kv_heads":1,'
    '"layout":"layer_first","layout_version":1,"model_id":"m","num_layers":3,'
    '"page_size":16,"revision":"r1","tenant":"default","tp_rank":null,"tp_size":null}'
)
MLA_FP_HEX = "95fc2ce352080aa5a7ede78d79578308181e2fe0564d0d474bfb269b0ab7966a"


def test_page_keys_match_the_pinned_chain():
    # the pages as hashed: uint32 little-endian
    assert np.asarray(TOKENS[:8], dtype="<u4").tobytes().hex() == "".join(PAGE_BYTES_HEX)
    want = [bytes.fromhex(h) for h in KEYS_HEX]
    assert spec_page_keys(SEED, TOKENS, 4) == want
    assert page_keys(SEED, TOKENS, 4) == want
    assert page_keys(SEED, np.array(TOKENS, dtype=np.int64), 4) == want


def test_a_chain_continues_from_the_key_before_it():
    first = bytes.fromhex(KEYS_HEX[0])
    assert page_keys(first, TOKENS[4:], 4) == [bytes.fromhex(KEYS_HEX[1])]


@pytest.mark.parametrize("seed,n", [(SEED, 37), (b"\x07" * 32, 64), (b"", 5)])
def test_page_keys_follow_the_spec_on_other_inputs(seed, n):
    toks = ((np.arange(n, dtype=np.int64) * 2654435761) % (1 << 32)).tolist()
    for size in (1, 3, 16):
        assert page_keys(seed, toks, size) == spec_page_keys(seed, toks, size)


def test_the_last_token_of_a_page_enters_its_key_and_every_key_after_it():
    other = list(TOKENS)
    other[3] += 1  # the last token of page 0
    assert page_keys(SEED, other, 4)[0] != page_keys(SEED, TOKENS, 4)[0]
    assert page_keys(SEED, other, 4)[1] != page_keys(SEED, TOKENS, 4)[1]


def test_fingerprints_match_the_pinned_canonical_json():
    assert spec_fingerprint_json(SMALL, model_id="m", tenant="b") == MHA_JSON
    assert json.loads(MHA_JSON)["tp_rank"] == 0
    assert spec_fingerprint(SMALL, model_id="m", tenant="b").hex() == MHA_FP_HEX
    assert (
        namespace_fingerprint(P.NamespaceSpec(model_id="m"), SMALL, 0, 1, "b").hex() == MHA_FP_HEX
    )
    names = {"model_id": "m", "revision": "r1", "cache_salt": "s", "tp_rank": 1, "tp_size": 2}
    assert spec_fingerprint_json(MLA, **names) == MLA_JSON
    assert spec_fingerprint(MLA, **names).hex() == MLA_FP_HEX
    spec = P.NamespaceSpec(model_id="m", revision="r1", cache_salt="s")
    assert namespace_fingerprint(spec, MLA, 1, 2, "default").hex() == MLA_FP_HEX
    assert namespace_fingerprint(spec, MLA, 0, 2, "default").hex() == MLA_FP_HEX  # any rank
    assert namespace_fingerprint(spec, MLA, 0, 1, "default").hex() == MLA_FP_HEX  # any TP size


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "a"},
        {"model_id": "m2"},
        {"revision": "x"},
        {"cache_salt": "x"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
    ],
)
def test_every_namespace_field_enters_the_fingerprint(change):
    base = {
        "model_id": "m",
        "revision": "",
        "cache_salt": "",
        "tenant": "b",
        "tp_rank": 0,
        "tp_size": 1,
    }
    args = {**base, **change}
    spec = P.NamespaceSpec(
        model_id=args["model_id"], revision=args["revision"], cache_salt=args["cache_salt"]
    )
    got = namespace_fingerprint(spec, SMALL, args["tp_rank"], args["tp_size"], args["tenant"])
    assert got == spec_fingerprint(SMALL, **args)
    assert got.hex() != MHA_FP_HEX
