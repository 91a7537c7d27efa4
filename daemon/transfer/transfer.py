"""Page transfers between an engine's KV memory and the host pool, run off the event loop.

A transfer copies the same set of pages for every layer, layer by layer, and announces
each finished layer in the session's completion block, so the engine's forward pass can
start layer ``i`` as soon as its pages are in place. When all of an engine's regions are
mapped, each layer is one native call over its regions' rows of the engine's
:class:`~kvtier.daemon.transfer.engine_memory.RegionTable` (a transfer that ends before
its reply, one call in all), which keeps a small transfer's fixed cost to a few
microseconds; otherwise each region is copied on its own. The copies themselves are the
kernels in :mod:`kvtier.kernels` (the CPU reference here, numpy and C only: no torch; a
CUDA executor on a GPU), and they release the GIL, so worker threads copy while the event
loop keeps answering.

State machine: PENDING → RUNNING → (DONE | FAILED | CANCELLED). Cancellation is checked
between layers; the event loop commits a store's pages (DONE) or frees them (anything
else), and drops a load's pins whatever the outcome.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from kvtier.config.errors import KvtierError
from kvtier.daemon.pool.layout import page_checksums
from kvtier.daemon.transfer.engine_memory import RegionTable, RegionView
from kvtier.ipc.completion import TransferStatus
from kvtier.kernels.file_io import read_pages, write_pages
from kvtier.kernels.guarded_copy import copy_pages, copy_regions, copy_strided, strided
from kvtier.kernels.host_views import ArenaView, EngineView, HostBuffer
from kvtier.kernels.page_copy import CopyPlan

log = logging.getLogger("kvtier.daemon.transfer.transfer")

STREAM_BYTES = 1 << 20
"""Transfers of at least this many bytes write their destination with non-temporal stores
(:func:`~kvtier.kernels.guarded_copy.copy_strided`'s ``stream``): their pages are rarely in
the cache, and ordinary stores would first read every destination line into it, so the
memory bus carries each byte three times instead of twice. Smaller ones keep ``memcpy``:
they may still be hot, where it is faster."""


class RegionIOError(KvtierError):
    """Engine memory copied by positional I/O returned short (the engine shrank it)."""


class Direction(enum.Enum):
    """Which way the bytes go."""

    STORE = "store"  # engine → host
    LOAD = "load"  # host → engine


@dataclass(slots=True, eq=False)
class Transfer:
    """One STORE or LOAD in flight.

    Attributes:
        direction: STORE or LOAD.
        session_id / slot / seq: where completion is signalled.
        host_slots: host-pool slot ids (pinned for a load, WRITING for a store).
        page_ids: engine page ids, same order.
        offsets: byte offsets of the host slots in the arena.
        nbytes: bytes moved (pages x page bytes).
        cancelled: set by the event loop; the worker stops before the next layer.
        detached: a cancelled STORE whose keys left the pool's index at once
            (:meth:`HostPool.detach`): it is aborted when settled, never committed.
        committing: a copied STORE whose commit runs in slices: a cancel does not
            detach its keys (its pages are whole; the commit ends as it began).
        status: the outcome, set by the worker.
        started: monotonic start time (load latency).
        keys: the page keys of ``host_slots``, same order (write-through after a store,
            prefetched-page accounting after a load).
        checksums: a finished store's page checksums (the pool records them, so a restart
            can verify the pages it adopts); None otherwise.
        yield_bytes: the copy gives its CPU up after every this many bytes (0: never;
            :func:`~kvtier.kernels.guarded_copy.copy_strided`): set for a copy nobody
            waits on, so that the threads answering others run as soon as they wake up.
        stop: stops the copy where it runs in C (a native copy thread's), or None.
    """

    direction: Direction
    session_id: int
    slot: int
    seq: int
    host_slots: list[int]
    page_ids: np.ndarray
    offsets: np.ndarray
    nbytes: int
    cancelled: bool = False
    detached: bool = False
    committing: bool = False
    status: TransferStatus = TransferStatus.RUNNING
    started: float = 0.0
    keys: Sequence[bytes] = field(default_factory=list)
    checksum: bool = False  # a store records its pages' checksums (verify_on_adopt)
    checksums: list[int] | None = None
    extra: dict[str, object] = field(default_factory=dict)
    yield_bytes: int = 0
    stop: Callable[[], object] | None = None

    def cancel(self) -> None:
        """Stop the copy before its next layer (it ends CANCELLED, or DONE when it was past
        its last); the event loop settles it as usual."""
        self.cancelled = True
        if self.stop is not None:
            self.stop()


def run_transfer(
    t: Transfer,
    arena: HostBuffer,
    regions: Sequence[RegionView],
    num_layers: int,
    page_bytes: int,
    block: LayerSink,
    table: RegionTable | None = None,
    whole: bool = False,
) -> TransferStatus:
    """Copy every region of ``t``'s pages and signal each finished layer; runs in a worker thread.

    Regions holding several layers (``layer = -1``) are copied first; then the regions of
    layer 0, 1, ...; layer ``l`` is announced once every region of layers ``<= l`` is in
    place (all of them once the last region is).

    Args:
        t: the transfer (its slot was begun by the event loop before the reply went out).
        arena: the host pool as a flat uint8 numpy array (a CPU tensor is taken too).
        regions: the engine's memory regions, in host-page order.
        num_layers: the model's layers (the completion block counts up to it).
        page_bytes: bytes of one host page (the regions' page bytes added up).
        block: the session's completion block (or anything with its ``layer_done``).
        table: ``regions`` as the native copy takes them (one C call per announced layer),
            when all are mapped; None copies region by region.
        whole: with ``table``, copy every region in one call and announce the layers at the
            end (for a transfer whose layers nobody follows: one that ends before its reply,
            or a STORE).

    Returns:
        The final status. The event loop writes it to the block once the pages are
        committed (a store) or unpinned (a load), so DONE means "visible in L2".
    """
    status, sums = copy_part(
        t, 0, len(t.host_slots), arena, regions, num_layers, page_bytes, block, table, whole
    )
    t.checksums = sums
    t.status = status
    return status


def copy_part(
    t: Transfer,
    first: int,
    end: int,
    arena: HostBuffer,
    regions: Sequence[RegionView],
    num_layers: int,
    page_bytes: int,
    block: LayerSink,
    table: RegionTable | None = None,
    whole: bool = False,
) -> tuple[TransferStatus, list[int] | None]:
    """Copy pages ``[first, end)`` of ``t`` (all of them, or one part of a split transfer)
    and announce each layer they finished to ``block`` (``table`` and ``whole``: as for
    :func:`run_transfer`).

    Returns:
        (the part's status, the checksums of its pages when ``t`` asks for them and it
        completed, else None). ``t`` itself is not changed: the caller combines the parts.
    """
    status = TransferStatus.DONE
    sums: list[int] | None = None
    page_ids, offsets = t.page_ids[first:end], t.offsets[first:end]
    try:
        store = t.direction is Direction.STORE
        host = ArenaView.of(arena, write=store)
        if table is not None and (store or table.writable):
            status = _copy_table(t, page_ids, offsets, host, table, block, whole)
        else:
            plans: dict[int, CopyPlan] = {}
            order = sorted(regions, key=lambda r: r.layer)  # stable: -1 first, then by layer
            for i, r in enumerate(order):
                if t.cancelled:
                    status = TransferStatus.CANCELLED
                    break
                _copy_region(
                    t.direction,
                    page_ids,
                    offsets,
                    plans,
                    page_bytes,
                    host,
                    r,
                    t.nbytes >= STREAM_BYTES,
                    t.yield_bytes,
                )
                nxt = order[i + 1].layer if i + 1 < len(order) else num_layers
                if nxt > r.layer >= 0:
                    block.layer_done(t.slot, r.layer + 1)
        if status is TransferStatus.DONE:
            block.layer_done(t.slot, num_layers)
        if status is TransferStatus.DONE and t.checksum and end > first:
            # checksummed here, in the copy thread, while the bytes are hot in cache
            sums = page_checksums(host.array, offsets.tolist(), page_bytes)
    except (
        Exception
    ):  # a bug, a vanished mapping, a short read: the transfer fails, the daemon stays up
        log.exception("transfer session=%d slot=%d failed", t.session_id, t.slot)
        status = TransferStatus.FAILED
    return status, sums


class LayerSink(Protocol):
    """Where a copy announces finished layers: a completion block, or a :class:`LayerGate`'s
    part."""

    def layer_done(self, slot: int, layers: int) -> None:
        """The first ``layers`` layers of the transfer in ``slot`` are in place."""
        ...


class LayerGate:
    """Announces the layers of a transfer copied in parts by several threads: layer ``l``
    once every part has copied it (the smallest of the parts' progress).

    Args:
        block: the session's completion block.
        parts: how many parts copy the transfer.
    """

    __slots__ = ("_block", "_levels", "_lock", "_shown")

    def __init__(self, block: LayerSink, parts: int) -> None:
        self._block = block
        self._levels = [0] * parts
        self._shown = 0
        self._lock = threading.Lock()

    def part(self, index: int) -> LayerSink:
        """The sink part ``index`` announces its own progress to."""
        return _GatePart(self, index)

    def _arrive(self, index: int, slot: int, layers: int) -> None:
        with self._lock:
            self._levels[index] = max(self._levels[index], layers)
            low = min(self._levels)
            if low > self._shown:
                self._shown = low
                self._block.layer_done(slot, low)


class _GatePart:
    """Part ``index`` of a :class:`LayerGate` (a :class:`LayerSink`)."""

    __slots__ = ("_gate", "_index")

    def __init__(self, gate: LayerGate, index: int) -> None:
        self._gate, self._index = gate, index

    def layer_done(self, slot: int, layers: int) -> None:
        """Part ``index`` has copied the first ``layers`` layers."""
        self._gate._arrive(self._index, slot, layers)


def combine(results: Sequence[tuple[TransferStatus, list[int] | None]], t: Transfer) -> None:
    """Set ``t``'s status (and checksums) from its parts', in page order: DONE when every
    part is; else CANCELLED when one was cancelled; else FAILED."""
    statuses = [st for st, _ in results]
    if all(st is TransferStatus.DONE for st in statuses):
        t.status = TransferStatus.DONE
        if t.checksum and t.host_slots:
            t.checksums = [c for _, sums in results for c in (sums or [])]
    elif TransferStatus.CANCELLED in statuses:
        t.status = TransferStatus.CANCELLED
    else:
        t.status = TransferStatus.FAILED


def _copy_table(
    t: Transfer,
    page_ids: np.ndarray,
    offsets: np.ndarray,
    host: ArenaView,
    table: RegionTable,
    block: LayerSink,
    whole: bool,
) -> TransferStatus:
    """Copy the pages of every region in ``table``, one native call per announced layer
    (one in all when ``whole``), announcing each; the caller announces the last."""
    rows, store, stream = table.table, t.direction is Direction.STORE, t.nbytes >= STREAM_BYTES
    groups = ((0, len(rows), 0),) if whole else table.groups
    n = len(page_ids)
    page_ids = np.ascontiguousarray(page_ids, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    for a, b, layers in groups:
        if t.cancelled:
            return TransferStatus.CANCELLED
        done = copy_regions(
            host.address, host.nbytes, offsets, page_ids, rows[a:b], store, stream, t.yield_bytes
        )
        if done < (b - a) * n:
            raise RegionIOError(
                f"page {int(page_ids[done % n])} could not be copied: a page of the engine's "
                "memory is gone (its memfd shrank), or of the host pool (its pool_dir is "
                "full, with prefault off)"
            )
        if layers and b < len(rows):
            block.layer_done(t.slot, layers)
    return TransferStatus.DONE


def _copy_region(
    direction: Direction,
    page_ids: np.ndarray,
    offsets: np.ndarray,
    plans: dict[int, CopyPlan],
    slot_bytes: int,
    arena: ArenaView,
    r: RegionView,
    stream: bool = False,
    yield_bytes: int = 0,
) -> None:
    """Move one region's bytes of the pages ``page_ids`` (host slots at ``offsets``).

    Mapped memory, sealed or not, is copied by :func:`copy_strided` when the native
    extension is there: every index checked, then one ``memcpy`` per page in C, stopping
    at a page gone from a mapping that shrank (``stream``: with non-temporal stores, see
    :data:`STREAM_BYTES`; ``yield_bytes``: as :attr:`Transfer.yield_bytes`). Without it:
    numpy plans on a sealed mapping (``plans`` caches them per region size, for the
    transfer; they never yield), guarded copies on one that may shrink, ``pread``/``pwrite``
    on an unmapped descriptor (never yielding either)."""
    store = direction is Direction.STORE
    view = r.view
    mapped: tuple[int, int, int] | None = None  # (page 0's address, pages, page stride)
    if r.address:
        mapped = (r.address, r.num_pages, r.page_stride)
    elif (
        isinstance(view, EngineView)
        and view.row_bytes == r.page_bytes
        and (store or view.array.flags.writeable)
    ):
        mapped = (view.address, view.num_pages, view.page_stride)
    if strided() and mapped is not None:
        done = copy_strided(
            arena.address,
            arena.nbytes,
            offsets,
            r.host_offset,
            mapped[0],
            mapped[1],
            page_ids,
            mapped[2],
            r.page_bytes,
            store,
            stream,
            yield_bytes,
        )
        if done < len(page_ids):
            raise RegionIOError(
                f"engine memory: page {int(page_ids[done])} of a region is gone "
                "(the engine shrank its memfd)"
            )
        return
    plan = plans.get(r.page_bytes)
    if plan is None:
        plan = plans[r.page_bytes] = CopyPlan.build(
            page_ids, offsets, r.page_bytes, slot_bytes=slot_bytes
        )
    if view is not None:
        if store:
            plan.to_host(arena, view, r.host_offset)
        else:
            plan.from_host(arena, view, r.host_offset)
        return
    plan.check_copy(
        arena_nbytes=arena.nbytes,
        num_pages=r.num_pages,
        row_bytes=r.page_bytes,
        chunk_offset=r.host_offset,
        name="engine region",
    )
    if r.address:  # mapped, but the engine may shrink it: guarded copies only
        engine = (page_ids * r.page_stride + r.address).tolist()
        host = (offsets + (arena.address + r.host_offset)).tolist()
        done = (
            copy_pages(host, engine, r.page_bytes, stream, yield_bytes)
            if store
            else copy_pages(engine, host, r.page_bytes, stream, yield_bytes)
        )
        if done < len(host):
            raise RegionIOError(
                f"engine memory: page {int(page_ids[done])} of a region is gone "
                "(the engine shrank its memfd)"
            )
        return
    at = (offsets + r.host_offset).tolist()
    positions = (page_ids * r.page_stride + r.base).tolist()
    buf = arena.array.data  # a memoryview of the arena
    io = read_pages if store else write_pages
    sums = io(r.fd, buf, at, r.page_bytes, positions)
    if any(x is None for x in sums):
        raise RegionIOError(
            f"engine memory: a page of {r.page_bytes} bytes at "
            f"{positions[[x is None for x in sums].index(True)]} could not be "
            f"{'read' if store else 'written'} "
            "(the descriptor shrank?)"
        )
