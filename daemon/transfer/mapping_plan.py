"""Which bytes of an engine's segments the daemon maps: the spans its regions use, no more.

A segment handed over may declare far more bytes than its regions use: a sparse memfd of
terabytes costs the engine nothing, but mapping it whole costs the daemon that much of its
address space (and a prefault pass over it). :func:`plan_windows` turns the regions'
spans (checked against the segment sizes first) into the few mappings that cover them;
their bytes are what the per-user limit ``max_mapped_bytes_per_user`` counts.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

__all__ = ["MAP_GAP", "Window", "mapped_bytes", "plan_windows"]

MAP_GAP = 2 << 20
"""Runs of a segment closer than this share one mapping (fewer mappings; the gap counts)."""


@dataclass(frozen=True, slots=True)
class Window:
    """One mapping: bytes ``[start, end)`` of segment ``segment``."""

    segment: int
    start: int
    end: int

    def holds(self, segment: int, offset: int, span: int) -> bool:
        """Whether bytes ``[offset, offset + span)`` of ``segment`` lie inside."""
        return segment == self.segment and self.start <= offset and offset + span <= self.end


def plan_windows(
    sizes: list[int], spans: list[tuple[int, int, int]], grains: list[int] | None = None
) -> list[Window]:
    """The mappings that cover ``spans``, and nothing far from them.

    A sparse segment may declare terabytes it never uses: only the bytes the regions
    span are mapped, each run widened to whole pages of its segment (``grains``: a huge
    page for memory of huge pages, whose mappings start and end on one) and cut at the
    segment's end; runs closer than :data:`MAP_GAP` share one mapping.

    Args:
        sizes: each segment's declared size.
        spans: ``(segment, offset, bytes)`` of each region (checked to fit already).
        grains: each segment's page size (default: ``mmap.ALLOCATIONGRANULARITY`` for all).

    Returns:
        The windows, by segment then offset.
    """
    out: list[Window] = []
    for seg in sorted({s for s, _, _ in spans}):
        gran = mmap.ALLOCATIONGRANULARITY if grains is None else grains[seg]
        runs = sorted(
            (off - off % gran, min(sizes[seg], -(-(off + n) // gran) * gran))
            for s, off, n in spans
            if s == seg
        )
        start, end = runs[0]
        for lo, hi in runs[1:]:
            if lo <= end + MAP_GAP:
                end = max(end, hi)
            else:
                out.append(Window(seg, start, end))
                start, end = lo, hi
        out.append(Window(seg, start, end))
    return out


def mapped_bytes(windows: list[Window], grains: list[int] | None = None) -> int:
    """The bytes ``windows`` take mapped: each rounded up to whole pages of its segment
    (the kernel maps memory of huge pages a whole huge page at a time)."""
    total = 0
    for w in windows:
        gran = mmap.ALLOCATIONGRANULARITY if grains is None else grains[w.segment]
        total += -(-(w.end - w.start) // gran) * gran
    return total
