"""What the host pool reports, and how it fails: page states, records, errors.

The pool (:class:`~kvtier.daemon.pool.host_pool.HostPool`) and its persistence
(:mod:`~kvtier.daemon.pool.meta`, :mod:`~kvtier.daemon.pool.adopt`) share these, so they
live apart from both: plain values and an error hierarchy, nothing that touches a slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from kvtier.config.errors import KvtierError

__all__ = [
    "MATCHED",
    "AdoptResult",
    "ClassStats",
    "EvictedPage",
    "HostPoolError",
    "HostPoolStats",
    "PageInfo",
    "PageState",
    "PageStateError",
    "ResidentPages",
]


class HostPoolError(KvtierError):
    """Misuse of the host pool: bad geometry, unknown class or slot id, bad key or id."""


class PageState(IntEnum):
    """State of one host page (slot), as stored in the state column."""

    FREE = 0
    WRITING = 1
    READY = 2


class PageStateError(HostPoolError):
    """A page state transition was asked of a page in the wrong state."""


class EvictedPage(NamedTuple):
    """One eviction, as :meth:`HostPool.drain_evicted` reports it.

    Attributes:
        key: the page key.
        ns_id: the page's namespace.
        slot: the slot it occupied (free now, maybe reused).
        in_l3: whether the page was marked as present in L3.
    """

    key: bytes
    ns_id: int
    slot: int
    in_l3: bool


@dataclass(frozen=True, slots=True)
class PageInfo:
    """What the pool records about one slot (admin views, tests).

    Attributes:
        slot: the slot id.
        state: its page state.
        key: the page key, None when FREE.
        ns_id / owner: namespace and tenant (stale when FREE).
        class_id / offset: class and arena offset, -1 when the extent is free.
        pins: pin count.
        parent: slot of the resident page this page extends, or -1.
        children: resident pages that extend this page.
        in_l3: whether the page is marked as present in L3.
        last_access: recency stamp (larger is more recent).
        evictable: READY with no pins and no resident children.
        checksum: the payload's xxh3-64 recorded at commit, None when none was (or the
            page is not READY); the same value an L3 object of the page records.
    """

    slot: int
    state: PageState
    key: bytes | None
    ns_id: int
    owner: int
    class_id: int
    offset: int
    pins: int
    parent: int
    children: int
    in_l3: bool
    last_access: int
    evictable: bool
    checksum: int | None = None


@dataclass(frozen=True, slots=True)
class ClassStats:
    """Counters of one page class.

    Attributes:
        class_id: id from :meth:`HostPool.register_class`.
        page_bytes: page size the class was registered with.
        stride: slot size (the slot headroom, if any, then ``page_bytes`` rounded up to the
            alignment).
        slots_per_extent: slots the class cuts from one extent.
        extents: extents the class holds.
        pages_ready: READY pages of the class.
        pages_writing: WRITING pages of the class.
    """

    class_id: int
    page_bytes: int
    stride: int
    slots_per_extent: int
    extents: int
    pages_ready: int
    pages_writing: int


@dataclass(frozen=True, slots=True)
class HostPoolStats:
    """A snapshot of the pool's counters.

    Attributes:
        capacity_bytes: the arena size the pool was built with.
        used_bytes: bytes of READY and WRITING slots (pages x stride).
        pages_ready / pages_writing: pages in each state.
        pages_pinned: pages with at least one pin.
        evictions: pages evicted since construction or adoption (flushes not counted).
        evicted_unlogged: evictions left out of the full eviction log.
        extents_free / extents_total: extents owned by no class / in the arena.
        classes: per-class counters, by class id.
        eviction_policy: the pool's eviction policy.
        evictions_by_reason: evictions by the list the victim came from (``lru``: "lru";
            ``arc``, ``reuse``: "t1", stored once, and "t2", used again).
        eviction_split: under ``arc`` and ``reuse`` (empty under ``lru``): ``t2_pages``,
            resident pages used again; ``arc``'s ``t1_target_ratio``, the share of the
            resident pages that pages stored once may hold before they are evicted first;
            ``reuse``'s ``lifetime_ratio``, how long a page used again keeps its place (in
            access-clock ticks) over the resident pages at the last eviction (absent after
            a restart until the first eviction); ``ghosts``, keys of recent evictions
            remembered.
    """

    capacity_bytes: int
    used_bytes: int
    pages_ready: int
    pages_writing: int
    pages_pinned: int
    evictions: int
    evicted_unlogged: int
    extents_free: int
    extents_total: int
    classes: tuple[ClassStats, ...]
    eviction_policy: str = "lru"
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    eviction_split: dict[str, float] = field(default_factory=dict)


MATCHED = "metadata matches the config"
""":attr:`AdoptResult.reason` of an adoption (what it dropped and why may follow, after
``"; "``)."""


@dataclass(frozen=True, slots=True)
class AdoptResult:
    """What a :class:`HostPool` built over metadata did with what it found
    (:attr:`HostPool.adopted`).

    Attributes:
        adopted: True when the pages were adopted, False when everything was discarded.
        reason: why it was discarded (one phrase), or that the metadata matched.
        pages_adopted: READY pages visible again.
        pages_dropped: pages found but not adopted (WRITING, failed checks); 0 on a discard.
        bytes_adopted: payload bytes of the adopted pages.
        seconds: time the adoption took (header, scan, verification, rebuild).
        generation: the pool's generation now (1 after a discard, +1 per adoption).
    """

    adopted: bool
    reason: str
    pages_adopted: int
    pages_dropped: int
    bytes_adopted: int
    seconds: float
    generation: int

    @property
    def summary(self) -> str:
        """One log line: what was adopted, or what was discarded and why."""
        if not self.adopted:
            return f"host pool started empty (generation 1): {self.reason}"
        note = "" if self.reason == MATCHED else f" ({self.reason.removeprefix(MATCHED + '; ')})"
        return (
            f"host pool adopted (generation {self.generation}): {self.pages_adopted} pages, "
            f"{self.bytes_adopted / 2**20:.1f} MiB, {self.pages_dropped} dropped{note}, "
            f"in {self.seconds * 1e3:.0f} ms"
        )


class ResidentPages:
    """The number of resident pages (READY and WRITING) of a page table, as ``len``.

    Args:
        maps: the ``ns_id -> key -> slot`` dicts whose entries count.
    """

    __slots__ = ("_maps",)

    def __init__(self, *maps: dict[int, dict[bytes, int]]) -> None:
        self._maps = maps

    def __len__(self) -> int:
        return sum(len(by_key) for m in self._maps for by_key in m.values())
