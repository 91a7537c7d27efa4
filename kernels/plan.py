"""The copy plan of one transfer: validated page/slot pairs, coalesced into strided runs.

Both copy back ends (:mod:`kvtier.kernels.page_copy` on the CPU, :mod:`kvtier.kernels.cuda_copy`
on a GPU) start from a :class:`PagePlan`. Layouts::

    engine: one buffer per (layer l, component c)      host arena: one flat uint8 array
    (c in {0: K, 1: V} for MHA; only c = 0 for MLA)

            ┌──────── chunk_bytes ────────┐           slot at slot_offset (page-major)
    page 0  │ [page_size, kv_heads, dim]  │           ┌──────┬──────┬──────┬──────┬─────┐
    page 1  │                             │           │ l0c0 │ l0c1 │ l1c0 │ l1c1 │ ... │
      ...   │                             │           └──────┴──────┴──────┴──────┴─────┘
            └─────────────────────────────┘           chunk_offset = (l * C + c) * chunk_bytes

A transfer moves ``n`` pages given as two index arrays of the same length: ``page_ids`` (engine
page ids) and ``slot_offsets`` (byte offsets of host slots in the arena). *Store* copies engine
pages into slots; *load* copies slots into engine pages.

Why a plan: the index arrays are the same for every layer and component of a transfer, so they
are checked and planned once (vectorised numpy, no Python loop per page) and reused for every
buffer. Planning sorts the pairs by page id and coalesces them into *runs*: pages ``p, p+1, ...``
whose slots are ``o, o+stride, ...``, which a back end can move as one strided copy.

Input checks (dtypes, lengths, duplicates, overlapping slots, bounds) all run before the first
byte moves, so a copy that raises writes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypeAlias

import numpy as np
import numpy.typing as npt
from kvtier.config.errors import KvtierError

if TYPE_CHECKING:
    import torch

__all__ = [
    "IndexArray",
    "PageCopyError",
    "PagePlan",
    "positive_int",
    "select_layers",
]

IndexArray: TypeAlias = "npt.NDArray[np.int64] | torch.Tensor"
"""A 1-D int64 index array: a numpy array or a CPU torch tensor (recognised only when torch is
imported already: this module never imports it)."""

MIN_STRIDED_RUN = 3
"""Runs at least this long are copied as one strided copy rather than one copy per page: on the
CPU, building the two views costs about as much as two or three ctypes calls."""

_MAX_INDEX = 1 << 62
"""Ids and offsets above this are rejected so that byte arithmetic on them cannot overflow int64."""


class PageCopyError(KvtierError, ValueError):
    """A page copy was asked with bad arguments; the message names the argument and the value.

    Raised before any byte is written.
    """


@dataclass(frozen=True, slots=True, eq=False)
class PagePlan:
    """The page copies of one transfer, validated and coalesced once, reused for every layer.

    Build it with :meth:`build`; a back end then checks each (layer, component) copy with
    :meth:`check_copy` and moves the bytes. A plan is immutable and may be used from several
    threads at once (on disjoint buffers).

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
    ) -> Self:
        """Validate a transfer's index arrays and plan its copies.

        Args:
            page_ids: Engine page ids, 1-D int64 (numpy array or CPU tensor); each at most once.
            slot_offsets: Arena byte offsets of the host slots, 1-D int64, same length.
            chunk_bytes: Bytes of one page of one (layer, component) buffer.
            slot_bytes: Bytes each slot owns (``n_layers * n_components * chunk_bytes`` for a full
                host page); defaults to ``chunk_bytes``. Slots closer than this are rejected.

        Returns:
            The plan (an instance of ``cls``). Bounds against a particular engine buffer and
            arena are checked per copy.

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
        chunk = positive_int(chunk_bytes, "chunk_bytes")
        extent = chunk if slot_bytes is None else positive_int(slot_bytes, "slot_bytes")
        if extent < chunk:
            raise PageCopyError(f"slot_bytes = {extent} is smaller than chunk_bytes = {chunk}")
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
        self.check_part(
            arena_nbytes=arena_nbytes,
            num_pages=num_pages,
            part_offset=chunk_offset,
            part_bytes=self.chunk_bytes,
            name=name,
        )

    def check_part(
        self,
        *,
        arena_nbytes: int,
        num_pages: int,
        part_offset: int,
        part_bytes: int,
        name: str,
        offset_name: str = "chunk_offset",
    ) -> None:
        """Check that ``part_bytes`` at ``part_offset`` of every slot and every page fit.

        The bounds half of :meth:`check_copy`, for a part of a page of any size (a region of
        :mod:`kvtier.kernels.cuda_segments` whose page bytes differ from ``chunk_bytes``).

        Args:
            arena_nbytes: Size of the host arena in bytes.
            num_pages: Pages on the engine side.
            part_offset: Where the part sits inside each slot.
            part_bytes: Bytes of the part.
            name: How the engine side is named in error messages.
            offset_name: How ``part_offset`` is named in error messages.

        Raises:
            PageCopyError: The part does not fit in a slot; a page id or slot is out of bounds.
        """
        if isinstance(part_offset, bool) or not isinstance(part_offset, int):
            raise PageCopyError(f"{offset_name} must be an int, got {part_offset!r}")
        if part_offset < 0 or part_offset + part_bytes > self.slot_bytes:
            raise PageCopyError(
                f"{offset_name} = {part_offset} puts a {part_bytes}-byte chunk outside a "
                f"{self.slot_bytes}-byte slot"
            )
        if self.max_page_id >= num_pages:
            i = int(np.flatnonzero(self.page_ids >= num_pages)[0])
            raise PageCopyError(
                f"page_ids[{i}] = {int(self.page_ids[i])} is out of range for {name} with "
                f"{num_pages} pages"
            )
        limit = arena_nbytes - part_offset - part_bytes
        if self.max_slot_offset > limit:
            i = int(np.flatnonzero(self.slot_offsets > limit)[0])
            raise PageCopyError(
                f"slot_offsets[{i}] = {int(self.slot_offsets[i])} puts {offset_name} "
                f"{part_offset} + {part_bytes} bytes past the end of a {arena_nbytes}-byte "
                "arena"
            )


def positive_int(value: int, name: str) -> int:
    """Return ``value`` as an int if it is a positive int.

    Args:
        value: The value to check (a Python or numpy integer; not a bool).
        name: How the argument is named in the error message.

    Returns:
        ``int(value)``.

    Raises:
        PageCopyError: ``value`` is not a positive int.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise PageCopyError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def select_layers(
    engine_bufs: Sequence[Sequence[Any]], layers: Sequence[int] | None
) -> tuple[list[tuple[int, Sequence[Any]]], int]:
    """Pick the layers of a multi-layer copy and check their indices and component counts.

    Args:
        engine_bufs: Every buffer of the engine, indexed ``[layer][component]``.
        layers: The layers to copy, in this order; ``None`` selects them all.

    Returns:
        ``(selected, n_components)``: ``(layer, buffers)`` pairs in copy order, and the
        component count every layer shares.

    Raises:
        PageCopyError: No layers or components; layers with different component counts; a
            layer index that is not an int or out of range.
    """
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
    selected: list[tuple[int, Sequence[Any]]] = []
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise PageCopyError(f"layers must hold ints, got {layer!r}")
        if not 0 <= layer < len(engine_bufs):
            raise PageCopyError(
                f"layer {layer} is out of range for engine_bufs with {len(engine_bufs)} layers"
            )
        selected.append((layer, engine_bufs[layer]))
    return selected, n_components


def _index_array(values: IndexArray, name: str) -> npt.NDArray[np.int64]:
    """Return a private 1-D int64 numpy copy of an index array, or raise naming ``name``."""
    torch = sys.modules.get("torch")  # a tensor exists only if torch is imported already
    if torch is not None and isinstance(values, torch.Tensor):
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
    long_runs = lengths >= MIN_STRIDED_RUN
    runs = tuple(
        zip(
            pids[starts[long_runs]].tolist(),
            offs[starts[long_runs]].tolist(),
            lengths[long_runs].tolist(),
        )
    )
    singles = ~np.repeat(long_runs, lengths)
    return stride, runs, singles
