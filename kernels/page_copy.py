"""Page copies between an engine's layer-first KV buffers and the host arena (CPU).

Layouts::

    engine: one buffer per (layer l, component c)      host arena: one flat uint8 tensor
    (c in {0: K, 1: V} for MHA; only c = 0 for MLA)

            ┌──────── chunk_bytes ────────┐           slot at slot_offset (page-major)
    page 0  │ [page_size, kv_heads, dim]  │           ┌──────┬──────┬──────┬──────┬─────┐
    page 1  │                             │           │ l0c0 │ l0c1 │ l1c0 │ l1c1 │ ... │
      ...   │                             │           └──────┴──────┴──────┴──────┴─────┘
            └─────────────────────────────┘           chunk_offset = (l * C + c) * chunk_bytes

A transfer moves ``n`` pages given as two index arrays of the same length: ``page_ids`` (engine
page ids) and ``slot_offsets`` (byte offsets of host slots in the arena). *Store* copies engine
pages into slots (``*_to_host``); *load* copies slots into engine pages (``*_from_host``).

How the copies run. A :class:`CopyPlan` is built once per transfer (vectorised numpy, no Python
loop per page) and reused for every layer and component, since the index arrays are the same for
all of them. Planning sorts the pairs by page id and coalesces them into *runs*: pages
``p, p+1, ...`` whose slots are ``o, o+stride, ...``. A run of three pages or more is copied by
one numpy strided copy (engine rows contiguous, host rows ``stride`` bytes apart); every other
page is one ``memmove`` through ctypes. Both release the GIL while bytes move, so other threads
and the daemon's event loop keep running. Choices measured on the 2-core build machine against a
single-threaded numpy memcpy of the same 256 MiB (128 KiB chunks, 8 layers x 2 components; ratios
from one run each, the machine is noisy):

============================================  ===========  ===========
approach                                       consecutive  random
============================================  ===========  ===========
this module, as the daemon runs it (bench)     0.85-1.07    0.83-0.95
strided numpy copy per run (chosen for runs)   0.95-1.1     n/a
ctypes ``memmove`` per chunk (chosen else)     0.84-0.94    0.81-0.92
numpy ``take`` + fancy store via a cache-sized
temporary                                      0.4-0.7      0.55-0.71
``process_vm_readv`` on the own process        0.57-0.66    0.52-0.60
torch ``_foreach_copy_`` over split views      0.06-0.5     0.1-0.3
torch ``copy_`` per page view                  0.24-0.26    0.34-0.39
torch ``index_select(out=)`` + ``index_copy_``
(int64 view)                                   0.01-0.14    0.01-0.25
============================================  ===========  ===========

The GIL is needed between two copies, once per run or per single page. Next to a thread that
waits (an event loop, a loop sleeping 1 ms) copies keep about 97% of their speed here; next to a
thread that spins in Python without ever blocking they fall to about a third (3 GB/s), because
each hand-off may wait out the interpreter's switch interval.

Input checks (dtypes, lengths, duplicates, bounds) run before the first byte moves, so a call
that raises writes nothing. ``python -m kvtier.bench.kernels_bench`` measures the chosen path.
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from kvtier.config.errors import KvtierError

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

IndexArray: TypeAlias = npt.NDArray[np.int64] | torch.Tensor
"""A 1-D int64 index array: a numpy array or a CPU torch tensor."""

_MIN_STRIDED_RUN = 3
"""Runs at least this long are copied by one strided numpy copy rather than one memmove each:
building the two views costs about as much as two or three ctypes calls."""

_MAX_INDEX = 1 << 62
"""Ids and offsets above this are rejected so that byte arithmetic on them cannot overflow int64."""

# libc memmove as a CFUNCTYPE foreign function, so ctypes releases the GIL around each call; no
# return value to convert (about 10% less call overhead than ``ctypes.memmove`` here).
_MEMMOVE_ADDRESS = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
assert _MEMMOVE_ADDRESS is not None
_memmove = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _MEMMOVE_ADDRESS
)


class PageCopyError(KvtierError, ValueError):
    """A page copy was asked with bad arguments; the message names the argument and the value.

    Raised before any byte is written.
    """


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """The page copies of one transfer, validated and coalesced once, reused for every layer.

    Build it with :meth:`build`; then call :meth:`to_host` / :meth:`from_host` per (layer,
    component) buffer, :meth:`layer_to_host` / :meth:`layer_from_host` per layer, or
    :meth:`layers_to_host` / :meth:`layers_from_host` for all layers. A plan is immutable and may
    be used from several threads at once (on disjoint buffers).

    Slot ``i`` owns the arena bytes ``[slot_offsets[i], slot_offsets[i] + slot_bytes)``; the plan
    guarantees that those ranges do not overlap and that no engine page appears twice, so no copy
    of the transfer writes a byte another copy of it writes.

    Attributes:
        page_ids: Engine page ids, int64, in the caller's order (a private, read-only copy).
        slot_offsets: Arena byte offsets of the slots, int64, in the caller's order (a private,
            read-only copy).
        chunk_bytes: Bytes of one page of one (layer, component) buffer.
        slot_bytes: Bytes each slot owns from its offset on (at least ``chunk_bytes``).
        stride: Arena distance between the slots of consecutive pages within a run (0: no runs).
        runs: ``(first_page_id, first_slot_offset, length)`` of each run copied as one strided copy.
        single_page_ids: Page ids copied one chunk at a time, ascending.
        single_slot_offsets: Their slot offsets, aligned with ``single_page_ids``.
        max_page_id: The largest page id (-1 when the plan is empty).
        max_slot_offset: The largest slot offset (-1 when the plan is empty).
    """

    page_ids: npt.NDArray[np.int64]
    slot_offsets: npt.NDArray[np.int64]
    chunk_bytes: int
    slot_bytes: int
    stride: int
    runs: tuple[tuple[int, int, int], ...]
    single_page_ids: npt.NDArray[np.int64]
    single_slot_offsets: npt.NDArray[np.int64]
    max_page_id: int
    max_slot_offset: int

    @classmethod
    def build(
        cls,
        page_ids: IndexArray,
        slot_offsets: IndexArray,
        chunk_bytes: int,
        *,
        slot_bytes: int | None = None,
    ) -> CopyPlan:
        """Validate a transfer's index arrays and plan its copies.

        Args:
            page_ids: Engine page ids, 1-D int64 (numpy array or CPU tensor); each at most once.
            slot_offsets: Arena byte offsets of the host slots, 1-D int64, same length.
            chunk_bytes: Bytes of one page of one (layer, component) buffer.
            slot_bytes: Bytes each slot owns (``n_layers * n_components * chunk_bytes`` for a full
                host page); defaults to ``chunk_bytes``. Slots closer than this are rejected.

        Returns:
            The plan. Bounds against a particular engine buffer and arena are checked per copy.

        Raises:
            PageCopyError: Wrong type, dtype or shape; lengths differ; a negative or huge id or
                offset; a page id given twice; two slots closer than ``slot_bytes``.
        """
        pids = _index_array(page_ids, "page_ids")
        offs = _index_array(slot_offsets, "slot_offsets")
        if pids.shape != offs.shape:
            raise PageCopyError(
                f"page_ids and slot_offsets must have the same length, got {pids.size} and "
                f"{offs.size}"
            )
        chunk = _positive_int(chunk_bytes, "chunk_bytes")
        extent = chunk if slot_bytes is None else _positive_int(slot_bytes, "slot_bytes")
        if extent < chunk:
            raise PageCopyError(
                f"slot_bytes = {extent} is smaller than chunk_bytes = {chunk}"
            )
        if pids.size == 0:
            empty = np.empty(0, dtype=np.int64)
            return cls(pids, offs, chunk, extent, 0, (), empty, empty, -1, -1)

        _check_range(pids, "page_ids", _MAX_INDEX // chunk)
        _check_range(offs, "slot_offsets", _MAX_INDEX - extent)

        order = np.argsort(pids, kind="stable")
        sorted_pids = pids[order]
        sorted_offs = offs[order]
        dup = np.flatnonzero(sorted_pids[1:] == sorted_pids[:-1])
        if dup.size:
            raise PageCopyError(f"page_ids holds page id {int(sorted_pids[dup[0]])} twice")
        by_offset = np.sort(offs)
        close = np.flatnonzero(np.diff(by_offset) < extent)
        if close.size:
            a, b = int(by_offset[close[0]]), int(by_offset[close[0] + 1])
            raise PageCopyError(
                f"slot_offsets {a} and {b} are closer than slot_bytes = {extent}: the slots overlap"
            )

        stride, runs, singles = _coalesce(sorted_pids, sorted_offs)
        single_pids, single_offs = sorted_pids[singles], sorted_offs[singles]
        for array in (pids, offs, single_pids, single_offs):
            array.flags.writeable = False
        return cls(
            page_ids=pids,
            slot_offsets=offs,
            chunk_bytes=chunk,
            slot_bytes=extent,
            stride=stride,
            runs=runs,
            single_page_ids=single_pids,
            single_slot_offsets=single_offs,
            max_page_id=int(sorted_pids[-1]),
            max_slot_offset=int(by_offset[-1]),
        )

    def __len__(self) -> int:
        """Number of pages the transfer moves."""
        return int(self.page_ids.size)

    @property
    def num_runs(self) -> int:
        """Number of runs copied as one strided copy each."""
        return len(self.runs)

    @property
    def num_singles(self) -> int:
        """Number of pages copied one chunk at a time."""
        return int(self.single_page_ids.size)

    # -- one (layer, component) buffer -----------------------------------------------------------

    def to_host(self, arena: torch.Tensor, engine_buf: torch.Tensor, chunk_offset: int) -> None:
        """Store: copy the planned pages of one engine buffer into their slots.

        Args:
            arena: The host arena, a 1-D contiguous uint8 CPU tensor.
            engine_buf: One (layer, component) buffer, a contiguous CPU tensor of any dtype whose
                first dimension is the page id; its bytes per page must equal ``chunk_bytes``.
            chunk_offset: Where this buffer's chunk sits inside each slot, in bytes.

        Raises:
            PageCopyError: A bad buffer or offset; a page id or slot out of bounds.
        """
        arena_view = _ArenaView.of(arena)
        engine_view = self._checked(arena_view, engine_buf, "engine_buf", chunk_offset)
        self._copy(arena_view, engine_view, chunk_offset, to_host=True)

    def from_host(self, arena: torch.Tensor, engine_buf: torch.Tensor, chunk_offset: int) -> None:
        """Load: copy the planned slots into the pages of one engine buffer.

        Arguments and errors as for :meth:`to_host`.
        """
        arena_view = _ArenaView.of(arena)
        engine_view = self._checked(arena_view, engine_buf, "engine_buf", chunk_offset)
        self._copy(arena_view, engine_view, chunk_offset, to_host=False)

    # -- all components of one layer -------------------------------------------------------------

    def layer_to_host(
        self, arena: torch.Tensor, layer_bufs: Sequence[torch.Tensor], layer: int
    ) -> None:
        """Store every component of one layer (K and V for MHA, the latent for MLA).

        Args:
            arena: The host arena, a 1-D contiguous uint8 CPU tensor.
            layer_bufs: The layer's buffers indexed by component; ``C = len(layer_bufs)``.
            layer: The layer index ``l``; component ``c`` lands at ``(l * C + c) * chunk_bytes``.

        Raises:
            PageCopyError: As for :meth:`to_host`, for any component (nothing is written then).
        """
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), to_host=True)

    def layer_from_host(
        self, arena: torch.Tensor, layer_bufs: Sequence[torch.Tensor], layer: int
    ) -> None:
        """Load every component of one layer; arguments and errors as for :meth:`layer_to_host`."""
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), to_host=False)

    # -- all layers ------------------------------------------------------------------------------

    def layers_to_host(
        self,
        arena: torch.Tensor,
        engine_bufs: Sequence[Sequence[torch.Tensor]],
        layers: Sequence[int] | None = None,
    ) -> None:
        """Store several layers (all by default), layer by layer.

        Args:
            arena: The host arena, a 1-D contiguous uint8 CPU tensor.
            engine_bufs: Every buffer of the engine, indexed ``[layer][component]``; every layer
                must have the same number of components.
            layers: The layers to copy, in this order; ``None`` copies them all.

        Raises:
            PageCopyError: As for :meth:`to_host`, for any buffer (nothing is written then).
        """
        self._run_layers(arena, *_select_layers(engine_bufs, layers), to_host=True)

    def layers_from_host(
        self,
        arena: torch.Tensor,
        engine_bufs: Sequence[Sequence[torch.Tensor]],
        layers: Sequence[int] | None = None,
    ) -> None:
        """Load several layers (all by default); arguments as for :meth:`layers_to_host`."""
        self._run_layers(arena, *_select_layers(engine_bufs, layers), to_host=False)

    # -- internals -------------------------------------------------------------------------------

    def _run_layers(
        self,
        arena: torch.Tensor,
        selected: Sequence[tuple[int, Sequence[torch.Tensor]]],
        n_components: int,
        *,
        to_host: bool,
    ) -> None:
        """Check every buffer of the selected layers, then copy them in order."""
        arena_view = _ArenaView.of(arena)
        jobs: list[tuple[_EngineView, int]] = []
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
                jobs.append((self._checked(arena_view, buf, name, chunk_offset), chunk_offset))
        for engine_view, chunk_offset in jobs:
            self._copy(arena_view, engine_view, chunk_offset, to_host=to_host)

    def check_copy(
        self, *, arena_nbytes: int, num_pages: int, row_bytes: int, chunk_offset: int, name: str
    ) -> None:
        """Check one (layer, component) copy of this plan against a buffer and an arena.

        Used by every copy before it moves a byte, on CPU and CUDA alike.

        Args:
            arena_nbytes: Size of the host arena in bytes.
            num_pages: Pages in the engine buffer.
            row_bytes: Bytes per page of the engine buffer.
            chunk_offset: Where the buffer's chunk sits inside each slot.
            name: How the buffer is named in error messages.

        Raises:
            PageCopyError: The buffer's page size differs from ``chunk_bytes``; the chunk does not
                fit in a slot; a page id or slot is out of bounds.
        """
        if row_bytes != self.chunk_bytes:
            raise PageCopyError(
                f"{name} holds {row_bytes} bytes per page, the plan copies chunks of "
                f"{self.chunk_bytes}"
            )
        if isinstance(chunk_offset, bool) or not isinstance(chunk_offset, int):
            raise PageCopyError(f"chunk_offset must be an int, got {chunk_offset!r}")
        if chunk_offset < 0 or chunk_offset + self.chunk_bytes > self.slot_bytes:
            raise PageCopyError(
                f"chunk_offset = {chunk_offset} puts a {self.chunk_bytes}-byte chunk outside a "
                f"{self.slot_bytes}-byte slot"
            )
        if self.max_page_id >= num_pages:
            i = int(np.flatnonzero(self.page_ids >= num_pages)[0])
            raise PageCopyError(
                f"page_ids[{i}] = {int(self.page_ids[i])} is out of range for {name} with "
                f"{num_pages} pages"
            )
        limit = arena_nbytes - chunk_offset - self.chunk_bytes
        if self.max_slot_offset > limit:
            i = int(np.flatnonzero(self.slot_offsets > limit)[0])
            raise PageCopyError(
                f"slot_offsets[{i}] = {int(self.slot_offsets[i])} puts chunk_offset "
                f"{chunk_offset} + {self.chunk_bytes} bytes past the end of a {arena_nbytes}-byte "
                "arena"
            )

    def _checked(
        self, arena: _ArenaView, engine_buf: torch.Tensor, name: str, chunk_offset: int
    ) -> _EngineView:
        """Check one copy's buffer, chunk offset and bounds; return the buffer's byte view."""
        view = _EngineView.of(engine_buf, name)
        self.check_copy(
            arena_nbytes=arena.nbytes,
            num_pages=view.num_pages,
            row_bytes=view.row_bytes,
            chunk_offset=chunk_offset,
            name=name,
        )
        return view

    def _copy(
        self, arena: _ArenaView, engine: _EngineView, chunk_offset: int, *, to_host: bool
    ) -> None:
        """Move the bytes of one checked (layer, component) copy."""
        chunk = self.chunk_bytes
        if self.runs:
            host_np = arena.array()
            engine_np = engine.array()
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
            engine_addrs = (self.single_page_ids * chunk + engine.address).tolist()
            host_addrs = (self.single_slot_offsets + (arena.address + chunk_offset)).tolist()
            dsts, srcs = (host_addrs, engine_addrs) if to_host else (engine_addrs, host_addrs)
            # one memmove per page, driven from C (map) rather than a Python-level loop body
            deque(map(_memmove, dsts, srcs, repeat(chunk, len(dsts))), maxlen=0)


@dataclass(frozen=True, slots=True)
class _ArenaView:
    """A checked host arena: its tensor, base address and size in bytes."""

    tensor: torch.Tensor
    address: int
    nbytes: int

    @classmethod
    def of(cls, arena: torch.Tensor) -> _ArenaView:
        """Check that ``arena`` is a 1-D contiguous uint8 CPU tensor."""
        if not isinstance(arena, torch.Tensor):
            raise PageCopyError(f"arena must be a torch.Tensor, got {type(arena).__name__}")
        if arena.device.type != "cpu":
            raise PageCopyError(f"arena must be a CPU tensor, got device {arena.device}")
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise PageCopyError(
                "arena must be a 1-D contiguous uint8 tensor, got "
                f"{arena.dtype} of shape {tuple(arena.shape)}"
            )
        return cls(arena, arena.data_ptr(), arena.numel())

    def array(self) -> npt.NDArray[np.uint8]:
        """The arena as a numpy array sharing its memory."""
        return self.tensor.detach().numpy()


@dataclass(frozen=True, slots=True)
class _EngineView:
    """A checked engine buffer seen as bytes: ``[num_pages, row_bytes]`` at ``address``."""

    tensor: torch.Tensor
    address: int
    num_pages: int
    row_bytes: int

    @classmethod
    def of(cls, buf: torch.Tensor, name: str) -> _EngineView:
        """Check that ``buf`` is a contiguous CPU tensor with the page id as first dimension."""
        if not isinstance(buf, torch.Tensor):
            raise PageCopyError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.device.type != "cpu":
            raise PageCopyError(f"{name} must be a CPU tensor, got device {buf.device}")
        if buf.dim() < 1 or not buf.is_contiguous():
            raise PageCopyError(
                f"{name} must be contiguous with the page id as first dimension, got shape "
                f"{tuple(buf.shape)} and strides {buf.stride()}"
            )
        row_bytes = math.prod(buf.shape[1:]) * buf.element_size()
        return cls(buf, buf.data_ptr(), int(buf.shape[0]), row_bytes)

    def array(self) -> npt.NDArray[np.uint8]:
        """The buffer as a ``[num_pages, row_bytes]`` uint8 numpy array sharing its memory."""
        flat = self.tensor.detach().reshape(-1).view(torch.uint8)
        return flat.numpy().reshape(self.num_pages, self.row_bytes)


def _index_array(values: IndexArray, name: str) -> npt.NDArray[np.int64]:
    """Return a private 1-D int64 numpy copy of an index array, or raise naming ``name``."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise PageCopyError(f"{name} must be on the CPU, got device {values.device}")
        if values.dtype != torch.int64:
            raise PageCopyError(f"{name} must have dtype int64, got {values.dtype}")
        array = values.detach().numpy()
    elif isinstance(values, np.ndarray):
        if values.dtype != np.int64:
            raise PageCopyError(f"{name} must have dtype int64, got {values.dtype}")
        array = values
    else:
        raise PageCopyError(
            f"{name} must be a numpy array or a torch tensor, got {type(values).__name__}"
        )
    if array.ndim != 1:
        raise PageCopyError(f"{name} must be 1-D, got shape {array.shape}")
    return np.array(array, dtype=np.int64, copy=True)


def _positive_int(value: int, name: str) -> int:
    """Return ``value`` if it is a positive int, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise PageCopyError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_range(values: npt.NDArray[np.int64], name: str, upper: int) -> None:
    """Raise naming the first entry of ``values`` outside ``[0, upper]``."""
    bad = np.flatnonzero((values < 0) | (values > upper))
    if bad.size:
        i = int(bad[0])
        raise PageCopyError(f"{name}[{i}] = {int(values[i])} is out of range")


def _coalesce(
    pids: npt.NDArray[np.int64], offs: npt.NDArray[np.int64]
) -> tuple[int, tuple[tuple[int, int, int], ...], npt.NDArray[np.bool_]]:
    """Split pairs sorted by page id into strided runs and single pages.

    Two neighbours belong to one run when their page ids differ by one and their slots by the
    plan's stride: the most common slot distance between pages whose ids differ by one.

    Returns:
        ``(stride, runs, singles)``: runs as ``(first_page, first_offset, length)``, and a mask
        over the sorted pairs of those copied one at a time.
    """
    n = pids.size
    page_step = np.diff(pids) == 1
    slot_step = np.diff(offs)
    candidates = slot_step[page_step]
    if candidates.size == 0:
        return 0, (), np.ones(n, dtype=np.bool_)
    values, counts = np.unique(candidates, return_counts=True)
    stride = int(values[np.argmax(counts)])
    linked = page_step & (slot_step == stride)
    starts = np.flatnonzero(np.concatenate(([True], ~linked)))
    lengths = np.diff(np.append(starts, n))
    long_runs = lengths >= _MIN_STRIDED_RUN
    runs = tuple(
        zip(
            pids[starts[long_runs]].tolist(),
            offs[starts[long_runs]].tolist(),
            lengths[long_runs].tolist(),
        )
    )
    singles = ~np.repeat(long_runs, lengths)
    return stride, runs, singles


def _select_layers(
    engine_bufs: Sequence[Sequence[torch.Tensor]], layers: Sequence[int] | None
) -> tuple[list[tuple[int, Sequence[torch.Tensor]]], int]:
    """Pick ``(layer, buffers)`` pairs and the common component count, checking indices."""
    if len(engine_bufs) == 0:
        raise PageCopyError("engine_bufs is empty")
    n_components = len(engine_bufs[0])
    if n_components == 0:
        raise PageCopyError("engine_bufs[0] has no components")
    for layer, bufs in enumerate(engine_bufs):
        if len(bufs) != n_components:
            raise PageCopyError(
                f"engine_bufs[{layer}] has {len(bufs)} components, engine_bufs[0] has "
                f"{n_components}"
            )
    chosen = range(len(engine_bufs)) if layers is None else layers
    selected: list[tuple[int, Sequence[torch.Tensor]]] = []
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise PageCopyError(f"layers must hold ints, got {layer!r}")
        if not 0 <= layer < len(engine_bufs):
            raise PageCopyError(
                f"layer {layer} is out of range for engine_bufs with {len(engine_bufs)} layers"
            )
        selected.append((layer, engine_bufs[layer]))
    return selected, n_components


# -- one-shot functions: plan and copy in one call ----------------------------------------------


def copy_layer_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
) -> None:
    """Store one (layer, component) buffer: ``engine_buf[page_ids[i]]`` into slot ``i``.

    The chunk of slot ``i`` starts at ``slot_offsets[i] + chunk_offset``. For many layers of one
    transfer build a :class:`CopyPlan` once instead: this function plans on every call.

    Args:
        arena: The host arena, a 1-D contiguous uint8 CPU tensor.
        slot_offsets: Arena byte offsets of the slots, 1-D int64.
        engine_buf: A contiguous CPU tensor, first dimension the page id; its bytes per page are
            the chunk size.
        page_ids: Engine page ids, 1-D int64, same length as ``slot_offsets``, each at most once.
        chunk_offset: ``(l * n_components + c) * chunk_bytes`` for layer ``l``, component ``c``.

    Raises:
        PageCopyError: A bad argument (named in the message); nothing is written then. Slots
            must lie at least ``chunk_offset + chunk_bytes`` apart.
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset)
    plan.to_host(arena, engine_buf, chunk_offset)


def copy_layer_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
) -> None:
    """Load one (layer, component) buffer: slot ``i`` into ``engine_buf[page_ids[i]]``.

    Arguments and errors as for :func:`copy_layer_to_host`.
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset)
    plan.from_host(arena, engine_buf, chunk_offset)


def copy_layer_kv_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
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
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    layer: int,
    n_layers: int,
) -> None:
    """Load every component of one layer; arguments as for :func:`copy_layer_kv_to_host`."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers)
    plan.layer_from_host(arena, layer_bufs, layer)


def copy_layers_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
) -> None:
    """Store whole pages: every layer and component of ``engine_bufs[layer][component]``.

    Plans once and copies layer by layer. Slots must be a full host page apart at least.
    Errors as for :func:`copy_layer_to_host`; nothing is written when one is raised.
    """
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids)
    plan.layers_to_host(arena, engine_bufs)


def copy_layers_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
) -> None:
    """Load whole pages into every layer and component; see :func:`copy_layers_to_host`."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids)
    plan.layers_from_host(arena, engine_bufs)


def _plan_for_buffer(
    slot_offsets: IndexArray, engine_buf: torch.Tensor, page_ids: IndexArray, chunk_offset: int
) -> CopyPlan:
    """Plan a single-buffer copy: each slot owns ``chunk_offset + chunk_bytes`` bytes."""
    chunk = _EngineView.of(engine_buf, "engine_buf").row_bytes
    if isinstance(chunk_offset, bool) or not isinstance(chunk_offset, int) or chunk_offset < 0:
        raise PageCopyError(f"chunk_offset must be a non-negative int, got {chunk_offset!r}")
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=chunk_offset + chunk)


def _plan_for_layers(
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    n_layers: int,
) -> CopyPlan:
    """Plan a copy of one layer's components; each slot owns a full host page."""
    if len(layer_bufs) == 0:
        raise PageCopyError("layer_bufs is empty")
    n_layers = _positive_int(n_layers, "n_layers")
    chunk = _EngineView.of(layer_bufs[0], "layer_bufs[0]").row_bytes
    slot_bytes = n_layers * len(layer_bufs) * chunk
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=slot_bytes)


def _plan_for_engine(
    slot_offsets: IndexArray, engine_bufs: Sequence[Sequence[torch.Tensor]], page_ids: IndexArray
) -> CopyPlan:
    """Plan a copy of whole host pages for ``engine_bufs[layer][component]``."""
    if len(engine_bufs) == 0 or len(engine_bufs[0]) == 0:
        raise PageCopyError("engine_bufs must hold at least one layer with one component")
    chunk = _EngineView.of(engine_bufs[0][0], "engine_bufs[0][0]").row_bytes
    slot_bytes = len(engine_bufs) * len(engine_bufs[0]) * chunk
    return CopyPlan.build(page_ids, slot_offsets, chunk, slot_bytes=slot_bytes)
