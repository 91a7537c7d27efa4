"""KV events of the vLLM connector: the blocks a vLLM engine can load from kvtierd, in vLLM's
own event stream.

A vLLM started with ``--kv-events-config`` publishes its GPU cache's ``BlockStored`` and
``BlockRemoved``. With the kvtier connector it also says which blocks kvtierd holds for it:

- the scheduler side names each block it asks the workers to store by vLLM's own block hash
  (:func:`engine_blocks`; ``maybe_convert_block_hash``, as vLLM's events do), and the workers
  send those hashes with the STORE, so kvtierd's events use them too;
- each worker notes a ``BlockStored`` with medium :data:`MEDIUM_KVTIER` once kvtierd has the
  blocks (the store ended; pages it already held count), and hands the step's events to vLLM
  (``get_kv_connector_kv_cache_events``);
- vLLM gathers them from every worker into the scheduler side's
  ``update_connector_output``, which keeps those every worker reported (a block is loadable
  only when every tensor-parallel rank has it) until ``take_events``, which the scheduler
  publishes with its own events.

Blocks leaving kvtierd are kvtierd's to announce (its own stream: ``kv_events_endpoint``).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_events import (
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

__all__ = ["MEDIUM_KVTIER", "KvtierEvents", "StoredLog", "engine_blocks", "stored_event"]

MEDIUM_KVTIER = "KVTIER"
"""The medium of blocks the engine can load from kvtierd (its L2, or L3 through it)."""


def engine_blocks(request: Any, start: int, end: int) -> tuple[list[Any], Any, str | None]:
    """vLLM's external hashes of blocks ``start .. end`` of ``request``, the hash of the
    block before ``start`` (None at 0) and the request's LoRA name; ([], None, name) when
    vLLM has not hashed that far (prefix caching off)."""
    lora = getattr(request, "lora_request", None)
    name = lora.lora_name if lora is not None else None
    hashes = getattr(request, "block_hashes", None) or []
    if len(hashes) < end:
        return [], None, name
    parent = maybe_convert_block_hash(hashes[start - 1]) if start else None
    return [maybe_convert_block_hash(h) for h in hashes[start:end]], parent, name


def stored_event(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int, lora_name: str | None
) -> BlockStored:
    """The ``BlockStored`` of blocks now loadable from kvtierd."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_KVTIER,
        lora_name=lora_name,
    )


class KvtierEvents(KVConnectorKVEvents):
    """The connector's events on their way from the workers to the scheduler: vLLM merges
    every worker's, :meth:`aggregate` keeps those all workers reported."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Add a worker's events."""
        self._agg.add_events(events)

    def aggregate(self) -> KvtierEvents:
        """Keep only the events every worker reported."""
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        """Count more workers."""
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every event held (once per worker that reported it)."""
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        """Workers whose events are held."""
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        """Forget the events."""
        self._agg.clear_events()
        self._agg.reset_workers()


class StoredLog:
    """A worker's events since the last step (the I/O thread adds, the step takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []

    def add(self, event: KVCacheEvent) -> None:
        """Note an event (from the I/O thread)."""
        with self._lock:
            self._events.append(event)

    def take(self) -> KvtierEvents | None:
        """The events noted since the last call (None: none)."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return None
        out = KvtierEvents(1)
        out.add_events(events)
        return out
