"""The vLLM connector's engine-side copy path (``copy_mode = "engine"``).

vLLM allocates its KV cache as it normally does (GPU memory on CUDA, plain memory on the
CPU); the worker copies pages between it and a :class:`~kvtier.client.staging.area.StagingArea`
that kvtierd maps, and kvtierd copies staging ↔ pool on the CPU (no CUDA context in the
daemon). :class:`StagedWorkerSide` is :class:`~kvtier.client.adapters.vllm.worker.WorkerSide`
with its loads and stores going through staging slots:

- a layer-wise load takes slots for its pages and sends the LOAD into them; when the forward
  pass reaches layer *i* (``wait_for_layer_load``), the daemon has filled layer *i* of the
  slots (completion block), the worker issues that layer's host → device copy on its copy
  stream and the compute stream waits for it (:meth:`CopyDone.wait_on_compute
  <kvtier.client.staging.copies.CopyDone.wait_on_compute>`). The slots are given back when
  the step ends (the copies are done by then);
- an asynchronous load (I/O thread) loads into slots, copies every layer to the device and
  waits for the copy before the request is reported loaded;
- every copy to the device starts after the kernels issued before its load started (an
  event recorded on the compute stream then): they may still read the blocks it overwrites;
- a store: ``wait_for_save`` marks the compute stream (the forward wrote the blocks); on the
  I/O thread the blocks are copied device → host into slots after that mark, then STOREd
  from the slots, at most half the area per STORE. Each STORE carries vLLM's hashes of its
  blocks and, once it ended, they are published on vLLM's KV event stream as in the
  daemon copy mode (:mod:`~kvtier.client.adapters.vllm.events`).

The layer-wise loads of one step take at most half the area together, and an asynchronous
load as much (:meth:`StagedWorkerSide.load_capacity`: the scheduler side offers no more, the
rest of a longer hit is computed); a STORE takes at most the other half, so a step's loads
find their slots while a store is copied. A layer-wise load waits for slots at
most ``staging_wait_s`` (the forward waits with it; past it the load is recomputed); a store,
on the I/O thread, at most :data:`STORE_SLOT_WAIT_S` (past it the rest of the store is
dropped). A copy or a daemon call that raises fails its own load or store only: the blocks
are recomputed, and the I/O thread goes on with the next job.

One kvtier page is one vLLM block: per layer, the block in vLLM's logical order
(:func:`~kvtier.client.adapters.vllm.copy_mode.engine_parts`), so on the CPU both copy
modes share pages (the same layout label).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from kvtier.client.adapters.daemon_link import DaemonLink
from kvtier.client.adapters.vllm.copy_mode import engine_parts
from kvtier.client.adapters.vllm.metadata import KvtierMetadata, LoadSpec, StoreSpec
from kvtier.client.adapters.vllm.worker import WorkerSide
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.client.staging.area import StagingArea, StagingPart
from kvtier.client.staging.copies import CopyDone, StagedCopier
from kvtier.config import KvtierError

__all__ = ["StagedWorkerSide"]

log = logging.getLogger("kvtier.vllm")

STORE_SLOT_WAIT_S = 1.0
"""Longest wait of a store for free staging slots. Stores wait on the I/O thread, not in
the forward pass, so longer than a load may; bounded, as asynchronous loads queue behind."""


@dataclass(slots=True)
class _StagedLoad:
    """A layer-wise load of this step: its slots and the layers copied to the device."""

    spec: LoadSpec
    handle: TransferHandle
    slots: list[int]
    started: float
    marker: Any = None  # the compute stream when the load started (None on the CPU)
    next_layer: int = 0
    failed: bool = False
    copies: list[CopyDone] = field(default_factory=list)


class StagedWorkerSide(WorkerSide):
    """The worker side with vLLM's own KV allocation and a staging area (see the module
    docstring); same arguments as :class:`WorkerSide`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocation = None  # vLLM allocates its KV cache itself
        self.area: StagingArea | None = None
        self.copier: StagedCopier | None = None
        self._markers: dict[int, Any] = {}  # id(I/O thread's spec) → compute-stream event

    @staticmethod
    def load_capacity(staging_pages: int) -> int:
        """Pages the loads of one step take at most (together) from a staging area of
        ``staging_pages``: half of it, the other half for a store."""
        return max(1, staging_pages // 2)

    # ------------------------------------------------------------------ setup
    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layer_index: Mapping[str, int]
    ) -> None:
        """Make the staging area over vLLM's KV tensors and start the I/O thread."""
        first: dict[int, tuple[int, torch.Tensor]] = {}  # tensor → (its first layer, it)
        for name, t in kv_caches.items():
            if t.data_ptr() not in first or layer_index[name] < first[t.data_ptr()][0]:
                first[t.data_ptr()] = (layer_index[name], t)
        ordered = sorted(first.values(), key=lambda lt: lt[0])
        region_of = {t.data_ptr(): i for i, (_, t) in enumerate(ordered)}
        self._layer_of = {name: region_of[t.data_ptr()] for name, t in kv_caches.items()}
        g = self.geometry
        try:
            device_parts, parts = [], []
            for region, (_, t) in enumerate(ordered):
                for p in engine_parts(t, g):
                    device_parts.append(p)
                    parts.append(StagingPart(region, tuple(p.shape[1:]), p.dtype))
            if len({p.shape[0] for p in device_parts}) != 1:
                raise ValueError("layers disagree on the number of blocks")
            page_bytes = sum(p.nbytes for p in parts)
            if page_bytes != g.page_bytes:
                raise ValueError(
                    f"vLLM's KV blocks hold {page_bytes} bytes, kvtier expects {g.page_bytes}"
                )
            cuda = device_parts[0].device.type == "cuda"
            self.area = StagingArea(parts, self.settings.staging_pages, pin=cuda)
            self.copier = StagedCopier(self.area, device_parts)
        except (ValueError, OSError) as err:
            log.warning("kvtier cannot stage this KV cache (%s); kvtier is off", err)
            return
        area = self.area
        model_id, revision, rank, size_tp = self._ns
        self.link = DaemonLink(
            lambda: area.memory(g, label="vllm-staging"),
            model_id,
            self.settings.client,
            rank,
            size_tp,
            self.settings.retry_interval_s,
            revision=revision,
        )
        self.link.get()
        self._start_io_thread()

    def _start_io_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtier-vllm-io", daemon=True)
        self._thread.start()

    def _release(self, slots: list[int], handle: TransferHandle | None, ok: bool) -> None:
        """Give slots back; those of a transfer the daemon may still copy once it stopped."""
        assert self.area is not None
        self.area.release(slots, None if ok or handle is None else handle.copying)

    # ------------------------------------------------------------------ layer-wise loads
    def _start_layerwise(self, spec: LoadSpec) -> None:
        """Take slots and send the LOAD into them; the forward copies them per layer."""
        started = time.perf_counter()
        assert self.link is not None and self.area is not None and self.copier is not None
        n = min(len(spec.block_ids), self.area.capacity)
        conn = self.link.get()
        marker = None
        if conn is not None:
            try:  # the copies wait for the kernels issued before the load (they may read
                marker = self.copier.compute_marker()  # the blocks it overwrites)
            except Exception:
                log.exception("kvtier load of %s: no event on the compute stream", spec.req_id)
                conn = None
        slots = self.area.acquire(n, self.settings.staging_wait_s) if conn is not None else None
        if conn is not None and slots is None:
            log.warning(
                "kvtier load of %s: no %d free staging pages within %.3f s; recomputed",
                spec.req_id,
                n,
                self.settings.staging_wait_s,
            )
        handle = None
        if conn is not None and slots is not None:
            try:
                handle = conn.load(self._keys(conn, spec)[spec.start : spec.start + n], slots)
            except (KvtierError, OSError) as err:  # a miss, never the engine's failure
                log.warning("kvtier load of %s failed: %s", spec.req_id, err)
        if handle is None or not handle.count:
            if slots is not None:
                self._release(slots, handle, ok=False)
            with self._cv:
                self._load_errors.update(spec.block_ids)
                self._step_missed.add(spec.req_id)
            return
        assert slots is not None
        # the base class's list of this step's layer-wise loads holds staged ones here
        self._layerwise.append(cast(Any, _StagedLoad(spec, handle, slots, started, marker)))

    def _copy_layers(self, load: _StagedLoad, upto: int) -> None:
        """Issue the host → device copies of layers ``next_layer .. upto`` once the daemon
        filled each, and of later layers it has already filled; the compute stream waits
        for them."""
        assert self.copier is not None
        count = load.handle.count
        upto = max(upto, load.handle.layers_ready() - 1)
        while not load.failed and load.next_layer <= upto:
            layer = load.next_layer
            if not load.handle.wait_layer(layer):
                load.failed = True
                break
            try:
                done = self.copier.to_device(
                    self.copier.parts_of(layer),
                    load.slots[:count],
                    load.spec.block_ids[:count],
                    after=load.marker,
                )
                done.wait_on_compute()
            except Exception:  # a miss, never the engine's failure (e.g. out of memory)
                log.exception("kvtier load of %s: copy of layer %d failed", load.spec.req_id, layer)
                load.failed = True
                break
            load.copies.append(done)
            load.next_layer = layer + 1

    def wait_for_layer(self, layer_name: str) -> None:
        """Copy this layer of the step's layer-wise loads to the device before it runs."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for load in cast(list[_StagedLoad], self._layerwise):
            self._copy_layers(load, layer)

    def _end_layerwise(self) -> set[str]:
        """Finish the step's layer-wise loads, give their slots back, note their misses;
        the requests whose load missed blocks."""
        done = list(cast(list[_StagedLoad], self._layerwise))
        self._layerwise.clear()
        last = self.geometry.num_layers - 1
        missed: set[str] = set()
        for load in done:
            ok = False
            try:
                self._copy_layers(load, last)
                # the handle ends (its completion slot comes back) even when a copy failed
                ok = load.handle.wait_loaded() and not load.failed
            except Exception:  # a miss, never the engine's failure; the other loads go on
                log.exception("kvtier load of %s failed", load.spec.req_id)
            ok = self._synchronized(load) and ok  # every load gives its slots back
            self._release(load.slots, load.handle, ok)
            spec = load.spec
            good = load.handle.count if ok else 0
            if good < len(spec.block_ids):
                missed.add(spec.req_id)
                if ok:  # the rest was not in L2, or did not fit in the staging area
                    log.info(
                        "kvtier load of %s: %d of %d blocks loaded, the rest is recomputed",
                        spec.req_id,
                        good,
                        len(spec.block_ids),
                    )
                else:
                    log.warning(
                        "kvtier load of %s failed; its %d blocks are recomputed",
                        spec.req_id,
                        len(spec.block_ids),
                    )
                with self._cv:
                    self._load_errors.update(spec.block_ids[good:])
            else:
                self.load_times.append(time.perf_counter() - load.started)
        return missed

    @staticmethod
    def _synchronized(load: _StagedLoad) -> bool:
        """Wait for the load's device copies; False when one failed (the blocks are then
        recomputed; the slots are free either way, no copy still reads them)."""
        ok = True
        for c in load.copies:
            try:
                c.synchronize()
            except Exception:
                log.exception("kvtier load of %s: a copy to the device failed", load.spec.req_id)
                ok = False
        return ok

    # ------------------------------------------------------------------ I/O thread
    def start_loads(self, meta: KvtierMetadata, idle: bool = False) -> None:
        """Mark the compute stream for the asynchronous loads (their copies to the device
        wait for the kernels issued before), then start the step's loads."""
        if self.copier is not None and self.copier.cuda and self._io_alive():
            specs = [s for s in meta.loads if not s.layerwise]
            if specs:
                marker = self.copier.compute_marker()
                for spec in specs:
                    self._markers[id(spec)] = marker
        super().start_loads(meta, idle)

    def _load(self, spec: LoadSpec) -> list[int]:
        """Claim and load one request's pages through staging; the blocks not loaded."""
        assert self.link is not None and self.area is not None and self.copier is not None
        marker = self._markers.pop(id(spec), None)
        conn = self.link.get()
        if conn is None:
            return list(spec.block_ids)
        keys = self._keys(conn, spec)
        end = spec.start + len(spec.block_ids)
        if spec.in_l2 < end:  # part of the hit is only in L3: fetch it into L2 first
            conn.prefetch(keys, skip=spec.in_l2)
            conn.claim(keys, policy=self.settings.prefetch_policy or None)
        n = min(len(spec.block_ids), self.area.capacity)
        slots = self.area.acquire(n, self.settings.staging_wait_s)
        if slots is None:
            log.info("kvtier load of %s: the staging area is full; recomputed", spec.req_id)
            return list(spec.block_ids)
        handle: TransferHandle | None = None
        good = 0
        try:
            handle = conn.load(keys[spec.start : spec.start + n], slots)
            good = handle.count if handle.count and handle.wait_loaded() else 0
            if good:
                self.copier.to_device(
                    range(len(self.area.parts)), slots[:good], spec.block_ids[:good], after=marker
                ).synchronize()
        finally:
            self._release(slots, handle, ok=bool(good) or handle is None or not handle.count)
        if good < len(spec.block_ids):
            log.info(
                "kvtier load of %s: %d of %d blocks loaded, the rest is recomputed",
                spec.req_id,
                good,
                len(spec.block_ids),
            )
        return list(spec.block_ids[good:])

    def start_stores(self, meta: KvtierMetadata) -> None:
        """Mark the compute stream (the forward wrote the blocks), then queue the stores."""
        if self.copier is not None and self.copier.cuda and meta.stores:
            marker = self.copier.compute_marker()
            for spec in meta.stores:
                self._markers[id(spec)] = marker
        super().start_stores(meta)

    def _store_skipped(self, spec: StoreSpec) -> None:
        """A store not queued: its marker goes."""
        self._markers.pop(id(spec), None)

    def _store(self, spec: StoreSpec) -> None:
        """Copy the blocks into slots and STORE them, at most half the area at a time."""
        assert self.link is not None and self.area is not None and self.copier is not None
        marker = self._markers.pop(id(spec), None)
        conn = self.link.get()
        if conn is None:
            return
        keys = self._keys(conn, spec)
        parent = keys[spec.start - 1] if spec.start else None
        step = max(1, self.area.capacity // 2)
        for at in range(0, len(spec.block_ids), step):
            blocks = spec.block_ids[at : at + step]
            page_keys = keys[spec.start + at : spec.start + at + len(blocks)]
            eng, tokens = self._engine_blocks(spec, at, len(blocks))
            slots = self.area.acquire(
                len(blocks), max(STORE_SLOT_WAIT_S, self.settings.staging_wait_s)
            )
            if slots is None:
                log.warning(
                    "kvtier store of %s: the staging area stayed full; %d pages dropped",
                    spec.req_id,
                    len(spec.block_ids) - at,
                )
                return
            handle: TransferHandle | None = None
            ok = False
            try:
                self.copier.to_host(slots, blocks, after=marker).synchronize()
                handle = conn.store(page_keys, slots, parent_key=parent, engine=eng)
                ok = handle.wait()
            finally:
                self._release(slots, handle, ok or handle is None or not handle.writing)
            if ok:
                self._advertise(spec, at, handle.count, tokens)
            if not ok or handle.count < len(blocks):
                return  # the chain is broken: later pages would have no parent in L2
            parent = page_keys[-1]

    def close(self) -> None:
        """Stop the I/O thread, unregister, then unpin and close the staging area (left
        mapped when the I/O thread did not stop in time: it may still copy into it)."""
        thread = self._thread
        super().close()
        if thread is not None and thread.is_alive():
            log.warning("the kvtier I/O thread did not stop; its staging area stays mapped")
            self.area = None
        if self.area is not None:
            self.area.close()
            self.area = None
        self.copier = None
