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

Events are reused by every transfer of a session. That is safe because all of them run on one
in-order stream: a wait that picks up a later record than the one it needs only waits longer.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch
from kvtier.daemon.transfer.cuda.memory import CudaEngineMemory, CudaMemoryError, arena_tensor
from kvtier.daemon.transfer.transfer import Direction, Transfer
from kvtier.ipc import cuda_ipc
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.kernels.cuda_copy import CudaCopyPlan

__all__ = ["GPU_TIMEOUT_S", "CudaSessionCopier", "run_cuda_transfer"]

log = logging.getLogger("kvtier.daemon.cuda")

GPU_TIMEOUT_S = 120.0
"""How long a transfer waits for its copies to finish on the GPU (they wait for the engine's
``ready`` record, so a long engine kernel delays them) before it is declared stuck."""
_STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit sync with the legacy stream


class CudaSessionCopier:
    """One session's copy stream and interprocess events, created once and reused.

    Attributes:
        device: the session's GPU (daemon numbering).
        stream: the session's own non-blocking CUDA stream (not one of torch's pooled
            streams, so sessions never wait for each other's copies).
        layer_events: one interprocess event per layer, recorded after that layer's copies.
        ready_event: the interprocess event the engine records before each request.
        event_handles: the 64-byte handles of ``layer_events``, for the registration reply.
        ready_handle: the handle of ``ready_event``.
        lock: held while a transfer enqueues, so transfers of a session enqueue one at a time.
        stuck: a copy never finished on the GPU; the stream is then never destroyed.
    """

    __slots__ = (
        "_raw_stream",
        "device",
        "event_handles",
        "layer_events",
        "lock",
        "ready_event",
        "ready_handle",
        "stream",
        "stuck",
    )

    def __init__(
        self,
        device: torch.device,
        raw_stream: int,
        layer_events: list[torch.cuda.Event],
        event_handles: list[bytes],
        ready_event: torch.cuda.Event,
        ready_handle: bytes,
    ) -> None:
        self.device = device
        self._raw_stream = raw_stream
        self.stream = torch.cuda.ExternalStream(raw_stream, device=device)
        self.layer_events = layer_events
        self.event_handles = event_handles
        self.ready_event = ready_event
        self.ready_handle = ready_handle
        self.lock = threading.Lock()
        self.stuck = False

    @classmethod
    def create(cls, memory: CudaEngineMemory) -> CudaSessionCopier:
        """Make the stream and ``num_layers + 1`` events for a session on ``memory.device``.

        Raises:
            CudaMemoryError: the stream or an event cannot be created (the daemon answers
                BAD_MEMORY, as for memory it cannot open).
        """
        cupy = cuda_ipc.cupy_module()
        device = memory.device
        ordinal = cuda_ipc.ordinal_of(device)
        try:
            with cupy.cuda.Device(ordinal):
                raw = int(cupy.cuda.runtime.streamCreateWithFlags(_STREAM_NON_BLOCKING))
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise CudaMemoryError(f"cannot create a CUDA stream on cuda:{ordinal}: {err}") from err
        try:
            made = [
                cuda_ipc.create_ipc_event(device) for _ in range(memory.geometry.num_layers + 1)
            ]
        except BaseException as err:
            with cupy.cuda.Device(ordinal):
                cupy.cuda.runtime.streamDestroy(raw)
            if isinstance(err, (cuda_ipc.CudaIpcError, RuntimeError)):
                raise CudaMemoryError(
                    f"cannot create interprocess events on cuda:{ordinal}: {err}"
                ) from err
            raise
        (ready, ready_handle), layers = made[-1], made[:-1]
        return cls(device, raw, [e for e, _ in layers], [h for _, h in layers], ready, ready_handle)

    @property
    def num_layers(self) -> int:
        """Layers (events) of the session."""
        return len(self.layer_events)

    def close(self) -> None:
        """Destroy the stream (unless a copy on it is stuck) and drop the events. Idempotent.

        Call only after every transfer of the session returned.
        """
        raw, self._raw_stream = self._raw_stream, 0
        self.layer_events = []
        if not raw:
            return
        if self.stuck:
            log.error(
                "copy stream of a session on %s left alive: a copy never finished", self.device
            )
            return
        cupy = cuda_ipc.cupy_module()
        try:
            with cupy.cuda.Device(cuda_ipc.ordinal_of(self.device)):
                cupy.cuda.runtime.streamDestroy(raw)
        except cupy.cuda.runtime.CUDARuntimeError as err:
            log.warning("cudaStreamDestroy failed: %s", err)


def _wait_gpu(event: torch.cuda.Event, deadline: float) -> bool:
    """Poll ``event`` until it completes (True) or ``deadline`` passes (False).

    Polling with short sleeps instead of ``synchronize()`` keeps a worker thread from spinning a
    core, and lets the wait give up.
    """
    delay = 20e-6
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 200e-6)
    return True


def run_cuda_transfer(
    t: Transfer,
    arena: np.ndarray | torch.Tensor,
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
        arena: the host pool as a flat uint8 numpy array (the daemon's; a torch view of it is
            made here) or CPU tensor, pinned by ``CudaRuntime.pin_arena``.
        memory: the session's engine memory.
        chunk_bytes: bytes of one page of one buffer.
        block: the session's completion block.
        copier: the session's stream and events.
        gpu_timeout_s: how long to wait for the GPU before declaring the copies stuck.

    Returns:
        DONE, CANCELLED or FAILED. When the GPU did not finish in time the transfer is FAILED,
        ``t.extra["gpu_pending"]`` is True, and ``memory.stuck`` / ``copier.stuck`` are set: a
        store's slots may still be written, so the event loop must not free them (it should
        keep them out of use), and the engine memory stays mapped.
    """
    status = TransferStatus.DONE
    launched = False
    done: torch.cuda.Event | None = None
    try:
        arena = arena_tensor(arena)
        buffers = memory.buffers
        n_comp = len(buffers[0]) if buffers else 0
        with copier.lock, torch.cuda.device(copier.device):
            stream = copier.stream
            plan = CudaCopyPlan.build(
                t.page_ids,
                t.offsets,
                chunk_bytes,
                device=copier.device,
                slot_bytes=len(buffers) * n_comp * chunk_bytes,
                stream=stream,
            )
            launched = True  # the plan's offsets are uploading on the stream
            stream.wait_event(copier.ready_event)
            try:
                for layer, row in enumerate(buffers):
                    if t.cancelled:
                        status = TransferStatus.CANCELLED
                        break
                    if t.direction is Direction.STORE:
                        plan.layer_to_host(arena, row, layer, stream=stream)
                    else:
                        plan.layer_from_host(arena, row, layer, stream=stream)
                    copier.layer_events[layer].record(stream)
                    block.layer_done(t.slot, layer + 1)
            finally:
                marker = torch.cuda.Event()
                marker.record(stream)
                done = marker  # only once recorded: an unrecorded event always reads as complete
    except Exception:  # a bug, a bad index or a CUDA error: the transfer fails, the daemon stays up
        log.exception("CUDA transfer session=%d slot=%d failed", t.session_id, t.slot)
        status = TransferStatus.FAILED
    if launched:
        deadline = time.monotonic() + gpu_timeout_s
        try:
            finished = done is not None and _wait_gpu(done, deadline)
        except RuntimeError:  # torch reports a CUDA error (e.g. a fault) as RuntimeError
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
    t.status = status
    return status
