"""The CPU memory a page copy reads and writes, checked and seen as numpy bytes.

The CPU copy path (:mod:`kvtier.kernels.page_copy`, the daemon's transfers) works on numpy
arrays: the daemon's host arena and the engine memory it maps are numpy views of shared
memory, so a CPU daemon never imports torch. Callers that hold CPU torch tensors (engines,
tests, the CUDA back end's reference copies) may pass them as they are: a tensor is
recognised only when torch is imported already (``sys.modules``), so this module never
imports it either.

- :class:`ArenaView`: the host arena, a 1-D contiguous uint8 array (or tensor).
- :class:`EngineView`: one engine buffer, ``[num_pages, row_bytes]`` bytes whose rows lie
  ``page_stride`` apart: any contiguous array with the page id as first dimension, or a 2-D
  uint8 view whose rows are spaced further apart than they are long.

Both check the object before any byte moves, and a copy's destination must be writable. A view
made once may be passed to the copies in place of its array, so memory that many transfers
copy (the daemon's view of an engine's region) is not checked again each time: finding a
numpy array's address alone costs microseconds.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt
from kvtier.kernels.plan import PageCopyError

if TYPE_CHECKING:
    import torch

__all__ = ["ArenaView", "EngineView", "HostBuffer", "address_of", "torch_tensor"]

HostBuffer: TypeAlias = "npt.NDArray[Any] | torch.Tensor"
"""CPU memory a copy accepts: a numpy array, or a CPU torch tensor."""


def torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (False whenever torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def address_of(array: np.ndarray) -> int:
    """The address of ``array``'s first byte."""
    return int(array.__array_interface__["data"][0])


@dataclass(frozen=True, slots=True)
class ArenaView:
    """A checked host arena.

    Attributes:
        array: the arena as a 1-D uint8 numpy array (sharing the caller's memory).
        address: the address of its first byte.
        nbytes: its size in bytes.
    """

    array: npt.NDArray[np.uint8]
    address: int
    nbytes: int

    @classmethod
    def of(cls, arena: HostBuffer | ArenaView, *, write: bool = False) -> ArenaView:
        """Check that ``arena`` is a 1-D contiguous uint8 array or CPU tensor.

        Args:
            arena: the host arena, or a view of it checked before (returned as it is).
            write: the copy writes it (then it must be writable).

        Raises:
            PageCopyError: another type, device, dtype, shape or layout; read-only.
        """
        if isinstance(arena, ArenaView):
            array = arena.array
        elif isinstance(arena, np.ndarray):
            array = arena
            if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
                raise PageCopyError(
                    "arena must be a 1-D contiguous uint8 array, got "
                    f"{array.dtype} of shape {array.shape}"
                )
        elif torch_tensor(arena):
            if arena.device.type != "cpu":
                raise PageCopyError(f"arena must be a CPU tensor, got device {arena.device}")
            if arena.dtype != _torch().uint8 or arena.dim() != 1 or not arena.is_contiguous():
                raise PageCopyError(
                    "arena must be a 1-D contiguous uint8 array, got "
                    f"{arena.dtype} of shape {tuple(arena.shape)}"
                )
            array = arena.detach().numpy()
        else:
            raise PageCopyError(
                f"arena must be a numpy array or a torch.Tensor, got {type(arena).__name__}"
            )
        if write and not array.flags.writeable:
            raise PageCopyError("arena is read-only")
        if isinstance(arena, ArenaView):
            return arena
        return cls(array, address_of(array), int(array.size))


@dataclass(frozen=True, slots=True)
class EngineView:
    """A checked engine buffer seen as bytes: ``[num_pages, row_bytes]``, rows ``page_stride``
    apart from ``address``.

    Attributes:
        array: the buffer as a 2-D uint8 numpy array sharing its memory.
        address: the address of page 0.
        num_pages: pages in the buffer.
        row_bytes: bytes of one page.
        page_stride: bytes from one page to the next (``row_bytes`` when contiguous).
    """

    array: npt.NDArray[np.uint8]
    address: int
    num_pages: int
    row_bytes: int
    page_stride: int

    @classmethod
    def of(cls, buf: HostBuffer | EngineView, name: str, *, write: bool = False) -> EngineView:
        """Check that ``buf`` has the page id as first dimension: contiguous (any dtype), or a
        2-D uint8 ``[num_pages, row_bytes]`` view whose rows lie at least ``row_bytes`` apart.

        Args:
            buf: a numpy array or a CPU torch tensor, or a view checked before (returned as
                it is: the daemon makes one per region of an engine's memory, at registration).
            name: how the buffer is named in error messages.
            write: the copy writes it (then it must be writable).

        Raises:
            PageCopyError: another type or device; not laid out as above; read-only.
        """
        if isinstance(buf, EngineView):
            if write and not buf.array.flags.writeable:
                raise PageCopyError(f"{name} is read-only")
            return buf
        if isinstance(buf, np.ndarray):
            array = _numpy_rows(buf, name)
        elif torch_tensor(buf):
            array = _tensor_rows(buf, name)
        else:
            raise PageCopyError(
                f"{name} must be a numpy array or a torch.Tensor, got {type(buf).__name__}"
            )
        if write and not array.flags.writeable:
            raise PageCopyError(f"{name} is read-only")
        rows, row_bytes = array.shape
        return cls(array, address_of(array), int(rows), int(row_bytes), int(array.strides[0]))


def _torch() -> Any:
    """The torch module, imported already (only called for a tensor)."""
    return sys.modules["torch"]


def _strided_rows(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """A 2-D byte layout whose rows are contiguous and do not overlap."""
    return len(shape) == 2 and strides[1] == 1 and strides[0] >= shape[1]


def _numpy_rows(buf: np.ndarray, name: str) -> npt.NDArray[np.uint8]:
    """``buf`` as ``[num_pages, row_bytes]`` uint8 rows, or raise naming ``name``."""
    if buf.dtype == np.uint8 and _strided_rows(buf.shape, buf.strides):
        return buf
    if buf.ndim < 1 or not buf.flags.c_contiguous or buf.dtype.hasobject:
        raise PageCopyError(
            f"{name} must be contiguous with the page id as first dimension, got shape "
            f"{buf.shape}, dtype {buf.dtype} and strides {buf.strides}"
        )
    row_bytes = math.prod(buf.shape[1:]) * buf.itemsize
    return buf.reshape(-1).view(np.uint8).reshape(buf.shape[0], row_bytes)


def _tensor_rows(buf: torch.Tensor, name: str) -> npt.NDArray[np.uint8]:
    """A CPU tensor as ``[num_pages, row_bytes]`` uint8 rows (sharing its memory)."""
    torch = _torch()
    if buf.device.type != "cpu":
        raise PageCopyError(f"{name} must be a CPU tensor, got device {buf.device}")
    if buf.dtype == torch.uint8 and _strided_rows(tuple(buf.shape), buf.stride()):
        return buf.detach().numpy()
    if buf.dim() < 1 or not buf.is_contiguous():
        raise PageCopyError(
            f"{name} must be contiguous with the page id as first dimension, got shape "
            f"{tuple(buf.shape)} and strides {buf.stride()}"
        )
    row_bytes = math.prod(buf.shape[1:]) * buf.element_size()
    flat = buf.detach().reshape(-1).view(torch.uint8)  # bytes of any dtype (bf16, fp8)
    return flat.numpy().reshape(int(buf.shape[0]), row_bytes)
