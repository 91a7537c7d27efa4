"""The scheduler side of the vLLM connector (runs in vLLM's EngineCore process).

It holds no KV memory: it registers one control-only session
(:class:`~kvtier.client.kv_pool.regions.ControlOnly`) per tensor-parallel rank, whose LOOKUP
answers from that rank's namespace (each rank's pages are keyed from its own fingerprint).
For each new request it keys the request's full blocks with kvtier's chain (one page = one
block; at least one prompt token is always left to compute), looks up the blocks beyond
vLLM's own hit on every rank, takes the smallest answer (a block counts only when every
rank holds it), and plans their load:

- a hit wholly in L2 is loaded layer by layer (``load_async=False``, setting
  ``layerwise_loads``): the request is scheduled at once, the workers start the LOAD in
  ``start_load_kv`` and the forward pass waits for each layer in ``wait_for_layer_load``,
  so the copy of layer i+1 overlaps the compute of layer i;
- a hit that reaches into L3 is loaded asynchronously (``load_async=True``): the request
  waits in ``WAITING_FOR_REMOTE_KVS`` while the workers prefetch, claim and load the pages,
  so this process never waits on storage.

The keys it computed for the lookup travel with the load plan (workers of the same
namespace use them as they are). Each step it also tells the workers which blocks became
full, to back them up to L2.

When kvtierd is away every lookup is a miss (0 tokens) and nothing waits: see
:class:`~kvtier.client.adapters.daemon_link.DaemonLink`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.adapters.daemon_link import DaemonLink
from kvtier.client.adapters.vllm.events import KvtierEvents, engine_blocks
from kvtier.client.adapters.vllm.metadata import KvtierMetadata, LoadSpec, StoreSpec
from kvtier.client.adapters.vllm.namespace import chain_seed, request_lora, unkeyable
from kvtier.client.adapters.vllm.settings import ConnectorSettings
from kvtier.client.kv_pool.regions import ControlOnly
from kvtier.client.page_keys import page_keys
from kvtier.ipc.protocol import Geometry

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvtier.vllm")


@dataclass(slots=True)
class _Hit:
    """What the last lookup for a request found (pages counted from page 0)."""

    local: int  # pages vLLM has itself
    total: int  # pages vLLM will have after the load
    in_l2: int  # leading pages in L2 (the rest of the hit is in L3)
    seed: bytes  # the key chain's seed
    keys: list[bytes]  # the keys of pages 0 .. total
    layerwise: bool  # loaded layer by layer in the step that schedules the request


@dataclass(slots=True)
class _Tracked:
    """A request the connector follows until it finishes."""

    request: Any
    stored: int = 0  # pages below this are in kvtier (stored, loaded or being stored)
    stores: int = 0  # store specs sent to the workers
    load_start: int = 0  # first page of the planned load
    in_l2: int = 0  # leading pages the lookup saw in L2
    load_blocks: set[int] = field(default_factory=set)
    seed: bytes = b""  # the key chain's seed ("" while unknown: the workers hash)
    keys: list[bytes] = field(default_factory=list)  # keys of the request's first pages


class SchedulerSide:
    """Lookups, load plans and store plans for vLLM's scheduler.

    Args:
        geometry: the workers' page geometry (their namespace).
        settings: the connector settings.
        model_id / revision: the namespace's model.
        tp_size: the engine's tensor-parallel size.
        max_load_pages: the most pages loaded at once (the engine copy mode's share of its
            staging area): by one request, and by the layer-wise loads of one step together
            (they hold their pages until the step ends); the rest of a longer hit is
            computed. None: no bound.
    """

    def __init__(
        self,
        geometry: Geometry,
        settings: ConnectorSettings,
        model_id: str,
        revision: str,
        tp_size: int,
        max_load_pages: int | None = None,
    ) -> None:
        self.geometry = geometry
        self.max_load_pages = max_load_pages
        self._step_pages = 0  # pages of this step's layer-wise loads, planned so far
        if max_load_pages is not None and max_load_pages < settings.min_load_pages:
            log.warning(
                "kvtier loads at most %d pages at once (half of staging_pages) and "
                "min_load_pages is %d: nothing will be loaded",
                max_load_pages,
                settings.min_load_pages,
            )
        self.block_size = geometry.page_size
        self.settings = settings
        self.links = [
            DaemonLink(
                lambda: ControlOnly(geometry),
                model_id,
                settings.client,
                rank,
                tp_size,
                settings.retry_interval_s,
                revision=revision,
            )
            for rank in range(tp_size)
        ]
        self._hits: dict[str, _Hit] = {}
        self._in_l2: dict[str, int] = {}  # the last lookup's leading pages in L2 (all ranks)
        self._chains: dict[str, tuple[bytes, list[bytes]]] = {}  # the last lookup's keys
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._events: KvtierEvents | None = None  # the workers' KV events, not taken yet

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond vLLM's own (block-aligned) hit that kvtier can load, and whether
        they load asynchronously (part of the hit only in L3, or ``layerwise_loads`` off)."""
        bs = self.block_size
        tokens = request.all_token_ids
        pages = (len(tokens) - 1) // bs  # leave at least one token to compute
        local = num_computed_tokens // bs
        self._hits.pop(request.request_id, None)
        self._in_l2.pop(request.request_id, None)
        if pages - local < self.settings.min_load_pages or unkeyable(request):
            return 0, False
        conns = [link.get() for link in self.links]
        if any(conn is None for conn in conns):
            return 0, False
        total, in_l2 = pages, pages
        for rank, conn in enumerate(conns):
            assert conn is not None
            rank_seed = chain_seed(
                conn.ns_fingerprint, request.cache_salt or "", request_lora(request)
            )
            rank_keys = page_keys(rank_seed, tokens[: pages * bs], bs)
            if rank == 0:  # rank 0's chain goes to the workers (a rank of another seed hashes)
                seed, keys = rank_seed, rank_keys
                self._chains[request.request_id] = (seed, keys)
            rep = conn.lookup(rank_keys)
            # the daemon prefetches an L3 run only from prefetch_threshold tokens on
            l3 = rep.l3 if rep.l3 * bs >= self.settings.client.prefetch_threshold else 0
            total, in_l2 = min(total, rep.l2 + l3), min(in_l2, rep.l2)
            if total - local < self.settings.min_load_pages:
                return 0, False
        self._in_l2[request.request_id] = in_l2  # not stored again, whatever is loaded
        if self.max_load_pages is not None:  # what does not fit is computed, not loaded
            total = min(total, local + self.max_load_pages)  # (L2 keeps the rest: not stored)
            if total - local < self.settings.min_load_pages:
                return 0, False
        layerwise = self.settings.layerwise_loads and in_l2 >= total
        if layerwise and self.max_load_pages is not None:  # what this step's loads have left
            total = min(total, local + max(0, self.max_load_pages - self._step_pages))
            if total - local < self.settings.min_load_pages:
                return 0, False
        self._hits[request.request_id] = _Hit(
            local=local, total=total, in_l2=in_l2, seed=seed, keys=keys[:total], layerwise=layerwise
        )
        return (total - local) * bs, not layerwise

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Split a request's external hit into host memory (L2) and disk (L3) tokens."""
        t = self._tracked.get(request.request_id)
        if t is None or not num_external_tokens:
            return {}
        host = min(max(0, t.in_l2 - t.load_start) * self.block_size, num_external_tokens)
        return {k: v for k, v in (("host", host), ("disk", num_external_tokens - host)) if v}

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Plan the load of the hit into the blocks vLLM just allocated."""
        rid = request.request_id
        if unkeyable(request):  # its pages are named by more than its tokens: not stored
            return
        tracked = self._tracked.get(rid)
        if tracked is None:
            tracked = self._tracked[rid] = _Tracked(request)
        chain = self._chains.pop(rid, None)
        if chain is not None and not tracked.seed:
            tracked.seed, tracked.keys = chain[0], list(chain[1])
        # pages L2 holds (past a hit capped to what a step's loads can take, trimmed by vLLM,
        # or too short to load) are computed again but not stored again
        tracked.stored = max(tracked.stored, self._in_l2.pop(rid, 0))
        hit = self._hits.pop(rid, None)
        if num_external_tokens == 0 or hit is None:
            return
        bs = self.block_size
        total = min(hit.total, hit.local + num_external_tokens // bs)  # vLLM may trim a hit
        blocks = list(block_ids[hit.local : total])
        self._loads.append(
            LoadSpec(
                req_id=rid,
                tokens=list(request.all_token_ids[: total * bs]),
                salt=request.cache_salt or "",
                start=hit.local,
                block_ids=blocks,
                in_l2=min(hit.in_l2, total),
                layerwise=hit.layerwise,
                seed=hit.seed,
                keys=hit.keys[:total],
                lora=request_lora(request),
            )
        )
        hit.total = total
        if hit.layerwise:
            self._step_pages += total - hit.local
        tracked.stored = max(tracked.stored, hit.total)
        tracked.load_start, tracked.in_l2, tracked.load_blocks = hit.local, hit.in_l2, set(blocks)

    # ------------------------------------------------------------------ per step
    def build_meta(self, scheduler_output: Any, block_ids_of: Any) -> KvtierMetadata:
        """This step's loads (planned since the last step) and stores (blocks this step
        fills), for the workers."""
        meta = KvtierMetadata(
            loads=self._loads, preempted=sorted(scheduler_output.preempted_req_ids or ())
        )
        for rid in meta.preempted:  # the workers wait for their stores to end this step:
            t = self._tracked.get(rid)  # its finish waits only for stores made after it
            if t is not None:
                t.stores = 0
        self._loads = []
        self._step_pages = 0
        bs = self.block_size
        for rid, n_new in scheduler_output.num_scheduled_tokens.items():
            t = self._tracked.get(rid)
            if t is None:
                continue
            req = t.request
            tokens = req.all_token_ids
            end = min(req.num_computed_tokens + n_new, len(tokens)) // bs
            if end <= t.stored:
                continue
            blocks = block_ids_of(rid)
            if blocks is None or len(blocks) < end:
                continue
            if t.seed and len(t.keys) < end:  # pages decoded since: extend the chain
                t.keys += page_keys(
                    t.keys[-1] if t.keys else t.seed, tokens[len(t.keys) * bs : end * bs], bs
                )
            hashes, parent, lora = engine_blocks(req, t.stored, end)
            meta.stores.append(
                StoreSpec(
                    req_id=rid,
                    tokens=list(tokens[: end * bs]),
                    salt=req.cache_salt or "",
                    start=t.stored,
                    block_ids=list(blocks[t.stored : end]),
                    seed=t.seed,
                    keys=t.keys[:end] if t.seed else [],
                    block_hashes=hashes,
                    parent_hash=parent,
                    lora_name=lora,
                )
            )
            t.stored = end
            t.stores += 1
        return meta

    def workers_events(self, events: Any) -> None:
        """Keep the KV events the workers reported this step (vLLM merged them)."""
        if not isinstance(events, KvtierEvents):
            return
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())
            self._events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> list[Any]:
        """The events every worker reported since the last call (vLLM publishes them)."""
        events, self._events = self._events, None
        return [] if events is None else events.aggregate().get_all_events()

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """Pages of a failed load are not in kvtier after all: store them once recomputed."""
        for t in self._tracked.values():
            if t.load_blocks & invalid_block_ids:
                t.stored = min(t.stored, t.load_start)
                t.load_blocks = set()

    def request_finished(self, request: Any) -> bool:
        """Forget the request; True when its blocks must outlive it until the workers
        report its stores done (``finished_sending``)."""
        self._hits.pop(request.request_id, None)
        self._in_l2.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        t = self._tracked.pop(request.request_id, None)
        return t is not None and t.stores > 0

    def close(self) -> None:
        """Close the control sessions."""
        for link in self.links:
            link.close()
