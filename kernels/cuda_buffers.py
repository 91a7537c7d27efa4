"""The two sides of a GPU page copy, checked: the pinned host arena and one engine buffer.

:class:`DeviceArena` finds the address a copy uses for the host arena (the host pointer for a
DMA copy, the mapped device pointer for a copy kernel); :class:`DeviceBuffer` sees an engine
buffer on the GPU as pages of contiguous bytes a fixed stride apart, which covers kvtier's own
contiguous buffers and strided ones (a 2-D uint8 view of a region, vLLM's HND caches where K and
V of a block lie side by side, SGLang's page_first pools).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvtier.kernels.cuda_dma import use_device
from kvtier.kernels.cuda_kernel import import_cupy
from kvtier.kernels.cuda_segments import EngineRegion
from kvtier.kernels.plan import PageCopyError

__all__ = ["DeviceArena", "DeviceBuffer"]

_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost in cudaPointerAttributes.type


@dataclass(frozen=True, slots=True)
class DeviceArena:
    """A checked arena: the address a copy uses for its first byte, and its size.

    Attributes:
        address: For a host arena, the host pointer (``mapped=False``: DMA) or its mapped device
            pointer (``mapped=True``: a copy kernel); for a CUDA tensor, its device pointer.
        nbytes: Size in bytes.
    """

    address: int
    nbytes: int

    @classmethod
    def of(cls, arena: torch.Tensor, device: torch.device, *, mapped: bool) -> DeviceArena:
        """Check the arena and find the address a copy on ``device`` uses for it.

        Args:
            arena: A 1-D contiguous uint8 tensor: pinned host memory, or on ``device``.
            device: The GPU of the engine buffers.
            mapped: The copy needs the host memory's device pointer (a kernel reads it).

        Raises:
            PageCopyError: Another type, dtype, shape or device; host memory that is not pinned
                (or not mapped, when ``mapped``).
        """
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
        assert device.index is not None, "a plan's device always has an index"
        cupy = import_cupy()
        use_device(cupy, device.index)
        try:
            attrs = cupy.cuda.runtime.pointerGetAttributes(arena.data_ptr())
        except cupy.cuda.runtime.CUDARuntimeError as err:
            raise PageCopyError(
                "arena is not pinned host memory: register it with cudaHostRegister first"
            ) from err
        if attrs.type != _CUDA_MEMORY_TYPE_HOST:
            raise PageCopyError(
                "arena is not pinned host memory (cudaPointerGetAttributes type "
                f"{attrs.type}): register it with cudaHostRegister first"
            )
        if not mapped:
            return cls(arena.data_ptr(), arena.numel())
        if not attrs.devicePointer:
            raise PageCopyError(
                "arena is not pinned and mapped host memory: the copy kernels need "
                "cudaHostRegister with cudaHostRegisterMapped"
            )
        return cls(int(attrs.devicePointer), arena.numel())


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """A checked engine buffer on the GPU: ``num_pages`` pages of ``row_bytes`` contiguous bytes.

    Attributes:
        address: Device address of page 0.
        num_pages: Pages (the first dimension).
        row_bytes: Bytes of one page.
        page_stride: Bytes from one page to the next (``row_bytes`` for a contiguous buffer).
    """

    address: int
    num_pages: int
    row_bytes: int
    page_stride: int

    @classmethod
    def of(cls, buf: torch.Tensor, name: str, device: torch.device) -> DeviceBuffer:
        """Check that ``buf`` is a CUDA tensor on ``device`` whose pages are dense byte ranges.

        The first dimension is the page id and may have any stride at least a page long; the
        other dimensions must cover one dense range of bytes (in any order of their strides,
        so a permuted view of a contiguous page is accepted and copied as the bytes it holds).

        Raises:
            PageCopyError: Not a tensor; another device; no page dimension; pages that are not
                dense or that overlap.
        """
        if not isinstance(buf, torch.Tensor):
            raise PageCopyError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.device != device:
            raise PageCopyError(f"{name} must be on {device}, got device {buf.device}")
        if buf.dim() < 1:
            raise PageCopyError(
                f"{name} needs the page id as first dimension, got shape {tuple(buf.shape)}"
            )
        shape, strides = tuple(buf.shape), buf.stride()
        if not _dense(shape[1:], strides[1:]):
            raise PageCopyError(
                f"{name}'s pages must each be one dense range of bytes, got shape {shape} and "
                f"strides {strides}"
            )
        size = buf.element_size()
        row_bytes = math.prod(shape[1:]) * size
        page_stride = strides[0] * size if shape[0] > 1 else row_bytes
        if page_stride < row_bytes:
            raise PageCopyError(
                f"{name}'s pages overlap: they lie {page_stride} bytes apart and hold "
                f"{row_bytes} bytes each (strides {strides})"
            )
        return cls(buf.data_ptr(), int(shape[0]), row_bytes, page_stride)

    @property
    def region(self) -> EngineRegion:
        """The buffer as a segment planner's region, its offset the absolute device address."""
        return EngineRegion(self.address, self.page_stride, self.row_bytes, self.num_pages)


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether dimensions of these sizes and strides (elements) cover a dense range exactly."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
