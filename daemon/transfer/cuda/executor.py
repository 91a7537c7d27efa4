"""Page transfers on a GPU: the daemon's copy stream, per-layer interprocess events, and waits.

The CUDA counterpart of :func:`kvtier.daemon.transfer.transfer.run_transfer`. Each session has a
:class:`CudaSessionCopier`, made once at registration: its own CUDA stream and interprocess
events that the engine opens from the handles in its registration reply::

    engine stream:  ... compute ─ rec(ready) ──────────────── wait(ev[0]) L0 ─ wait(ev[1]) L1 ...
                                     │  LOAD request                 ▲             ▲
                                     ▼                               │             │
    daemon stream:            wait(ready) ─ copy L0 ─ rec(ev[0]) ─ copy L1 ─ rec(ev[1]) ─ ...
    completion block:                      layers_done = 1 ──────────── layers_done = 2 ...

- ``ready``: the engine records it on its stream just before sending STORE or LOAD; the daemon's
  stream waits for it first, so a store never reads pages the engine is still writing and a load
  never overwrites pages the engine is still reading.
- ``ev[i]``: recorded after layer ``i``'s copies; the engine's stream waits for it just before
  layer ``i``. No CPU waits for a copy, so loading overlaps computing.
- ``layers_done`` in the completion block means, for a CUDA transfer, "``ev[i]`` is recorded for
  this transfer": a stream wait issued before that record would order after the previous record
  (an earlier transfer) and read stale pages. The engine spins on it, which costs the few
  microseconds the daemon needs to enqueue a layer, never a copy.
- The final status is written by the event loop after :func:`run_cuda_transfer` returns, which it
  does only once the GPU finished every copy: a store's pages are then in the host pool, and the
  engine may reuse the device pages once it sees DONE.

Every CUDA operation goes through the runtime's backend
(:class:`~kvtier.ipc.cuda_backend.DaemonCudaBackend`), each thread setting its GPU explicitly.

Events are reused by every transfer of a session. That is safe because all of them run on one
in-order stream: a wait that picks up a later record than the one it needs only waits longer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
from kvtier.daemon.pool.layout import page_checksums
from kvtier.daemon.transfer.cuda.memory import CudaEngineMemory, CudaMemoryError
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.ipc.cuda_backend import DaemonCudaBackend
from kvtier.ipc.cuda_ipc import CudaIpcError

__all__ = ["GPU_TIMEOUT_S", "CudaSessionCopier", "run_cuda_transfer"]

log = logging.getLogger("kvtier.daemon.cuda")

GPU_TIMEOUT_S = 120.0
"""How long a transfer waits for its copies to finish on the GPU (they wait for the engine's
``ready`` record, so a long engine kernel delays them) before it is declared stuck."""


class CudaSessionCopier:
    """One session's copy stream and interprocess events, created once and reused.

    Attributes:
        backend: the CUDA operations.
        ordinal: the session's GPU (daemon numbering).
        stream: the session's own non-blocking stream (not one of torch's pooled
            streams, so sessions never wait for each other's copies).
        layer_events: one interprocess event per layer, recorded after that layer's copies.
        ready_event: the interprocess event the engine records before each request.
        event_handles: the 64-byte handles of ``layer_events``, for the registration reply.
        ready_handle: the handle of ``ready_event``.
        lock: held while a transfer enqueues, so transfers of a session enqueue one at a time.
        stuck: a copy never finished on the GPU; the stream and events are then never
            destroyed.
    """

    __slots__ = (
        "backend",
        "copy_mode",
        "event_handles",
        "layer_events",
        "lock",
        "ordinal",
        "ready_event",
        "ready_handle",
        "stream",
        "stuck",
    )

    def __init__(
        self,
        backend: DaemonCudaBackend,
        ordinal: int,
        stream: Any,
        events: list[tuple[Any, bytes]],
        copy_mode: str = "dma",
    ) -> None:
        self.backend = backend
        self.copy_mode = copy_mode
        self.ordinal = ordinal
        self.stream: Any = stream
        (self.ready_event, self.ready_handle), layers = events[-1], events[:-1]
        self.layer_events = [e for e, _ in layers]
        self.event_handles = [h for _, h in layers]
        self.lock = threading.Lock()
        self.stuck = False

    @classmethod
    def create(
        cls, memory: CudaEngineMemory, backend: DaemonCudaBackend, copy_mode: str = "dma"
    ) -> CudaSessionCopier:
        """Make the stream and ``num_layers + 1`` events for a session on ``memory``'s GPU;
        its copies go by ``copy_mode`` (the daemon's ``cuda_copy``: ``dma`` or ``kernel``).

        Raises:
            CudaMemoryError: the stream or an event cannot be created (the daemon answers
                BAD_MEMORY, as for memory it cannot open); nothing stays created then.
        """
        ordinal = memory.ordinal
        try:
            backend.use_device(ordinal)
            stream = backend.create_stream(ordinal)
        except CudaIpcError as err:
            raise CudaMemoryError(str(err)) from err
        made: list[tuple[Any, bytes]] = []
        try:
            for _ in range(memory.geometry.num_layers + 1):
                made.append(backend.create_ipc_event(ordinal))
        except BaseException as err:
            for event, _ in made:
                backend.destroy_event(event)
            backend.destroy_stream(stream)
            if isinstance(err, CudaIpcError):
                raise CudaMemoryError(
                    f"cannot create interprocess events on cuda:{ordinal}: {err}"
                ) from err
            raise
        return cls(backend, ordinal, stream, made, copy_mode)

    @property
    def num_layers(self) -> int:
        """Layers (events) of the session."""
        return len(self.layer_events)

    def close(self) -> None:
        """Destroy the events and the stream (unless a copy on it is stuck). Idempotent.

        Call only after every transfer of the session returned, and before the session's
        engine memory is closed.
        """
        stream, self.stream = self.stream, None
        events = [*self.layer_events, self.ready_event]
        self.layer_events = []
        if stream is None:
            return
        if self.stuck:
            log.error(
                "copy stream of a session on cuda:%d left alive: a copy never finished",
                self.ordinal,
            )
            return
        try:
            self.backend.use_device(self.ordinal)
            for event in events:
                self.backend.destroy_event(event)
            self.backend.destroy_stream(stream)
        except CudaIpcError as err:
            log.warning("%s", err)


def _wait_gpu(backend: DaemonCudaBackend, event: Any, deadline: float) -> bool:
    """Poll ``event`` until it completes (True) or ``deadline`` passes (False).

    Polling with short sleeps instead of ``synchronize()`` keeps a worker thread from spinning a
    core, and lets the wait give up.
    """
    delay = 20e-6
    while not backend.query(event):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 200e-6)
    return True


def run_cuda_transfer(
    t: Transfer,
    arena: np.ndarray,
    memory: CudaEngineMemory,
    chunk_bytes: int,
    block: CompletionBlock,
    copier: CudaSessionCopier,
    *,
    gpu_timeout_s: float = GPU_TIMEOUT_S,
) -> TransferStatus:
    """Enqueue every layer of ``t`` on the session's stream, record its events, wait for the GPU.

    Runs in a worker thread, like :func:`~kvtier.daemon.transfer.transfer.run_transfer`. Layer ``i``'s
    copies are launched, ``copier.layer_events[i]`` recorded after them, and then
    ``layers_done = i + 1`` is written to the completion block (see the module docstring).
    Cancellation is checked between layers. The function returns only when the GPU has finished
    every copy it launched, so the event loop may commit, free or unpin the host slots at once.

    Args:
        t: the transfer (its slot was begun by the event loop before the reply went out).
        arena: the host pool as a flat uint8 numpy array, pinned by ``CudaRuntime.pin_arena``.
        memory: the session's engine memory.
        chunk_bytes: bytes of one page of one buffer.
        block: the session's completion block.
        copier: the session's stream and events.
        gpu_timeout_s: how long to wait for the GPU before declaring the copies stuck.

    Returns:
        DONE, CANCELLED or FAILED. When the GPU did not finish in time (or reported an error
        while the copies may still run) the transfer is FAILED, ``t.extra["gpu_pending"]`` is
        True, and ``memory.stuck`` / ``copier.stuck`` are set: a store's slots may still be
        written, so the event loop must keep them out of use, and the engine memory stays mapped.
    """
    status = TransferStatus.DONE
    launched = False
    done: Any = None
    backend = copier.backend
    buffers = memory.buffers
    n_comp = len(buffers[0]) if buffers else 0
    slot_bytes = len(buffers) * n_comp * chunk_bytes  # a whole host page
    try:
        with copier.lock:
            backend.use_device(copier.ordinal)
            host = backend.host_arena(arena)
            stream = copier.stream
            plan = backend.copy_plan(
                t.page_ids,
                t.offsets,
                chunk_bytes,
                slot_bytes,
                copier.ordinal,
                stream,
                copier.copy_mode,
            )
            launched = True  # the plan's offsets are uploading on the stream
            backend.stream_wait(stream, copier.ready_event)
            try:
                for layer, row in enumerate(buffers):
                    if t.cancelled:
                        status = TransferStatus.CANCELLED
                        break
                    if t.direction is Direction.STORE:
                        plan.layer_to_host(host, row, layer, stream=stream)
                    else:
                        plan.layer_from_host(host, row, layer, stream=stream)
                    backend.record(copier.layer_events[layer], stream)
                    block.layer_done(t.slot, layer + 1)
            finally:
                done = backend.marker(stream)  # only once recorded: an unrecorded one reads done
    except Exception:  # a bug, a bad index or a CUDA error: the transfer fails, the daemon stays up
        log.exception("CUDA transfer session=%d slot=%d failed", t.session_id, t.slot)
        status = TransferStatus.FAILED
    if launched:
        deadline = time.monotonic() + gpu_timeout_s
        try:
            finished = done is not None and _wait_gpu(backend, done, deadline)
        except RuntimeError:  # a CUDA error (e.g. a fault) while waiting: the copies' fate unknown
            log.exception(
                "CUDA transfer session=%d slot=%d: waiting for the GPU failed", t.session_id, t.slot
            )
            finished = False
        if not finished:
            log.error(
                "CUDA transfer session=%d slot=%d (%s, %d pages) did not finish on the GPU "
                "within %.0fs; its host slots and the engine memory stay reserved",
                t.session_id,
                t.slot,
                t.direction.value,
                len(t.host_slots),
                gpu_timeout_s,
            )
            t.extra["gpu_pending"] = True
            memory.stuck = True
            copier.stuck = True
            status = TransferStatus.FAILED
    if status is TransferStatus.DONE and t.direction is Direction.STORE and t.checksum:
        # verify_on_adopt: the pages are in the host pool now, checksummed on the CPU
        t.checksums = page_checksums(arena, t.offsets.tolist(), slot_bytes)
    t.status = status
    return status
