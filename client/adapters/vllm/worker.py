"""The worker side of the vLLM connector (runs in each vLLM worker, one per TP rank).

vLLM's KV allocation is placed in a sealed memfd
(:class:`~kvtier.client.adapters.vllm.memfd.MemfdAllocation`) and registered with kvtierd once,
as one region per layer.

- a layer-wise load (a hit wholly in L2) is started in ``start_load_kv``, on the engine's
  own thread, before the forward pass; the daemon copies layer by layer and
  ``wait_for_layer_load`` waits for each layer as the forward reaches it, so later layers
  are copied while earlier ones compute. The step ends only once the whole copy ended;
  the blocks it could not fill are reported in ``get_block_ids_with_load_errors`` of the
  same step (vLLM then drops the step's output for the request and recomputes them);

Every other daemon call runs on one I/O thread, in the order the steps asked for them, so
the forward pass never waits on it:

- an asynchronous load (a hit reaching into L3) prefetches and claims the pages that were
  only in L3, then loads the leading L2 run into the request's blocks; the request id is
  reported in ``finished_recving`` once the load ended, and the blocks it could not fill
  in ``get_block_ids_with_load_errors`` (vLLM then recomputes them);
- a store (blocks the step filled) runs after the forward (``wait_for_save``); a finished
  request whose stores are still running keeps its blocks (the scheduler delayed their
  release) until it is reported in ``finished_sending``; a preempted one is waited for
  before its blocks can be reused (``handle_preemptions``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from kvtier.client.adapters.daemon_link import DaemonLink
from kvtier.client.adapters.vllm.events import StoredLog, stored_event
from kvtier.client.adapters.vllm.memfd import MemfdAllocation, cpu_regions
from kvtier.client.adapters.vllm.metadata import KvtierMetadata, LoadSpec, StoreSpec
from kvtier.client.adapters.vllm.namespace import chain_seed
from kvtier.client.adapters.vllm.settings import ConnectorSettings
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.client.page_keys import page_keys
from kvtier.config import KvtierError
from kvtier.ipc import protocol as P
from kvtier.ipc.protocol import Geometry

__all__ = ["WorkerSide"]


log = logging.getLogger("kvtier.vllm")

_STOP = object()
IDLE_WAIT_S = 0.02
"""Longest wait, in a step without a forward pass, for a load or a store to end."""


class WorkerSide:
    """Registers vLLM's KV memory and runs the step's loads and stores.

    Args:
        geometry: the page geometry (as the scheduler side computes it).
        settings: the connector settings.
        model_id / revision: the namespace's model.
        tp_rank / tp_size: this worker's tensor-parallel position.
        kv_bytes: the size of vLLM's KV backing allocation.
    """

    def __init__(
        self,
        geometry: Geometry,
        settings: ConnectorSettings,
        model_id: str,
        revision: str,
        tp_rank: int,
        tp_size: int,
        kv_bytes: int,
    ) -> None:
        self.geometry = geometry
        self.settings = settings
        self._ns = (model_id, revision, tp_rank, tp_size)
        # vLLM's KV allocation in a memfd (None: the engine-copy subclass stages instead)
        self.allocation: MemfdAllocation | None = MemfdAllocation(kv_bytes)
        self.link: DaemonLink | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._cv = threading.Condition()
        self._outstanding: dict[str, int] = {}  # store jobs queued or running, per request
        self._stored: set[str] = set()  # requests that were sent stores (delayed release)
        self._finished: set[str] = set()  # of those, finished and not reported yet
        self._loading: set[str] = set()
        self._loaded: set[str] = set()  # loads ended since the last report
        self._load_errors: set[int] = set()
        self._step_missed: set[str] = set()  # requests whose layer-wise LOAD this step failed
        self._step_errors: set[int] = set()
        self._thread: threading.Thread | None = None
        self._idle = False
        self._ended = 0  # jobs ended so far
        self._load_started: dict[str, float] = {}
        # this step's layer-wise loads and when each started (engine thread only)
        self._layerwise: list[tuple[LoadSpec, TransferHandle, float]] = []
        self._layer_of: dict[str, int] = {}  # vLLM layer name → region (the daemon's layer)
        self.load_times: deque[float] = deque(maxlen=1024)
        """Seconds the last loads took, from the step that started each to its end."""
        self.events = StoredLog()
        """KV events of the stores that ended, for vLLM's stream (see :mod:`.events`)."""

    # ------------------------------------------------------------------ setup
    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layer_index: Mapping[str, int]
    ) -> None:
        """Describe vLLM's KV tensors as regions and start the I/O thread (the daemon is
        reached on first use, and again whenever it comes back)."""
        seg = self.allocation.segment if self.allocation is not None else None
        if seg is None:
            log.warning("vLLM's KV cache was not allocated in shared memory; kvtier is off")
            return
        regions, num_blocks = cpu_regions(kv_caches, layer_index, seg)
        first: dict[int, int] = {}  # as cpu_regions numbers them: tensor → its first layer
        for name, t in kv_caches.items():
            first.setdefault(t.data_ptr(), layer_index[name])
        region_of = {ptr: i for i, ptr in enumerate(sorted(first, key=first.__getitem__))}
        self._layer_of = {name: region_of[t.data_ptr()] for name, t in kv_caches.items()}
        fd, size, g = seg.fd, seg.size, self.geometry
        assert fd is not None
        if sum(r.page_bytes for r in regions) != g.page_bytes:
            log.warning(
                "vLLM's KV blocks hold %d bytes, kvtier expects %d; kvtier is off",
                sum(r.page_bytes for r in regions),
                g.page_bytes,
            )
            return
        model_id, revision, rank, size_tp = self._ns
        self.link = DaemonLink(
            lambda: RegionMemory(g, num_blocks, [fd], [size], regions, labels=["vllm-kv"]),
            model_id,
            self.settings.client,
            rank,
            size_tp,
            self.settings.retry_interval_s,
            revision=revision,
        )
        self.link.get()  # register now if a daemon runs (else at the first load or store)
        self._thread = threading.Thread(target=self._run, name="kvtier-vllm-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ per step
    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """Wait until the stores of preempted requests ended: their blocks are reused next."""
        if not meta.preempted:
            return
        deadline = time.monotonic() + self.settings.client.load_timeout_s + 1.0
        with self._cv:
            self._cv.wait_for(
                lambda: not any(self._outstanding.get(r) for r in meta.preempted),
                timeout=max(0.0, deadline - time.monotonic()),
            )
            # their stores ended: their finish no longer waits on them (the scheduler side
            # forgot them too), so a finish while a resumed load runs is vLLM's to delay
            ended = {r for r in meta.preempted if not self._outstanding.get(r)}
            self._stored -= ended
            for r in ended:
                self._outstanding.pop(r, None)

    def _io_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_loads(self, meta: KvtierMetadata, idle: bool = False) -> None:
        """Start this step's layer-wise loads; queue its asynchronous ones (each at most once).

        Args:
            meta: the step's metadata.
            idle: the step ran no forward pass (vLLM only polls for finished transfers).
        """
        self._idle = idle
        with self._cv:
            self._step_missed = set()
        if not self._io_alive():
            with self._cv:
                for spec in meta.loads:
                    if not spec.layerwise:
                        self._loaded.add(spec.req_id)
                    self._load_errors.update(spec.block_ids)
            return
        for spec in meta.loads:
            if spec.layerwise:
                self._start_layerwise(spec)
                continue
            with self._cv:
                if spec.req_id in self._loading:
                    continue
                self._loading.add(spec.req_id)
                self._load_started[spec.req_id] = time.perf_counter()
            self._jobs.put(spec)

    def _start_layerwise(self, spec: LoadSpec) -> None:
        """Send the LOAD of a hit wholly in L2 now; the forward waits for it per layer."""
        started = time.perf_counter()
        assert self.link is not None
        conn = self.link.get()
        handle = None
        if conn is not None:
            try:
                handle = conn.load(self._keys(conn, spec)[spec.start :], spec.block_ids)
            except (KvtierError, OSError) as err:  # a miss, never the engine's failure
                log.warning("kvtier load of %s failed: %s", spec.req_id, err)
        if handle is None or not handle.count:
            with self._cv:
                self._load_errors.update(spec.block_ids)
                self._step_missed.add(spec.req_id)
            return
        self._layerwise.append((spec, handle, started))

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's layer-wise loads have put layer ``layer_name`` in place
        (a load that fails is reported when the step ends)."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for _, handle, _ in self._layerwise:
            handle.wait_layer(layer)

    def _end_layerwise(self) -> set[str]:
        """Wait for the rest of this step's layer-wise loads; note the blocks they missed.
        Returns the requests whose load missed blocks."""
        done, self._layerwise = self._layerwise, []
        missed: set[str] = set()
        for spec, handle, started in done:
            good = handle.count if handle.wait_loaded() else 0
            if not good:
                _until_ended(handle, spec.req_id)
            if good < len(spec.block_ids):
                missed.add(spec.req_id)
                log.warning(
                    "kvtier load of %s: %d of %d blocks loaded, the rest is recomputed",
                    spec.req_id,
                    good,
                    len(spec.block_ids),
                )
                with self._cv:
                    self._load_errors.update(spec.block_ids[good:] if good else spec.block_ids)
            else:
                self.load_times.append(time.perf_counter() - started)
        return missed

    def start_stores(self, meta: KvtierMetadata) -> None:
        """Queue this step's stores (the forward has written their blocks), except those of
        requests whose layer-wise load of this step missed blocks: the forward computed
        their new pages over KV that was not there (vLLM computes them again, and the
        scheduler stores them then)."""
        missed = self._end_layerwise() if self._layerwise else set()
        with self._cv:
            missed |= self._step_missed
            self._step_missed = set()
        for spec in meta.stores:
            with self._cv:
                self._stored.add(spec.req_id)  # its finish still waits for its stores' end
                skip = not self._io_alive() or spec.req_id in missed
                if not skip:
                    self._outstanding[spec.req_id] = self._outstanding.get(spec.req_id, 0) + 1
            if skip:
                self._store_skipped(spec)
                continue
            self._jobs.put(spec)

    def _store_skipped(self, spec: StoreSpec) -> None:
        """A store not queued (the I/O thread is gone, or its pages were computed over a
        failed load); nothing to undo here."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose stores ended after they finished, requests whose loads ended).

        The step's layer-wise loads have ended when it returns; the blocks of the loads
        that failed are kept for :meth:`load_errors`.
        """
        if self._layerwise:
            self._end_layerwise()
        with self._cv:
            self._finished.update(r for r in finished_req_ids if r in self._stored)
            if (
                self._idle
                and not self._loaded
                and (self._loading or any(self._outstanding.get(r) for r in self._finished))
            ):
                # a step without a forward pass only polls for these: let the I/O thread run
                # instead of spinning vLLM's loop, which would hold the GIL the thread needs
                # (a new request waits at most this long)
                ended = self._ended
                self._cv.wait_for(lambda: self._ended != ended, timeout=IDLE_WAIT_S)
            sending = {r for r in self._finished if not self._outstanding.get(r)}
            self._finished -= sending
            self._stored -= sending
            for r in sending:
                self._outstanding.pop(r, None)
            recving, self._loaded = self._loaded, set()
            self._loading -= recving
            self._step_errors |= self._load_errors
            self._load_errors = set()
        return sending, recving

    def load_errors(self) -> set[int]:
        """Blocks whose load failed, reported once."""
        with self._cv:
            errors, self._step_errors = self._step_errors, set()
        return errors

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            failed: list[int] = list(job.block_ids) if isinstance(job, LoadSpec) else []
            try:
                if isinstance(job, LoadSpec):
                    failed = self._load(job)
                else:
                    self._store(job)
            except (KvtierError, OSError) as err:  # a miss, never the engine's failure
                log.warning("kvtier %s of %s failed: %s", type(job).__name__, job.req_id, err)
            except Exception:  # anything else (a device copy out of memory, a bug): the same,
                # and the thread goes on: the jobs queued behind must end too
                log.exception("kvtier %s of %s failed", type(job).__name__, job.req_id)
            finally:  # even on a bug: the request must not wait forever
                self._job_ended(job, failed)

    def _job_ended(self, job: LoadSpec | StoreSpec, failed: list[int]) -> None:
        with self._cv:
            if isinstance(job, LoadSpec):
                self._loaded.add(job.req_id)
                self._load_errors.update(failed)
                started = self._load_started.pop(job.req_id, None)
                if started is not None and not failed:
                    self.load_times.append(time.perf_counter() - started)
            else:
                self._outstanding[job.req_id] -= 1
            self._ended += 1
            self._cv.notify_all()

    def _load(self, spec: LoadSpec) -> list[int]:
        """Claim and load one request's pages; the blocks not loaded."""
        assert self.link is not None
        conn = self.link.get()
        if conn is None:
            return list(spec.block_ids)
        keys = self._keys(conn, spec)
        end = spec.start + len(spec.block_ids)
        if spec.in_l2 < end:  # part of the hit is only in L3: fetch it into L2 first
            conn.prefetch(keys, skip=spec.in_l2)
            conn.claim(keys, policy=self.settings.prefetch_policy or None)
        handle = conn.load(keys[spec.start :], spec.block_ids)
        good = handle.count if handle.count and handle.wait_loaded() else 0
        if handle.count and not good:
            _until_ended(handle, spec.req_id)
        if good < len(spec.block_ids):
            log.warning(
                "kvtier load of %s: %d of %d blocks loaded, the rest is recomputed",
                spec.req_id,
                good,
                len(spec.block_ids),
            )
        return list(spec.block_ids[good:])

    def _keys(self, conn: Any, spec: LoadSpec | StoreSpec) -> list[bytes]:
        """The keys of a spec's pages ``0 .. start + len(block_ids)``: the scheduler's when
        this worker's chain seed is the one it used, else hashed here."""
        lora = spec.lora if isinstance(spec, LoadSpec) else (spec.lora_name or "")
        seed = chain_seed(conn.ns_fingerprint, spec.salt, lora)
        end = spec.start + len(spec.block_ids)
        if spec.seed == seed and len(spec.keys) >= end:
            return spec.keys[:end]
        bs = self.geometry.page_size
        return page_keys(seed, spec.tokens[: end * bs], bs)

    def _store(self, spec: StoreSpec) -> None:
        assert self.link is not None
        conn = self.link.get()
        if conn is None:
            return
        keys = self._keys(conn, spec)
        parent = keys[spec.start - 1] if spec.start else None
        eng, tokens = self._engine_blocks(spec, 0, len(spec.block_ids))
        h = conn.store(keys[spec.start :], spec.block_ids, parent_key=parent, engine=eng)
        if h.wait():
            self._advertise(spec, 0, h.count, tokens)
        else:
            _until_ended(h, spec.req_id)

    def _engine_blocks(
        self, spec: StoreSpec, at: int, n: int
    ) -> tuple[P.EngineBlocks | None, list[int]]:
        """vLLM's view of the ``n`` pages of ``spec`` from its ``at``-th on: the
        ``EngineBlocks`` a STORE of them carries (kvtierd's KV events name them with vLLM's
        hashes; None when vLLM does not hash blocks), and their tokens."""
        bs = self.geometry.page_size
        first = spec.start + at
        tokens = [int(t) for t in spec.tokens[first * bs : (first + n) * bs]]
        if not spec.block_hashes:
            return None, tokens
        eng = P.EngineBlocks(
            hashes=spec.block_hashes[at : at + n],
            parent=self._parent_hash(spec, at),
            token_ids=P.pack_tokens(tokens),
            block_size=bs,
            lora_name=spec.lora_name,
        )
        return eng, tokens

    @staticmethod
    def _parent_hash(spec: StoreSpec, at: int) -> Any:
        """vLLM's hash of the block before the ``at``-th page of ``spec``."""
        return spec.block_hashes[at - 1] if at else spec.parent_hash

    def _advertise(self, spec: StoreSpec, at: int, count: int, tokens: list[int]) -> None:
        """Publish (vLLM's KV event stream, medium ``KVTIER``) that kvtierd holds ``count``
        pages of ``spec`` from its ``at``-th on, whose tokens begin ``tokens``."""
        if count and spec.block_hashes:
            self.events.add(
                stored_event(
                    spec.block_hashes[at : at + count],
                    self._parent_hash(spec, at),
                    tokens[: count * self.geometry.page_size],
                    self.geometry.page_size,
                    spec.lora_name,
                )
            )

    def close(self) -> None:
        """Stop the I/O thread, unregister, close the memfd."""
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join(timeout=self.settings.client.load_timeout_s + 5)
            self._thread = None
        if self.link is not None:
            self.link.close()
        if self.allocation is not None:
            self.allocation.close()


def _until_ended(handle: Any, req_id: str) -> None:
    """Return once kvtierd can no longer copy to or from the blocks of a transfer whose wait
    failed (:meth:`~kvtier.client.connection.transfer_handle.TransferHandle.until_ended`):
    vLLM reuses the blocks of a failed store and recomputes a failed load into them."""
    handle.until_ended(req_id)
