"""Page copies between CUDA engine buffers and the pinned host arena (a CuPy kernel).

The functions and the plan mirror :mod:`kvtier.kernels.page_copy` (same layouts, same arguments,
same checks and :class:`~kvtier.kernels.page_copy.PageCopyError` messages) and add one keyword,
``stream``: a ``torch.cuda.Stream`` to launch on (default: the current stream of the engine
buffer's device). Copies are asynchronous on that stream; synchronise it, or record an event on it,
before reading the destination.

- Engine buffers are CUDA tensors (contiguous, first dimension the page id), typically opened from
  the engine's CUDA IPC handles.
- The arena is a 1-D uint8 CPU tensor over host memory that is pinned and mapped: the daemon's
  shared-memory pool after ``cudaHostRegister`` (mapped), or a ``pin_memory()`` tensor. The kernel
  reaches it through its device pointer (``cudaPointerGetAttributes``). A CUDA tensor is accepted
  as the arena too (then it is device memory).

Kernel: one launch per (layer, component) buffer. Block ``(x, y)`` of the grid copies segment ``y``
of page chunk ``x``; the pair's source and destination byte offsets come from two int64 device
arrays built once per transfer by :class:`CudaCopyPlan`. Each thread moves ``UNROLL`` words with
all loads issued before the stores, so many loads are in flight over PCIe. The word is the widest
of 16 (``uint4``), 8, 4, 2 or 1 bytes that divides the chunk size and aligns every address of the
launch, so the usual layouts move 16 bytes per thread access.

cupy is imported on first use, so this module imports on machines with neither cupy nor a GPU; a
call there raises :class:`CudaCopyUnavailable`.

Verified only on a GPU machine: the tests in ``tests/cuda/test_cuda_copy.py`` compare every path
with the CPU reference and are skipped where no GPU or cupy is present.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvtier.config.errors import KvtierError
from kvtier.kernels.page_copy import (
    CopyPlan,
    IndexArray,
    PageCopyError,
    _positive_int,
    _select_layers,
)

__all__ = [
    "CudaCopyPlan",
    "CudaCopyUnavailable",
    "copy_layer_from_host",
    "copy_layer_kv_from_host",
    "copy_layer_kv_to_host",
    "copy_layer_to_host",
    "copy_layers_from_host",
    "copy_layers_to_host",
]

_THREADS = 256
_UNROLL = 4
_WORDS_PER_BLOCK = _THREADS * _UNROLL * 2
"""Words one block copies (32 KiB with 16-byte words): a 128 KiB chunk spreads over 4 blocks."""
_MAX_GRID_Y = 65535
_WIDTHS = (16, 8, 4, 2, 1)
_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost in cudaPointerAttributes.type

# KVTIER_UNROLL and KVTIER_THREADS come in as -D compiler options.
_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void kvtier_copy_chunks(
    unsigned long long src_base, unsigned long long dst_base,
    const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
    long long words, long long words_per_block) {
  const long long chunk = blockIdx.x;
  const T* __restrict__ src = reinterpret_cast<const T*>(src_base + src_off[chunk]);
  T* __restrict__ dst = reinterpret_cast<T*>(dst_base + dst_off[chunk]);
  const long long begin = (long long)blockIdx.y * words_per_block;
  const long long stop = begin + words_per_block;
  const long long end = stop < words ? stop : words;
  const long long step = (long long)blockDim.x * KVTIER_UNROLL;
  for (long long first = begin + threadIdx.x; first < end; first += step) {
    T v[KVTIER_UNROLL];
#pragma unroll
    for (int u = 0; u < KVTIER_UNROLL; ++u) {
      const long long i = first + (long long)u * blockDim.x;
      if (i < end) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < KVTIER_UNROLL; ++u) {
      const long long i = first + (long long)u * blockDim.x;
      if (i < end) dst[i] = v[u];
    }
  }
}

#define KVTIER_COPY_KERNEL(NAME, T)                                                     \
  extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(                  \
      unsigned long long src_base, unsigned long long dst_base,                         \
      unsigned long long src_off, unsigned long long dst_off,                           \
      long long words, long long words_per_block) {                                     \
    kvtier_copy_chunks<T>(src_base, dst_base,                                           \
                          reinterpret_cast<const long long*>(src_off),                  \
                          reinterpret_cast<const long long*>(dst_off),                  \
                          words, words_per_block);                                      \
  }

KVTIER_COPY_KERNEL(kvtier_copy_w16, uint4)
KVTIER_COPY_KERNEL(kvtier_copy_w8, unsigned long long)
KVTIER_COPY_KERNEL(kvtier_copy_w4, unsigned int)
KVTIER_COPY_KERNEL(kvtier_copy_w2, unsigned short)
KVTIER_COPY_KERNEL(kvtier_copy_w1, unsigned char)
"""


class CudaCopyUnavailable(KvtierError, RuntimeError):
    """The CUDA copies were called where cupy or an NVIDIA GPU is missing."""


def _cupy() -> Any:
    """Import cupy, or raise :class:`CudaCopyUnavailable` saying what is missing."""
    try:
        import cupy
    except ImportError as err:
        raise CudaCopyUnavailable(
            "kvtier.kernels.cuda_copy needs cupy (pip install 'kvtier[cuda]') and an NVIDIA GPU"
        ) from err
    return cupy


def _require_cuda() -> None:
    """Raise :class:`CudaCopyUnavailable` unless torch sees a GPU and cupy imports."""
    if not torch.cuda.is_available():
        raise CudaCopyUnavailable(
            "kvtier.kernels.cuda_copy needs an NVIDIA GPU visible to torch and cupy; torch sees "
            "no CUDA device"
        )
    _cupy()


@functools.cache
def _kernel(device_index: int, width: int) -> Any:
    """The compiled copy kernel for ``width``-byte words on one device (compiled once)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        options = ("--std=c++14", f"-DKVTIER_UNROLL={_UNROLL}", f"-DKVTIER_THREADS={_THREADS}")
        module = cupy.RawModule(code=_SOURCE, options=options)
        return module.get_function(f"kvtier_copy_w{width}")


def _alignment(value: int) -> int:
    """The largest of the copy widths that divides ``value``."""
    return next(w for w in _WIDTHS if value % w == 0)


def _offsets_alignment(offsets: np.ndarray) -> int:
    """The largest copy width dividing every offset (16 when there are none)."""
    if offsets.size == 0:
        return _WIDTHS[0]
    return _alignment(int(np.bitwise_or.reduce(offsets)) | _WIDTHS[0])


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
        cupy = _cupy()
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

    Wraps a :class:`~kvtier.kernels.page_copy.CopyPlan` (all index checks) and holds the
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

    plan: CopyPlan
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
        """Validate a transfer's index arrays (as :meth:`CopyPlan.build`) and upload its offsets.

        Args:
            page_ids: Engine page ids, 1-D int64 (numpy array or CPU tensor); each at most once.
            slot_offsets: Arena byte offsets of the host slots, 1-D int64, same length.
            chunk_bytes: Bytes of one page of one (layer, component) buffer.
            device: The GPU holding the engine buffers.
            slot_bytes: Bytes each slot owns; defaults to ``chunk_bytes``.
            stream: Stream the upload is ordered on (default: the device's current stream).

        Raises:
            PageCopyError: As :meth:`CopyPlan.build`, or ``device`` is not a CUDA device.
            CudaCopyUnavailable: No GPU or no cupy.
        """
        _require_cuda()
        plan = CopyPlan.build(page_ids, slot_offsets, chunk_bytes, slot_bytes=slot_bytes)
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
            plan, dev, offsets[0], offsets[1], _offsets_alignment(plan.slot_offsets), uploaded
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
        selected, n_components = _select_layers(engine_bufs, layers)
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
        selected, n_components = _select_layers(engine_bufs, layers)
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
        cupy = _cupy()
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
                width = min(
                    _alignment(chunk),
                    _alignment(buf.address),
                    _alignment(host_base),
                    self.offsets_alignment,
                )
                words = chunk // width
                per_block = max(_WORDS_PER_BLOCK, -(-words // _MAX_GRID_Y))
                grid = (n, -(-words // per_block), 1)
                if to_host:
                    src, dst, src_off, dst_off = buf.address, host_base, page_off, slot_off
                else:
                    src, dst, src_off, dst_off = host_base, buf.address, slot_off, page_off
                _kernel(index, width)(
                    grid,
                    (_THREADS, 1, 1),
                    (
                        np.uint64(src),
                        np.uint64(dst),
                        src_off,
                        dst_off,
                        np.int64(words),
                        np.int64(per_block),
                    ),
                )


# -- one-shot functions: plan, upload and launch in one call ------------------------------------


def copy_layer_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Store one (layer, component) CUDA buffer; see ``page_copy.copy_layer_to_host``.

    Asynchronous on ``stream`` (default: the buffer's current stream).
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset, stream)
    plan.to_host(arena, engine_buf, chunk_offset, stream=stream)


def copy_layer_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Load one (layer, component) CUDA buffer; see ``page_copy.copy_layer_from_host``."""
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset, stream)
    plan.from_host(arena, engine_buf, chunk_offset, stream=stream)


def copy_layer_kv_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    layer: int,
    n_layers: int,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Store every component of one layer; see ``page_copy.copy_layer_kv_to_host``."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers, stream)
    plan.layer_to_host(arena, layer_bufs, layer, stream=stream)


def copy_layer_kv_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    layer: int,
    n_layers: int,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Load every component of one layer; see ``page_copy.copy_layer_kv_from_host``."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers, stream)
    plan.layer_from_host(arena, layer_bufs, layer, stream=stream)


def copy_layers_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Store whole pages from CUDA buffers; see ``page_copy.copy_layers_to_host``."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids, stream)
    plan.layers_to_host(arena, engine_bufs, stream=stream)


def copy_layers_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Load whole pages into CUDA buffers; see ``page_copy.copy_layers_from_host``."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids, stream)
    plan.layers_from_host(arena, engine_bufs, stream=stream)


def _cuda_tensor(buf: object, name: str) -> torch.Tensor:
    """Return ``buf`` if it is a CUDA tensor, else raise naming it."""
    if not isinstance(buf, torch.Tensor) or not buf.is_cuda:
        where = buf.device if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise PageCopyError(f"{name} must be a CUDA tensor, got {where}")
    return buf


def _row_bytes(buf: torch.Tensor) -> int:
    """Bytes per page of a buffer whose first dimension is the page id."""
    if buf.dim() < 1:
        raise PageCopyError(
            f"an engine buffer needs a page dimension, got shape {tuple(buf.shape)}"
        )
    return math.prod(buf.shape[1:]) * buf.element_size()


def _plan_for_buffer(
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
    stream: torch.cuda.Stream | None,
) -> CudaCopyPlan:
    """Plan a single-buffer copy: each slot owns ``chunk_offset + chunk_bytes`` bytes."""
    _require_cuda()
    buf = _cuda_tensor(engine_buf, "engine_buf")
    chunk = _row_bytes(buf)
    if isinstance(chunk_offset, bool) or not isinstance(chunk_offset, int) or chunk_offset < 0:
        raise PageCopyError(f"chunk_offset must be a non-negative int, got {chunk_offset!r}")
    return CudaCopyPlan.build(
        page_ids, slot_offsets, chunk, device=buf.device, slot_bytes=chunk_offset + chunk,
        stream=stream,
    )


def _plan_for_layers(
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    n_layers: int,
    stream: torch.cuda.Stream | None,
) -> CudaCopyPlan:
    """Plan a copy of one layer's components; each slot owns a full host page."""
    _require_cuda()
    if len(layer_bufs) == 0:
        raise PageCopyError("layer_bufs is empty")
    buf = _cuda_tensor(layer_bufs[0], "layer_bufs[0]")
    slot_bytes = _positive_int(n_layers, "n_layers") * len(layer_bufs) * _row_bytes(buf)
    return CudaCopyPlan.build(
        page_ids, slot_offsets, _row_bytes(buf), device=buf.device, slot_bytes=slot_bytes,
        stream=stream,
    )


def _plan_for_engine(
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    stream: torch.cuda.Stream | None,
) -> CudaCopyPlan:
    """Plan a copy of whole host pages for ``engine_bufs[layer][component]``."""
    _require_cuda()
    if len(engine_bufs) == 0 or len(engine_bufs[0]) == 0:
        raise PageCopyError("engine_bufs must hold at least one layer with one component")
    buf = _cuda_tensor(engine_bufs[0][0], "engine_bufs[0][0]")
    slot_bytes = len(engine_bufs) * len(engine_bufs[0]) * _row_bytes(buf)
    return CudaCopyPlan.build(
        page_ids, slot_offsets, _row_bytes(buf), device=buf.device, slot_bytes=slot_bytes,
        stream=stream,
    )
