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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvtier.ipc import cuda_ipc
from kvtier.ipc.cuda_ipc import CudaIpcError

__all__ = ["CudaLayerWaiter"]


class CudaLayerWaiter:
    """A session's interprocess events, opened in the engine.

    Args:
        device: the engine's GPU (the KV pool's device).
        event_handles: the per-layer event handles from the registration reply, layer order.
        ready_handle: the ``ready`` event's handle from the registration reply.

    Attributes:
        device: the GPU.
        num_layers: how many layer events there are.

    Raises:
        CudaIpcError: a handle is malformed (checked before any CUDA call) or cannot be opened.
        CudaUnavailable: no GPU.
    """

    __slots__ = ("_layers", "_ready", "device")

    def __init__(
        self, device: torch.device | int | str, event_handles: Sequence[bytes], ready_handle: bytes
    ) -> None:
        if len(event_handles) == 0:
            raise CudaIpcError("a CUDA session needs one event handle per layer, got none")
        handles = [
            cuda_ipc.check_ipc_handle(h, f"event_handles[{i}]") for i, h in enumerate(event_handles)
        ]
        ready = cuda_ipc.check_ipc_handle(ready_handle, "ready_event")
        cuda_ipc.require_cuda("CudaLayerWaiter")
        self.device = torch.device("cuda", cuda_ipc.ordinal_of(device))
        self._layers: list[torch.cuda.Event] = [
            cuda_ipc.open_ipc_event(h, self.device) for h in handles
        ]
        self._ready: torch.cuda.Event | None = cuda_ipc.open_ipc_event(ready, self.device)

    @property
    def num_layers(self) -> int:
        """How many layer events there are."""
        return len(self._layers)

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        if stream is None:
            return torch.cuda.current_stream(self.device)
        if stream.device != self.device:
            raise CudaIpcError(
                f"stream is on {stream.device}, the session's events on {self.device}"
            )
        return stream

    def record_ready(self, stream: torch.cuda.Stream | None = None) -> None:
        """Record the ``ready`` event: the daemon's next copies wait for work issued so far.

        Call just before sending a STORE or LOAD.

        Args:
            stream: the stream that writes and reads the KV pool (default: the current stream).
        """
        if self._ready is None:
            raise CudaIpcError("the CudaLayerWaiter is closed")
        self._ready.record(self._stream(stream))

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` wait (on the GPU) for the copies of layer ``layer``.

        Returns at once; only work issued on ``stream`` afterwards is ordered after the copies.

        Args:
            layer: the layer, ``0 <= layer < num_layers``.
            stream: the compute stream (default: the current stream).

        Raises:
            CudaIpcError: ``layer`` out of range, or the waiter is closed.
        """
        if not 0 <= layer < len(self._layers):
            raise CudaIpcError(f"layer = {layer!r} is outside [0, {len(self._layers)})")
        self._stream(stream).wait_event(self._layers[layer])

    def close(self) -> None:
        """Drop the opened events. Idempotent."""
        self._layers = []
        self._ready = None
