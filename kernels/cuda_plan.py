"""The page copies of one transfer on one GPU: a checked plan, issued as DMA or as kernels.

:class:`CudaCopyPlan` wraps a :class:`~kvtier.kernels.plan.PagePlan` (every index check, shared
with the CPU copies). Methods mirror :class:`~kvtier.kernels.page_copy.CopyPlan`'s and add a
``stream``; see :mod:`kvtier.kernels.cuda_copy` for the memory each side must be in. Two modes:

- ``dma`` (the default): each call plans its byte segments
  (:func:`~kvtier.kernels.cuda_segments.plan_segments`, merged where pages continue one another,
  grouped into 2-D copies where they repeat) and enqueues one ``cudaMemcpyAsync`` or
  ``cudaMemcpy2DAsync`` per copy (:mod:`kvtier.kernels.cuda_dma`). The copy
  engines run them, apart from the engine's compute kernels.
- ``kernel``: the per-page byte offsets are uploaded to the GPU once at :meth:`~CudaCopyPlan.build`,
  and each (layer, component) buffer costs one kernel launch
  (:mod:`kvtier.kernels.cuda_kernel`) reading and writing the mapped host arena.

Engine buffers may be strided: pages of contiguous bytes any stride apart (see
:class:`~kvtier.kernels.cuda_buffers.DeviceBuffer`), in both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.kernels.cuda_buffers import DeviceArena, DeviceBuffer
from kvtier.kernels.cuda_dma import CopyMode, check_mode, issue_rows, use_device
from kvtier.kernels.cuda_kernel import (
    alignment_of_offsets,
    cupy_stream,
    import_cupy,
    launch_copy,
    require_cuda,
)
from kvtier.kernels.cuda_segments import plan_rows, plan_segments
from kvtier.kernels.plan import IndexArray, PageCopyError, PagePlan, select_layers

__all__ = ["CudaCopyPlan"]

_Job = tuple[DeviceBuffer, int, str]
"""One checked (layer, component) copy: the buffer, its chunk offset in a slot, its name."""


@dataclass(frozen=True, slots=True, eq=False)
class CudaCopyPlan:
    """The page copies of one transfer on one GPU, validated once, reused for every layer.

    Wraps a :class:`~kvtier.kernels.plan.PagePlan` (all index checks). Methods mirror
    ``CopyPlan``'s and take a ``stream``; each enqueues its copies on that stream and returns at
    once, without synchronising the device: one ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` per
    planned copy in ``dma`` mode, one kernel per (layer, component) buffer in ``kernel`` mode.

    Every call leaves :attr:`device` current on the calling thread (``cudaSetDevice``; see
    :mod:`kvtier.kernels.cuda_dma` for why it is not switched back).

    Attributes:
        plan: The validated CPU plan (page ids, slot offsets, sizes, bounds).
        device: The GPU of the engine buffers.
        mode: ``dma`` or ``kernel``.
        page_bytes: ``kernel`` mode: ``page_ids * chunk_bytes`` on the device, int64, in the
            caller's order; None in ``dma`` mode.
        slot_offsets: ``kernel`` mode: the slot offsets on the device, int64, aligned with
            ``page_bytes``; None in ``dma`` mode.
        offsets_alignment: The largest copy width (16, 8, 4, 2, 1) dividing every slot offset.
        uploaded: ``kernel`` mode: recorded on the upload stream after the offsets were copied;
            every launch stream waits for it, so a plan can be used on any stream of its
            device. None in ``dma`` mode.
    """

    plan: PagePlan
    device: torch.device
    page_bytes: torch.Tensor | None
    slot_offsets: torch.Tensor | None
    offsets_alignment: int
    uploaded: torch.cuda.Event | None
    mode: CopyMode = "dma"

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
        mode: CopyMode = "dma",
    ) -> CudaCopyPlan:
        """Validate a transfer's index arrays (as :meth:`PagePlan.build`); in ``kernel`` mode,
        upload its offsets.

        Args:
            page_ids: Engine page ids, 1-D int64 (numpy array or CPU tensor); each at most once.
            slot_offsets: Arena byte offsets of the host slots, 1-D int64, same length.
            chunk_bytes: Bytes of one page of one (layer, component) buffer.
            device: The GPU holding the engine buffers.
            slot_bytes: Bytes each slot owns; defaults to ``chunk_bytes``.
            stream: Stream the upload is ordered on (``kernel`` mode; default: the device's
                current stream). A ``dma`` plan touches no stream until a copy.
            mode: ``dma`` (copy engines) or ``kernel`` (copy kernels).

        Raises:
            PageCopyError: As :meth:`PagePlan.build`, ``device`` is not a CUDA device, or
                ``mode`` is neither ``dma`` nor ``kernel``.
            CudaCopyUnavailable: No GPU or no cupy.
        """
        copy_mode = check_mode(mode)
        require_cuda()
        plan = PagePlan.build(page_ids, slot_offsets, chunk_bytes, slot_bytes=slot_bytes)
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise PageCopyError(f"device must be a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        alignment = alignment_of_offsets(plan.slot_offsets)
        if copy_mode == "dma":
            return cls(plan, dev, None, None, alignment, None, copy_mode)
        host = torch.from_numpy(np.stack([plan.page_ids * plan.chunk_bytes, plan.slot_offsets]))
        upload_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(upload_stream):
            offsets = host.pin_memory().to(dev, non_blocking=True)
            uploaded = torch.cuda.Event()
            uploaded.record(upload_stream)
        return cls(plan, dev, offsets[0], offsets[1], alignment, uploaded, copy_mode)

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
        :attr:`device` (its pages may lie any stride apart); ``arena`` is pinned host memory,
        mapped too in ``kernel`` mode (see :mod:`kvtier.kernels.cuda_copy`).
        """
        target = self._arena(arena)
        job = self._checked(target, engine_buf, "engine_buf", chunk_offset)
        self._issue(target, [job], stream, to_host=True)

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
        target = self._arena(arena)
        job = self._checked(target, engine_buf, "engine_buf", chunk_offset)
        self._issue(target, [job], stream, to_host=False)

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

    def _arena(self, arena: torch.Tensor) -> DeviceArena:
        """Check the arena; a kernel needs its mapped device address, DMA its host address."""
        return DeviceArena.of(arena, self.device, mapped=self.mode == "kernel")

    def _run_layers(
        self,
        arena: torch.Tensor,
        selected: Sequence[tuple[int, Sequence[torch.Tensor]]],
        n_components: int,
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Check every buffer of the selected layers, then issue their copies in order."""
        target = self._arena(arena)
        jobs: list[_Job] = []
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
        self._issue(target, jobs, stream, to_host=to_host)

    def _checked(
        self, arena: DeviceArena, engine_buf: torch.Tensor, name: str, chunk_offset: int
    ) -> _Job:
        """Check one copy; return the buffer's view, its chunk offset and its name."""
        view = DeviceBuffer.of(engine_buf, name, self.device)
        self.plan.check_copy(
            arena_nbytes=arena.nbytes,
            num_pages=view.num_pages,
            row_bytes=view.row_bytes,
            chunk_offset=chunk_offset,
            name=name,
        )
        return view, chunk_offset, name

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        """The stream to issue on: ``stream``, or the device's current one; on the plan's GPU."""
        chosen = stream if stream is not None else torch.cuda.current_stream(self.device)
        if chosen.device != self.device:
            raise PageCopyError(f"stream is on {chosen.device}, the plan on {self.device}")
        return chosen

    def _issue(
        self,
        arena: DeviceArena,
        jobs: Sequence[_Job],
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Enqueue the checked copies on ``stream`` in the plan's mode."""
        if len(self.plan) == 0 or not jobs:
            return
        if self.mode == "dma":
            self._issue_dma(arena, jobs, stream, to_host=to_host)
        else:
            self._launch(arena, jobs, stream, to_host=to_host)

    def _issue_dma(
        self,
        arena: DeviceArena,
        jobs: Sequence[_Job],
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Plan the copies of every job together (so neighbours merge) and enqueue them."""
        launch_stream = self._stream(stream)
        regions = [b.region for b, _, _ in jobs]
        segments = plan_segments(
            self.plan,
            regions,
            [chunk_offset for _, chunk_offset, _ in jobs],
            arena_nbytes=arena.nbytes,
            to_host=to_host,
            names=[name for _, _, name in jobs],
        )
        cupy = import_cupy()
        assert self.device.index is not None
        use_device(cupy, self.device.index)
        issue_rows(
            cupy,
            plan_rows(segments),
            engine_base=0,
            host_base=arena.address,
            stream=launch_stream.cuda_stream,
        )

    def _launch(
        self,
        arena: DeviceArena,
        jobs: Sequence[_Job],
        stream: torch.cuda.Stream | None,
        *,
        to_host: bool,
    ) -> None:
        """Launch one kernel per checked (buffer, chunk offset) on ``stream``."""
        assert self.page_bytes is not None and self.slot_offsets is not None
        assert self.uploaded is not None and self.device.index is not None
        cupy = import_cupy()
        launch_stream = self._stream(stream)
        launch_stream.wait_event(self.uploaded)
        # the offsets were allocated on the upload stream: keep them alive for this one too
        self.page_bytes.record_stream(launch_stream)
        self.slot_offsets.record_stream(launch_stream)
        chunk = self.plan.chunk_bytes
        slot_off = np.uint64(self.slot_offsets.data_ptr())
        index = self.device.index
        use_device(cupy, index)  # not cupy.cuda.Device: its exit may switch to device 0
        strided: dict[int, torch.Tensor] = {}  # page offsets per stride, alive until launched
        with cupy_stream(cupy, launch_stream.cuda_stream, index):
            for buf, chunk_offset, _ in jobs:
                page_offsets = self._page_offsets(buf.page_stride, launch_stream, strided)
                page_off = np.uint64(page_offsets.data_ptr())
                host_base = arena.address + chunk_offset
                if to_host:
                    src, dst, src_off, dst_off = buf.address, host_base, page_off, slot_off
                else:
                    src, dst, src_off, dst_off = host_base, buf.address, slot_off, page_off
                launch_copy(
                    index,
                    n_chunks=len(self.plan),
                    chunk_bytes=chunk,
                    src=src,
                    dst=dst,
                    src_off=src_off,
                    dst_off=dst_off,
                    offsets_align=min(
                        self.offsets_alignment,
                        alignment_of_offsets(np.array([buf.page_stride], dtype=np.int64)),
                    ),
                )

    def _page_offsets(
        self, page_stride: int, stream: torch.cuda.Stream, made: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """Device byte offsets of the plan's pages in a buffer whose pages lie ``page_stride`` apart.

        The uploaded ``page_bytes`` for a contiguous buffer; otherwise computed on ``stream``
        (so ordered before the launch that reads them) and kept in ``made``.
        """
        assert self.page_bytes is not None
        chunk = self.plan.chunk_bytes
        if page_stride == chunk:
            return self.page_bytes
        if page_stride not in made:
            with torch.cuda.stream(stream):
                made[page_stride] = (
                    torch.div(self.page_bytes, chunk, rounding_mode="floor") * page_stride
                )
        return made[page_stride]
