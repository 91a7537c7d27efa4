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

Offsets are int64 throughout; nothing is narrowed to 32 bits (pools and engine allocations
exceed 4 GiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from kvtier.kernels.plan import PageCopyError, PagePlan

__all__ = ["EngineRegion", "Segments", "default_part_offsets", "plan_segments"]

_MAX_EXTENT = 1 << 62
"""Offsets and extents above this are refused, so that no sum of two of them overflows int64."""


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
