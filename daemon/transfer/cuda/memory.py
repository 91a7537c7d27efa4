"""kvtierd's GPU state: an engine's KV pool opened from CUDA IPC handles, and the pinned arena.

The CPU path maps an engine's shared-memory segments (:mod:`kvtier.daemon.transfer.engine_memory`); on a
GPU the engine exports CUDA IPC handles instead, and this module opens them::

    CudaRuntime (one per daemon, touches no GPU until the first CUDA registration)
      ├─ GPUs by UUID ──▶ ordinal in this process; one CUDA context per GPU (the primary
      │                   context, created by the first call on that GPU)
      ├─ IPC mappings: (ordinal, handle) ──▶ [device pointer, references]
      │                   a handle is opened once per process and GPU, closed with its last user
      └─ host arena: the shared-memory pool, pinned with cudaHostRegister (portable, mapped)
                     once, unpinned at close; the copy kernels read and write it directly, so
                     there is no staging buffer at all

    CudaEngineMemory (one per session): ``buffers[layer][component]`` are uint8 CUDA tensors
      ``[num_pages, chunk_bytes]`` over the mapped engine memory, as EngineMemory's are over
      shared memory; their pages lie ``chunk_bytes`` apart (the per-buffer form) or any
      stride apart (``regions``: an engine's own layout, e.g. vLLM's HND cache, K and V
      of a block side by side).

Checks before anything is opened (:func:`check_cuda_export`, pure, tested without a GPU): kind,
page count, buffer count (or one region per layer and component, in order, each page one
chunk), 64-byte handles, one GPU per registration, every buffer's last page inside its
segment. After opening, the daemon asks the driver for the mapped size, so an engine cannot make
it write past an allocation by declaring a larger one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvtier.daemon.transfer.cuda.backend import daemon_backend
from kvtier.daemon.transfer.engine_memory import EngineMemoryError, check_buffers
from kvtier.ipc import cuda_ipc
from kvtier.ipc.limits import MAX_PAGES
from kvtier.ipc.cuda_backend import DaemonCudaBackend
from kvtier.ipc.cuda_ipc import CudaIpcError
from kvtier.ipc.protocol import Geometry, KVMemory

__all__ = [
    "CudaEngineMemory",
    "CudaMemoryError",
    "CudaRuntime",
    "arena_tensor",
    "check_cuda_export",
]

log = logging.getLogger("kvtier.daemon.cuda")


class CudaMemoryError(EngineMemoryError):
    """A CUDA IPC export cannot be opened, or the daemon has no usable GPU (BAD_MEMORY)."""


def arena_tensor(arena: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The host arena as the CUDA path takes it: a torch view of the daemon's numpy arena.

    The daemon keeps its arena as a numpy array (its CPU copy path imports no torch); this
    module, imported only for CUDA sessions, makes the tensor over the same
    memory (``torch.from_numpy``, no copy). A tensor is returned as it is.
    """
    if isinstance(arena, np.ndarray):
        return torch.from_numpy(arena)
    return arena


def check_cuda_export(geometry: Geometry, memory: KVMemory) -> str:
    """Check a ``cuda_ipc`` export against the geometry before anything is opened.

    Args:
        geometry: the registration's (validated) geometry.
        memory: the export.

    Returns:
        The UUID of the one GPU every segment is on.

    Raises:
        CudaMemoryError: naming the first field that is wrong.
    """
    g = geometry
    if memory.kind != "cuda_ipc":
        raise CudaMemoryError(f"memory.kind = {memory.kind!r}: CudaEngineMemory opens 'cuda_ipc'")
    if memory.regions:
        _check_regions(g, memory)
    else:
        check_buffers(g, memory, CudaMemoryError)
    uuid: bytes | None = None
    for i, seg in enumerate(memory.segments):
        try:
            cuda_ipc.check_ipc_handle(seg.handle, f"memory.segments[{i}].handle")
            this = cuda_ipc.parse_device_uuid(seg.device_uuid)
        except CudaIpcError as err:
            raise CudaMemoryError(str(err)) from err
        if seg.size <= 0:
            raise CudaMemoryError(f"memory.segments[{i}].size = {seg.size!r} must be > 0")
        if uuid is not None and this != uuid:
            raise CudaMemoryError(
                f"memory.segments[{i}] is on GPU {seg.device_uuid}, segment 0 "
                f"on {memory.segments[0].device_uuid}: one registration, one GPU"
            )
        uuid = this
    buf_bytes = memory.num_pages * g.chunk_bytes
    for i, (s_idx, off) in enumerate(zip(memory.buffer_segments, memory.buffer_offsets)):
        if not 0 <= s_idx < len(memory.segments):
            raise CudaMemoryError(f"memory.buffer_segments[{i}] = {s_idx!r} is out of range")
        size = memory.segments[s_idx].size
        if off < 0 or off + buf_bytes > size:
            raise CudaMemoryError(
                f"memory.buffer_offsets[{i}] = {off!r}: {buf_bytes} bytes do "
                f"not fit in segment {s_idx} of {size} bytes"
            )
    for i, r in enumerate(memory.regions):
        if not 0 <= r.segment < len(memory.segments):
            raise CudaMemoryError(f"memory.regions[{i}].segment = {r.segment!r} is out of range")
        size = memory.segments[r.segment].size
        end = r.offset + (memory.num_pages - 1) * r.page_stride + r.page_bytes
        if r.offset < 0 or end > size:
            raise CudaMemoryError(
                f"memory.regions[{i}].offset = {r.offset!r}: its {memory.num_pages} pages, "
                f"{r.page_stride} bytes apart, end at byte {end} of segment {r.segment} of "
                f"{size} bytes"
            )
    assert uuid is not None
    return cuda_ipc.format_device_uuid(uuid)


def _check_regions(g: Geometry, memory: KVMemory) -> None:
    """A ``cuda_ipc`` export in the region form: one region per (layer, component), in
    order, each page one chunk (``geometry.chunk_bytes``) of contiguous bytes, pages at
    least a chunk apart; segment bounds are checked by the caller."""
    if not 1 <= memory.num_pages <= MAX_PAGES:
        raise CudaMemoryError(f"memory.num_pages = {memory.num_pages!r} is out of range")
    if memory.buffer_offsets or memory.buffer_segments:
        raise CudaMemoryError(
            "memory: a cuda_ipc export gives regions or buffer_offsets / buffer_segments, not both"
        )
    n_buf = g.num_layers * g.components
    if len(memory.regions) != n_buf:
        raise CudaMemoryError(
            f"memory.regions has {len(memory.regions)} entries; a cuda_ipc session needs one "
            f"per layer and component: {n_buf} ({g.num_layers} layers x {g.components})"
        )
    if not 1 <= len(memory.segments) <= n_buf:
        raise CudaMemoryError(f"memory.segments has {len(memory.segments)} entries")
    for i, r in enumerate(memory.regions):
        if r.layer != i // g.components:
            raise CudaMemoryError(
                f"memory.regions[{i}].layer = {r.layer!r}: region {i} must hold layer "
                f"{i // g.components} (one region per layer and component, in order)"
            )
        if r.page_bytes != g.chunk_bytes:
            raise CudaMemoryError(
                f"memory.regions[{i}].page_bytes = {r.page_bytes!r}: a cuda_ipc region's page "
                f"is one layer's component, {g.chunk_bytes} bytes"
            )
        if r.page_stride < r.page_bytes:
            raise CudaMemoryError(
                f"memory.regions[{i}].page_stride = {r.page_stride!r} is smaller than its "
                f"page_bytes = {r.page_bytes}"
            )


def _page_view(seg: Any, offset: int, stride: int, nbytes: int, pages: int) -> Any:
    """``pages`` pages of ``nbytes`` bytes, ``stride`` bytes apart from ``offset`` on, as a
    ``[pages, nbytes]`` uint8 view of ``seg`` (a CUDA tensor; numpy with a fake backend)."""
    if stride == nbytes:
        return seg[offset : offset + pages * nbytes].reshape(pages, nbytes)
    if isinstance(seg, np.ndarray):
        return np.lib.stride_tricks.as_strided(seg[offset:], (pages, nbytes), (stride, 1))
    return seg[offset:].as_strided((pages, nbytes), (stride, 1))


@dataclass(slots=True)
class _Mapping:
    """One opened IPC allocation and how many sessions use it."""

    ptr: int
    size: int
    refs: int


class CudaRuntime:
    """kvtierd's CUDA state: GPUs by UUID, shared IPC mappings, the pinned host arena.

    Creating it touches no GPU. Thread-safe: registrations open memory from worker threads.
    Close it after every session's memory is closed and before the arena is unmapped.

    Args:
        backend: the CUDA operations (default: the process's, :func:`daemon_backend`).
    """

    __slots__ = (
        "_closed",
        "_lock",
        "_mappings",
        "_ordinals",
        "_pinned",
        "_pinned_here",
        "backend",
    )

    def __init__(self, backend: DaemonCudaBackend | None = None) -> None:
        self.backend = backend if backend is not None else daemon_backend()
        self._lock = threading.Lock()
        self._ordinals: dict[str, int] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._pinned: tuple[np.ndarray, int] | None = None  # (arena, ordinal)
        self._pinned_here = False
        self._closed = False

    def unavailable_reason(self) -> str | None:
        """Why this daemon cannot serve CUDA engines (no GPU, no cupy), or None."""
        return self.backend.unavailable_reason()

    def require(self) -> None:
        """Raise :class:`CudaMemoryError` unless CUDA engines can be served."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise CudaMemoryError(f"memory.kind = 'cuda_ipc': kvtierd {reason}")
        if self._closed:
            raise CudaMemoryError("kvtierd's CUDA runtime is closed (the daemon is stopping)")

    def ordinal_of(self, uuid: str) -> int:
        """The ordinal, in the daemon, of the GPU named ``uuid`` (looked up once).

        Raises:
            CudaMemoryError: malformed UUID, or the GPU is not visible to the daemon.
        """
        self.require()
        with self._lock:
            if uuid not in self._ordinals:
                try:
                    self._ordinals[uuid] = self.backend.device_ordinal(uuid)
                except CudaIpcError as err:
                    raise CudaMemoryError(str(err)) from err
            return self._ordinals[uuid]

    @property
    def pinned(self) -> bool:
        """Whether the host arena is pinned."""
        return self._pinned is not None

    def pin_arena(self, arena: np.ndarray, ordinal: int = 0) -> None:
        """Pin the host pool (``cudaHostRegister``, portable and mapped); idempotent.

        Pinning touches every page of the pool (seconds for hundreds of GiB): call it from a
        worker thread.

        Args:
            arena: the pool as a flat uint8 numpy array over shared memory.
            ordinal: the GPU whose context performs the call (portable: every GPU sees it).

        Raises:
            CudaMemoryError: the driver refused (the message has the RLIMIT_MEMLOCK limits).
        """
        self.require()
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
            raise CudaMemoryError(
                f"the arena must be a flat uint8 numpy array, got {type(arena).__name__}"
            )
        with self._lock:
            if self._pinned is not None:
                if self._pinned[0] is not arena:
                    raise CudaMemoryError("a different host arena is already pinned")
                return
            try:
                self._pinned_here = self.backend.pin_host(arena, ordinal)
            except CudaIpcError as err:
                raise CudaMemoryError(str(err)) from err
            self._pinned = (arena, ordinal)
            log.info("host pool pinned for CUDA: %d bytes", arena.nbytes)

    def acquire(self, ordinal: int, handle: bytes) -> tuple[int, int | None]:
        """Open ``handle`` on GPU ``ordinal`` (or share the mapping a session already has).

        Returns:
            The mapped base address and the mapped size the driver reports (None if unknown).

        Raises:
            CudaMemoryError: the handle cannot be opened.
        """
        key = (ordinal, handle)
        with self._lock:
            m = self._mappings.get(key)
            if m is None:
                try:
                    ptr = self.backend.open_mem(handle, ordinal)
                except CudaIpcError as err:
                    raise CudaMemoryError(str(err)) from err
                size = self.backend.mapped_size(ptr)
                m = _Mapping(ptr, size if size is not None else -1, 0)
                self._mappings[key] = m
            m.refs += 1
            return m.ptr, (m.size if m.size >= 0 else None)

    def release(self, ordinal: int, handle: bytes) -> None:
        """Drop one user of a mapping; the last one closes it (``cudaIpcCloseMemHandle``)."""
        key = (ordinal, handle)
        with self._lock:
            m = self._mappings.get(key)
            assert m is not None and m.refs > 0, "release of a mapping that is not open"
            m.refs -= 1
            if m.refs:
                return
            del self._mappings[key]
        try:
            self.backend.close_mem(m.ptr, ordinal)
        except CudaIpcError as err:  # the mapping is gone either way; the daemon keeps serving
            log.warning("%s", err)

    def open_memory(self, geometry: Geometry, memory: KVMemory) -> CudaEngineMemory:
        """Open an engine's ``cuda_ipc`` export (see :class:`CudaEngineMemory`)."""
        return CudaEngineMemory(geometry, memory, self)

    @property
    def mappings(self) -> int:
        """How many IPC allocations are open."""
        return len(self._mappings)

    def close(self) -> None:
        """Unpin the arena (if this runtime pinned it). Idempotent.

        Sessions must be closed first; mappings still open then belong to transfers that never
        finished on the GPU and are left open on purpose (see ``CudaEngineMemory.stuck``).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pinned, self._pinned = self._pinned, None
            left = len(self._mappings)
        if left:
            log.warning("closing the CUDA runtime with %d IPC mappings still open", left)
        if pinned is not None and self._pinned_here:
            try:
                self.backend.unpin_host(*pinned)
            except CudaIpcError as err:
                log.warning("%s", err)


class CudaEngineMemory:
    """An engine's KV pool as the daemon sees it on a GPU: opened CUDA IPC allocations.

    Same surface as :class:`~kvtier.daemon.transfer.engine_memory.EngineMemory`: ``buffers[layer]
    [component]`` are flat-page buffers ``[num_pages, chunk_bytes]`` (uint8 CUDA tensors with
    the real backend); :meth:`close`.

    Attributes:
        geometry / num_pages: as registered.
        ordinal: the GPU, in the daemon's numbering.
        device_uuid: the GPU's UUID.
        buffers: ``[layer][component]`` buffers over the engine's memory.
        paths: always empty (nothing of the engine's lives on disk).
        regions / table: always empty / None (the CPU copy path's description of where pages
            lie; a CUDA session never takes that path).
        stuck: set by the CUDA executor when a copy never finished on the GPU; then
            :meth:`close` keeps the mappings open, so that the late copy cannot fault.

    Raises:
        CudaMemoryError: the export is invalid, the GPU is not visible, or a handle cannot be
            opened (nothing stays open then).
    """

    __slots__ = (
        "_opened",
        "_runtime",
        "buffers",
        "device_uuid",
        "geometry",
        "num_pages",
        "ordinal",
        "paths",
        "regions",
        "stuck",
        "table",
    )

    def __init__(self, geometry: Geometry, memory: KVMemory, runtime: CudaRuntime) -> None:
        self.geometry = geometry
        self.num_pages = memory.num_pages
        self.device_uuid = check_cuda_export(geometry, memory)
        self.buffers: list[list[Any]] = []
        self.paths: list[str] = []
        self.regions: list[Any] = []
        self.table: None = None
        self.stuck = False
        self._runtime = runtime
        self._opened: list[tuple[int, bytes]] = []
        self.ordinal = runtime.ordinal_of(self.device_uuid)
        try:
            runtime.backend.use_device(self.ordinal)
            self._open(memory, self.ordinal)
        except BaseException:
            self.close()
            raise

    @property
    def device(self) -> torch.device:
        """The GPU as a torch device."""
        return torch.device("cuda", self.ordinal)

    def _open(self, memory: KVMemory, ordinal: int) -> None:
        g = self.geometry
        whole: list[Any] = []
        for i, seg in enumerate(memory.segments):
            handle = bytes(seg.handle)
            ptr, mapped = self._runtime.acquire(ordinal, handle)
            self._opened.append((ordinal, handle))
            if mapped is not None and mapped < seg.size:
                raise CudaMemoryError(
                    f"memory.segments[{i}].size = {seg.size} but the driver mapped {mapped} bytes"
                )
            try:
                whole.append(self._runtime.backend.device_bytes(ptr, seg.size, ordinal))
            except CudaIpcError as err:
                raise CudaMemoryError(str(err)) from err
        regions = memory.layout_regions(g)
        for layer in range(g.num_layers):
            row = []
            for comp in range(g.components):
                r = regions[layer * g.components + comp]
                row.append(
                    _page_view(
                        whole[r.segment], r.offset, r.page_stride, r.page_bytes, memory.num_pages
                    )
                )
            self.buffers.append(row)

    def close(self) -> None:
        """Drop the buffers and release the mappings (the engine owns the memory). Idempotent.

        When :attr:`stuck` is set the mappings stay open for the life of the daemon: a copy
        the GPU never finished must not find its memory unmapped.
        """
        self.buffers = []
        if self.stuck:
            if self._opened:
                log.error(
                    "engine memory on %s left mapped: a copy on it never finished", self.device_uuid
                )
            self._opened = []
            return
        opened, self._opened = self._opened, []
        for ordinal, handle in opened:
            self._runtime.release(ordinal, handle)
