"""KV events on the wire, in vLLM's format: what kvtierd publishes for cache-aware routers.

A router (vLLM's, SGLang's, llm-d's KV-cache manager, Dynamo's KV router) learns where
prefixes are cached from engines' KV events. kvtierd publishes the same stream for what its
node holds in L2 and L3, so the routers read it with the decoders they already have.

The encoding is vLLM's (``vllm.distributed.kv_events``, msgspec MessagePack):

- a batch is an array ``[ts, events, data_parallel_rank]`` (the rank None: one daemon per node);
- an event is a map tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``;
  fields at their defaults are left out, as vLLM's encoder does.

Frames::

    PUB:              [topic, seq, batch]        seq: 8 bytes, big-endian, from 0
    replay request:   [b"", start_seq]           to the ROUTER (a REQ socket adds the b"")
    replay answer:    [b"", topic, seq, batch] per buffered batch with seq >= start_seq,
                      then [b"", b"", END_SEQ, b""]

A block hash is the engine's own where the engine gave it with STORE (vLLM's
``ExternalBlockHash``: an int, or bytes), else kvtier's 32-byte page key.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
import numpy as np

__all__ = [
    "END_SEQ",
    "MEDIUM_L2",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "model_topic",
    "namespace_topic",
    "replay_request",
    "seq_of",
]

MEDIUM_L2 = "CPU"
"""The medium of L2 pages (host memory), vLLM's ``MEDIUM_CPU``. L3 pages carry the storage
backend's name in capitals (``FILE``, ``REDIS``, ``MOONCAKE``, ...)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""

BlockHash = int | bytes
"""An engine's block hash (vLLM's ``ExternalBlockHash``) or a kvtier page key."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks became readable from ``medium``: a chain, ``block_hashes[0]`` extending
    ``parent_block_hash`` (None: a chain start, or not known)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks left ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every block the topic's publisher announced is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: a timestamp (seconds since the epoch) and its events."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch as vLLM's publisher encodes it."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode a batch (raises ``msgspec.DecodeError`` naming what is wrong)."""
    return _decoder.decode(payload)


_U32 = np.dtype([("tag", "u1"), ("value", ">u4")])


def packed_token_ids(packed: bytes, start: int, end: int) -> list[int]:
    """Token ids ``start .. end`` of little-endian uint32 ``packed`` (a STORE's
    ``engine.token_ids``) as a MessagePack array already encoded: a ``BlockStored``'s
    ``token_ids`` that costs a numpy pass instead of an int object per token (it decodes
    as the list of ints; the annotation says what it decodes as)."""
    n = end - start
    out = np.empty(n, dtype=_U32)
    out["tag"] = 0xCE  # MessagePack uint32
    out["value"] = np.frombuffer(packed, dtype="<u4", count=n, offset=start * 4)
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return cast(list[int], msgspec.Raw(head + out.tobytes()))


def seq_of(frame: bytes) -> int:
    """The sequence number of a sequence frame (signed: :data:`END_SEQ` is -1)."""
    return int.from_bytes(frame, "big", signed=True)


def replay_request(start_seq: int) -> bytes:
    """The body of a replay request for the batches from ``start_seq`` on."""
    return start_seq.to_bytes(8, "big")


def model_topic(model_id: str) -> str:
    """The topic prefix of a model's events: ``kvtier/<model id>/``, the model id with each
    ``%`` written ``%25`` and each ``/`` written ``%2F``.

    ZeroMQ filters topics by prefix, so a router subscribes to this for every namespace of
    its model (tenants, tensor-parallel ranks), or to ``kvtier/`` for all. The escapes keep
    one model's prefix from matching another's: ``org`` and ``org/llama`` are ``kvtier/org/``
    and ``kvtier/org%2Fllama/``.
    """
    return f"kvtier/{model_id.replace('%', '%25').replace('/', '%2F')}/"


def namespace_topic(model_id: str, fingerprint: bytes) -> str:
    """The topic of a namespace's events: :func:`model_topic` then the namespace's
    fingerprint in hex."""
    return model_topic(model_id) + fingerprint.hex()


def as_dict(event: Any) -> dict[str, Any]:
    """An event as a plain dict with its ``type`` (bytes hashes as hex), for JSON output."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, list):
            value = [v.hex() if isinstance(v, bytes) else v for v in value]
        out[name] = value
    return out
