"""The byte segments of a page transfer: what each ``cudaMemcpyAsync`` of a GPU copy moves.

A GPU transfer by DMA issues one copy per contiguous byte range, so planning it means turning
page ids, host slots and the engine's memory layout into ``(src, dst, nbytes)`` triples and
merging those that continue one another. This module does that arithmetic and nothing else:
it is pure numpy (no torch, no CuPy, no GPU), so it is tested exactly on any machine.

Engine side: *regions*, as an engine describes its KV memory at REGISTER
(:class:`~kvtier.ipc.geometry.MemoryRegion`). Page ``p`` of a region is ``page_bytes``
contiguous bytes at ``offset + p * page_stride``; ``page_stride > page_bytes`` describes strided
layouts (vLLM's HND / FlashInfer caches with K and V of a block side by side, SGLang's
page_first pools with every layer of a page together)::

    engine memory (a region with page_stride = 2 * page_bytes, two regions interleaved)
    ┌──────┬──────┬──────┬──────┬──────┬──────┐
    │ K p0 │ V p0 │ K p1 │ V p1 │ K p2 │ V p2 │ ...      region K: offset 0, stride 2b, bytes b
    └──────┴──────┴──────┴──────┴──────┴──────┘          region V: offset b, stride 2b, bytes b

    host arena: slot i at slot_offsets[i]; region r's part at part_offsets[r] inside it
    ┌────────────── slot ──────────────┐
    │ part 0 (K) │ part 1 (V) │ ...    │                  default part offsets: the regions'
    └──────────────────────────────────┘                  page bytes, concatenated in order

Host side: the slots of a :class:`~kvtier.kernels.plan.PagePlan` (its index checks: dtypes,
lengths, duplicate pages, overlapping slots) and each region's part offset inside a slot.

Segments are merged when they continue one another on *both* sides: consecutive engine pages
of a contiguous region whose slots are consecutive too, or the K and V parts of one page that
lie side by side in engine memory and in the slot. Every destination byte is written at most
once: the plan refuses a transfer whose destinations overlap, naming the regions and pages.

:func:`plan_rows` then groups segments that repeat at a fixed distance on both sides into 2-D
copies (``cudaMemcpy2DAsync``): one layer's part of consecutive pages going to consecutive slots
lies a whole slot apart in the host arena, so it cannot merge into one 1-D copy, but it is one
2-D copy instead of one call per page.

Offsets are int64 throughout; nothing is narrowed to 32 bits (pools and engine allocations
exceed 4 GiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from kvtier.kernels.plan import PageCopyError, PagePlan

__all__ = ["EngineRegion", "Rows", "Segments", "default_part_offsets", "plan_rows", "plan_segments"]

_MAX_EXTENT = 1 << 62
"""Offsets and extents above this are refused, so that no sum of two of them overflows int64."""

MAX_PITCH = (1 << 31) - 1
"""The largest pitch a 2-D copy is given (``cudaDevAttrMaxPitch`` is at least this on current
GPUs); copies further apart stay 1-D."""


@dataclass(frozen=True, slots=True)
class EngineRegion:
    """Where one part of every page lies on the engine side.

    Attributes:
        offset: Byte offset of page 0 from the engine base the segments are applied to (a
            segment's start, or 0 when offsets are absolute addresses).
        page_stride: Bytes from one page of the region to the next (at least ``page_bytes``).
        page_bytes: Bytes of one page of the region (contiguous).
        num_pages: Pages the region holds; page ids must be below it.
    """

    offset: int
    page_stride: int
    page_bytes: int
    num_pages: int

    def check(self, name: str) -> None:
        """Raise :class:`PageCopyError` naming the first field of ``name`` that is out of range."""
        for field in ("offset", "page_stride", "page_bytes", "num_pages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise PageCopyError(f"{name}.{field} must be an int, got {value!r}")
            low = 0 if field == "offset" else 1
            if not low <= value <= _MAX_EXTENT:
                raise PageCopyError(f"{name}.{field} = {value} is out of range")
        if self.page_stride < self.page_bytes:
            raise PageCopyError(
                f"{name}.page_stride = {self.page_stride} is smaller than its page_bytes = "
                f"{self.page_bytes}: its pages overlap"
            )
        end = self.offset + (self.num_pages - 1) * self.page_stride + self.page_bytes
        if end > _MAX_EXTENT:
            raise PageCopyError(f"{name} ends at byte {end}, out of range")


@dataclass(frozen=True, slots=True, eq=False)
class Segments:
    """The contiguous copies of one transfer step, merged, in ascending source order.

    Attributes:
        src: Source byte offsets, int64 (engine offsets for a store, arena offsets for a load).
        dst: Destination byte offsets, int64, aligned with ``src``.
        nbytes: Bytes of each copy, int64, > 0.
        to_host: True for a store (engine → arena), False for a load (arena → engine).
    """

    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.int64]
    to_host: bool

    def __len__(self) -> int:
        """Number of copies."""
        return int(self.nbytes.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the copies move."""
        return int(self.nbytes.sum())

    def addresses(
        self, *, engine_base: int, host_base: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The copies' absolute ``(src, dst)`` addresses, given where both sides start.

        Args:
            engine_base: Address the engine regions' offsets are relative to.
            host_base: Address of the arena's first byte.

        Raises:
            PageCopyError: A base is negative, or an address would not fit in int64.
        """
        src_base, dst_base = (engine_base, host_base) if self.to_host else (host_base, engine_base)
        return _shifted(self.src, src_base, "src"), _shifted(self.dst, dst_base, "dst")


@dataclass(frozen=True, slots=True, eq=False)
class Rows:
    """Copies grouped into 2-D copies: ``height`` rows of ``width`` bytes, a pitch apart.

    Row ``k`` of copy ``i`` moves ``width[i]`` bytes from ``src[i] + k * src_pitch[i]`` to
    ``dst[i] + k * dst_pitch[i]``; a copy of height 1 is a plain 1-D copy (its pitches equal
    its width). All arrays int64, aligned.

    Attributes:
        src: Source offset of each copy's first row.
        dst: Destination offset of each copy's first row.
        width: Bytes per row.
        height: Rows.
        src_pitch: Bytes between rows at the source (at least ``width``).
        dst_pitch: Bytes between rows at the destination (at least ``width``).
        to_host: True for a store, False for a load.
    """

    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    width: npt.NDArray[np.int64]
    height: npt.NDArray[np.int64]
    src_pitch: npt.NDArray[np.int64]
    dst_pitch: npt.NDArray[np.int64]
    to_host: bool

    def __len__(self) -> int:
        """Number of copies (1-D and 2-D)."""
        return int(self.width.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the copies move."""
        return int((self.width * self.height).sum())

    def addresses(
        self, *, engine_base: int, host_base: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The copies' absolute ``(src, dst)`` first-row addresses; as :meth:`Segments.addresses`.

        The last row of a copy lies ``(height - 1) * pitch`` past its first; those addresses
        are within the sides' extents, which the planner checked.
        """
        src_base, dst_base = (engine_base, host_base) if self.to_host else (host_base, engine_base)
        return _shifted(self.src, src_base, "src"), _shifted(self.dst, dst_base, "dst")


def plan_rows(segments: Segments) -> Rows:
    """Group copies that repeat at a fixed distance on both sides into 2-D copies.

    Neighbours in engine order (ascending engine offset) of equal size whose sources and
    destinations step by the same two distances form one 2-D copy: consecutive pages of a
    region into consecutive slots, when each slot holds every layer (one copy per page per
    buffer otherwise). Only steps seen for at least two consecutive pairs start a 2-D copy (three
    copies or more), so where two such runs touch, the later one gives up its first copy and
    still has two: no run is cut to nothing, which keeps the grouping one vectorised pass.

    Args:
        segments: Merged copies from :func:`plan_segments`.

    Returns:
        The same bytes as 2-D copies where they repeat and 1-D copies (height 1) elsewhere, in
        ascending order of their first engine byte.
    """
    # in engine order: there one buffer's pages follow one another; on the host, the parts of
    # a page (K, V, other layers) interleave
    order = np.argsort(segments.src if segments.to_host else segments.dst, kind="stable")
    src, dst, n = segments.src[order], segments.dst[order], segments.nbytes[order]
    m = int(n.size)
    if m < 3:
        return Rows(src, dst, n, np.ones(m, np.int64), n, n, segments.to_host)
    # pair i joins copies i and i + 1; it can be a step of a 2-D copy when both are one size
    # and both sides step forward by at least that size
    ds, dd = np.diff(src), np.diff(dst)
    ok = (n[1:] == n[:-1]) & (ds >= n[:-1]) & (dd >= n[:-1]) & (ds <= MAX_PITCH) & (dd <= MAX_PITCH)
    same = np.zeros(ok.size, dtype=np.bool_)  # pair i continues pair i - 1's steps
    same[1:] = ok[1:] & ok[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
    is_start = ok & ~same
    run_of_pair = np.cumsum(is_start) - 1
    starts = np.flatnonzero(is_start)
    lengths = np.bincount(run_of_pair[ok], minlength=starts.size)  # pairs per run
    keep = lengths >= 2
    first, last = starts[keep], starts[keep] + lengths[keep] - 1
    in_run = _cover(first, last, ok.size)
    # a run whose first copy ends the run before it gives that copy up (it keeps >= 2 copies)
    first = first + ((first > 0) & in_run[np.maximum(first - 1, 0)])
    single = ~_cover(first, last + 1, m)
    pick = np.concatenate((first, np.flatnonzero(single)))
    order = np.argsort((src if segments.to_host else dst)[pick], kind="stable")
    n_single = int(single.sum())
    rows = Rows(
        src=src[pick][order],
        dst=dst[pick][order],
        width=n[pick][order],
        height=np.concatenate((last - first + 2, np.ones(n_single, np.int64)))[order],
        src_pitch=np.concatenate((ds[first], n[single]))[order],
        dst_pitch=np.concatenate((dd[first], n[single]))[order],
        to_host=segments.to_host,
    )
    return rows


def _cover(
    first: npt.NDArray[np.int64], last: npt.NDArray[np.int64], size: int
) -> npt.NDArray[np.bool_]:
    """A mask of ``size`` entries, True on every ``[first[j], last[j]]`` (inclusive)."""
    marks = np.zeros(size + 1, dtype=np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, last + 1, -1)
    return np.cumsum(marks[:size]) > 0


def default_part_offsets(regions: Sequence[EngineRegion]) -> list[int]:
    """Each region's offset inside a slot when a slot holds every region's page bytes in order."""
    offsets, at = [], 0
    for region in regions:
        offsets.append(at)
        at += int(region.page_bytes)
    return offsets


def plan_segments(
    plan: PagePlan,
    regions: Sequence[EngineRegion],
    part_offsets: Sequence[int] | None = None,
    *,
    arena_nbytes: int,
    to_host: bool,
    names: Sequence[str] | None = None,
) -> Segments:
    """Turn a transfer's pages and slots into merged ``(src, dst, nbytes)`` copies.

    Page ``plan.page_ids[i]`` of every region ``r`` goes to (store) or comes from (load) the
    arena bytes ``[slot_offsets[i] + part_offsets[r], ... + regions[r].page_bytes)``.

    Args:
        plan: The checked page ids and slot offsets (its ``slot_bytes`` bounds every part).
        regions: The engine regions the step copies (e.g. one layer's K and V).
        part_offsets: Each region's byte offset inside a slot; defaults to
            :func:`default_part_offsets` (the regions' page bytes, concatenated).
        arena_nbytes: Size of the host arena; every slot part must lie inside it.
        to_host: True for a store, False for a load.
        names: How each region is named in error messages (default ``regions[r]``).

    Returns:
        The merged copies, ascending by source offset.

    Raises:
        PageCopyError: A region field out of range; a part outside a slot; a page id beyond a
            region's pages; a slot past the end of the arena; two copies that would write the
            same destination byte. Each names the field and the value.
    """
    n_regions = len(regions)
    labels = list(names) if names is not None else [f"regions[{r}]" for r in range(n_regions)]
    parts = list(part_offsets) if part_offsets is not None else default_part_offsets(regions)
    if len(labels) != n_regions or len(parts) != n_regions:
        raise PageCopyError(
            f"{n_regions} regions but {len(parts)} part_offsets and {len(labels)} names"
        )
    for r, region in enumerate(regions):
        if not isinstance(region, EngineRegion):
            raise PageCopyError(f"{labels[r]} must be an EngineRegion, got {type(region).__name__}")
        region.check(labels[r])
        plan.check_part(
            arena_nbytes=arena_nbytes,
            num_pages=int(region.num_pages),
            part_offset=parts[r],
            part_bytes=int(region.page_bytes),
            name=labels[r],
            offset_name=f"part_offsets[{r}]",
        )
    empty = np.empty(0, dtype=np.int64)
    if len(plan) == 0 or n_regions == 0:
        return Segments(empty, empty.copy(), empty.copy(), to_host)

    offset = np.array([int(g.offset) for g in regions], dtype=np.int64)[:, None]
    stride = np.array([int(g.page_stride) for g in regions], dtype=np.int64)[:, None]
    size = np.array([int(g.page_bytes) for g in regions], dtype=np.int64)[:, None]
    part = np.array(parts, dtype=np.int64)[:, None]
    engine = (offset + plan.page_ids[None, :] * stride).ravel()
    host = (plan.slot_offsets[None, :] + part).ravel()
    nbytes = np.broadcast_to(size, (n_regions, len(plan))).ravel()
    src, dst = (engine, host) if to_host else (host, engine)
    _check_destinations(dst, nbytes, plan, labels, to_host)
    order = np.lexsort((dst, src))
    return _merged(src[order], dst[order], nbytes[order], to_host)


def _check_destinations(
    dst: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    plan: PagePlan,
    labels: Sequence[str],
    to_host: bool,
) -> None:
    """Raise naming two copies whose destination bytes overlap."""
    order = np.argsort(dst, kind="stable")
    starts, sizes = dst[order], nbytes[order]
    clash = np.flatnonzero(starts[1:] < starts[:-1] + sizes[:-1])
    if not clash.size:
        return
    a, b = (int(order[k]) for k in (clash[0], clash[0] + 1))
    n = len(plan)
    side = "arena" if to_host else "engine"
    first, second = (f"{labels[k // n]} page {int(plan.page_ids[k % n])}" for k in (a, b))
    raise PageCopyError(
        f"{first} and {second} write the same {side} bytes at offset {int(dst[b])}: "
        "the regions overlap"
    )


def _merged(
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    to_host: bool,
) -> Segments:
    """Merge neighbours (in the given order) that continue one another on both sides."""
    ends_src, ends_dst = src[:-1] + nbytes[:-1], dst[:-1] + nbytes[:-1]
    breaks = (src[1:] != ends_src) | (dst[1:] != ends_dst)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    merged = np.add.reduceat(nbytes, starts)
    src_out, dst_out = src[starts], dst[starts]
    for array in (src_out, dst_out, merged):
        array.flags.writeable = False
    return Segments(src_out, dst_out, merged.astype(np.int64, copy=False), to_host)


def _shifted(offsets: npt.NDArray[np.int64], base: int, name: str) -> npt.NDArray[np.int64]:
    """``offsets + base`` as int64, refusing a negative base or a sum past int64."""
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise PageCopyError(f"{name} base must be a non-negative int, got {base!r}")
    if offsets.size and base > np.iinfo(np.int64).max - int(offsets.max()):
        raise PageCopyError(f"{name} base {base:#x} puts an address past int64")
    return offsets + np.int64(base)
