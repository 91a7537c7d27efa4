"""CUDA IPC: export an engine's GPU memory and interprocess events, and open them in kvtierd.

An engine hands its KV pool to the daemon once, at registration, as CUDA IPC memory handles; the
daemon maps them and copies pages itself. Per-layer completion travels back as interprocess CUDA
events that the engine's compute stream waits on. This module has both halves and nothing else:

    engine process                                       kvtierd
    ──────────────                                       ───────
    tensor ─▶ its allocation [base, base + size)          ptr = cudaIpcOpenMemHandle(handle)
              handle = cudaIpcGetMemHandle(base)  ──────▶  buffer = ptr + offset
              offset = data_ptr - base                     (once per allocation per GPU)
    MemorySegment(name, size, handle[64 B], device_uuid)

Why the base: a handle names a whole ``cudaMalloc`` allocation and opening it maps the allocation
at its start, so a tensor carved out of a cached segment (torch's caching allocator) is found at
``base + offset`` in the daemon.

Which memory can be exported: only allocations made by ``cudaMalloc``. Memory from CUDA's virtual
memory API (PyTorch with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) or from the
stream-ordered allocator (``backend:cudaMallocAsync``) has no legacy IPC handle; exporting it
raises :class:`CudaIpcError` saying so, instead of failing later in the daemon.

Device identity: ordinals depend on each process's ``CUDA_VISIBLE_DEVICES``, so segments name
their GPU by UUID (:mod:`kvtier.ipc.cuda_device`).

This module holds the handles: exporting tensors, opening and closing memory handles, and the
interprocess events. What it builds on lives next to it and is imported here, so every name of
the CUDA IPC API can still be imported from ``kvtier.ipc.cuda_ipc``: availability, cupy and
errors in :mod:`kvtier.ipc.cuda_runtime`, device UUIDs in :mod:`kvtier.ipc.cuda_device`,
allocation lookup and raw device memory in :mod:`kvtier.ipc.cuda_alloc`.

cupy (the ``cuda`` extra) is imported on first use and torch's CUDA state is touched only by the
functions that need it, so this module imports on machines with neither cupy nor a GPU; a call
there raises :class:`CudaUnavailable` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvtier.ipc.cuda_alloc import (
    use_device,
    AllocationRange,
    allocation_range,
    device_tensor,
    empty_ipc_capable,
    mapped_range,
    range_from_snapshot,
)
from kvtier.ipc.cuda_device import (
    UUID_BYTES,
    device_ordinal,
    device_uuid,
    format_device_uuid,
    parse_device_uuid,
)
from kvtier.ipc.cuda_runtime import (
    NEEDS_GPU,
    CudaIpcError,
    CudaUnavailable,
    cuda_error_types,
    cuda_unavailable_reason,
    cupy_module,
    ordinal_of,
    require_cuda,
)
from kvtier.ipc.protocol import KVMemory, MemorySegment

__all__ = [
    "IPC_HANDLE_BYTES",
    "NEEDS_GPU",
    "UUID_BYTES",
    "AllocationRange",
    "CudaExport",
    "CudaIpcError",
    "CudaUnavailable",
    "allocation_range",
    "check_ipc_handle",
    "close_mem_handle",
    "create_ipc_event",
    "cuda_unavailable_reason",
    "cupy_module",
    "device_ordinal",
    "device_tensor",
    "device_uuid",
    "empty_ipc_capable",
    "export_tensors",
    "format_device_uuid",
    "mapped_range",
    "open_ipc_event",
    "open_mem_handle",
    "ordinal_of",
    "parse_device_uuid",
    "range_from_snapshot",
    "require_cuda",
]

IPC_HANDLE_BYTES = 64
"""Bytes of a ``cudaIpcMemHandle_t`` and of a ``cudaIpcEventHandle_t``."""
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


# -- export (engine side) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaExport:
    """Exported CUDA tensors: the allocations they live in and where each tensor starts.

    Attributes:
        segments: one per distinct allocation, with its IPC handle and device UUID.
        buffer_segments: for each exported tensor, the index of its segment.
        buffer_offsets: for each exported tensor, its byte offset inside that segment.
    """

    segments: list[MemorySegment]
    buffer_segments: list[int]
    buffer_offsets: list[int]

    def memory(self, num_pages: int) -> KVMemory:
        """The ``KVMemory`` of a registration whose buffers are the exported tensors, in order."""
        return KVMemory(
            kind="cuda_ipc",
            num_pages=num_pages,
            segments=list(self.segments),
            buffer_segments=list(self.buffer_segments),
            buffer_offsets=list(self.buffer_offsets),
        )


def _checked_tensors(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Check what can be checked without a GPU; return the tensors' (single) device."""
    if len(tensors) == 0:
        raise CudaIpcError("export_tensors needs at least one tensor")
    device: torch.device | None = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise CudaIpcError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise CudaIpcError(
                f"tensors[{i}] is on {t.device}: CUDA IPC exports CUDA tensors only (an engine "
                "without a GPU keeps its KV pool in shared memory: kvtier.client.kv_pool."
                "SharedKVPool)"
            )
        if not t.is_contiguous() or t.numel() == 0:
            raise CudaIpcError(
                f"tensors[{i}] must be contiguous and non-empty, got shape "
                f"{tuple(t.shape)} and strides {t.stride()}"
            )
        if device is not None and t.device != device:
            raise CudaIpcError(
                f"tensors[{i}] is on {t.device}, tensors[0] on {device}: one "
                "registration exports one GPU"
            )
        device = t.device
    assert device is not None
    return device


def export_tensors(
    tensors: Sequence[torch.Tensor], known: Sequence[AllocationRange] = ()
) -> CudaExport:
    """Export CUDA tensors of one GPU: one IPC handle per allocation, an offset per tensor.

    Args:
        tensors: contiguous CUDA tensors, all on one device (typically a KV pool's buffers).
        known: allocations the caller made itself (e.g. with :func:`empty_ipc_capable`);
            others are found with the CUDA driver or torch's allocator.

    Returns:
        Segments (deduplicated by allocation) and each tensor's segment and offset.

    Raises:
        CudaIpcError: a tensor is not a contiguous CUDA tensor, the tensors span devices, or
            their memory cannot be exported (expandable segments, cudaMallocAsync pools).
        CudaUnavailable: no GPU or no cupy.
    """
    device = _checked_tensors(tensors)
    require_cuda("CUDA IPC export")
    cupy = cupy_module()
    errors = cuda_error_types()
    ordinal = ordinal_of(device)
    uuid = device_uuid(ordinal)
    segments: list[MemorySegment] = []
    index_of: dict[int, int] = {}
    seg_of: list[int] = []
    offsets: list[int] = []
    use_device(cupy, ordinal)
    with torch.cuda.device(ordinal):
        for i, t in enumerate(tensors):
            ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
            rng = allocation_range(ptr, ordinal, known)
            if rng.ipc_capable is False:
                raise _not_exportable(ptr, ordinal, "the driver reports it is not IPC capable")
            if ptr + nbytes > rng.base + rng.size:
                raise CudaIpcError(
                    f"tensors[{i}] ({nbytes} bytes at {ptr:#x}) runs past its "
                    f"allocation [{rng.base:#x}, +{rng.size})"
                )
            if rng.base not in index_of:
                try:
                    handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(rng.base))
                except errors as err:
                    raise _not_exportable(ptr, ordinal, f"cudaIpcGetMemHandle: {err}") from err
                check_ipc_handle(handle, f"the handle of tensors[{i}]")
                index_of[rng.base] = len(segments)
                segments.append(
                    MemorySegment(
                        name=f"cuda-ipc:{os.getpid()}:{rng.base:#x}",
                        size=rng.size,
                        handle=handle,
                        device_uuid=uuid,
                    )
                )
            seg_of.append(index_of[rng.base])
            offsets.append(ptr - rng.base)
    return CudaExport(segments, seg_of, offsets)


def _alloc_conf() -> str:
    """The allocator settings of this process, as the export error quotes them."""
    return (
        ";".join(f"{v}={os.environ[v]!r}" for v in _ALLOC_CONF_VARS if v in os.environ)
        or "PYTORCH_CUDA_ALLOC_CONF unset"
    )


def _not_exportable(ptr: int, ordinal: int, detail: str) -> CudaIpcError:
    """The error for memory without an IPC handle, naming the usual cause and the fixes."""
    return CudaIpcError(
        f"CUDA memory at {ptr:#x} on cuda:{ordinal} cannot be exported by CUDA IPC ({detail}): "
        "only plain cudaMalloc allocations have IPC handles. PyTorch allocates otherwise when "
        "PYTORCH_CUDA_ALLOC_CONF holds expandable_segments:True or backend:cudaMallocAsync "
        f"(here: {_alloc_conf()}); unset that for the engine process, or allocate the KV pool "
        "with CudaKVPool(..., allocator='cudamalloc')"
    )


# -- open (daemon side) -------------------------------------------------------------------------


def check_ipc_handle(handle: object, what: str) -> bytes:
    """Return ``handle`` if it is a 64-byte CUDA IPC handle, else raise naming ``what``.

    Raises:
        CudaIpcError: not bytes of the right length.
    """
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        size = len(handle) if isinstance(handle, (bytes, bytearray)) else type(handle).__name__
        raise CudaIpcError(f"{what} must be a {IPC_HANDLE_BYTES}-byte CUDA IPC handle, got {size}")
    return bytes(handle)


def open_mem_handle(handle: bytes, ordinal: int) -> int:
    """Map another process's allocation (``cudaIpcOpenMemHandle``); return its base address.

    Open each handle once per process and device, and close it with :func:`close_mem_handle`.

    Raises:
        CudaIpcError: the handle cannot be opened (the message has the CUDA error and the
            usual causes).
    """
    handle = check_ipc_handle(handle, "the memory handle")
    cupy = cupy_module()
    try:
        cupy.cuda.runtime.setDevice(ordinal)  # no Device(...) block: its exit switches to GPU 0
        return int(cupy.cuda.runtime.ipcOpenMemHandle(handle))
    except cuda_error_types() as err:
        raise CudaIpcError(
            f"cudaIpcOpenMemHandle on cuda:{ordinal} failed: {err}. The exporting process must "
            "be alive, on this node, another process than this one, and share the IPC namespace "
            "(containers: --ipc=host)"
        ) from err


def close_mem_handle(ptr: int, ordinal: int) -> None:
    """Unmap an allocation opened by :func:`open_mem_handle`.

    Raises:
        CudaIpcError: ``cudaIpcCloseMemHandle`` failed.
    """
    cupy = cupy_module()
    try:
        cupy.cuda.runtime.setDevice(ordinal)
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    except cuda_error_types() as err:
        raise CudaIpcError(
            f"cudaIpcCloseMemHandle({ptr:#x}) on cuda:{ordinal} failed: {err}"
        ) from err


# -- interprocess events ------------------------------------------------------------------------


def create_ipc_event(device: torch.device | int | str) -> tuple[torch.cuda.Event, bytes]:
    """Create an interprocess event (``cudaEventInterprocess | cudaEventDisableTiming``).

    Returns:
        The event and its 64-byte handle, which another process opens with
        :func:`open_ipc_event`. Either process may record the event and wait on it; a wait
        orders after the most recent record issued before the wait call.

    Raises:
        CudaUnavailable: no GPU.
    """
    require_cuda("create_ipc_event")
    ordinal = ordinal_of(device)
    with torch.cuda.device(ordinal):
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        handle = bytes(event.ipc_handle())  # creates the event on the current device
    return event, check_ipc_handle(handle, "the event handle")


def open_ipc_event(handle: bytes, device: torch.device | int | str) -> torch.cuda.Event:
    """Open an event exported by another process with :func:`create_ipc_event`.

    Raises:
        CudaIpcError: the handle is malformed or cannot be opened.
        CudaUnavailable: no GPU.
    """
    handle = check_ipc_handle(handle, "the event handle")
    require_cuda("open_ipc_event")
    ordinal = ordinal_of(device)
    try:
        event: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(
            torch.device("cuda", ordinal), handle
        )
        return event
    except RuntimeError as err:  # torch reports CUDA errors as RuntimeError
        raise CudaIpcError(f"cannot open an interprocess event on cuda:{ordinal}: {err}") from err
