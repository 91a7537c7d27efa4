"""The engine-side copy path (``copy_mode = "engine"``) as a link the cache manager uses.

An engine that keeps its KV cache where kvtierd cannot map it (GPU memory it allocated
itself, or private CPU memory) registers a :class:`~kvtier.client.staging.area.StagingArea`
instead and copies pages between its cache and the area's slots with a
:class:`~kvtier.client.staging.copies.StagedCopier`. :class:`StagedConnection` does that
behind the :class:`~kvtier.client.cache.link.CacheLink` interface, so the
:class:`~kvtier.client.cache.manager.CacheManager` and the engine's forward pass speak of their
own device pages only::

    load:  take slots ─▶ LOAD into slots ─▶ wait_layer(i): the daemon filled layer i of the
           slots (completion block) ─▶ host → device copy of layer i ─▶ compute stream waits
           for its event ─▶ layer i runs ─▶ ... ─▶ wait(): slots back
    store: take slots ─▶ mark the compute stream ─▶ device → host copy after the mark ─▶
           STORE from the slots ─▶ wait(): slots back

The area is bounded: a transfer takes at most ``capacity`` slots and waits at most
``wait_s`` for them; past it a load is a miss (the engine computes) and a store is dropped.
A transfer that failed while the daemon may still copy keeps its slots out of use until it
stopped (:meth:`StagingArea.release <kvtier.client.staging.area.StagingArea.release>`).
The daemon never touches the engine's device memory on this path, so it needs no CUDA
context, and a failed load never leaves a late write in the engine's pages. A copy between
the engine's memory and the area that raises (out of memory, a CUDA error) makes that load a
miss and that store dropped, and gives its slots back: nothing reaches the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import LookupReply
from kvtier.client.connection.transfer_handle import TransferHandle
from kvtier.client.kv_pool.shared import TORCH_DTYPES
from kvtier.client.staging.area import (
    StagingArea,
    StagingPart,
    check_staging_pages,
    check_wait_s,
)
from kvtier.client.staging.copies import CopyDone, StagedCopier
from kvtier.config import ClientConfig
from kvtier.ipc.protocol import Geometry

log = logging.getLogger("kvtier.staged")

__all__ = ["StagedConnection", "StagedLoad", "StagedStore"]


class StagedLoad:
    """A LOAD into staging slots, copied to the engine's pages layer by layer.

    Attributes:
        count / writing: leading pages being loaded (0: a miss, nothing runs).
    """

    __slots__ = (
        "_area",
        "_copier",
        "_copies",
        "_handle",
        "_marker",
        "_next",
        "_ok",
        "_pages",
        "_slots",
        "count",
        "writing",
    )

    def __init__(
        self,
        area: StagingArea,
        copier: StagedCopier,
        handle: TransferHandle | None,
        slots: Sequence[int],
        pages: Sequence[int],
    ) -> None:
        self._area, self._copier, self._handle = area, copier, handle
        self.count = self.writing = handle.count if handle is not None else 0
        self._slots, self._pages = list(slots[: self.count]), list(pages[: self.count])
        self._next = 0  # the first layer not copied to the device yet
        # the copies wait for the kernels issued before the load (they may read these pages)
        self._marker: torch.cuda.Event | None = copier.compute_marker() if self.count else None
        self._copies: list[CopyDone] = []
        self._ok: bool | None = None if self.count else True

    @property
    def ok(self) -> bool:
        """True once the load ended with every page in the engine's memory."""
        return self._ok is True

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Copy layers up to ``layer`` to the device once the daemon has staged each; the
        current (compute) stream waits for the copies. False: the load failed, recompute."""
        if self._ok is not None:
            return self._ok
        assert self._handle is not None
        while self._next <= layer:
            if not self._handle.wait_layer(self._next, timeout):
                self._finish(False)
                return False
            try:
                parts = self._copier.parts_of(self._next)
                done = self._copier.to_device(parts, self._slots, self._pages, after=self._marker)
                done.wait_on_compute()
            except Exception:  # a miss, never the engine's failure (e.g. out of memory)
                log.exception("staged load: the copy of layer %d to the device failed", self._next)
                self._handle.wait_loaded(timeout)  # its slot ends; then the slots are free
                self._finish(False)
                return False
            self._copies.append(done)
            self._next += 1
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Copy every layer, wait for the copies and give the slots back; True when the
        pages are in place. Idempotent."""
        if self._ok is None:
            assert self._handle is not None
            last = self._handle.num_layers - 1
            ok = self.wait_layer(last, timeout) and self._handle.wait_loaded(timeout)
            if self._ok is None:
                self._finish(ok)
        return self._ok is True

    def copying(self) -> bool:
        """False: kvtierd copies into staging slots, never into the engine's pages."""
        return False

    def _finish(self, ok: bool) -> None:
        for c in self._copies:
            try:
                c.synchronize()
            except Exception:  # the copy failed: the pages are recomputed
                log.exception("staged load: a copy to the device failed")
                ok = False
        self._copies = []
        handle = self._handle
        self._area.release(self._slots, None if ok or handle is None else handle.copying)
        self._ok = ok


class StagedStore:
    """A STORE from staging slots the engine's pages were copied into.

    Attributes:
        count: leading keys now in L2 or being written by this store (the rest were
            dropped, or are still another store's).
        writing: pages actually being copied.
    """

    __slots__ = ("_area", "_handle", "_slots", "count", "writing")

    def __init__(self, area: StagingArea, handle: TransferHandle | None, slots: list[int]) -> None:
        self._area, self._handle, self._slots = area, handle, slots
        self.count = handle.count if handle is not None else 0
        self.writing = handle.writing if handle is not None else 0

    @property
    def ok(self) -> bool:
        """True when the store ended in success (a dropped store is a success of 0 pages)."""
        return self._handle is None or self._handle.ok

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` is in L2's slots."""
        return self._handle is None or self._handle.wait_layer(layer, timeout)

    def copying(self) -> bool:
        """False: kvtierd reads the staging slots (held until it ends), never the engine's
        pages."""
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the STORE ends, then give the slots back; True when it succeeded."""
        if self._handle is None:
            return True
        ok = self._handle.wait(timeout)
        if self._slots:
            slots, self._slots = self._slots, []
            self._area.release(slots, None if ok else self._handle.copying)
        return ok


class StagedConnection:
    """A :class:`Connection` registered over a staging area, speaking of device pages.

    :meth:`over` builds one over an engine's KV tensors (the usual way).

    Args:
        connection: registered with ``area.memory(geometry)`` as its pool.
        area: the staging area.
        copier: copies between the engine's KV tensors and ``area``.
        wait_s: longest wait for free slots; past it a load is a miss, a store dropped.
        owns_area: :meth:`close` closes the area too (after the connection).

    Attributes:
        connection / area / copier / wait_s: as given.
        geometry / config: the connection's.
    """

    def __init__(
        self,
        connection: Connection,
        area: StagingArea,
        copier: StagedCopier,
        wait_s: float,
        owns_area: bool = False,
    ) -> None:
        if copier.area is not area:
            raise ValueError("the copier copies into another staging area")
        self.connection, self.area, self.copier, self.wait_s = connection, area, copier, wait_s
        self.geometry = connection.geometry
        self.config = connection.config
        self._owns_area = owns_area

    @classmethod
    def over(
        cls,
        kv: Sequence[torch.Tensor],
        geometry: Geometry,
        model_id: str,
        *,
        staging_pages: int = 64,
        wait_s: float = 0.05,
        config: ClientConfig | None = None,
        revision: str = "",
    ) -> StagedConnection:
        """Stage an engine's ``layer_first`` KV tensors and register the staging area.

        Args:
            kv: per layer, K then V (MHA) or the latent (MLA): ``[num_pages, page_size,
                kv_heads, head_dim]`` tensors of the geometry's dtype, on one device (a GPU or
                the CPU). Pages are staged in that order, the bytes a
                :class:`~kvtier.client.kv_pool.shared.SharedKVPool` holds, so engines of
                either copy mode share pages.
            geometry / model_id / revision / config: as for :class:`Connection`.
            staging_pages: slots of the staging area (pinned on CUDA): at most this many
                pages per load or store.
            wait_s: longest wait for free slots.

        Raises:
            ValueError: tensors that do not match the geometry (count, shape, dtype, one
                device), or a bad ``staging_pages`` / ``wait_s`` (each named).
            DaemonUnavailable / DaemonError / UnexpectedReply: REGISTER failed (nothing is
                left behind).
        """
        g = geometry
        check_staging_pages(staging_pages)
        wait_s = check_wait_s(wait_s)
        if len(kv) != g.num_layers * g.components:
            raise ValueError(
                f"{len(kv)} KV tensors; the geometry has {g.num_layers} layers of "
                f"{g.components} buffers"
            )
        shape, dtype = (g.page_size, g.kv_heads, g.head_dim), TORCH_DTYPES[g.dtype]
        for i, t in enumerate(kv):
            if t.dim() != 4 or tuple(t.shape[1:]) != shape or t.dtype != dtype:
                raise ValueError(
                    f"kv[{i}]: a {t.dtype} tensor of shape {tuple(t.shape)}; the geometry's "
                    f"are {dtype} [num_pages, {', '.join(map(str, shape))}]"
                )
            if t.device != kv[0].device:
                raise ValueError(f"kv[{i}] is on {t.device}, kv[0] on {kv[0].device}")
        parts = [
            StagingPart(i // g.components, tuple(t.shape[1:]), t.dtype) for i, t in enumerate(kv)
        ]
        area = StagingArea(parts, staging_pages, pin=kv[0].device.type == "cuda")
        try:
            copier = StagedCopier(area, kv)
            memory = area.memory(g, label="engine-staging")
            conn = Connection(memory, model_id, revision, config)  # type: ignore[arg-type]
        except BaseException:
            area.close()
            raise
        return cls(conn, area, copier, wait_s, owns_area=True)

    @property
    def ns_fingerprint(self) -> bytes:
        """The connection's namespace fingerprint."""
        return self.connection.ns_fingerprint

    @property
    def epoch(self) -> int:
        """The connection's daemon epoch."""
        return self.connection.epoch

    def lookup(self, keys: Sequence[bytes]) -> LookupReply:
        """The connection's lookup."""
        return self.connection.lookup(keys)

    def daemon_alive(self) -> bool:
        """Whether the daemon lives (the connection's view)."""
        return self.connection.daemon_alive()

    def prefetch_coming(self, keys: Sequence[bytes], skip: int = 0) -> int:
        """The connection's prefetch (L3 to L2: no staging involved)."""
        return self.connection.prefetch_coming(keys, skip=skip)

    def claim(self, keys: Sequence[bytes]) -> int:
        """The connection's claim, with its client's prefetch policy."""
        return self.connection.claim(keys)

    @property
    def store_room(self) -> tuple[int, int]:
        """``(stores, pages)`` a caller may keep in flight as STOREs: the connection's
        stores, and half the staging area's slots (the other half is for loads), less the
        slots failed transfers hold (:attr:`StagingArea.held
        <kvtier.client.staging.area.StagingArea.held>`) beyond the loads' half (at least
        1). A STORE holds its slots until it is waited for; one that finds none free within
        ``wait_s`` is dropped."""
        held = self.area.held  # past the loads' share, failed STOREs' slots take this half's
        over = max(0, held - (self.area.capacity - self.area.capacity // 2))
        return self.connection.store_room[0], max(1, self.area.capacity // 2 - over)

    @property
    def load_room(self) -> tuple[int, int]:
        """``(loads, pages)`` a caller may keep in flight as LOADs: the connection's loads,
        and the staging area's slots :attr:`store_room` leaves, less those a failed
        transfer's daemon may still copy (:attr:`StagingArea.held
        <kvtier.client.staging.area.StagingArea.held>`): loads then take no slot STOREs
        need (under ``write_back`` an eviction's STORE is the only copy of its pages). 0
        pages while they cover the loads' share."""
        share = max(1, self.area.capacity - self.area.capacity // 2)
        return self.connection.load_room[0], max(0, share - self.area.held)

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> StagedLoad:
        """Load the leading L2 run of ``keys`` (at most the area's capacity) through slots;
        the device ``pages`` are written layer by layer by :meth:`StagedLoad.wait_layer`."""
        n = min(len(keys), len(pages), self.area.capacity)
        slots = self.area.acquire(n, self.wait_s) if n else None
        if slots is None:  # nothing asked, or the area stayed full: a miss
            return StagedLoad(self.area, self.copier, None, [], [])
        try:
            handle = self.connection.load(keys[:n], slots)
        except BaseException:
            self.area.release(slots)
            raise
        if handle.count < n:  # the daemon writes only the first count slots
            self.area.release(slots[handle.count :])
        return StagedLoad(self.area, self.copier, handle, slots, pages)

    def store(
        self, keys: Sequence[bytes], pages: Sequence[int], parent_key: bytes | None = None
    ) -> StagedStore:
        """Copy device ``pages`` into slots (after the compute that wrote them) and STORE
        them under ``keys``; at most the area's capacity, the rest dropped."""
        n = min(len(keys), len(pages), self.area.capacity)
        slots = self.area.acquire(n, self.wait_s) if n else None
        if slots is None:  # nothing asked, or the area stayed full: dropped
            return StagedStore(self.area, None, [])
        handle: TransferHandle | None = None
        try:
            marker = self.copier.compute_marker()
            self.copier.to_host(slots, pages[:n], after=marker).synchronize()
            handle = self.connection.store(keys[:n], slots, parent_key=parent_key)
        except Exception:  # dropped, never the engine's failure (e.g. out of memory)
            log.exception("staged store: the copy from the device failed; dropped")
            return StagedStore(self.area, None, [])
        finally:
            if handle is None or not handle.writing:  # nothing reads the slots
                self.area.release(slots)
        assert handle is not None
        return StagedStore(self.area, handle, slots if handle.writing else [])

    def page_keys(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Keys of the full pages of ``tokens`` (the connection's)."""
        return self.connection.page_keys(tokens, parent)

    def close(self) -> None:
        """Close the connection, then the area if it owns it. Idempotent."""
        try:
            self.connection.close()
        finally:
            if self._owns_area:
                self.area.close()

    def __enter__(self) -> StagedConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
