"""Page copies between CUDA engine buffers and the pinned host arena (DMA, or a CuPy kernel).

The functions and the plan mirror :mod:`kvtier.kernels.page_copy` (same layouts, same arguments,
same checks and :class:`~kvtier.kernels.plan.PageCopyError` messages) and add two keywords:
``stream``, a ``torch.cuda.Stream`` to copy on (default: the current stream of the engine
buffer's device), and ``mode``: ``dma`` (the default: ``cudaMemcpyAsync`` on the copy engines,
:mod:`kvtier.kernels.cuda_dma`) or ``kernel`` (:mod:`kvtier.kernels.cuda_kernel`). Copies are
asynchronous on that stream; synchronise it, or record an event on it, before reading the
destination.

- Engine buffers are CUDA tensors whose first dimension is the page id, typically opened from
  the engine's CUDA IPC handles: contiguous, or pages of dense bytes a larger stride apart
  (a strided region).
- The arena is a 1-D uint8 CPU tensor over pinned host memory: the daemon's shared-memory pool
  after ``cudaHostRegister``, or a ``pin_memory()`` tensor. DMA uses its host address; the kernel
  reaches it through its device pointer (``cudaPointerGetAttributes``), so in ``kernel`` mode it
  must be registered as mapped too. A CUDA tensor is accepted as the arena too (then it is
  device memory).

This module holds the one-shot functions (plan and copy in one call); the plan is
:class:`~kvtier.kernels.cuda_plan.CudaCopyPlan`. It is imported here, so
``cuda_copy.CudaCopyPlan`` and ``cuda_copy.CudaCopyUnavailable`` keep working.

cupy is imported on first use, so this module imports on machines with neither cupy nor a GPU; a
call there raises :class:`CudaCopyUnavailable`.

Verified only on a GPU machine: the tests in ``tests/cuda/test_cuda_copy.py`` compare every path
with the CPU reference and are skipped where no GPU or cupy is present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from kvtier.kernels.cuda_dma import CopyMode
from kvtier.kernels.cuda_kernel import CudaCopyUnavailable, require_cuda
from kvtier.kernels.cuda_plan import CudaCopyPlan
from kvtier.kernels.plan import IndexArray, PageCopyError, positive_int

__all__ = [
    "CopyMode",
    "CudaCopyPlan",
    "CudaCopyUnavailable",
    "copy_layer_from_host",
    "copy_layer_kv_from_host",
    "copy_layer_kv_to_host",
    "copy_layer_to_host",
    "copy_layers_from_host",
    "copy_layers_to_host",
]


# -- one-shot functions: plan, upload and launch in one call ------------------------------------


def copy_layer_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
    *,
    stream: torch.cuda.Stream | None = None,
    mode: CopyMode = "dma",
) -> None:
    """Store one (layer, component) CUDA buffer; see ``page_copy.copy_layer_to_host``.

    Asynchronous on ``stream`` (default: the buffer's current stream).
    """
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset, stream, mode)
    plan.to_host(arena, engine_buf, chunk_offset, stream=stream)


def copy_layer_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_buf: torch.Tensor,
    page_ids: IndexArray,
    chunk_offset: int,
    *,
    stream: torch.cuda.Stream | None = None,
    mode: CopyMode = "dma",
) -> None:
    """Load one (layer, component) CUDA buffer; see ``page_copy.copy_layer_from_host``."""
    plan = _plan_for_buffer(slot_offsets, engine_buf, page_ids, chunk_offset, stream, mode)
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
    mode: CopyMode = "dma",
) -> None:
    """Store every component of one layer; see ``page_copy.copy_layer_kv_to_host``."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers, stream, mode)
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
    mode: CopyMode = "dma",
) -> None:
    """Load every component of one layer; see ``page_copy.copy_layer_kv_from_host``."""
    plan = _plan_for_layers(slot_offsets, layer_bufs, page_ids, n_layers, stream, mode)
    plan.layer_from_host(arena, layer_bufs, layer, stream=stream)


def copy_layers_to_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    *,
    stream: torch.cuda.Stream | None = None,
    mode: CopyMode = "dma",
) -> None:
    """Store whole pages from CUDA buffers; see ``page_copy.copy_layers_to_host``."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids, stream, mode)
    plan.layers_to_host(arena, engine_bufs, stream=stream)


def copy_layers_from_host(
    arena: torch.Tensor,
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    *,
    stream: torch.cuda.Stream | None = None,
    mode: CopyMode = "dma",
) -> None:
    """Load whole pages into CUDA buffers; see ``page_copy.copy_layers_from_host``."""
    plan = _plan_for_engine(slot_offsets, engine_bufs, page_ids, stream, mode)
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
    mode: CopyMode,
) -> CudaCopyPlan:
    """Plan a single-buffer copy: each slot owns ``chunk_offset + chunk_bytes`` bytes."""
    require_cuda()
    buf = _cuda_tensor(engine_buf, "engine_buf")
    chunk = _row_bytes(buf)
    if isinstance(chunk_offset, bool) or not isinstance(chunk_offset, int) or chunk_offset < 0:
        raise PageCopyError(f"chunk_offset must be a non-negative int, got {chunk_offset!r}")
    return CudaCopyPlan.build(
        page_ids,
        slot_offsets,
        chunk,
        device=buf.device,
        slot_bytes=chunk_offset + chunk,
        stream=stream,
        mode=mode,
    )


def _plan_for_layers(
    slot_offsets: IndexArray,
    layer_bufs: Sequence[torch.Tensor],
    page_ids: IndexArray,
    n_layers: int,
    stream: torch.cuda.Stream | None,
    mode: CopyMode,
) -> CudaCopyPlan:
    """Plan a copy of one layer's components; each slot owns a full host page."""
    require_cuda()
    if len(layer_bufs) == 0:
        raise PageCopyError("layer_bufs is empty")
    buf = _cuda_tensor(layer_bufs[0], "layer_bufs[0]")
    slot_bytes = positive_int(n_layers, "n_layers") * len(layer_bufs) * _row_bytes(buf)
    return CudaCopyPlan.build(
        page_ids,
        slot_offsets,
        _row_bytes(buf),
        device=buf.device,
        slot_bytes=slot_bytes,
        stream=stream,
        mode=mode,
    )


def _plan_for_engine(
    slot_offsets: IndexArray,
    engine_bufs: Sequence[Sequence[torch.Tensor]],
    page_ids: IndexArray,
    stream: torch.cuda.Stream | None,
    mode: CopyMode,
) -> CudaCopyPlan:
    """Plan a copy of whole host pages for ``engine_bufs[layer][component]``."""
    require_cuda()
    if len(engine_bufs) == 0 or len(engine_bufs[0]) == 0:
        raise PageCopyError("engine_bufs must hold at least one layer with one component")
    buf = _cuda_tensor(engine_bufs[0][0], "engine_bufs[0][0]")
    slot_bytes = len(engine_bufs) * len(engine_bufs[0]) * _row_bytes(buf)
    return CudaCopyPlan.build(
        page_ids,
        slot_offsets,
        _row_bytes(buf),
        device=buf.device,
        slot_bytes=slot_bytes,
        stream=stream,
        mode=mode,
    )
