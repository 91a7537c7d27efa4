"""The CUDA operations kvtier's GPU path uses, as two small interfaces (engine and daemon).

The daemon's CUDA sessions (:mod:`kvtier.daemon.transfer.cuda`) and the engine's side of them
(:class:`~kvtier.client.kv_pool.cuda.CudaKVPool`, :class:`~kvtier.client.connection.cuda_wait.
CudaLayerWaiter`) reach CUDA only through these interfaces, so that everything around them
(the registration, the session lifecycle, the waits, the failure handling) is the same code
whichever implementation runs. The real ones use torch and CuPy
(:class:`TorchEngineBackend` here, ``kvtier.daemon.transfer.cuda.backend.TorchCupyBackend``
in the daemon); the test suite has a fake over shared memory for machines without a GPU.

Objects a backend hands out (streams, events, buffers, plans) are opaque to the callers:
they only pass them back to the same backend.

Device selection is explicit and per thread (``use_device``): never a context manager that
switches back on exit, which would create a context on a GPU the session does not use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["CopyPlan", "DaemonCudaBackend", "EngineCudaBackend", "TorchEngineBackend"]


class CopyPlan(Protocol):
    """The page copies of one transfer, launched a layer at a time on a stream."""

    def layer_to_host(self, arena: Any, row: Sequence[Any], layer: int, *, stream: Any) -> None:
        """Copy layer ``layer`` of the transfer's pages from ``row`` into the host arena."""

    def layer_from_host(self, arena: Any, row: Sequence[Any], layer: int, *, stream: Any) -> None:
        """Copy layer ``layer`` of the transfer's pages from the host arena into ``row``."""


class EngineCudaBackend(Protocol):
    """What an engine process needs: its KV pool's memory and the daemon's events."""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here, or None."""

    def ordinal_of(self, device: Any) -> int:
        """The ordinal of ``device`` (``"cuda"``: the current one)."""

    def allocate(self, nbytes: int, ordinal: int) -> tuple[Any, Any]:
        """``nbytes`` of exportable device memory: a flat uint8 tensor, and what the export needs."""

    def export(self, flat: Any, known: Any) -> tuple[Any, int]:
        """The ``MemorySegment`` of ``flat``'s allocation and ``flat``'s offset in it."""

    def open_ipc_event(self, handle: bytes, ordinal: int) -> Any:
        """Open an event another process exported."""

    def close_event(self, event: Any) -> None:
        """Drop an opened event."""

    def current_stream(self, ordinal: int) -> Any:
        """The calling thread's current stream on ``ordinal``."""

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (None: the current stream)."""

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` (None: the current stream) wait for ``event``'s latest record."""

    def synchronize(self, ordinal: int) -> None:
        """Wait until GPU ``ordinal`` has run everything issued to it, on every stream."""


class DaemonCudaBackend(Protocol):
    """What kvtierd needs to serve a CUDA session (see docs/gpu.md)."""

    def unavailable_reason(self) -> str | None:
        """Why this daemon cannot serve CUDA engines (no GPU, no CuPy), or None."""

    def device_ordinal(self, uuid: str) -> int:
        """The ordinal, here, of the GPU named ``uuid`` (raises CudaIpcError if not visible)."""

    def use_device(self, ordinal: int) -> None:
        """Make ``ordinal`` this thread's current device."""

    def pin_host(self, arena: np.ndarray, ordinal: int) -> bool:
        """Page-lock and map the host pool; False when it was pinned already (not by us)."""

    def unpin_host(self, arena: np.ndarray, ordinal: int) -> None:
        """Undo :meth:`pin_host`."""

    def open_mem(self, handle: bytes, ordinal: int) -> int:
        """Open an engine's memory handle; its base address (raises CudaIpcError)."""

    def mapped_size(self, ptr: int) -> int | None:
        """Bytes mapped at ``ptr`` as the driver reports them (None: unknown)."""

    def close_mem(self, ptr: int, ordinal: int) -> None:
        """Close what :meth:`open_mem` opened (raises CudaIpcError)."""

    def device_bytes(self, ptr: int, nbytes: int, ordinal: int) -> Any:
        """A flat uint8 buffer over ``nbytes`` at ``ptr`` (sliceable, ``reshape``-able)."""

    def host_arena(self, arena: np.ndarray) -> Any:
        """The host pool as the copies take it."""

    def create_stream(self, ordinal: int) -> Any:
        """A new non-blocking stream of the session."""

    def destroy_stream(self, stream: Any) -> None:
        """Destroy a stream made by :meth:`create_stream`."""

    def create_ipc_event(self, ordinal: int) -> tuple[Any, bytes]:
        """An interprocess event and its 64-byte handle."""

    def destroy_event(self, event: Any) -> None:
        """Destroy an event made by :meth:`create_ipc_event`."""

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``."""

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``'s latest record."""

    def marker(self, stream: Any) -> Any:
        """Record and return a plain event on ``stream`` (what :meth:`query` polls)."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed (raises RuntimeError on a GPU fault)."""

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
        """Plan a transfer's copies (its index arrays uploading on ``stream``), by DMA
        (``mode="dma"``) or by copy kernels (``"kernel"``)."""


class TorchEngineBackend:
    """The real engine side: torch's CUDA allocator and events, CuPy's IPC handles."""

    def unavailable_reason(self) -> str | None:
        """See :func:`kvtier.ipc.cuda_runtime.cuda_unavailable_reason`."""
        from kvtier.ipc.cuda_runtime import cuda_unavailable_reason

        return cuda_unavailable_reason()

    def ordinal_of(self, device: Any) -> int:
        """See :func:`kvtier.ipc.cuda_runtime.ordinal_of`."""
        from kvtier.ipc.cuda_runtime import ordinal_of

        return ordinal_of(device)

    def allocate(self, nbytes: int, ordinal: int) -> tuple[Any, Any]:
        """Not used: :class:`CudaKVPool` allocates through torch or CuPy itself."""
        raise NotImplementedError("CudaKVPool allocates real device memory itself")

    def export(self, flat: Any, known: Any) -> tuple[Any, int]:
        """See :func:`kvtier.ipc.cuda_ipc.export_tensors`."""
        from kvtier.ipc.cuda_ipc import export_tensors

        whole = export_tensors([flat], known=known)
        return whole.segments[0], whole.buffer_offsets[0]

    def open_ipc_event(self, handle: bytes, ordinal: int) -> Any:
        """See :func:`kvtier.ipc.cuda_ipc.open_ipc_event`."""
        from kvtier.ipc.cuda_ipc import open_ipc_event

        return open_ipc_event(handle, ordinal)

    def close_event(self, event: Any) -> None:
        """torch destroys the event with its last reference."""

    def current_stream(self, ordinal: int) -> Any:
        """``torch.cuda.current_stream(ordinal)``."""
        import torch

        return torch.cuda.current_stream(ordinal)

    def record(self, event: Any, stream: Any) -> None:
        """``event.record(stream)``."""
        event.record(stream)

    def stream_wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)``."""
        stream.wait_event(event)

    def synchronize(self, ordinal: int) -> None:
        """``torch.cuda.synchronize(ordinal)``."""
        import torch

        torch.cuda.synchronize(ordinal)
