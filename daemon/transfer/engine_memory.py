"""Map an engine's KV memory into the daemon from the descriptors it handed over (CPU).

The daemon never opens or removes an engine's memory by name: the engine passes its
descriptors on the handover socket (:mod:`kvtier.ipc.fdpass`) and REGISTER declares what
they hold (``memory.kind = "fd"``). Each descriptor is checked before it is mapped:

- a regular file or memfd (``fstat``), opened read-write;
- exactly the size the export declares;
- sealed against shrinking (``F_GET_SEALS`` has ``F_SEAL_SHRINK``): a file that could
  shrink under the daemon's mapping would make its next copy a SIGBUS, ending the daemon.

A refused descriptor is a :class:`EngineMemoryError` naming the segment and the reason.
The mapping is ``MAP_SHARED``; the caller closes the descriptors afterwards.
"""

from __future__ import annotations

import fcntl
import os
import stat

import torch
from kvtier.config.errors import KvtierError
from kvtier.ipc.limits import MAX_PAGES
from kvtier.ipc.protocol import Geometry, KVMemory
from kvtier.ipc.shm import SharedMemoryError, SharedMemorySegment

NAMES_REFUSED = ("memory.kind = 'shm' (a file name) is not accepted: hand the memory over by "
                 "descriptor (memory.kind = 'fd', see docs/protocol.md, 'Memory handover')")
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


def check_descriptor(fd: int, size: int, what: str) -> None:
    """Check that ``fd`` is safe to map as ``size`` bytes of engine memory.

    Args:
        fd: a descriptor the engine handed over.
        size: the bytes the export declares for it.
        what: names it in the error (``memory.segments[0]``).

    Raises:
        EngineMemoryError: not a regular file / memfd, not read-write, another size, or
            not sealed against shrinking.
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
        raise EngineMemoryError(f"{what}: the descriptor has {st.st_size} bytes, the export "
                                f"declares {size}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as err:  # EINVAL: a file system without seals
        raise EngineMemoryError(f"{what}: the descriptor cannot be sealed ({err}); hand over a "
                                "memfd sealed with F_SEAL_SHRINK") from err
    if not seals & fcntl.F_SEAL_SHRINK:
        raise EngineMemoryError(f"{what}: the memfd is not sealed against shrinking "
                                "(F_SEAL_SHRINK); it could be truncated under the daemon")


class EngineMemory:
    """An engine's KV pool as the daemon sees it: one uint8 ``[num_pages, chunk_bytes]``
    tensor per (layer, component), indexed ``buffers[layer][component]``.

    Args:
        geometry: the engine's page geometry.
        memory: the export (``kind = "fd"``): sizes and buffer offsets.
        fds: the handover's descriptors, one per segment (the caller still closes them).

    Raises:
        EngineMemoryError: the export or a descriptor is refused (nothing stays mapped).
    """

    __slots__ = ("buffers", "geometry", "num_pages", "segments")

    def __init__(self, geometry: Geometry, memory: KVMemory, fds: list[int]) -> None:
        self.geometry = geometry
        self.num_pages = memory.num_pages
        self.segments: list[SharedMemorySegment] = []
        self.buffers: list[list[torch.Tensor]] = []
        try:
            self._map(memory, fds)
        except BaseException:
            self.close()
            raise

    def _map(self, memory: KVMemory, fds: list[int]) -> None:
        g = self.geometry
        if memory.kind == "shm":
            raise EngineMemoryError(NAMES_REFUSED)
        if memory.kind != "fd":
            raise EngineMemoryError(
                f"memory.kind = {memory.kind!r}: this daemon maps 'fd' exports (CUDA IPC needs a GPU build)"
            )
        check_buffers(g, memory, EngineMemoryError)
        if len(memory.segments) != len(fds):
            raise EngineMemoryError(f"memory.segments has {len(memory.segments)} entries but the "
                                    f"handover passed {len(fds)} descriptors")
        for i, (seg, fd) in enumerate(zip(memory.segments, fds, strict=True)):
            what = f"memory.segments[{i}]"
            check_descriptor(fd, seg.size, what)
            try:
                self.segments.append(SharedMemorySegment.from_fd(fd, seg.size, writable=True,
                                                                 label=what))
            except SharedMemoryError as err:
                raise EngineMemoryError(str(err)) from err
        buf_bytes = memory.num_pages * g.chunk_bytes
        for layer in range(g.num_layers):
            row = []
            for comp in range(g.components):
                i = layer * g.components + comp
                s_idx, off = memory.buffer_segments[i], memory.buffer_offsets[i]
                if not 0 <= s_idx < len(self.segments):
                    raise EngineMemoryError(f"memory.buffer_segments[{i}] = {s_idx!r} is out of range")
                seg = self.segments[s_idx]
                if off < 0 or off + buf_bytes > seg.size:
                    raise EngineMemoryError(
                        f"memory.buffer_offsets[{i}] = {off!r}: {buf_bytes} bytes do not fit in "
                        f"{seg.path} of {seg.size} bytes"
                    )
                row.append(seg.tensor(off, buf_bytes).view(memory.num_pages, g.chunk_bytes))
            self.buffers.append(row)

    def close(self) -> None:
        """Drop the tensors and unmap every segment (nothing is ever removed: there is no
        file; the memory goes when the engine's last descriptor and mapping go)."""
        self.buffers = []
        for seg in self.segments:
            seg.close(unlink=False)
        self.segments = []
