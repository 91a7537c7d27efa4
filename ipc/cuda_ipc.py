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
their GPU by UUID, written as ``nvidia-smi -L`` prints it (``GPU-8-4-4-4-12`` hex digits).

cupy (the ``cuda`` extra) is imported on first use and torch's CUDA state is touched only by the
functions that need it, so this module imports on machines with neither cupy nor a GPU; a call
there raises :class:`CudaUnavailable` with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvtier.config.errors import KvtierError
from kvtier.ipc.protocol import KVMemory, MemorySegment

__all__ = [
    "IPC_HANDLE_BYTES",
    "NEEDS_GPU",
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
UUID_BYTES = 16
NEEDS_GPU = "needs an NVIDIA GPU with cupy (pip install -e .[cuda])"
"""The reason every CUDA-only entry point (and test) gives on a machine without one."""

# CUpointer_attribute values (cuda.h, stable since CUDA 10.2).
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_UUID_RE = re.compile(r"^(?:gpu-|mig-)?([0-9a-f]{8})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{4})"
                      r"-?([0-9a-f]{12})$")


class CudaIpcError(KvtierError):
    """CUDA memory or an event could not be exported or opened; the message says why."""


class CudaUnavailable(CudaIpcError, RuntimeError):
    """A CUDA-only operation was called where there is no GPU or no cupy."""


# -- availability -------------------------------------------------------------------------------


def cuda_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here, or None when it can.

    Returns:
        None when torch sees a CUDA device and cupy is installed; otherwise a sentence that
        starts with :data:`NEEDS_GPU`. Does not create a CUDA context.
    """
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"{NEEDS_GPU}: torch {torch.__version__} ({build}) sees no CUDA device"
    if importlib.util.find_spec("cupy") is None:
        return f"{NEEDS_GPU}: cupy is not installed"
    return None


def require_cuda(what: str) -> None:
    """Raise :class:`CudaUnavailable` naming ``what`` unless the GPU path can run here.

    Args:
        what: the operation, e.g. ``"CudaKVPool"``, used as the message's subject.
    """
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise CudaUnavailable(f"{what} {reason}")


def cupy_module() -> Any:
    """Import and return cupy.

    Raises:
        CudaUnavailable: cupy is missing, or installed but does not load (e.g. built for
            another CUDA major version than the driver's).
    """
    try:
        import cupy
    except ImportError as err:
        raise CudaUnavailable(f"{NEEDS_GPU}: cupy does not import: {err}") from err
    return cupy


def _cuda_error_types() -> tuple[type[BaseException], ...]:
    """The exception types cupy's runtime wrappers raise."""
    cupy = cupy_module()
    return (cupy.cuda.runtime.CUDARuntimeError,)


def ordinal_of(device: torch.device | int | str) -> int:
    """The CUDA ordinal (in this process) of ``device``; ``"cuda"`` means the current device.

    Raises:
        CudaIpcError: ``device`` is not a CUDA device.
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise CudaIpcError(f"device must be a CUDA device, got {dev}")
    return torch.cuda.current_device() if dev.index is None else int(dev.index)


# -- device identity ----------------------------------------------------------------------------


def format_device_uuid(raw: bytes) -> str:
    """Write a 16-byte device UUID as ``nvidia-smi -L`` does: ``GPU-xxxxxxxx-xxxx-...``.

    Raises:
        CudaIpcError: ``raw`` is not 16 bytes.
    """
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != UUID_BYTES:
        raise CudaIpcError(f"a device UUID has {UUID_BYTES} bytes, got {raw!r}")
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def parse_device_uuid(text: str) -> bytes:
    """The 16 bytes of a device UUID written as :func:`format_device_uuid` (or torch) writes it.

    Accepts an optional ``GPU-`` / ``MIG-`` prefix, any case, with or without dashes.

    Raises:
        CudaIpcError: ``text`` is not a device UUID.
    """
    m = _UUID_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if m is None:
        raise CudaIpcError(f"device_uuid = {text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-"
                           "xxxx-xxxxxxxxxxxx)")
    return bytes.fromhex("".join(m.groups()))


def device_uuid(device: torch.device | int | str) -> str:
    """The UUID of a visible GPU, formatted by :func:`format_device_uuid`.

    Asks torch first (its ``_CudaDeviceProperties.uuid``), then cupy (whose property dictionary
    loses UUIDs with a zero byte, so only a 16-byte answer is used).

    Raises:
        CudaUnavailable: no GPU.
        CudaIpcError: neither torch nor cupy reports the UUID.
    """
    require_cuda("device_uuid")
    ordinal = ordinal_of(device)
    uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    if uuid is not None:
        raw = getattr(uuid, "bytes", None)
        if raw is not None and len(raw) == UUID_BYTES:
            return format_device_uuid(bytes(raw))
        return format_device_uuid(parse_device_uuid(str(uuid)))
    raw = cupy_module().cuda.runtime.getDeviceProperties(ordinal).get("uuid", b"")
    if isinstance(raw, bytes) and len(raw) == UUID_BYTES:
        return format_device_uuid(raw)
    raise CudaIpcError(f"cannot read the UUID of cuda:{ordinal} from torch or cupy")


def device_ordinal(uuid: str) -> int:
    """The ordinal, in this process, of the GPU with ``uuid``.

    Raises:
        CudaIpcError: ``uuid`` is malformed, or no visible GPU has it (the message lists the
            visible ones and ``CUDA_VISIBLE_DEVICES``).
    """
    want = parse_device_uuid(uuid)
    require_cuda("device_ordinal")
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    for i, u in enumerate(seen):
        if parse_device_uuid(u) == want:
            return i
    raise CudaIpcError(
        f"GPU {uuid} is not visible to this process (it sees {seen}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); the engine and kvtierd must "
        "run on the same node and see the same GPU"
    )


# -- allocations --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllocationRange:
    """One device allocation.

    Attributes:
        base: its first address (what ``cudaIpcGetMemHandle`` names).
        size: its size in bytes.
        ipc_capable: whether it has a legacy CUDA IPC handle (False for the virtual memory API
            and stream-ordered pools; None when unknown).
    """

    base: int
    size: int
    ipc_capable: bool | None = None

    def __contains__(self, ptr: object) -> bool:
        return isinstance(ptr, int) and self.base <= ptr < self.base + self.size


@functools.cache
def _libcuda() -> Any | None:
    """The CUDA driver library loaded by ctypes, or None where it is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuPointerGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return lib


def _pointer_attribute(lib: Any, attribute: int, ptr: int) -> int | None:
    """``cuPointerGetAttribute`` as an integer, or None when the driver refuses."""
    # 8 zeroed bytes: integer attributes fill the low bytes (little-endian), pointers all 8
    value = ctypes.c_uint64(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ctypes.c_uint64(ptr))
    return int(value.value) if rc == 0 else None


def range_from_snapshot(snapshot: Iterable[Mapping[str, Any]], ptr: int,
                        ordinal: int) -> AllocationRange | None:
    """Find the allocation holding ``ptr`` in ``torch.cuda.memory_snapshot()`` segments.

    Args:
        snapshot: segment dictionaries (``device``, ``address``, ``total_size``,
            ``is_expandable`` where torch reports it).
        ptr: a device address.
        ordinal: the device the address is on.

    Returns:
        The segment's range, or None when no segment of the caching allocator holds ``ptr``.
    """
    for seg in snapshot:
        base, size = int(seg.get("address", 0)), int(seg.get("total_size", 0))
        if int(seg.get("device", -1)) == ordinal and base <= ptr < base + size:
            return AllocationRange(base, size, not bool(seg.get("is_expandable", False)))
    return None


def mapped_range(ptr: int) -> AllocationRange | None:
    """The allocation or mapping holding device address ``ptr``, from the CUDA driver.

    Returns:
        Its range and IPC capability, or None where the driver cannot be asked (no
        ``libcuda.so.1`` for ctypes) or does not know the address.
    """
    lib = _libcuda()
    if lib is None:
        return None
    base = _pointer_attribute(lib, _ATTR_RANGE_START_ADDR, ptr)
    size = _pointer_attribute(lib, _ATTR_RANGE_SIZE, ptr)
    if base is None or size is None or size == 0:
        return None
    capable = _pointer_attribute(lib, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
    return AllocationRange(base, size, None if capable is None else bool(capable))


def allocation_range(ptr: int, ordinal: int,
                     known: Sequence[AllocationRange] = ()) -> AllocationRange:
    """The allocation holding ``ptr``: from ``known``, the CUDA driver, or torch's allocator.

    Raises:
        CudaIpcError: none of them knows the address.
    """
    for rng in known:
        if ptr in rng:
            return rng
    from_driver = mapped_range(ptr)
    if from_driver is not None:
        return from_driver
    from_torch = range_from_snapshot(torch.cuda.memory_snapshot(), ptr, ordinal)
    if from_torch is not None:
        return from_torch
    raise CudaIpcError(f"cannot find the allocation holding {ptr:#x} on cuda:{ordinal} (the "
                       "CUDA driver could not be asked and torch's caching allocator does not "
                       "own it)")


def _alloc_conf() -> str:
    return ";".join(f"{v}={os.environ[v]!r}" for v in _ALLOC_CONF_VARS if v in os.environ) or \
        "PYTORCH_CUDA_ALLOC_CONF unset"


def _not_exportable(ptr: int, ordinal: int, detail: str) -> CudaIpcError:
    return CudaIpcError(
        f"CUDA memory at {ptr:#x} on cuda:{ordinal} cannot be exported by CUDA IPC ({detail}): "
        "only plain cudaMalloc allocations have IPC handles. PyTorch allocates otherwise when "
        "PYTORCH_CUDA_ALLOC_CONF holds expandable_segments:True or backend:cudaMallocAsync "
        f"(here: {_alloc_conf()}); unset that for the engine process, or allocate the KV pool "
        "with CudaKVPool(..., allocator='cudamalloc')"
    )


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
        return KVMemory(kind="cuda_ipc", num_pages=num_pages, segments=list(self.segments),
                        buffer_segments=list(self.buffer_segments),
                        buffer_offsets=list(self.buffer_offsets))


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
            raise CudaIpcError(f"tensors[{i}] must be contiguous and non-empty, got shape "
                               f"{tuple(t.shape)} and strides {t.stride()}")
        if device is not None and t.device != device:
            raise CudaIpcError(f"tensors[{i}] is on {t.device}, tensors[0] on {device}: one "
                               "registration exports one GPU")
        device = t.device
    assert device is not None
    return device


def export_tensors(tensors: Sequence[torch.Tensor],
                   known: Sequence[AllocationRange] = ()) -> CudaExport:
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
    errors = _cuda_error_types()
    ordinal = ordinal_of(device)
    uuid = device_uuid(ordinal)
    segments: list[MemorySegment] = []
    index_of: dict[int, int] = {}
    seg_of: list[int] = []
    offsets: list[int] = []
    with torch.cuda.device(ordinal), cupy.cuda.Device(ordinal):
        for i, t in enumerate(tensors):
            ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
            rng = allocation_range(ptr, ordinal, known)
            if rng.ipc_capable is False:
                raise _not_exportable(ptr, ordinal, "the driver reports it is not IPC capable")
            if ptr + nbytes > rng.base + rng.size:
                raise CudaIpcError(f"tensors[{i}] ({nbytes} bytes at {ptr:#x}) runs past its "
                                   f"allocation [{rng.base:#x}, +{rng.size})")
            if rng.base not in index_of:
                try:
                    handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(rng.base))
                except errors as err:
                    raise _not_exportable(ptr, ordinal, f"cudaIpcGetMemHandle: {err}") from err
                check_ipc_handle(handle, f"the handle of tensors[{i}]")
                index_of[rng.base] = len(segments)
                segments.append(MemorySegment(name=f"cuda-ipc:{os.getpid()}:{rng.base:#x}",
                                              size=rng.size, handle=handle, device_uuid=uuid))
            seg_of.append(index_of[rng.base])
            offsets.append(ptr - rng.base)
    return CudaExport(segments, seg_of, offsets)


class _CudaMallocBlock:
    """Owns one ``cudaMalloc`` allocation; frees it when garbage collected."""

    __slots__ = ("__weakref__", "_finalizer", "nbytes", "ordinal", "ptr")

    def __init__(self, ptr: int, nbytes: int, ordinal: int) -> None:
        self.ptr, self.nbytes, self.ordinal = ptr, nbytes, ordinal
        self._finalizer = weakref.finalize(self, _cuda_free, ptr, ordinal)


def _cuda_free(ptr: int, ordinal: int) -> None:
    cupy = cupy_module()
    try:
        with cupy.cuda.Device(ordinal):
            cupy.cuda.runtime.free(ptr)  # synchronises the device: no copy still uses it
    except cupy.cuda.runtime.CUDARuntimeError:
        pass  # the CUDA runtime is already shut down at interpreter exit: the driver frees it


class _DeviceBytes:
    """Device bytes described by ``__cuda_array_interface__`` (v2), so torch can wrap them.

    Holds ``owner`` (or nothing) alive for as long as any tensor over the bytes lives.
    """

    __slots__ = ("nbytes", "owner", "ptr")

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.ptr, self.nbytes, self.owner = ptr, nbytes, owner

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 2}


def device_tensor(ptr: int, nbytes: int, device: torch.device | int | str,
                  owner: object = None) -> torch.Tensor:
    """A 1-D uint8 CUDA tensor over ``nbytes`` of device memory at ``ptr`` (no copy).

    Args:
        ptr: device address (e.g. from :func:`open_mem_handle`).
        nbytes: length in bytes (> 0).
        device: the GPU the address belongs to.
        owner: kept alive while any tensor over the bytes lives (None: the caller owns them).

    Raises:
        CudaIpcError: torch copied the memory instead of wrapping it (it must never do so).
    """
    require_cuda("device_tensor")
    ordinal = ordinal_of(device)
    if nbytes <= 0:
        raise CudaIpcError(f"nbytes must be > 0, got {nbytes!r}")
    with torch.cuda.device(ordinal):
        t = torch.as_tensor(_DeviceBytes(ptr, nbytes, owner), device=torch.device("cuda", ordinal))
    if t.data_ptr() != ptr:
        raise CudaIpcError(f"torch copied the memory at {ptr:#x} instead of wrapping it")
    return t


def empty_ipc_capable(nbytes: int, device: torch.device | int | str) -> tuple[torch.Tensor,
                                                                              AllocationRange]:
    """Allocate ``nbytes`` with ``cudaMalloc`` itself, bypassing torch's caching allocator.

    The memory is IPC capable whatever ``PYTORCH_CUDA_ALLOC_CONF`` says, and is freed when the
    last tensor over it is garbage collected.

    Returns:
        A 1-D uint8 tensor over the allocation (uninitialised), and the allocation's range
        (pass it to :func:`export_tensors` as ``known``).

    Raises:
        CudaUnavailable: no GPU or no cupy.
        CudaIpcError: ``cudaMalloc`` failed (the message has the CUDA error).
    """
    require_cuda("empty_ipc_capable")
    cupy = cupy_module()
    ordinal = ordinal_of(device)
    try:
        with cupy.cuda.Device(ordinal):
            ptr = int(cupy.cuda.runtime.malloc(nbytes))
    except _cuda_error_types() as err:
        raise CudaIpcError(f"cudaMalloc of {nbytes} bytes on cuda:{ordinal} failed: {err}") from err
    block = _CudaMallocBlock(ptr, nbytes, ordinal)
    return device_tensor(ptr, nbytes, ordinal, owner=block), AllocationRange(ptr, nbytes, True)


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
        with cupy.cuda.Device(ordinal):
            return int(cupy.cuda.runtime.ipcOpenMemHandle(handle))
    except _cuda_error_types() as err:
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
        with cupy.cuda.Device(ordinal):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    except _cuda_error_types() as err:
        raise CudaIpcError(f"cudaIpcCloseMemHandle({ptr:#x}) on cuda:{ordinal} failed: {err}") from err


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
        return torch.cuda.Event.from_ipc_handle(torch.device("cuda", ordinal), handle)
    except RuntimeError as err:  # torch reports CUDA errors as RuntimeError
        raise CudaIpcError(f"cannot open an interprocess event on cuda:{ordinal}: {err}") from err
