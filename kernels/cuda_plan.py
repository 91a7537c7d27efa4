"""The page copies of one transfer on one GPU: a checked plan whose offsets live on the device.

:class:`CudaCopyPlan` wraps a :class:`~kvtier.kernels.plan.PagePlan` (every index check, shared
with the CPU copies) and uploads the per-page byte offsets to the GPU once, so each (layer,
component) buffer of the transfer costs one kernel launch and nothing else. Methods mirror
:class:`~kvtier.kernels.page_copy.CopyPlan`'s and add a ``stream``; see
:mod:`kvtier.kernels.cuda_copy` for the memory each side must be in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.kernels.cuda_kernel import (
    alignment_of_offsets,
    import_cupy,
    launch_copy,
    require_cuda,
)
from kvtier.kernels.plan import IndexArray, PageCopyError, PagePlan, select_layers

__all__ = ["CudaCopyPlan"]

_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost in cudaPointerAttributes.type


@dataclass(frozen=True, slots=True)
class _DeviceArena:
    """A checked arena: device-visible address and size in bytes."""

    address: int
    nbytes: int

    @classmethod
    def of(cls, arena: torch.Tensor, device: torch.device) -> _DeviceArena:
        """Check the arena and find the address the kernel uses for it."""
        if not isinstance(arena, torch.Tensor):
            raise PageCopyError(f"arena must be a torch.Tensor, got {type(arena).__name__}")
        if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
            raise PageCopyError(
                "arena must be a 1-D contiguous uint8 tensor, got "
                f"{arena.dtype} of shape {tuple(arena.shape)}"
            )
        if arena.is_cuda:
            if arena.device != device:
                raise PageCopyError(f"arena is on {arena.device}, the engine buffers on {device}")
            return cls(arena.data_ptr(), arena.numel())
        if arena.device.type != "cpu":
            raise PageCopyError(f"arena must be a CPU or CUDA tensor, got device {arena.device}")
        if arena.numel() == 0:
            return cls(0, 0)
        cupy = import_cupy()
        try:
            with cupy.cuda.Device(device.index):
                attrs = cupy.cuda.runtime.pointerGetAttributes(arena.data_ptr())
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise PageCopyError(
                "arena is not pinned host memory: register it with cudaHostRegister (mapped)"
            ) from err
        if attrs.type != _CUDA_MEMORY_TYPE_HOST or not attrs.devicePointer:
            raise PageCopyError(
                "arena is not pinned and mapped host memory (cudaPointerGetAttributes type "
                f"{attrs.type}): register it with cudaHostRegister (mapped) first"
            )
        return cls(int(attrs.devicePointer), arena.numel())


@dataclass(frozen=True, slots=True)
class _DeviceBuffer:
    """A checked engine buffer on the GPU seen as ``[num_pages, row_bytes]`` bytes."""

    address: int
    num_pages: int
    row_bytes: int

    @classmethod
    def of(cls, buf: torch.Tensor, name: str, device: torch.device) -> _DeviceBuffer:
        """Check that ``buf`` is a contiguous CUDA tensor on ``device``."""
        if not isinstance(buf, torch.Tensor):
            raise PageCopyError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.device != device:
            raise PageCopyError(f"{name} must be on {device}, got device {buf.device}")
        if buf.dim() < 1 or not buf.is_contiguous():
            raise PageCopyError(
                f"{name} must be contiguous with the page id as first dimension, got shape "
                f"{tuple(buf.shape)} and strides {buf.stride()}"
            )
        row_bytes = math.prod(buf.shape[1:]) * buf.element_size()
        return cls(buf.data_ptr(), int(buf.shape[0]), row_bytes)


@dataclass(frozen=True, slots=True, eq=False)
class CudaCopyPlan:
    """The page copies of one transfer on one GPU, validated once, reused for every layer.

    Wraps a :class:`~kvtier.kernels.plan.PagePlan` (all index checks) and holds the
    per-page byte offsets on the device, uploaded once. Methods mirror ``CopyPlan``'s and take a
    ``stream``; each launches one kernel per (layer, component) buffer and returns at once.

    Attributes:
        plan: The validated CPU plan (page ids, slot offsets, sizes, bounds).
        device: The GPU of the engine buffers.
        page_bytes: ``page_ids * chunk_bytes`` on the device, int64, in the caller's order.
        slot_offsets: The slot offsets on the device, int64, aligned with ``page_bytes``.
        offsets_alignment: The largest copy width (16, 8, 4, 2, 1) dividing every slot offset.
        uploaded: Recorded on the upload stream after the offsets were copied; every launch
            stream waits for it, so a plan can be used on any stream of its device.
    """

    plan: PagePlan
    device: torch.device
    page_bytes: torch.Tensor
    slot_offsets: torch.Tensor
    offsets_alignment: int
    uploaded: torch.cuda.Event

    @classmethod
    def build(
        cls,
        page_ids: IndexArray,
        slot_offsets: IndexArray,
        chunk_bytes: int,
        *,
        device: torch.device | int | str,
        slot_bytes: int | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> CudaCopyPlan:
        """Validate a transfer's index arrays (as :meth:`PagePlan.build`) and upload its offsets.

        Args:
            page_ids: Engine page ids, 1-D int64 (numpy array or CPU tensor); each at most once.
            slot_offsets: Arena byte offsets of the host slots, 1-D int64, same length.
            chunk_bytes: Bytes of one page of one (layer, component) buffer.
            device: The GPU holding the engine buffers.
            slot_bytes: Bytes each slot owns; defaults to ``chunk_bytes``.
            stream: Stream the upload is ordered on (default: the device's current stream).

        Raises:
            PageCopyError: As :meth:`PagePlan.build`, or ``device`` is not a CUDA device.
            CudaCopyUnavailable: No GPU or no cupy.
        """
        require_cuda()
        plan = PagePlan.build(page_ids, slot_offsets, chunk_bytes, slot_bytes=slot_bytes)
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise PageCopyError(f"device must be a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        host = torch.from_numpy(np.stack([plan.page_ids * plan.chunk_bytes, plan.slot_offsets]))
        upload_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(upload_stream):
            offsets = host.pin_memory().to(dev, non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(upload_stream)
        return cls(
            plan, dev, offsets[0], offsets[1], alignment_of_offsets(plan.slot_offsets), uploaded
        )

    def __len__(self) -> int:
        """Number of pages the transfer moves."""
        return len(self.plan)

    def to_host(
        self,
        arena: torch.Tensor,
        engine_buf: torch.Tensor,
        chunk_offset: int,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Store: launch the copy of one engine buffer's pages into their slots.

        Args and errors as :meth:`CopyPlan.to_host`; ``engine_buf`` is a CUDA tensor on
        :attr:`device`; ``arena`` is pinned and mapped host memory (see the module docstring).
        """
        target = _DeviceArena.of(arena, self.device)
        job = self._checked(target, engine_buf, "engine_buf", chunk_offset)
        self._launch(target, [job], stream, to_host=True)

    def from_host(
        self,
        arena: torch.Tensor,
        engine_buf: torch.Tensor,
        chunk_offset: int,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Load: launch the copy of the slots into one engine buffer's pages.

        Args and errors as :meth:`to_host`.
        """
        target = _DeviceArena.of(arena, self.device)
        job = self._checked(target, engine_buf, "engine_buf", chunk_offset)
        self._launch(target, [job], stream, to_host=False)

    def layer_to_host(
        self,
        arena: torch.Tensor,
        layer_bufs: Sequence[torch.Tensor],
        layer: int,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Store every component of one layer; as :meth:`CopyPlan.layer_to_host`."""
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), stream, to_host=True)

    def layer_from_host(
        self,
        arena: torch.Tensor,
        layer_bufs: Sequence[torch.Tensor],
        layer: int,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Load every component of one layer; as :meth:`CopyPlan.layer_from_host`."""
        self._run_layers(arena, [(layer, layer_bufs)], len(layer_bufs), stream, to_host=False)

    def layers_to_host(
        self,
        arena: torch.Tensor,
        engine_bufs: Sequence[Sequence[torch.Tensor]],
        layers: Sequence[int] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Store several layers (all by default); as :meth:`CopyPlan.layers_to_host`."""
        selected, n_components = select_layers(engine_bufs, layers)
        self._run_layers(arena, selected, n_components, stream, to_host=True)

    def layers_from_host(
        self,
        arena: torch.Tensor,
        engine_bufs: Sequence[Sequence[torch.Tensor]],
        layers: Sequence[int] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Load several layers (all by default); as :meth:`CopyPlan.layers_from_host`."""
        selected, n_components = select_layers(engine_bufs, layers)
        self._run_layers(arena, selected, n_components, stream, to_host=False)

    # -- internals -------------------------------------------------------------------------------

    def _run_layers(
        self,
        arena: torch.Tensor,
        selected: Sequence[tuple[int, Sequence[torch.Tensor]]],
        n_components: int,
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Check every buffer of the selected layers, then launch their copies in order."""
        target = _DeviceArena.of(arena, self.device)
        jobs: list[tuple[_DeviceBuffer, int]] = []
        for layer, bufs in selected:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise PageCopyError(f"layer must be a non-negative int, got {layer!r}")
            if len(bufs) != n_components:
                raise PageCopyError(
                    f"layer {layer} has {len(bufs)} components, expected {n_components}"
                )
            for c, buf in enumerate(bufs):
                chunk_offset = (layer * n_components + c) * self.plan.chunk_bytes
                name = f"engine_bufs[{layer}][{c}]"
                jobs.append(self._checked(target, buf, name, chunk_offset))
        self._launch(target, jobs, stream, to_host=to_host)

    def _checked(
        self, arena: _DeviceArena, engine_buf: torch.Tensor, name: str, chunk_offset: int
    ) -> tuple[_DeviceBuffer, int]:
        """Check one copy; return the buffer's view and its chunk offset."""
        view = _DeviceBuffer.of(engine_buf, name, self.device)
        self.plan.check_copy(
            arena_nbytes=arena.nbytes,
            num_pages=view.num_pages,
            row_bytes=view.row_bytes,
            chunk_offset=chunk_offset,
            name=name,
        )
        return view, chunk_offset

    def _launch(
        self,
        arena: _DeviceArena,
        jobs: Sequence[tuple[_DeviceBuffer, int]],
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Launch one kernel per checked (buffer, chunk offset) on ``stream``."""
        n = len(self.plan)
        if n == 0 or not jobs:
            return
        cupy = import_cupy()
        launch_stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        if launch_stream.device != self.device:
            raise PageCopyError(f"stream is on {launch_stream.device}, the plan on {self.device}")
        launch_stream.wait_event(self.uploaded)
        # the offsets were allocated on the upload stream: keep them alive for this one too
        self.page_bytes.record_stream(launch_stream)
        self.slot_offsets.record_stream(launch_stream)
        chunk = self.plan.chunk_bytes
        page_off = np.uint64(self.page_bytes.data_ptr())
        slot_off = np.uint64(self.slot_offsets.data_ptr())
        index = self.device.index
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(launch_stream.cuda_stream, index):
            for buf, chunk_offset in jobs:
                host_base = arena.address + chunk_offset
                if to_host:
                    src, dst, src_off, dst_off = buf.address, host_base, page_off, slot_off
                else:
                    src, dst, src_off, dst_off = host_base, buf.address, slot_off, page_off
                launch_copy(
                    index,
                    n_chunks=n,
                    chunk_bytes=chunk,
                    src=src,
                    dst=dst,
                    src_off=src_off,
                    dst_off=dst_off,
                    offsets_align=self.offsets_alignment,
                )
