"""The ``file`` backend's index and slot allocator: which slot holds which page.

An in-memory dict (namespace, key) -> :class:`~.segments.Slot`, rebuilt at open from the
segments' header tables, and one :class:`SizeClass` per payload slot size: a free stack per
segment and an LRU of the stored objects. Eviction is LRU per size class, tail first: a put
batch (a prefix chain k0..kn) enters and touches the LRU in reverse order, so kn is evicted
before k0.

Pure bookkeeping: no I/O and no lock. The backend holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvtier.daemon.storage.file.segments import HEADER_STRIDE, Segment, Slot, table_bytes

__all__ = ["DROP_LOG", "STRIPES", "SizeClass", "SlotIndex", "runs"]

STRIPES = 2
"""Segments with free slots a size class grows to so that concurrent put batches write
different files; past that, a batch shares a segment another batch is writing rather than
create one (a fresh segment's first writes cost far more than rewrites)."""

DROP_LOG = 65536
"""Most dropped objects :attr:`SlotIndex.dropped` keeps until they are taken (KV events
announce them; a store that drops more between two batches loses the oldest)."""


@dataclass(eq=False, slots=True)
class SizeClass:
    """The slots of one payload slot size: free stacks, LRU, segments being written."""

    free: dict[Segment, list[Slot]] = field(default_factory=dict)  # per segment, top last
    lru: OrderedDict[Slot, None] = field(default_factory=OrderedDict)  # oldest first
    writers: dict[Segment, int] = field(default_factory=dict)  # put batches writing there

    def release(self, slot: Slot) -> None:
        """Give a slot back to its segment's free stack (reused first)."""
        self.free.setdefault(slot.seg, []).append(slot)

    def take(self, mine: Segment | None, shared: bool) -> Slot | None:
        """Pop a free slot: from ``mine`` (the batch's current segment) first, then from a
        segment no other batch writes to (two batches writing one file serialize on its
        inode lock); with ``shared``, from any segment. None if none. Only segments with
        free slots are kept, so a full store answers at once."""
        seg = (
            mine
            if mine is not None and mine in self.free
            else next((seg for seg in self.free if shared or not self.writers.get(seg)), None)
        )
        if seg is None:
            return None
        stack = self.free[seg]
        slot = stack.pop()
        if not stack:
            del self.free[seg]
        return slot

    def enter(self, seg: Segment) -> None:
        """Count one more put batch writing to ``seg``."""
        self.writers[seg] = self.writers.get(seg, 0) + 1

    def leave(self, seg: Segment) -> None:
        """Count one put batch fewer writing to ``seg``."""
        self.writers[seg] -= 1
        if not self.writers[seg]:
            del self.writers[seg]


def runs(items: list[tuple[int, Slot]]) -> list[list[tuple[int, Slot]]]:
    """Group (key index, slot) pairs into runs of adjacent header-table entries, in file order."""
    out: list[list[tuple[int, Slot]]] = []
    for item in sorted(items, key=lambda it: (it[1].seg.seq, it[1].hpos)):
        last, slot = out[-1][-1][1] if out else None, item[1]
        if last is not None and last.seg is slot.seg and last.hpos + HEADER_STRIDE == slot.hpos:
            out[-1].append(item)
        else:
            out.append([item])
    return out


class SlotIndex:
    """Pages to slots, free slots and capacity of one store.

    Args:
        capacity: most bytes of segment files.
        segment_bytes: most bytes of one segment file.

    Attributes:
        index: (namespace, key) -> slot, for objects stored or being written (``ready``
            tells which).
        classes: payload slot size -> its :class:`SizeClass`.
        allocated: bytes of segment files created or reserved.
        evictions: objects evicted to make room.
        dropped: ``(namespace, key)`` of the objects the store dropped on its own (evicted
            for room, detached as damaged) since :meth:`take_dropped` last took them; at
            most :data:`DROP_LOG`, the oldest go first.
    """

    __slots__ = (
        "_next_seq",
        "allocated",
        "capacity",
        "classes",
        "dropped",
        "evictions",
        "index",
        "max_segments",
        "segment_bytes",
        "segments",
    )

    def __init__(self, capacity: int, segment_bytes: int, max_segments: int | None = None) -> None:
        self.capacity = capacity
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments  # each keeps a descriptor open (None: no bound)
        self.index: dict[tuple[bytes, bytes], Slot] = {}
        self.classes: dict[int, SizeClass] = {}
        self.allocated = 0
        self.evictions = 0
        self.dropped: deque[tuple[bytes, bytes]] = deque(maxlen=DROP_LOG)
        self.segments: dict[Segment, list[Slot]] = {}  # every open segment's slots
        self._next_seq = 0

    def clear(self) -> None:
        """Forget every segment (after a failed open)."""
        self.index.clear()
        self.classes.clear()
        self.segments.clear()
        self.allocated = self._next_seq = 0

    def note_seq(self, seq: int) -> None:
        """A segment file numbered ``seq`` exists (not opened): new segments number past it."""
        self._next_seq = max(self._next_seq, seq + 1)

    def size_class(self, size: int) -> SizeClass:
        """The size class of payload slot ``size`` (created empty if new)."""
        return self.classes.setdefault(size, SizeClass())

    def add_segment(self, seg: Segment, slots: list[Slot], reserved: bool) -> None:
        """Enter an open segment's slots: named ones into the index and the LRU, the others
        onto the free stack (slot 0 handed out first). ``reserved``: its bytes were counted
        by :meth:`reserve_segment` already."""
        self._next_seq = max(self._next_seq, seg.seq + 1)
        self.allocated += 0 if reserved else seg.size
        self.segments[seg] = slots
        cls = self.size_class(seg.payload_slot)
        for slot in reversed(slots):
            if slot.ident is not None and slot.ident not in self.index:
                self.index[slot.ident] = slot
                cls.lru[slot] = None
            else:  # free, or a second copy of an object already indexed
                slot.ident, slot.ready = None, False
                cls.release(slot)

    def reserve_segment(self, slot: int) -> tuple[int, int] | None:
        """Reserve capacity for one more segment of payload slot ``slot``.

        Returns:
            ``(seq, slots)`` of the segment to create, or None when the capacity is spent
            or :attr:`max_segments` segments are open.
        """
        if self.max_segments is not None and len(self.segments) >= self.max_segments:
            return None

        def fit(room: int) -> int:  # most slots whose segment fits in room bytes
            n = max(0, room // (slot + HEADER_STRIDE))  # none when the store is over capacity
            while n and table_bytes(n) + n * slot > room:
                n -= 1
            return n

        slots = min(max(1, fit(self.segment_bytes)), fit(self.capacity - self.allocated))
        if slots <= 0:
            return None
        self.allocated += table_bytes(slots) + slots * slot
        self._next_seq += 1
        return self._next_seq - 1, slots

    def reclaim(self, size: int) -> Segment | None:
        """Give up a whole segment of another size class, so that payload slot ``size``
        (whose own class has nothing to evict) gets room: a segment with no object first,
        else the segment of the coldest object of the class holding the most bytes. Its
        objects are evicted (dropped), its slots forgotten (their generation bumped, so a
        read in flight frees nothing) and its bytes given back; the caller removes its file.
        A segment a batch is writing to is never chosen. None when no segment qualifies.
        """

        def idle(cls: SizeClass, seg: Segment) -> bool:
            return not cls.writers.get(seg) and not any(
                s.ident is not None and not s.ready for s in self.segments[seg]
            )

        others = [(c, cls) for c, cls in self.classes.items() if c != size]
        victim = next(
            (
                (cls, seg)
                for _, cls in others
                for seg, slots in cls.free.items()
                if len(slots) == seg.slots and idle(cls, seg)
            ),
            None,
        )
        if victim is None:
            held = {
                c: sum(seg.size for seg in self.segments if seg.payload_slot == c)
                for c, _ in others
            }
            for _, cls in sorted(others, key=lambda o: -held[o[0]]):
                coldest = next(iter(cls.lru), None)
                if coldest is not None and idle(cls, coldest.seg):
                    victim = (cls, coldest.seg)
                    break
        if victim is None:
            return None
        cls, seg = victim
        for s in self.segments.pop(seg):
            if s.ready:
                del self.index[s.ident]  # type: ignore[arg-type]
                del cls.lru[s]
                self.dropped.append(s.ident)  # type: ignore[arg-type]
                self.evictions += 1
            s.ident, s.ready = None, False
            s.gen += 1
        cls.free.pop(seg, None)
        self.allocated -= seg.size
        return seg

    def unreserve(self, slot: int, slots: int) -> None:
        """Give back a reservation whose segment could not be created."""
        self.allocated -= table_bytes(slots) + slots * slot

    def evict(self, cls: SizeClass, batch: set[tuple[bytes, bytes]]) -> Slot | None:
        """Free the coldest object of ``cls`` and return its slot; None when there is none,
        or when it belongs to ``batch`` (a batch never evicts its own keys)."""
        if not cls.lru or next(iter(cls.lru)).ident in batch:
            return None
        slot, _ = cls.lru.popitem(last=False)
        del self.index[slot.ident]  # type: ignore[arg-type]
        self.dropped.append(slot.ident)  # type: ignore[arg-type]
        self.evictions += 1
        return slot

    def take_dropped(self) -> list[tuple[bytes, bytes]]:
        """Return :attr:`dropped` and empty it."""
        out = list(self.dropped)
        self.dropped.clear()
        return out

    def detach(self, slots: list[Slot]) -> list[Slot]:
        """Take ready slots out of the index and the LRU; return those taken.

        They are not free yet: the backend zeroes their headers, then calls
        :meth:`release`, so that no writer claims a slot whose old header is being erased.
        """
        taken = []
        for slot in slots:
            if slot.ready:
                del self.index[slot.ident]  # type: ignore[arg-type]
                del self.classes[slot.seg.payload_slot].lru[slot]
                slot.ready = False
                taken.append(slot)
        return taken

    def take_free(self) -> list[Slot]:
        """Take every free slot off its free stack (to punch their payloads out of the
        segment files); give them back with :meth:`release`."""
        taken: list[Slot] = []
        for cls in self.classes.values():
            for slots in cls.free.values():
                taken += slots
            cls.free.clear()
        return taken

    def release(self, slots: list[Slot]) -> None:
        """Put detached (or never written) slots back on their free stacks."""
        for slot in slots:
            slot.ident = None
            self.classes[slot.seg.payload_slot].release(slot)
