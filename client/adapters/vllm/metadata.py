"""What the vLLM connector's scheduler side tells its worker side each step.

vLLM pickles the step's :class:`KvtierMetadata` from the scheduler (EngineCore process) to
every worker, so it holds plain lists only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["KvtierMetadata", "LoadSpec", "StoreSpec"]


@dataclass(slots=True)
class LoadSpec:
    """Load pages ``start .. start + len(block_ids)`` of a request into ``block_ids``.

    Attributes:
        req_id: vLLM's request id.
        tokens: the request's tokens up to the end of the last page to load (the key
            chain starts at token 0).
        salt: the request's ``cache_salt`` ("" for none).
        start: the first page to load (pages before it are vLLM's own hit).
        block_ids: vLLM blocks receiving the pages, in page order.
        in_l2: leading pages (from page 0) the scheduler saw in L2; pages past it were in
            L3 only and are prefetched and claimed before the load.
        layerwise: the whole hit is in L2: the load starts in ``start_load_kv`` and the
            forward pass waits for it layer by layer (``wait_for_layer_load``); otherwise it
            runs asynchronously and ends through ``get_finished``.
        seed / keys: the key chain's seed the scheduler used and the page keys it computed
            (pages ``0 .. start + len(block_ids)``); a worker whose own seed is ``seed``
            uses them instead of hashing ``tokens`` again.
        lora: the request's LoRA adapter ("" for none; it enters the chain's seed).
    """

    req_id: str
    tokens: list[int]
    salt: str
    start: int
    block_ids: list[int]
    in_l2: int
    layerwise: bool = False
    seed: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    lora: str = ""


@dataclass(slots=True)
class StoreSpec:
    """Store pages ``start .. start + len(block_ids)`` of a request from ``block_ids``.

    Attributes:
        req_id: vLLM's request id.
        tokens: the request's tokens up to the end of the last page to store.
        salt: the request's ``cache_salt`` ("" for none).
        start: the first page to store.
        block_ids: vLLM blocks holding the pages, in page order.
        seed / keys: as in :class:`LoadSpec` (empty when the scheduler has no keys).
        block_hashes / parent_hash / lora_name: vLLM's external hashes of the pages (empty
            when vLLM does not hash blocks), of the block before ``start``, and the LoRA,
            for KV events (:mod:`~kvtier.client.adapters.vllm.events`; the LoRA enters the key
            chain's seed too).
    """

    req_id: str
    tokens: list[int]
    salt: str
    start: int
    block_ids: list[int]
    seed: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    block_hashes: list[Any] = field(default_factory=list)
    parent_hash: Any = None
    lora_name: str | None = None


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's work for the worker side.

    Attributes:
        loads: pages to load before the request runs (asynchronously: the request
            waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it).
        stores: full pages this step computes, to back up to kvtierd after the forward.
        preempted: requests preempted this step: their stores must end before their
            blocks are reused.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
