"""kvtierd's CUDA sessions (``memory.kind = "cuda_ipc"``): open, copy, close (docs/gpu.md).

The event loop never touches CUDA here. Everything CUDA runs on one ``kvtier-cuda`` thread:

- REGISTER: importing torch and CuPy (the first time), creating the GPU's context, pinning
  the host pool (the first time), opening the engine's IPC handles and creating the session's
  stream and interprocess events (:meth:`CudaSessions.open`); any error is BAD_MEMORY naming
  why, e.g. on a daemon without a GPU;
- the end of a session: its copier closed (events and stream destroyed) *before* its engine
  memory is unmapped (:meth:`CudaSessions.close_session`), in the order the thread takes them.

Copies themselves run on the copy threads like any other transfer
(:meth:`CudaSessions.run`, called by :mod:`~kvtier.daemon.service.transfers`), never on the
event loop and never split or shared. One thread is enough: registrations are rare, and one
thread keeps a session's close after its open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtier.daemon.transfer.transfer import Transfer
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.ipc.protocol import Geometry, KVMemory

if TYPE_CHECKING:
    import numpy as np
    from kvtier.daemon.transfer.cuda.executor import CudaSessionCopier
    from kvtier.daemon.transfer.cuda.memory import CudaEngineMemory, CudaRuntime

__all__ = ["CudaSessions"]

log = logging.getLogger("kvtier.daemon.cuda")


class CudaSessions:
    """The daemon's CUDA runtime and its ``kvtier-cuda`` thread, both made on first use.

    Creating this imports nothing of CUDA and starts no thread.

    Args:
        copy_mode: the daemon's ``cuda_copy`` setting, read at each registration.
    """

    __slots__ = ("_arena", "_closed", "_copy_mode", "_pool", "_runtime")

    def __init__(self, copy_mode: Callable[[], str] = lambda: "dma") -> None:
        self._copy_mode = copy_mode
        self._closed = False
        self._arena: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._runtime: CudaRuntime | None = None

    def attach(self, arena: np.ndarray) -> None:
        """The host pool's arena (what CUDA copies read and write; pinned on first use)."""
        self._arena = arena

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-cuda")
        return self._pool

    async def open(
        self, geometry: Geometry, memory: KVMemory
    ) -> tuple[CudaEngineMemory, CudaSessionCopier]:
        """Open an engine's ``cuda_ipc`` export and make its session's stream and events.

        Raises:
            CudaMemoryError: (an EngineMemoryError) the daemon has no usable GPU, or the export
                cannot be opened; nothing stays open then.
        """
        if self._closed:
            from kvtier.daemon.transfer.cuda.memory import CudaMemoryError

            raise CudaMemoryError("kvtierd is stopping: its CUDA runtime is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread(), self._open, geometry, memory)

    def _open(
        self, geometry: Geometry, memory: KVMemory
    ) -> tuple[CudaEngineMemory, CudaSessionCopier]:
        """:meth:`open`, on the ``kvtier-cuda`` thread (the first call imports torch)."""
        from kvtier.daemon.transfer.cuda.executor import CudaSessionCopier
        from kvtier.daemon.transfer.cuda.memory import CudaMemoryError, CudaRuntime

        if self._arena is None:
            raise CudaMemoryError("kvtierd is stopping: its CUDA runtime is closed")
        if self._runtime is None:
            self._runtime = CudaRuntime()
        runtime = self._runtime
        runtime.require()
        mem = runtime.open_memory(geometry, memory)
        try:
            runtime.pin_arena(self._arena, mem.ordinal)
            copier = CudaSessionCopier.create(mem, runtime.backend, self._copy_mode())
        except BaseException:
            mem.close()
            raise
        return mem, copier

    def run(self, t: Transfer, memory: Any, block: CompletionBlock, copier: Any) -> TransferStatus:
        """Copy ``t`` (on a copy thread): see
        :func:`~kvtier.daemon.transfer.cuda.executor.run_cuda_transfer`."""
        from kvtier.daemon.transfer.cuda.executor import run_cuda_transfer

        assert self._arena is not None, "attach() first"
        return run_cuda_transfer(t, self._arena, memory, memory.geometry.chunk_bytes, block, copier)

    def close_session(self, copier: Any, memory: Any) -> None:
        """Close a session's copier, then its memory, on the ``kvtier-cuda`` thread (here,
        once that thread has ended at shutdown)."""
        if self._closed:
            _close_session(copier, memory)
        else:
            self._thread().submit(_close_session, copier, memory)

    def close(self) -> None:
        """Wait for the closes queued, then close the runtime (unpins the pool). Call it
        after every session was finalized and before the arena is unmapped."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._runtime is not None:
            self._runtime.close()
        self._arena = None


def _close_session(copier: Any, memory: Any) -> None:
    """Copier first (its stream may still reference the memory), then the memory."""
    try:
        try:
            copier.close()
        finally:
            memory.close()
    except Exception:  # close boundary: the daemon keeps serving the other sessions
        log.exception("closing a CUDA session failed")
