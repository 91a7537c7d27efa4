"""vLLM's KV cache in a sealed memfd, described to kvtierd as regions.

vLLM allocates its whole KV cache as one ``torch.zeros(n, dtype=torch.int8)`` and views
every layer into it. :class:`MemfdAllocation` (what the connector's
``get_mem_pool_context()`` returns) turns that one allocation into a tensor over a memfd,
sized, mapped and sealed against shrinking and growing (:meth:`SharedMemorySegment.create_memfd
<kvtier.ipc.shm.SharedMemorySegment.create_memfd>`), so kvtierd can map the engine's KV
memory and copy pages itself. :func:`cpu_regions` then says where each page lies.

vLLM's CPU layout, per layer (``LBHNC``)::

    layer l tensor: [num_blocks, kv_heads, block_size, 2 × head_dim]   contiguous
    block b of layer l:  | head 0: K[block_size × head_dim] V[...] | head 1: ... |
    → region l = (offset of layer l, page_stride = block stride, page_bytes = one block, layer l)

On CUDA, vLLM's flash-attention layout is per layer ``[2, num_blocks, block_size, kv_heads,
head_dim]``: two regions per layer (K at component 0, V at component 1), each with the
block stride of dim 1; that path needs CUDA IPC handles instead of a memfd and is not
provided by this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from kvtier.ipc.protocol import MemoryRegion
from kvtier.ipc.shm import SharedMemorySegment
from torch.overrides import TorchFunctionMode

__all__ = ["LayoutError", "MemfdAllocation", "cpu_regions"]


class LayoutError(ValueError):
    """vLLM's KV tensors are not laid out as this connector expects."""


class MemfdAllocation(TorchFunctionMode):
    """A torch function mode placing vLLM's KV allocation in a sealed memfd.

    Only the one ``torch.zeros(nbytes, dtype=torch.int8)`` call of the expected size is
    redirected (a fresh memfd reads as zeros); every other call runs unchanged.

    Args:
        nbytes: the size of vLLM's KV backing allocation (``kv_cache_tensors[0].size``).

    Attributes:
        segment: the memfd segment once the allocation happened (else None).
    """

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.segment: SharedMemorySegment | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Redirect the KV allocation; pass everything else through."""
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and self.segment is None
            and kwargs.get("dtype") is torch.int8
            and _size_arg(args) == self.nbytes
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        ):
            self.segment = SharedMemorySegment.create_memfd(
                f"kvtier-vllm-kv-{os.getpid()}", self.nbytes, prefault=True
            )
            return self.segment.tensor(0, self.nbytes).view(torch.int8)
        return func(*args, **kwargs)

    def close(self) -> None:
        """Close the memfd (the mapping goes with the last tensor over it)."""
        if self.segment is not None:
            self.segment.close()


def _size_arg(args: tuple) -> int | None:
    if len(args) == 1 and isinstance(args[0], int):
        return args[0]
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) and len(args[0]) == 1:
        return int(args[0][0])
    return None


def cpu_regions(
    kv_caches: Mapping[str, torch.Tensor],
    layer_index: Mapping[str, int],
    segment: SharedMemorySegment,
) -> tuple[list[MemoryRegion], int]:
    """One region per layer of vLLM's CPU KV cache, in layer order.

    Args:
        kv_caches: layer name → that layer's KV tensor ``[num_blocks, kv_heads,
            block_size, 2 × head_dim]`` (what ``register_kv_caches`` receives).
        layer_index: layer name → model layer index.
        segment: the memfd all tensors live in.

    Returns:
        The regions (segment 0) and the number of blocks.

    Raises:
        LayoutError: a tensor outside the segment, not 4-d, with a non-contiguous block,
            or layers that disagree on the block count.
    """
    seen: set[int] = set()
    regions: list[tuple[int, MemoryRegion]] = []
    num_blocks: int | None = None
    for name, t in kv_caches.items():
        if t.data_ptr() in seen:  # a layer sharing another's KV (cross-layer sharing)
            continue
        seen.add(t.data_ptr())
        if t.dim() != 4 or not t[0].is_contiguous():
            raise LayoutError(
                f"{name}: KV tensor of shape {tuple(t.shape)} and strides "
                f"{t.stride()} is not vLLM's CPU layout [blocks, heads, tokens, 2*dim]"
            )
        item = t.element_size()
        offset = t.data_ptr() - segment.address
        block_stride = t.stride(0) * item
        page_bytes = t[0].numel() * item
        if offset < 0 or offset + (t.shape[0] - 1) * block_stride + page_bytes > segment.size:
            raise LayoutError(f"{name}: KV tensor is not inside the shared KV allocation")
        if num_blocks is not None and t.shape[0] != num_blocks:
            raise LayoutError(f"{name}: {t.shape[0]} blocks, other layers have {num_blocks}")
        num_blocks = t.shape[0]
        layer = layer_index[name]
        regions.append(
            (
                layer,
                MemoryRegion(
                    segment=0,
                    offset=offset,
                    page_stride=block_stride,
                    page_bytes=page_bytes,
                    layer=layer,
                ),
            )
        )
    if num_blocks is None:
        raise LayoutError("no KV tensors to register")
    regions.sort(key=lambda lr: lr[0])
    layers = [lr[0] for lr in regions]
    if layers != list(range(len(layers))):
        # regions are numbered 0..n-1 in the geometry: renumber in layer order
        regions = [
            (
                i,
                MemoryRegion(
                    segment=0,
                    offset=r.offset,
                    page_stride=r.page_stride,
                    page_bytes=r.page_bytes,
                    layer=i,
                ),
            )
            for i, (_, r) in enumerate(regions)
        ]
    return [r for _, r in regions], num_blocks
