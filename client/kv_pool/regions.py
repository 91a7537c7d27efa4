"""Engine memory described for REGISTER when it is not a :class:`~kvtier.client.kv_pool.shared.SharedKVPool`.

An engine adapter (vLLM, SGLang) owns its KV memory and lays it out its own way. It tells
the daemon where each page lies with :class:`~kvtier.ipc.protocol.MemoryRegion` entries and
hands over the descriptors that hold it; :class:`RegionMemory` carries both, in the shape
:class:`~kvtier.client.connection.connection.Connection` takes as its ``pool``. A process that holds
no KV memory but wants LOOKUP answers (vLLM's scheduler) registers :class:`ControlOnly`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.ipc.protocol import Geometry, KVMemory, MemoryRegion, MemorySegment

__all__ = ["ControlOnly", "RegionMemory"]


class RegionMemory:
    """An engine's KV memory: descriptors, and where each page's bytes lie in them.

    The daemon maps a descriptor sealed against shrinking (``F_SEAL_SHRINK``) and copies
    an unsealed memfd's pages with ``pread``/``pwrite`` (slower, but safe for it).

    Args:
        geometry: the page geometry; ``geometry.layout`` should name the engine's layout
            (it enters the namespace).
        num_pages: pages each region holds.
        fds: the descriptors (not closed here: they stay the caller's).
        sizes: each descriptor's size in bytes, as ``fstat`` reports it.
        regions: where pages lie; their ``page_bytes`` add up to ``geometry.page_bytes``.
        labels: names for the daemon's log, one per descriptor (default ``engine-<i>``).

    Raises:
        ValueError: the counts disagree or the regions do not add up to a page.
    """

    def __init__(
        self,
        geometry: Geometry,
        num_pages: int,
        fds: Sequence[int],
        sizes: Sequence[int],
        regions: Sequence[MemoryRegion],
        labels: Sequence[str] | None = None,
    ) -> None:
        geometry.validate()
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages!r}")
        if len(fds) != len(sizes) or not fds:
            raise ValueError(f"{len(fds)} descriptors but {len(sizes)} sizes")
        total = sum(r.page_bytes for r in regions)
        if total != geometry.page_bytes:
            raise ValueError(
                f"the regions hold {total} bytes per page; the geometry's pages are "
                f"{geometry.page_bytes} bytes"
            )
        self.geometry = geometry
        self.num_pages = num_pages
        self._fds = list(fds)
        names = list(labels) if labels is not None else [f"engine-{i}" for i in range(len(fds))]
        self._segments = [MemorySegment(name=n, size=s) for n, s in zip(names, sizes, strict=True)]
        self.regions = list(regions)

    def memory_fds(self) -> list[int]:
        """The descriptors to hand over, in segment order."""
        return list(self._fds)

    def export(self) -> KVMemory:
        """Describe the memory for REGISTER."""
        return KVMemory(
            kind="fd",
            num_pages=self.num_pages,
            segments=list(self._segments),
            regions=list(self.regions),
        )


class ControlOnly:
    """No memory: a session that may only LOOKUP (``memory.kind = "none"``).

    It joins no TP rank group, so its LOOKUP is answered at once from its own rank's
    namespace (the ``tp_rank`` it registers as; keys from its own
    :meth:`~kvtier.client.connection.connection.Connection.page_keys`): what a scheduler needs before
    it decides how much of a request to load. For a TP engine with MHA, register one per
    rank and take the minimum of their answers.

    Args:
        geometry: the engine's page geometry (as its workers register it).
    """

    def __init__(self, geometry: Geometry) -> None:
        geometry.validate()
        self.geometry = geometry
        self.num_pages = 0

    def memory_fds(self) -> list[int]:
        """No descriptors."""
        return []

    def export(self) -> KVMemory:
        """Describe the (absent) memory for REGISTER."""
        return KVMemory(kind="none", num_pages=1, segments=[])
