"""The engine's side of per-layer completion on a GPU: stream waits on the daemon's events.

kvtierd creates, per session, one interprocess CUDA event per layer and one ``ready`` event, and
sends their handles in the registration reply. A :class:`CudaLayerWaiter` opens them in the
engine and does the two things the engine's streams need (see
:mod:`kvtier.daemon.transfer.cuda.executor` for the daemon's half)::

    before STORE / LOAD:   record_ready()  ─▶ the daemon's copies start after the engine's
                                              earlier work on its pages (no CPU sync)
    before layer i:        wait_layer(i)   ─▶ the engine's stream waits for layer i's copies
                                              (no CPU sync)

``wait_layer`` must be called only once the daemon has recorded event ``i`` for the transfer in
question, i.e. once the completion block reports ``layers_done > i`` for its slot and sequence
number; earlier, the stream would wait for a previous transfer's record instead. The connection's
``TransferHandle.wait_layer`` does that check and then calls :meth:`CudaLayerWaiter.wait_layer`.

The events belong to the daemon that created them: when it dies or restarts they are destroyed,
and a stream wait on a destroyed event is undefined behaviour (a hang in practice). So a
connection keeps one waiter per registration: it closes the waiter before every
(re-)registration and opens the new daemon's events from the new reply
(:func:`waiter_for`), and a handle whose waiter was closed, or whose daemon is gone, reports
its load as not loaded (a miss) instead of waiting on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvtier.client.connection.replies import DaemonError
from kvtier.ipc import cuda_ipc
from kvtier.ipc.cuda_backend import EngineCudaBackend, TorchEngineBackend
from kvtier.ipc.cuda_ipc import CudaIpcError, CudaUnavailable
from kvtier.ipc.protocol import ErrorCode, Registered

__all__ = ["CudaLayerWaiter", "waiter_for"]


class CudaLayerWaiter:
    """A session's interprocess events, opened in the engine.

    Args:
        device: the engine's GPU (the KV pool's device).
        event_handles: the per-layer event handles from the registration reply, layer order.
        ready_handle: the ``ready`` event's handle from the registration reply.
        backend: the CUDA operations (default: torch's).

    Attributes:
        device: the GPU.
        num_layers: how many layer events there are.
        closed: the events were dropped (the registration they came with is over).

    Raises:
        CudaIpcError: a handle is malformed (checked before any CUDA call) or cannot be opened.
        CudaUnavailable: no GPU.
    """

    __slots__ = ("_backend", "_layers", "_ordinal", "_ready", "device")

    def __init__(
        self,
        device: torch.device | int | str,
        event_handles: Sequence[bytes],
        ready_handle: bytes,
        backend: EngineCudaBackend | None = None,
    ) -> None:
        if len(event_handles) == 0:
            raise CudaIpcError("a CUDA session needs one event handle per layer, got none")
        handles = [
            cuda_ipc.check_ipc_handle(h, f"event_handles[{i}]") for i, h in enumerate(event_handles)
        ]
        ready = cuda_ipc.check_ipc_handle(ready_handle, "ready_event")
        self._backend: EngineCudaBackend = backend or TorchEngineBackend()
        reason = self._backend.unavailable_reason()
        if reason is not None:
            raise CudaUnavailable(f"CudaLayerWaiter {reason}")
        self._ordinal = self._backend.ordinal_of(device)
        self.device = torch.device("cuda", self._ordinal)
        self._layers: list[Any] = []
        self._ready: Any = None
        try:
            for h in handles:
                self._layers.append(self._backend.open_ipc_event(h, self._ordinal))
            self._ready = self._backend.open_ipc_event(ready, self._ordinal)
        except BaseException:
            self.close()
            raise

    @property
    def num_layers(self) -> int:
        """How many layer events there are."""
        return len(self._layers)

    @property
    def closed(self) -> bool:
        """Whether the events were dropped."""
        return self._ready is None

    def _stream(self, stream: Any) -> Any:
        if stream is None:
            return self._backend.current_stream(self._ordinal)
        if getattr(stream, "device", self.device) != self.device:
            raise CudaIpcError(
                f"stream is on {stream.device}, the session's events on {self.device}"
            )
        return stream

    def record_ready(self, stream: Any = None) -> None:
        """Record the ``ready`` event: the daemon's next copies wait for work issued so far.

        Call just before sending a STORE or LOAD.

        Args:
            stream: the stream that writes and reads the KV pool (default: the current stream).
        """
        if self._ready is None:
            raise CudaIpcError("the CudaLayerWaiter is closed")
        self._backend.record(self._ready, self._stream(stream))

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` wait (on the GPU) for the copies of layer ``layer``.

        Returns at once; only work issued on ``stream`` afterwards is ordered after the copies.

        Args:
            layer: the layer, ``0 <= layer < num_layers``.
            stream: the compute stream (default: the current stream).

        Raises:
            CudaIpcError: ``layer`` out of range, or the waiter is closed.
        """
        if self._ready is None:
            raise CudaIpcError("the CudaLayerWaiter is closed")
        if not 0 <= layer < len(self._layers):
            raise CudaIpcError(f"layer = {layer!r} is outside [0, {len(self._layers)})")
        self._backend.stream_wait(self._stream(stream), self._layers[layer])

    def wait_if_open(self, layer: int, stream: Any = None) -> bool:
        """:meth:`wait_layer`, or False (no wait) when the events were dropped meanwhile,
        e.g. by another thread's re-registration."""
        layers, ready = self._layers, self._ready  # held: another thread may close
        if ready is None or not 0 <= layer < len(layers):
            return False
        self._backend.stream_wait(self._stream(stream), layers[layer])
        return True

    def drain(self) -> None:
        """Wait until the GPU has run what was issued to it, on every stream: no stream still
        has a wait on these events queued. Call before the registration ends (the daemon
        then destroys the events; a queued wait on a destroyed event is undefined, a hang in
        practice)."""
        if self._ready is not None:
            self._backend.synchronize(self._ordinal)

    def close(self) -> None:
        """Drop the opened events. Idempotent."""
        events = [*self._layers, *([self._ready] if self._ready is not None else [])]
        self._layers = []
        self._ready = None
        for event in events:
            self._backend.close_event(event)


def waiter_for(pool: Any, rep: Registered, num_layers: int) -> CudaLayerWaiter | None:
    """The waiter of a registration: the events of ``rep`` opened for ``pool``'s GPU.

    Returns:
        None for a pool that is not on a GPU (it has no ``cuda_backend``).

    Raises:
        DaemonError: BAD_MEMORY, a CUDA pool's reply has not one event per layer, or they
            cannot be opened.
    """
    backend = getattr(pool, "cuda_backend", None)
    if backend is None:
        return None
    if len(rep.event_handles) != num_layers:
        raise DaemonError(
            ErrorCode.BAD_MEMORY,
            f"the daemon sent {len(rep.event_handles)} event handles for a CUDA session "
            f"of {num_layers} layers",
        )
    try:
        return CudaLayerWaiter(pool.device, rep.event_handles, rep.ready_event, backend)
    except CudaIpcError as err:
        raise DaemonError(ErrorCode.BAD_MEMORY, f"the daemon's CUDA events: {err}") from err
