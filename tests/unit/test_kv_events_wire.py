"""The KV event encoding: token ids written straight from a STORE's packed bytes decode as
the same ints, at every MessagePack array size; what a batch looks like on the wire (vLLM's
own decoder reads it in tests/adapters/vllm/test_vllm_kv_events.py)."""

from __future__ import annotations

import msgspec
import pytest
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65535, 65536, 70000])
def test_packed_token_ids_decode_as_the_ints(n):
    toks = [(i * 2654435761) % (1 << 32) for i in range(n + 3)]
    packed = P.pack_tokens(toks)
    ev = E.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=E.packed_token_ids(packed, 3, n + 3),
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    back = E.decode_batch(E.encode_batch(E.KVEventBatch(ts=1.0, events=[ev])))
    assert back.events[0].token_ids == toks[3:]


def test_a_batch_is_an_array_and_events_are_tagged_maps():
    batch = E.KVEventBatch(
        ts=2.5,
        events=[
            E.BlockStored(
                block_hashes=[7, b"\x01\x02"],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            E.BlockRemoved(block_hashes=[7], medium="FILE"),
            E.AllBlocksCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(E.encode_batch(batch))
    assert raw[0] == 2.5 and raw[2] is None  # [ts, events, data_parallel_rank]
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [7, b"\x01\x02"],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "FILE"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_topics_and_replay_frames():
    assert E.namespace_topic("org/m", b"\xab" * 2) == "kvtier/org%2Fm/abab"
    assert E.model_topic("a%2F/b") == "kvtier/a%252F%2Fb/"
    assert not E.namespace_topic("org/m", b"\xab").startswith(E.model_topic("org"))
    assert E.replay_request(5) == b"\0" * 7 + b"\5"
    assert E.seq_of(E.END_SEQ) == -1 and E.seq_of(E.replay_request(300)) == 300


def test_pack_tokens_refuses_what_is_not_a_uint32():
    with pytest.raises(ValueError):
        P.pack_tokens([1, -1])
    with pytest.raises(ValueError):
        P.pack_tokens([1 << 32])
