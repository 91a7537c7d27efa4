"""CPU page copies between an engine's layer-first KV buffers and the host arena.

:class:`CopyPlan` is a :class:`~kvtier.kernels.plan.PagePlan` (the checked, coalesced page and
slot pairs of one transfer; layouts there) that moves the bytes with the CPU; the ``copy_*``
functions plan and copy in one call. *Store* copies engine pages into slots (``*_to_host``);
*load* copies slots into engine pages (``*_from_host``).

How the copies run: a run of the plan (``MIN_STRIDED_RUN`` pages or more whose slots are one
stride apart) is one numpy strided copy (engine rows contiguous, host rows ``stride`` bytes
apart); every other page is one ``memmove`` through ctypes. Of the approaches compared, these
two come closest to a plain single-threaded memcpy of the same bytes; numpy ``take`` plus a
fancy store, ``process_vm_readv`` on the own process, and torch's per-page ``copy_``,
``_foreach_copy_`` or ``index_select``/``index_copy_`` are all clearly slower.
``python -m kvtier.bench.kernels_bench`` measures the chosen path on the machine at hand.

Both release the GIL while bytes move, so other threads and the daemon's event loop keep
running. The GIL is needed between two copies, once per run or per single page: next to a thread
that waits (an event loop) copies keep nearly their full speed, next to a thread that spins in
Python without ever blocking they slow down a lot, because each hand-off may wait out the
interpreter's switch interval.

Buffers are numpy arrays (the daemon's arena and mapped engine memory are), or CPU torch tensors
from callers that hold them (:mod:`kvtier.kernels.host_views`): this module never imports torch,
so neither does a CPU daemon.

Input checks (dtypes, lengths, duplicates, bounds, a writable destination) run before the first
byte moves, so a call that raises writes nothing.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np
from kvtier.kernels.host_views import ArenaView, EngineView, HostBuffer
from kvtier.kernels.plan import (
    IndexArray,
    PageCopyError,
    PagePlan,
    positive_int,
    select_layers,
)

__all__ = [
    "CopyPlan",
    "IndexArray",
    "PageCopyError",
    "copy_layer_from_host",
    "copy_layer_kv_from_host",
    "copy_layer_kv_to_host",
    "copy_layer_to_host",
    "copy_layers_from_host",
    "copy_layers_to_host",
]

# libc memmove as a CFUNCTYPE foreign function, so ctypes releases the GIL around each call; no
# return value to convert (less call overhead than ``ctypes.memmove``).
_MEMMOVE_ADDRESS = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
assert _MEMMOVE_ADDRESS is not None
_memmove = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _MEMMOVE_ADDRESS
)


class CopyPlan(PagePlan):
    """A :class:`~kvtier.kernels.plan.PagePlan` that copies with the CPU.

    Build it with :meth:`~kvtier.kernels.plan.PagePlan.build`; then call :meth:`to_host` /
    :meth:`from_host` per (layer, component) buffer, :meth:`layer_to_host` /
    :meth:`layer_from_host` per layer, or :meth:`layers_to_host` / :meth:`layers_from_host` for
    all layers. Immutable; may be used from several threads at once (on disjoint buffers).
    """

    __slots__ = ()

    # -- one (layer, component) buffer -----------------------------------------------------------

    def to_host(
        self, arena: HostBuffer | ArenaView, engine_buf: HostBuffer | EngineView, chunk_offset: int
    ) -> None:
        """Store: copy the planned pages of one engine buffer into their slots.

        Args:
            arena: The host arena, a 1-D contiguous uint8 numpy array (or CPU tensor), or an
                :class:`~kvtier.kernels.host_views.ArenaView` of it.
            engine_buf: One (layer, component) buffer, a contiguous array (or CPU tensor) of any
                dtype whose first dimension is the page id, or an
                :class:`~kvtier.kernels.host_views.EngineView` of one; its bytes per page must
                equal ``chunk_bytes``.
            chunk_offset: Where this buffer's chunk sits inside each slot, in bytes.

        Raises:
            PageCopyError: A bad buffer or offset; a page id or slot out of bounds.
        """
        arena_view = ArenaView.of(arena, write=True)
        engine_view = self._checked(arena_view, engine_buf, "engine_buf", chunk_offset, False)
        self._copy(arena_view, engine_view, chunk_offset, to_host=True)

    def from_host(
        self, arena: HostBuffer | ArenaView, engine_buf: HostBuffer | EngineView, chunk_offset: int
    ) -> None:
        """Load: copy the planned slots into the pages of one engine buffer.

        Arguments and errors as for :meth:`to_host`.
        """
        arena_view = ArenaView.of(arena)
        engine_view = self._checked(arena_view, engine_buf, "engine_buf", chunk_offset, True)
        self._copy(arena_view, engine_view, chunk_offset, to_host=False)

    # -- all components of one layer -------------------------------------------------------------

    def layer_to_host(
        self, arena: HostBuffer, layer_bufs: Sequence[HostBuffer], layer: int
    ) -> None:
        """Store every component of one layer (K and V for MHA, the latent for MLA).

        Args:
            arena: The host arena, a 1-D contiguous uint8 numpy array (or CPU tensor).
            layer_bufs: The layer's buffers indexed by component; ``C = len(layer_bufs)``.
            layer: The layer index ``l``; component ``c`` lands at ``(l * C + c) * chunk_bytes``.

        Raises:
            PageCopyError: As for :meth:`to_host`, for any component (nothing is written then).
        """
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), to_host=True)

    def layer_from_host(
        self, arena: HostBuffer, layer_bufs: Sequence[HostBuffer], layer: int
    ) -> None:
        """Load every component of one layer; arguments and errors as for :meth:`layer_to_host`."""
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), to_host=False)

    # -- all layers ------------------------------------------------------------------------------

    def layers_to_host(
        self,
        arena: HostBuffer,
        engine_bufs: Sequence[Sequence[HostBuffer]],
        layers: Sequence[int] | None = None,
    ) -> None:
        """Store several layers (all by default), layer by layer.

        Args:
            arena: The host arena, a 1-D contiguous uint8 numpy array (or CPU tensor).
            engine_bufs: Every buffer of the engine, indexed ``[layer][component]``; every layer
                must have the same number of components.
            layers: The layers to copy, in this order; ``None`` copies them all.

        Raises:
            PageCopyError: As for :meth:`to_host`, for any buffer (nothing is written then).
        """
        self._run_layers(arena, *select_layers(engine_bufs, layers), to_host=True)

    def layers_from_host(
        self,
        arena: HostBuffer,
        engine_bufs: Sequence[Sequence[HostBuffer]],
        layers: Sequence[int] | None = None,
    ) -> None:
        """Load several layers (all by default); arguments as for :meth:`layers_to_host`."""
        self._run_layers(arena, *select_layers(engine_bufs, layers), to_host=False)

    # -- internals -------------------------------------------------------------------------------

    def _run_layers(
        self,
        arena: HostBuffer,
        selected: Sequence[tuple[int, Sequence[HostBuffer]]],
        n_components: int,
        *,
        to_host: bool,
    ) -> None:
        """Check every buffer of the selected layers, then copy them in order."""
        arena_view = ArenaView.of(arena, write=to_host)
        jobs: list[tuple[EngineView, int]] = []
        for layer, bufs in selected:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise PageCopyError(f"layer must be a non-negative int, got {layer!r}")
            if len(bufs) != n_components:
                raise PageCopyError(
                    f"layer {layer} has {len(bufs)} components, expected {n_components}"
                )
            for c, buf in enumerate(bufs):
                chunk_offset = (layer * n_components + c) * self.chunk_bytes
                name = f"engine_bufs[{layer}][{c}]"
                view = self._checked(arena_view, buf, name, chunk_offset, not to_host)
                jobs.append((view, chunk_offset))
        for engine_view, chunk_offset in jobs:
            self._copy(arena_view, engine_view, chunk_offset, to_host=to_host)

    def _checked(
        self,
        arena: ArenaView,
        engine_buf: HostBuffer | EngineView,
        name: str,
        chunk_offset: int,
        write: bool,
    ) -> EngineView:
        """Check one copy's buffer (writable when ``write``), chunk offset and bounds; return
        the buffer's byte view."""
        view = EngineView.of(engine_buf, name, write=write)
        self.check_copy(
            arena_nbytes=arena.nbytes,
            num_pages=view.num_pages,
            row_bytes=view.row_bytes,
            chunk_offset=chunk_offset,
            name=name,
        )
        return view

    def _copy(
        self, arena: ArenaView, engine: EngineView, chunk_offset: int, *, to_host: bool
    ) -> None:
        """Move the bytes of one checked (layer, component) copy."""
        chunk = self.chunk_bytes
        if self.runs:
            host_np = arena.array
            engine_np = engine.array
            for first_page, first_offset, length in self.runs:
                host_rows = np.ndarray(
                    (length, chunk),
                    dtype=np.uint8,
                    buffer=host_np,
                    offset=first_offset + chunk_offset,
                    strides=(self.stride, 1),
                )
                engine_rows = engine_np[first_page : first_page + length]
                if to_host:
                    np.copyto(host_rows, engine_rows)
                else:
                    np.copyto(engine_rows, host_rows)
        if self.single_page_ids.size:
            engine_addrs = (self.single_page_ids * engine.page_stride + engine.address).tolist()
            host_addrs = (self.single_slot_offsets + (arena.address + chunk_offset)).tolist()
            dsts, srcs = (host_addrs, engine_addrs) if to_host else (engine_addrs, host_addrs)
            # one memmove per page, driven from C (map) rather than a Python-level loop body
            deque(map(_memmove, dsts, srcs, repeat(chunk, len(dsts))), maxlen=0)


# -- one-shot functions: plan and copy in one call ----------------------------------------------


def copy_layer_to_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    engine_buf: HostBuffer,
    page_ids: IndexArray,
    chunk_offset: int,
) -> None:
    """Store one (layer, component) buffer: ``engine_buf[page_ids[i]]`` into slot ``i``.

    The chunk of slot ``i`` starts at ``slot_offsets[i] + chunk_offset``. For many layers of one
    transfer build a :class:`CopyPlan` once instead: this function plans on every call.

    Args:
        arena: The host arena, a 1-D contiguous uint8 numpy array (or CPU tensor).
        slot_offsets: Arena byte offsets of the slots, 1-D int64.
        engine_buf: A contiguous array (or CPU tensor), first dimension the page id; its bytes per
            page are the chunk size.
        page_ids: Engine page ids, 1-D int64, same length as ``slot_offsets``, each at most once.
        chunk_offset: ``(l * n_components + c) * chunk_bytes`` for layer ``l``, component ``c``.

    Raises:
        PageCopyError: A bad argument (named in the message); nothing is written then. Slots
            must lie at least ``chunk_offset + chunk_bytes`` apart.
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset)
    plan.to_host(arena, engine_buf, chunk_offset)


def copy_layer_from_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    engine_buf: HostBuffer,
    page_ids: IndexArray,
    chunk_offset: int,
) -> None:
    """Load one (layer, component) buffer: slot ``i`` into ``engine_buf[page_ids[i]]``.

    Arguments and errors as for :func:`copy_layer_to_host`.
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset)
    plan.from_host(arena, engine_buf, chunk_offset)


def copy_layer_kv_to_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[HostBuffer],
    page_ids: IndexArray,
    layer: int,
    n_layers: int,
) -> None:
    """Store every component of one layer of an engine with ``n_layers`` layers.

    Slots must be ``n_layers * len(layer_bufs) * chunk_bytes`` bytes (a full host page) apart at
    least. Errors as for :func:`copy_layer_to_host`.
    """
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers)
    plan.layer_to_host(arena, layer_bufs, layer)


def copy_layer_kv_from_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[HostBuffer],
    page_ids: IndexArray,
    layer: int,
    n_layers: int,
) -> None:
    """Load every component of one layer; arguments as for :func:`copy_layer_kv_to_host`."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers)
    plan.layer_from_host(arena, layer_bufs, layer)


def copy_layers_to_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[HostBuffer]],
    page_ids: IndexArray,
) -> None:
    """Store whole pages: every layer and component of ``engine_bufs[layer][component]``.

    Plans once and copies layer by layer. Slots must be a full host page apart at least.
    Errors as for :func:`copy_layer_to_host`; nothing is written when one is raised.
    """
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids)
    plan.layers_to_host(arena, engine_bufs)


def copy_layers_from_host(
    arena: HostBuffer,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[HostBuffer]],
    page_ids: IndexArray,
) -> None:
    """Load whole pages into every layer and component; see :func:`copy_layers_to_host`."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids)
    plan.layers_from_host(arena, engine_bufs)


def _plan_for_buffer(
    slot_offsets: IndexArray, engine_buf: HostBuffer, page_ids: IndexArray, chunk_offset: int
) -> CopyPlan:
    """Plan a single-buffer copy: each slot owns ``chunk_offset + chunk_bytes`` bytes."""
    chunk = EngineView.of(engine_buf, "engine_buf").row_bytes
    if isinstance(chunk_offset, bool) or not isinstance(chunk_offset, int) or chunk_offset < 0:
        raise PageCopyError(f"chunk_offset must be a non-negative int, got {chunk_offset!r}")
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=chunk_offset + chunk)


def _plan_for_layers(
    slot_offsets: IndexArray,
    layer_bufs: Sequence[HostBuffer],
    page_ids: IndexArray,
    n_layers: int,
) -> CopyPlan:
    """Plan a copy of one layer's components; each slot owns a full host page."""
    if len(layer_bufs) == 0:
        raise PageCopyError("layer_bufs is empty")
    n_layers = positive_int(n_layers, "n_layers")
    chunk = EngineView.of(layer_bufs[0], "layer_bufs[0]").row_bytes
    slot_bytes = n_layers * len(layer_bufs) * chunk
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=slot_bytes)


def _plan_for_engine(
    slot_offsets: IndexArray, engine_bufs: Sequence[Sequence[HostBuffer]], page_ids: IndexArray
) -> CopyPlan:
    """Plan a copy of whole host pages for ``engine_bufs[layer][component]``."""
    if len(engine_bufs) == 0 or len(engine_bufs[0]) == 0:
        raise PageCopyError("engine_bufs must hold at least one layer with one component")
    chunk = EngineView.of(engine_bufs[0][0], "engine_bufs[0][0]").row_bytes
    slot_bytes = len(engine_bufs) * len(engine_bufs[0]) * chunk
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=slot_bytes)
