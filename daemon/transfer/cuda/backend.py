"""kvtierd's CUDA backend: torch and CuPy behind :class:`~kvtier.ipc.cuda_backend.DaemonCudaBackend`.

:class:`TorchCupyBackend` is what a daemon on a GPU machine uses. :func:`daemon_backend` returns
the process's backend: this one, unless another was installed with :func:`install_backend`
before the daemon started (a launcher that runs the daemon's own ``main`` does that; nothing in
the daemon selects a backend by itself).

Every CuPy call sets its GPU explicitly for the calling thread first (``cudaSetDevice``), never
with ``cupy.cuda.Device`` as a context manager: its exit switches back to the previously
current device, device 0 on a fresh thread, and so creates a context on GPU 0 of a multi-GPU
node that no session uses.

This module imports torch (through :mod:`kvtier.ipc.cuda_ipc`); the daemon imports it only in
its ``kvtier-cuda`` threads, never on the event loop.
"""

from __future__ import annotations

import resource
import threading
from typing import Any

import numpy as np
import torch
from kvtier.ipc import cuda_ipc
from kvtier.ipc.cuda_backend import CopyPlan, DaemonCudaBackend
from kvtier.ipc.cuda_ipc import CudaIpcError

__all__ = ["TorchCupyBackend", "daemon_backend", "install_backend"]

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit sync with the legacy stream

_installed: list[DaemonCudaBackend] = []
_lock = threading.Lock()


def install_backend(backend: DaemonCudaBackend) -> None:
    """Make ``backend`` the process's CUDA backend (before the daemon starts; once)."""
    with _lock:
        if _installed:
            raise RuntimeError("a CUDA backend is installed already")
        _installed.append(backend)


def daemon_backend() -> DaemonCudaBackend:
    """The process's CUDA backend (:class:`TorchCupyBackend` unless another was installed)."""
    with _lock:
        if not _installed:
            _installed.append(TorchCupyBackend())
        return _installed[0]


class _Stream:
    """A raw CUDA stream and torch's view of it."""

    __slots__ = ("ordinal", "raw", "torch")

    def __init__(self, raw: int, ordinal: int) -> None:
        self.raw, self.ordinal = raw, ordinal
        self.torch = torch.cuda.ExternalStream(raw, device=torch.device("cuda", ordinal))


class TorchCupyBackend:
    """The real backend: CuPy's runtime calls, torch's events and tensors, the copy plan of
    :mod:`kvtier.kernels.cuda_copy`."""

    def unavailable_reason(self) -> str | None:
        """See :func:`kvtier.ipc.cuda_runtime.cuda_unavailable_reason`."""
        return cuda_ipc.cuda_unavailable_reason()

    def device_ordinal(self, uuid: str) -> int:
        """See :func:`kvtier.ipc.cuda_device.device_ordinal`."""
        return cuda_ipc.device_ordinal(uuid)

    def use_device(self, ordinal: int) -> None:
        """``cudaSetDevice`` for CuPy and torch on this thread."""
        cuda_ipc.cupy_module().cuda.runtime.setDevice(ordinal)
        torch.cuda.set_device(ordinal)

    def pin_host(self, arena: np.ndarray, ordinal: int) -> bool:
        """``cudaHostRegister(portable | mapped)`` of the whole pool."""
        cupy = cuda_ipc.cupy_module()
        ptr, nbytes = int(arena.ctypes.data), int(arena.nbytes)
        try:
            self.use_device(ordinal)
            cupy.cuda.runtime.hostRegister(
                ptr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
            )
        except cupy.cuda.runtime.CUDARuntimeError as err:
            if getattr(err, "status", None) == _ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                return False  # pinned by someone else in this process: keep it
            soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            raise CudaIpcError(
                f"cannot pin the host pool ({nbytes} bytes) with cudaHostRegister: {err} "
                f"(RLIMIT_MEMLOCK soft={soft} hard={hard}; run kvtierd with "
                "LimitMEMLOCK=infinity)"
            ) from err
        return True

    def unpin_host(self, arena: np.ndarray, ordinal: int) -> None:
        """``cudaHostUnregister`` of the pool."""
        cupy = cuda_ipc.cupy_module()
        try:
            self.use_device(ordinal)
            cupy.cuda.runtime.hostUnregister(int(arena.ctypes.data))
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise CudaIpcError(f"cudaHostUnregister of the host pool failed: {err}") from err

    def open_mem(self, handle: bytes, ordinal: int) -> int:
        """See :func:`kvtier.ipc.cuda_ipc.open_mem_handle`."""
        return cuda_ipc.open_mem_handle(handle, ordinal)

    def mapped_size(self, ptr: int) -> int | None:
        """See :func:`kvtier.ipc.cuda_alloc.mapped_range`."""
        rng = cuda_ipc.mapped_range(ptr)
        return None if rng is None else rng.size

    def close_mem(self, ptr: int, ordinal: int) -> None:
        """See :func:`kvtier.ipc.cuda_ipc.close_mem_handle`."""
        cuda_ipc.close_mem_handle(ptr, ordinal)

    def device_bytes(self, ptr: int, nbytes: int, ordinal: int) -> Any:
        """See :func:`kvtier.ipc.cuda_alloc.device_tensor`."""
        return cuda_ipc.device_tensor(ptr, nbytes, ordinal)

    def host_arena(self, arena: np.ndarray) -> Any:
        """A torch view of the pool (no copy)."""
        return torch.from_numpy(arena)

    def create_stream(self, ordinal: int) -> Any:
        """``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` on ``ordinal``."""
        cupy = cuda_ipc.cupy_module()
        try:
            self.use_device(ordinal)
            raw = int(cupy.cuda.runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING))
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise CudaIpcError(f"cannot create a CUDA stream on cuda:{ordinal}: {err}") from err
        return _Stream(raw, ordinal)

    def destroy_stream(self, stream: Any) -> None:
        """``cudaStreamDestroy``."""
        cupy = cuda_ipc.cupy_module()
        try:
            self.use_device(stream.ordinal)
            cupy.cuda.runtime.streamDestroy(stream.raw)
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise CudaIpcError(f"cudaStreamDestroy failed: {err}") from err

    def create_ipc_event(self, ordinal: int) -> tuple[Any, bytes]:
        """See :func:`kvtier.ipc.cuda_ipc.create_ipc_event`."""
        self.use_device(ordinal)
        try:
            return cuda_ipc.create_ipc_event(ordinal)
        except RuntimeError as err:  # torch reports CUDA errors as RuntimeError
            raise CudaIpcError(f"cannot create an interprocess event: {err}") from err

    def destroy_event(self, event: Any) -> None:
        """torch destroys an event with its last reference."""

    def record(self, event: Any, stream: Any) -> None:
        """``cudaEventRecord``."""
        event.record(stream.torch)

    def stream_wait(self, stream: Any, event: Any) -> None:
        """``cudaStreamWaitEvent``."""
        stream.torch.wait_event(event)

    def marker(self, stream: Any) -> Any:
        """A plain event recorded on ``stream``."""
        marker = torch.cuda.Event()
        marker.record(stream.torch)
        return marker

    def query(self, event: Any) -> bool:
        """``cudaEventQuery`` (a CUDA error raises RuntimeError)."""
        return bool(event.query())

    def copy_plan(
        self,
        page_ids: np.ndarray,
        offsets: np.ndarray,
        chunk_bytes: int,
        slot_bytes: int,
        ordinal: int,
        stream: Any,
        mode: str = "dma",
    ) -> CopyPlan:
        """:class:`~kvtier.kernels.cuda_plan.CudaCopyPlan` on ``stream``, by ``mode``."""
        from kvtier.kernels.cuda_copy import CudaCopyPlan
        from kvtier.kernels.cuda_dma import check_mode

        plan = CudaCopyPlan.build(
            page_ids,
            offsets,
            chunk_bytes,
            device=torch.device("cuda", ordinal),
            slot_bytes=slot_bytes,
            stream=stream.torch,
            mode=check_mode(mode),
        )
        return _TorchPlan(plan)


class _TorchPlan:
    """CudaCopyPlan's layer copies, with this backend's streams."""

    __slots__ = ("_plan",)

    def __init__(self, plan: Any) -> None:
        self._plan = plan

    def layer_to_host(self, arena: Any, row: Any, layer: int, *, stream: Any) -> None:
        """See ``CudaCopyPlan.layer_to_host``."""
        self._plan.layer_to_host(arena, row, layer, stream=stream.torch)

    def layer_from_host(self, arena: Any, row: Any, layer: int, *, stream: Any) -> None:
        """See ``CudaCopyPlan.layer_from_host``."""
        self._plan.layer_from_host(arena, row, layer, stream=stream.torch)
