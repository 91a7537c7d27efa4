"""An engine's own KV tensors on a GPU, in its own layout, exported to kvtierd by CUDA IPC.

:class:`~kvtier.client.kv_pool.cuda.CudaKVPool` allocates the KV cache itself, in kvtier's
``layer_first`` layout. An engine that allocates its own (vLLM's HND cache for FlashInfer:
``[num_blocks, 2, kv_heads, block_size, head_dim]`` per layer, a block's K and V side by
side; SGLang's page-first pools) describes it instead: one tensor view per layer and component
(K, V; or the latent for MLA), ``[num_pages, ...]``, each page of it ``geometry.chunk_bytes``
contiguous bytes, the pages any stride apart. :class:`CudaRegionMemory` exports the allocations
those views live in and describes each view as a :class:`~kvtier.ipc.protocol.MemoryRegion`
(offset, page stride); kvtierd copies pages by DMA straight from and into them, as it does for a
``CudaKVPool``. A kvtier page is the concatenation of the views' pages in order (layer 0's K,
V, then layer 1's ...). Engines share pages when their geometries are equal, its ``layout``
label included: an engine whose pages order their elements otherwise than ``CudaKVPool``'s
``[page_size, kv_heads, head_dim]`` (HND's ``[kv_heads, block_size, head_dim]``) names its
layout in ``Geometry(layout=...)``, so that its pages are never read as another's.

Close the :class:`~kvtier.client.connection.connection.Connection` before freeing the tensors:
the daemon keeps the memory mapped until the session ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvtier.ipc.cuda_backend import EngineCudaBackend, TorchEngineBackend
from kvtier.ipc.cuda_ipc import CudaIpcError, CudaUnavailable
from kvtier.ipc.protocol import Geometry, KVMemory, MemoryRegion, MemorySegment

__all__ = ["CudaRegionMemory"]


def _span(t: torch.Tensor, num_pages: int, page_bytes: int) -> tuple[int, int, int]:
    """``(first byte address, page stride in bytes, bytes from the first page's start to the
    last page's end)`` of a view whose pages are ``page_bytes`` contiguous bytes each."""
    stride = t.stride(0) * t.element_size()
    return t.data_ptr(), stride, (num_pages - 1) * stride + page_bytes


class CudaRegionMemory:
    """KV tensors an engine allocated itself on one GPU, described for REGISTER by regions.

    Args:
        geometry: the page geometry (validated here).
        num_pages: pages each view holds (a view may have more; the first ``num_pages`` are
            registered).
        buffers: per layer, per component (K then V for MHA; the latent for MLA), a view
            ``[>= num_pages, ...]`` whose every page ``buffers[i][p]`` is
            ``geometry.chunk_bytes`` contiguous bytes; pages at least that many bytes apart.
        allocations: the tensors the views live in, each with what ``backend.export`` needs
            (``(tensor, known)``; the default backend needs no ``known``: ``()``). Default:
            each view's own span, whose allocation the CUDA driver finds.
        backend: the CUDA operations; None (the default) is torch and CuPy.

    Attributes:
        geometry / num_pages: as given.
        device: the GPU, with its index.
        cuda_backend: the CUDA operations (the connection opens the daemon's events with it).
        buffers: the views, as given.

    Raises:
        ValueError: a bad geometry or page count, the wrong number of views, or a view whose
            pages are not one chunk of contiguous bytes, or lie outside every allocation.
        CudaUnavailable: no GPU or no CuPy.
        CudaIpcError: the memory cannot be exported (expandable segments, cudaMallocAsync).
    """

    def __init__(
        self,
        geometry: Geometry,
        num_pages: int,
        buffers: Sequence[torch.Tensor],
        allocations: Sequence[tuple[torch.Tensor, Any]] | None = None,
        *,
        backend: EngineCudaBackend | None = None,
    ) -> None:
        geometry.validate()
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        g = geometry
        n_buf = g.num_layers * g.components
        if len(buffers) != n_buf:
            raise ValueError(
                f"{len(buffers)} buffers; the geometry needs one per layer and component: "
                f"{n_buf} ({g.num_layers} layers x {g.components})"
            )
        seen: dict[tuple[int, int], int] = {}
        for i, t in enumerate(buffers):
            _check_view(t, i, num_pages, g.chunk_bytes)
            first = seen.setdefault((t.data_ptr(), t.stride(0)), i)
            if first != i:
                raise ValueError(f"buffers[{i}] is buffers[{first}] again")
            if t.device != buffers[0].device:
                raise ValueError(
                    f"buffers[{i}] is on {t.device}, buffers[0] on {buffers[0].device}: one "
                    "registration exports one GPU"
                )
        self.cuda_backend: EngineCudaBackend = backend or TorchEngineBackend()
        reason = self.cuda_backend.unavailable_reason()
        if reason is not None:
            raise CudaUnavailable(f"CudaRegionMemory {reason}")
        self.geometry = geometry
        self.num_pages = num_pages
        where = buffers[0].device
        # a backend other than CUDA's (a test's fake) may keep its "device memory" on the host
        self.device = torch.device(
            "cuda", self.cuda_backend.ordinal_of(where if where.type == "cuda" else "cuda")
        )
        self.buffers = list(buffers)
        if allocations is None:
            allocations = [(_flat(t, num_pages, g), ()) for t in buffers]
        self._allocations = list(allocations)
        self._memory: KVMemory | None = None

    def export(self) -> KVMemory:
        """Describe the memory for REGISTER: one CUDA IPC handle per allocation, one region
        per view. Made once and reused by every registration.

        Raises:
            CudaIpcError: an allocation cannot be exported, or the memory was closed.
            ValueError: a view lies in none of the allocations.
        """
        if not self.buffers:
            raise CudaIpcError("the CudaRegionMemory is closed")
        if self._memory is not None:
            return self._memory
        g = self.geometry
        ranges = [
            (flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())
            for flat, _ in self._allocations
        ]
        home: list[int] = []  # each view's allocation
        for i, t in enumerate(self.buffers):
            ptr, _, span = _span(t, self.num_pages, g.chunk_bytes)
            where = next((a for a, (lo, hi) in enumerate(ranges) if lo <= ptr <= hi - span), None)
            if where is None:
                raise ValueError(
                    f"buffers[{i}] ({span} bytes at {ptr:#x}) lies in none of the allocations"
                )
            home.append(where)
        segments: list[MemorySegment] = []
        index_of: dict[str, int] = {}  # the backends name a segment after its allocation
        exported: dict[int, tuple[int, int]] = {}  # allocation -> (segment, its offset there)
        for a in sorted(set(home)):  # only the allocations a view lies in
            flat, known = self._allocations[a]
            segment, base = self.cuda_backend.export(flat, known)
            index = index_of.setdefault(segment.name, len(segments))
            if index == len(segments):
                segments.append(segment)
            exported[a] = (index, base)
        regions: list[MemoryRegion] = []
        for i, (t, a) in enumerate(zip(self.buffers, home, strict=True)):
            ptr, stride, _ = _span(t, self.num_pages, g.chunk_bytes)
            index, base = exported[a]
            start = ranges[a][0]
            regions.append(
                MemoryRegion(
                    segment=index,
                    offset=base + ptr - start,
                    page_stride=stride,
                    page_bytes=g.chunk_bytes,
                    layer=i // g.components,
                )
            )
        self._memory = KVMemory(
            kind="cuda_ipc", num_pages=self.num_pages, segments=segments, regions=regions
        )
        return self._memory

    def close(self) -> None:
        """Forget the views and allocations (the engine owns the memory). Idempotent.

        Unregister first (close the Connection): the daemon maps the memory until then.
        """
        self.buffers = []
        self._allocations = []
        self._memory = None

    def __enter__(self) -> CudaRegionMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_view(t: object, i: int, num_pages: int, chunk_bytes: int) -> None:
    """``buffers[i]``: a tensor of at least ``num_pages`` pages, each ``chunk_bytes``
    contiguous bytes, pages at least that far apart (ValueError naming it otherwise)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise ValueError(f"buffers[{i}] must be a tensor [num_pages, ...], got {t!r:.80}")
    if t.shape[0] < num_pages:
        raise ValueError(f"buffers[{i}] holds {t.shape[0]} pages, fewer than {num_pages}")
    page = t[0]
    if not page.is_contiguous() or page.numel() * t.element_size() != chunk_bytes:
        raise ValueError(
            f"buffers[{i}]: a page must be {chunk_bytes} contiguous bytes, got shape "
            f"{tuple(t.shape[1:])} of {t.dtype} with strides {t.stride()[1:]}"
        )
    if t.stride(0) * t.element_size() < chunk_bytes:
        raise ValueError(
            f"buffers[{i}]: pages {t.stride(0) * t.element_size()} bytes apart overlap "
            f"({chunk_bytes} bytes each)"
        )


def _flat(t: torch.Tensor, num_pages: int, g: Geometry) -> torch.Tensor:
    """A contiguous uint8 tensor over a view's span (its first page's start to its last
    page's end), in the same storage: what the export looks the allocation up by."""
    _, _, span = _span(t, num_pages, g.chunk_bytes)
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (span,), (1,))
    return flat
