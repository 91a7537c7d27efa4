"""Device allocations: the allocation holding an address, and IPC-capable memory of our own.

A CUDA IPC handle names a whole ``cudaMalloc`` allocation, so exporting a tensor starts by finding
the allocation it lives in: the CUDA driver knows (``cuPointerGetAttribute``, through ctypes,
when ``libcuda.so.1`` loads), and so does torch's caching allocator for its own segments. The
driver also says whether an allocation has a legacy IPC handle at all (memory from the virtual
memory API or a stream-ordered pool has none).

:func:`empty_ipc_capable` sidesteps torch's allocator settings by calling ``cudaMalloc`` itself;
:func:`device_tensor` wraps such raw device memory (or an opened IPC mapping) as a torch tensor
without copying it.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvtier.ipc.cuda_runtime import (
    CudaIpcError,
    cuda_error_types,
    cupy_module,
    ordinal_of,
    require_cuda,
)

__all__ = [
    "AllocationRange",
    "allocation_range",
    "device_tensor",
    "empty_ipc_capable",
    "mapped_range",
    "range_from_snapshot",
    "use_device",
]

# CUpointer_attribute values (cuda.h, stable since CUDA 10.2).
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12


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


def range_from_snapshot(
    snapshot: Iterable[Mapping[str, Any]], ptr: int, ordinal: int
) -> AllocationRange | None:
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


def allocation_range(
    ptr: int, ordinal: int, known: Sequence[AllocationRange] = ()
) -> AllocationRange:
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
    raise CudaIpcError(
        f"cannot find the allocation holding {ptr:#x} on cuda:{ordinal} (the "
        "CUDA driver could not be asked and torch's caching allocator does not "
        "own it)"
    )


class _CudaMallocBlock:
    """Owns one ``cudaMalloc`` allocation; frees it when garbage collected."""

    __slots__ = ("__weakref__", "_finalizer", "nbytes", "ordinal", "ptr")

    def __init__(self, ptr: int, nbytes: int, ordinal: int) -> None:
        self.ptr, self.nbytes, self.ordinal = ptr, nbytes, ordinal
        self._finalizer = weakref.finalize(self, _cuda_free, ptr, ordinal)


def use_device(cupy: Any, ordinal: int) -> None:
    """Make GPU ``ordinal`` current on the calling thread, and leave it current: never
    ``with cupy.cuda.Device(...)``, whose exit makes current again the device that was
    current before it: GPU 0 on a thread that never chose one (a CUDA context there,
    hundreds of MiB, on a GPU the engine does not use)."""
    runtime = cupy.cuda.runtime
    if runtime.getDevice() != ordinal:
        runtime.setDevice(ordinal)


def _cuda_free(ptr: int, ordinal: int) -> None:
    """Free a block (a finalizer: it runs in whatever thread drops the last reference). A
    thread that had a GPU current gets it back; one that had none is not given GPU 0."""
    cupy = cupy_module()
    runtime = cupy.cuda.runtime
    try:
        before = runtime.getDevice() if cupy.cuda.driver.ctxGetCurrent() != 0 else None
        use_device(cupy, ordinal)
        runtime.free(ptr)  # synchronises the device: no copy still uses it
        if before is not None and before != ordinal:
            runtime.setDevice(before)
    except runtime.CUDARuntimeError:
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
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 2,
        }


def device_tensor(
    ptr: int, nbytes: int, device: torch.device | int | str, owner: object = None
) -> torch.Tensor:
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


def empty_ipc_capable(
    nbytes: int, device: torch.device | int | str
) -> tuple[torch.Tensor, AllocationRange]:
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
        use_device(cupy, ordinal)
        ptr = int(cupy.cuda.runtime.malloc(nbytes))
    except cuda_error_types() as err:
        raise CudaIpcError(f"cudaMalloc of {nbytes} bytes on cuda:{ordinal} failed: {err}") from err
    block = _CudaMallocBlock(ptr, nbytes, ordinal)
    return device_tensor(ptr, nbytes, ordinal, owner=block), AllocationRange(ptr, nbytes, True)
