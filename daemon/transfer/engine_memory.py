"""Map an engine's KV memory into the daemon from the descriptors it handed over (CPU).

The daemon never opens or removes an engine's memory by name: the engine passes its
descriptors on the handover socket (:mod:`kvtier.ipc.fdpass`) and REGISTER declares what
they hold (``memory.kind = "fd"``) and where each page lies (``memory.regions``, or the
per-buffer form of kvtier's own ``layer_first`` layout). Each descriptor is checked first:

- a regular file or memfd (``fstat``), opened read-write, exactly the declared size;
- sealed against shrinking (``F_GET_SEALS`` has ``F_SEAL_SHRINK``): then it is **mapped**
  (``MAP_SHARED``) and pages are copied with memory copies;
- not sealed, but a memfd or tmpfs file (``fstatfs``): then it is **never mapped** (a file
  that shrank under a mapping would make the next copy a SIGBUS, ending the daemon); its
  pages are copied with ``pread``/``pwrite`` on the descriptor, so an engine that truncates
  it only fails its own transfers. SGLang's ``shm`` host pool is such a memfd (created
  without ``MFD_ALLOW_SEALING``). Other unsealed files are refused: I/O on a network or
  FUSE file could block a copy thread for good.

Only the spans the regions use are mapped (:mod:`~kvtier.daemon.transfer.mapping_plan`):
a segment may declare far more than it holds (a sparse memfd costs its maker nothing),
and the bytes and mappings planned are offered to the caller's ``admit`` (the per-user
limits) before any mapping is made.

Once the session is open, :meth:`EngineMemory.start_prefault` builds the daemon's page tables
over the mapped segments on a thread (:mod:`kvtier.daemon.transfer.prefault`), so the first
copy into an engine page takes no page fault.

A refused descriptor or region is a :class:`EngineMemoryError` naming the field and the
reason. The caller closes the handed-over descriptors afterwards (unmapped ones are
duplicated and kept until :meth:`EngineMemory.close`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt
from kvtier.config.errors import KvtierError
from kvtier.daemon.transfer.mapping_plan import Window, mapped_bytes, plan_windows
from kvtier.daemon.transfer.prefault import Prefaulter, PrefaultQueue, drop_page_tables
from kvtier.ipc.limits import MAX_PAGES
from kvtier.ipc.protocol import Geometry, KVMemory, MemoryRegion
from kvtier.ipc.shm import SharedMemoryError, SharedMemorySegment
from kvtier.kernels import guarded_copy
from kvtier.kernels.host_views import EngineView, HostBuffer

NAMES_REFUSED = (
    "memory.kind = 'shm' (a file name) is not accepted: hand the memory over by "
    "descriptor (memory.kind = 'fd', see docs/protocol.md, 'Memory handover')"
)
"""The refusal of an export by file name."""


class EngineMemoryError(KvtierError):
    """The exported memory does not match the geometry or its descriptors are unsafe."""


def check_buffers(geometry: Geometry, memory: KVMemory, error: type[KvtierError]) -> None:
    """Check that ``memory`` declares a page count in range and one buffer per (layer,
    component) of ``geometry``, in at least one and at most that many segments (a decoded
    request has its fields in range already; an export built in-process is checked too).

    Raises:
        error: naming the field or the counts that disagree.
    """
    g = geometry
    if memory.regions:
        raise error(
            "memory.regions: this copy path needs the per-buffer form "
            "(buffer_segments / buffer_offsets)"
        )
    if not 1 <= memory.num_pages <= MAX_PAGES:
        raise error(f"memory.num_pages = {memory.num_pages!r} is out of range")
    n_buf = g.num_layers * g.components
    if len(memory.buffer_offsets) != n_buf or len(memory.buffer_segments) != n_buf:
        raise error(
            f"memory declares {len(memory.buffer_offsets)} buffers; geometry needs "
            f"{n_buf} ({g.num_layers} layers x {g.components} components)"
        )
    if not 1 <= len(memory.segments) <= n_buf:
        raise error(f"memory.segments has {len(memory.segments)} entries")


TMPFS_MAGIC = 0x01021994
"""``statfs.f_type`` of tmpfs and memfds."""
HUGETLBFS_MAGIC = 0x958458F6
"""``statfs.f_type`` of hugetlbfs (``MFD_HUGETLB`` memfds)."""
_libc = ctypes.CDLL(None, use_errno=True)


def fs_type(fd: int) -> int:
    """``fstatfs(fd).f_type``: the kind of file system ``fd`` is on.

    Raises:
        OSError: ``fstatfs`` failed.
    """
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86-64 / arm64
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF


def check_descriptor(fd: int, size: int, what: str) -> bool:
    """Check that ``fd`` is safe to use as ``size`` bytes of engine memory.

    Args:
        fd: a descriptor the engine handed over.
        size: the bytes the export declares for it.
        what: names it in the error (``memory.segments[0]``).

    Returns:
        True when it may be mapped (sealed against shrinking); False when it must be
        copied with positional I/O only (an unsealed memfd or tmpfs file).

    Raises:
        EngineMemoryError: not a regular file / memfd, not read-write, another size, or
            neither sealed against shrinking nor on tmpfs.
    """
    try:
        st = os.fstat(fd)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as err:
        raise EngineMemoryError(f"{what}: the descriptor cannot be examined: {err}") from err
    if not stat.S_ISREG(st.st_mode):
        raise EngineMemoryError(f"{what}: the descriptor is not a memfd or regular file")
    if mode != os.O_RDWR:
        raise EngineMemoryError(f"{what}: the descriptor is not open read-write")
    if st.st_size != size:
        raise EngineMemoryError(
            f"{what}: the descriptor has {st.st_size} bytes, the export declares {size}"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file system without seals
        seals = 0
    if seals & fcntl.F_SEAL_SHRINK:
        return True
    try:
        kind = fs_type(fd)
    except OSError as err:
        raise EngineMemoryError(
            f"{what}: the descriptor's file system cannot be examined: {err}"
        ) from err
    if kind not in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        raise EngineMemoryError(
            f"{what}: the descriptor is neither sealed against shrinking "
            "(F_SEAL_SHRINK) nor a memfd or tmpfs file; hand over a memfd"
        )
    return False


def check_regions(
    geometry: Geometry, memory: KVMemory, error: type[KvtierError]
) -> list[MemoryRegion]:
    """Check the export's page layout against ``geometry``; return its regions.

    Either ``regions`` or the per-buffer form (one buffer per layer and component of
    ``geometry``), not both; the regions' page bytes add up to ``geometry.page_bytes``;
    each region's pages are at least ``page_bytes`` apart and name a layer of the model.
    Where each region lies in its segment is checked against the segment's size by
    :func:`check_region_fits`.

    Raises:
        error: naming the field and the value that disagree.
    """
    g = geometry
    if not 1 <= memory.num_pages <= MAX_PAGES:
        raise error(f"memory.num_pages = {memory.num_pages!r} is out of range")
    if memory.regions:
        if memory.buffer_offsets or memory.buffer_segments:
            raise error(
                "memory gives both regions and buffer_offsets / buffer_segments; give one of them"
            )
    else:
        check_buffers(g, memory, error)
    regions = memory.layout_regions(g)
    total = 0
    for i, r in enumerate(regions):
        if r.layer >= g.num_layers:
            raise error(
                f"memory.regions[{i}].layer = {r.layer!r}: the model has {g.num_layers} layers"
            )
        if r.page_stride < r.page_bytes:
            raise error(
                f"memory.regions[{i}].page_stride = {r.page_stride!r} is smaller than "
                f"its page_bytes = {r.page_bytes!r}"
            )
        if not 0 <= r.segment < len(memory.segments):
            raise error(
                f"memory.regions[{i}].segment = {r.segment!r} is out of range "
                f"({len(memory.segments)} segments)"
            )
        total += r.page_bytes
    if total != g.page_bytes:
        raise error(
            f"memory.regions hold {total} bytes per page; the geometry's pages are "
            f"{g.page_bytes} bytes"
        )
    return regions


def check_region_fits(
    r: MemoryRegion, i: int, num_pages: int, seg_size: int, error: type[KvtierError]
) -> int:
    """The bytes region ``i`` spans; raises ``error`` when they overrun its segment."""
    span = (num_pages - 1) * r.page_stride + r.page_bytes
    if r.offset + span > seg_size:
        raise error(
            f"memory.regions[{i}]: {num_pages} pages of {r.page_bytes} bytes "
            f"{r.page_stride} apart from offset {r.offset} overrun segment "
            f"{r.segment} of {seg_size} bytes"
        )
    return span


NO_ROOM = (errno.ENOMEM, errno.EAGAIN, errno.ENFILE, errno.EMFILE)
"""``mmap`` errors that mean the daemon ran out of room, not that the descriptor is bad
(an ENOMEM the daemon's own mapping of the same size does not meet is the descriptor's:
:func:`_room_for`)."""


def _room_for(nbytes: int) -> bool:
    """Whether the daemon can map ``nbytes`` of its own now (address space and mapping
    count: an anonymous mapping that reserves no memory), to tell an ENOMEM of its own from
    one of an engine's memory (a hugetlbfs file with no huge pages free behind it)."""
    try:
        probe = mmap.mmap(
            -1,
            max(nbytes, 1),
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
            prot=0,  # PROT_NONE: address space only
        )
    except OSError:
        return False
    probe.close()
    return True


Admit = Callable[[int, int], None]
"""Called with (bytes, mappings) planned before mapping; raises to refuse them."""


class EngineMemoryExhausted(EngineMemoryError):
    """The daemon could not map the memory: out of address space, memory or mappings."""


@dataclass(frozen=True, slots=True)
class RegionView:
    """One region of an engine's memory as the daemon copies it.

    Attributes:
        layer: the layer it holds (-1: several).
        host_offset: where its bytes sit inside a host page.
        page_bytes / page_stride / base: page ``p`` is ``page_bytes`` at
            ``base + p * page_stride`` of its segment.
        view: sealed, mapped memory: its byte view, checked once here (a strided uint8
            ``[num_pages, page_bytes]`` numpy array and its address); None otherwise. (A
            plain array or CPU tensor is taken too, and checked at each copy.)
        fd: the descriptor positional I/O uses (-1 when mapped).
        num_pages: pages the region holds.
        address: memory that may shrink, mapped for guarded copies only: the address of
            page 0 (0 otherwise).
    """

    layer: int
    host_offset: int
    page_bytes: int
    page_stride: int
    base: int
    view: EngineView | HostBuffer | None
    fd: int = -1
    num_pages: int = 0
    address: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class RegionTable:
    """Mapped regions as the native copy takes them (:func:`~kvtier.kernels.guarded_copy.copy_regions`):
    one C call per layer a transfer announces, instead of one call and its Python per region.

    Attributes:
        table: int64 rows ``(host_add, address of page 0, pages, page stride, bytes)``, in
            copy order (regions holding several layers first, then by layer).
        groups: ``(first row, end row, layers done after them)`` in order; the last group's
            layers are the last region's layer + 1 (the caller announces every layer once
            the last group is in place).
        writable: every region may be written (a LOAD may use the table).
        group_rows: ``groups`` as int64 rows, for the native copy threads.
        whole_rows: one group of every row, announcing no layer before the end (a copy
            whose layers nobody follows).
    """

    table: npt.NDArray[np.int64]
    groups: tuple[tuple[int, int, int], ...]
    writable: bool
    group_rows: npt.NDArray[np.int64]
    whole_rows: npt.NDArray[np.int64]

    @classmethod
    def of(cls, regions: list[RegionView]) -> RegionTable | None:
        """The table of ``regions``, or None when one is not mapped memory the native copy
        can reach (positional I/O, a numpy fallback) or the extension is not there."""
        if not regions or not guarded_copy.strided():
            return None
        order = sorted(regions, key=lambda r: r.layer)  # stable: -1 first, then by layer
        rows: list[tuple[int, int, int, int, int]] = []
        writable = True
        for r in order:
            if r.address:
                rows.append((r.host_offset, r.address, r.num_pages, r.page_stride, r.page_bytes))
            elif isinstance(r.view, EngineView) and r.view.row_bytes == r.page_bytes:
                v = r.view
                rows.append((r.host_offset, v.address, v.num_pages, v.page_stride, r.page_bytes))
                writable = writable and bool(v.array.flags.writeable)
            else:
                return None
        groups: list[tuple[int, int, int]] = []
        first = 0
        for i, r in enumerate(order):  # a group ends where copy_part would announce a layer
            nxt = order[i + 1].layer if i + 1 < len(order) else None
            if nxt is None or nxt > r.layer >= 0:
                groups.append((first, i + 1, r.layer + 1 if r.layer >= 0 else 0))
                first = i + 1
        return cls(
            np.array(rows, dtype=np.int64).reshape(-1, 5),
            tuple(groups),
            writable,
            np.array(groups, dtype=np.int64).reshape(-1, 3),
            np.array([(0, len(rows), 0)], dtype=np.int64),
        )


class EngineMemory:
    """An engine's KV pool as the daemon sees it: its regions, in host-page order.

    Args:
        geometry: the engine's page geometry.
        memory: the export (``kind = "fd"``): segment sizes and where pages lie.
        fds: the handover's descriptors, one per segment (the caller still closes them).
        admit: called with the bytes and the count of the mappings planned, before any is
            made; it raises to refuse them (the per-user limits).

    Attributes:
        segments: the mappings: one per run of a segment that the regions use
            (:func:`plan_windows`), not the whole segment.
        mapped_bytes: their bytes.
        regions: one :class:`RegionView` per region (their bytes make a host page).
        table: the regions for the native copy, when all of them are mapped (None otherwise).
        buffers: ``[layer][component]`` uint8 numpy arrays of ``[num_pages, chunk_bytes]``
            when the memory is kvtier's per-buffer layout and mapped (the form the CUDA back
            end's memory has too); empty otherwise.
        mapped: every segment is mapped (no positional I/O).
        guarded: some segment may shrink and is copied with guarded copies only.

    Raises:
        EngineMemoryError: the export or a descriptor is refused (nothing stays mapped).
        EngineMemoryExhausted: the daemon ran out of address space or memory mapping it.
    """

    __slots__ = (
        "_fds",
        "_prefault",
        "buffers",
        "geometry",
        "guarded",
        "mapped",
        "mapped_bytes",
        "num_pages",
        "regions",
        "segments",
        "table",
    )

    def __init__(
        self, geometry: Geometry, memory: KVMemory, fds: list[int], admit: Admit | None = None
    ) -> None:
        self.geometry = geometry
        self.num_pages = memory.num_pages
        self.segments: list[SharedMemorySegment] = []
        self._fds: list[int] = []
        self.regions: list[RegionView] = []
        self.table: RegionTable | None = None
        self.buffers: list[list[npt.NDArray[np.uint8]]] = []
        self.mapped = True
        self.guarded = False
        self._prefault: Prefaulter | None = None
        self.mapped_bytes = 0
        try:
            self._map(memory, fds, admit)
        except BaseException:
            self.close()
            raise

    def _map(self, memory: KVMemory, fds: list[int], admit: Admit | None) -> None:
        g = self.geometry
        if memory.kind == "shm":
            raise EngineMemoryError(NAMES_REFUSED)
        if memory.kind != "fd":
            raise EngineMemoryError(
                f"memory.kind = {memory.kind!r}: this daemon maps 'fd' exports (CUDA IPC needs a GPU build)"
            )
        regions = check_regions(g, memory, EngineMemoryError)
        if not memory.segments or len(memory.segments) != len(fds):
            raise EngineMemoryError(
                f"memory.segments has {len(memory.segments)} entries but the "
                f"handover passed {len(fds)} descriptors"
            )
        # everything declared is checked before anything is mapped
        spans = [
            check_region_fits(
                r, i, memory.num_pages, memory.segments[r.segment].size, EngineMemoryError
            )
            for i, r in enumerate(regions)
        ]
        sealed_of = [
            check_descriptor(fd, seg.size, f"memory.segments[{i}]")
            for i, (seg, fd) in enumerate(zip(memory.segments, fds, strict=True))
        ]
        maps = [sealed or guarded_copy.available() for sealed in sealed_of]
        # memory of huge pages (hugetlbfs says its page size here) maps whole huge pages
        grains = [max(mmap.ALLOCATIONGRANULARITY, os.fstat(fd).st_blksize) for fd in fds]
        windows = plan_windows(
            [seg.size for seg in memory.segments],
            [
                (r.segment, r.offset, span)
                for r, span in zip(regions, spans, strict=True)
                if maps[r.segment]
            ],
            grains,
        )
        self.mapped_bytes = mapped_bytes(windows, grains)
        if admit is not None:  # a segment copied by I/O keeps a descriptor of its own
            admit(self.mapped_bytes, len(windows) + maps.count(False))
        fd_of = [-1] * len(fds)
        for i, fd in enumerate(fds):
            if not maps[i]:
                try:
                    self._fds.append(os.dup(fd))
                except OSError as err:
                    if err.errno in NO_ROOM:
                        raise EngineMemoryExhausted(
                            f"memory.segments[{i}]: cannot keep its descriptor: {err.strerror}"
                        ) from err
                    raise
                fd_of[i] = self._fds[-1]
                self.mapped = False
        mapped: list[tuple[Window, SharedMemorySegment]] = []
        for w in windows:
            what = f"memory.segments[{w.segment}]"
            try:
                seg = SharedMemorySegment.from_fd(
                    fds[w.segment], w.end - w.start, writable=True, label=what, offset=w.start
                )
            except SharedMemoryError as err:
                cause = err.__cause__
                if isinstance(cause, OSError) and cause.errno in NO_ROOM:
                    if cause.errno == errno.ENOMEM and _room_for(w.end - w.start):
                        raise EngineMemoryError(  # the daemon could map as much of its own
                            f"{what}: {err}; the daemon has room for a mapping of this size, so "
                            "this memory cannot be mapped (huge pages the node has none "
                            "free of?)"
                        ) from err
                    raise EngineMemoryExhausted(f"{what}: {err}") from err
                raise EngineMemoryError(str(err)) from err
            self.segments.append(seg)
            mapped.append((w, seg))
        host_offset = 0
        for i, (r, span) in enumerate(zip(regions, spans, strict=True)):
            view, address = None, 0
            if maps[r.segment]:
                w, seg = next((w, seg) for w, seg in mapped if w.holds(r.segment, r.offset, span))
                at = r.offset - w.start
                if sealed_of[r.segment]:
                    rows = np.ndarray(
                        (memory.num_pages, r.page_bytes),
                        dtype=np.uint8,
                        buffer=seg.array(np.uint8, at, span),
                        strides=(r.page_stride, 1),
                    )
                    view = EngineView.of(rows, f"memory.regions[{i}]")
                else:  # may shrink: guarded copies only, never an array over it
                    address = seg.address + at
                    self.guarded = True
            self.regions.append(
                RegionView(
                    r.layer,
                    host_offset,
                    r.page_bytes,
                    r.page_stride,
                    r.offset,
                    view,
                    fd_of[r.segment],
                    memory.num_pages,
                    address,
                )
            )
            host_offset += r.page_bytes
        self.table = RegionTable.of(self.regions)
        if not memory.regions and self.mapped and not self.guarded:
            comps = g.components
            self.buffers = [
                [cast(EngineView, self.regions[layer * comps + c].view).array for c in range(comps)]
                for layer in range(g.num_layers)
            ]

    def start_prefault(
        self, label: str, queue: PrefaultQueue | None = None, user: int = -1
    ) -> None:
        """Build the page tables of the mapped spans where the engine has allocated its
        pages (:mod:`.prefault`), on ``queue`` in ``user``'s turns (else on a thread of its
        own): the first copy into a page then takes no fault. :meth:`close` stops it first."""
        if self._prefault is None:
            self._prefault = Prefaulter([(seg.address, seg.size) for seg in self.segments], label)
            if queue is not None:
                queue.submit(self._prefault, user)
            else:
                self._prefault.start()

    def stop_prefault(self) -> None:
        """Stop building page tables over this memory (waits for the step in progress);
        :meth:`close` does it too."""
        if self._prefault is not None:
            self._prefault.stop()

    def drop_page_tables(self) -> None:
        """Stop the prefault, then empty the page tables of every mapped segment a step at a
        time (:func:`~kvtier.daemon.transfer.prefault.drop_page_tables`): :meth:`close`
        then unmaps at once. For a closed session's memory only (nothing copies from or into
        it any more); the engine's bytes are untouched."""
        self.stop_prefault()
        for seg in self.segments:
            if not seg.closed:
                drop_page_tables(seg.address, seg.size)

    def close(self) -> None:
        """Drop the views, unmap every segment and close the kept descriptors (nothing is
        ever removed: there is no file; the memory goes when the engine's last descriptor
        and mapping go)."""
        if self._prefault is not None:
            self._prefault.stop()
        self.buffers = []
        self.regions = []
        self.table = None
        for seg in self.segments:
            seg.close(unlink=False)
        self.segments = []
        self.mapped_bytes = 0
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    @property
    def descriptors(self) -> int:
        """Descriptors this memory holds: one per mapping (``mmap`` keeps a duplicate) and
        one per segment copied by positional I/O."""
        return len(self.segments) + len(self._fds)


class NoMemory:
    """The memory of a control-only session (``memory.kind = "none"``): none.

    Such a session may LOOKUP but has no pages to copy (STORE, LOAD, PREFETCH and CLAIM
    are refused), e.g. the scheduler process of an engine whose workers hold the KV.
    """

    __slots__ = ()
    num_pages = 0
    regions: list[RegionView] = []  # noqa: RUF012 (never mutated)
    table: RegionTable | None = None
    buffers: list[list[npt.NDArray[np.uint8]]] = []  # noqa: RUF012
    mapped = True
    guarded = False

    @staticmethod
    def check(memory: KVMemory, fds: list[int]) -> None:
        """Check that a ``kind = "none"`` export declares nothing and no descriptor came.

        Raises:
            EngineMemoryError: naming what was declared or passed.
        """
        if memory.segments or memory.regions or memory.buffer_offsets or memory.buffer_segments:
            raise EngineMemoryError("memory.kind = 'none' declares no segments, regions or buffers")
        if fds:
            raise EngineMemoryError(
                f"memory.kind = 'none' but the handover passed {len(fds)} descriptors"
            )

    def close(self) -> None:
        """Nothing to release."""
