"""The shape of an engine's KV pages and where they lie in its memory (REGISTER's geometry
and memory description). Re-exported by :mod:`kvtier.ipc.protocol`."""

from __future__ import annotations

import typing
from typing import Annotated

import msgspec
from kvtier.ipc.limits import (
    MAX_BUFFERS,
    Attention,
    Dim,
    DType,
    Handle,
    Layers,
    Layout,
    MemoryKind,
    Name,
    Offsets,
    PageCount,
    RegionLayer,
    SegmentBytes,
    SegmentIndex,
    SegmentIndices,
    SegmentName,
    SegmentOffset,
)
from msgspec import Meta

__all__ = ["DTYPE_SIZES", "Geometry", "KVMemory", "MemoryRegion", "MemorySegment"]


class Geometry(msgspec.Struct, frozen=True):
    """The shape of one engine's KV pages (one TP rank).

    Attributes:
        num_layers: transformer layers.
        page_size: tokens per page.
        kv_heads: KV heads on this rank (MHA); 1 for MLA.
        head_dim: head dimension (MHA) or latent width (MLA).
        dtype: element type name, e.g. ``float16``, ``bfloat16``, ``float32``, ``fp8_e4m3``.
        attention: ``mha`` (K and V per layer) or ``mla`` (one latent per token).
        layout: a label naming the engine's memory layout (``layer_first``, the layout of
            :class:`~kvtier.client.kv_pool.shared.SharedKVPool`; an engine adapter's own, e.g.
            ``vllm_cpu``); part of the namespace, so pages of two layouts never mix.
    """

    num_layers: Layers
    page_size: Dim
    kv_heads: Dim
    head_dim: Dim
    dtype: DType
    attention: Attention = "mha"
    layout: Layout = "layer_first"

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_SIZES[self.dtype]

    @property
    def components(self) -> int:
        """Buffers per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 2 if self.attention == "mha" else 1

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page of one (layer, component) buffer."""
        return self.page_size * self.kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page, every layer and component (one host-pool slot)."""
        return self.num_layers * self.components * self.chunk_bytes

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range.

        A decoded geometry is within its field bounds already; this checks one built in
        Python against the same bounds, and the MLA rule that spans two fields.
        """
        try:
            msgspec.convert(msgspec.structs.asdict(self), Geometry)
        except msgspec.ValidationError as err:
            raise ValueError(f"geometry: {err}") from err
        if self.attention == "mla" and self.kv_heads != 1:
            raise ValueError(f"geometry.kv_heads = {self.kv_heads!r} must be 1 for MLA")


DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
assert set(DTYPE_SIZES) == set(typing.get_args(DType)), "DType and DTYPE_SIZES disagree"


class MemorySegment(msgspec.Struct, frozen=True):
    """One exported allocation.

    Attributes:
        name: for ``fd``, a label for logs (segment ``i`` is the handover's ``i``-th
            descriptor); for ``cuda_ipc``, a label. (``shm``, a file name, is refused.)
        size: bytes of the allocation (for ``fd``, exactly the descriptor's size).
        handle: for ``cuda_ipc``, the CUDA IPC memory handle bytes.
        device_uuid: for ``cuda_ipc``, the GPU's UUID (ordinals differ between processes).
    """

    name: SegmentName
    size: SegmentBytes
    handle: Handle = b""
    device_uuid: Name = ""


class MemoryRegion(msgspec.Struct, frozen=True):
    """Where one part of every page lies in engine memory.

    Page ``p`` of the region is the ``page_bytes`` bytes at ``offset + p * page_stride`` of
    ``segments[segment]``. A host-pool page is the page bytes of every region, concatenated
    in region order.

    Attributes:
        segment: index into :attr:`KVMemory.segments`.
        offset: where page 0 of the region starts in the segment.
        page_stride: bytes from one page of the region to the next (at least ``page_bytes``).
        page_bytes: bytes of one page in this region.
        layer: the model layer whose KV the region holds, or -1 when it holds several
            layers (a load signals those layers when the whole page is in place).
    """

    segment: SegmentIndex
    offset: SegmentOffset
    page_stride: SegmentBytes
    page_bytes: SegmentBytes
    layer: RegionLayer = -1


class KVMemory(msgspec.Struct, frozen=True):
    """An engine's KV pool as exported to the daemon once, at registration.

    Two ways to say where pages lie:

    - ``regions`` (any engine's layout): see :class:`MemoryRegion`; the regions' page bytes
      add up to ``geometry.page_bytes``.
    - the per-buffer form (kvtier's ``layer_first``): ``buffer_offsets[l * components + c]``
      is where layer ``l``, component ``c`` starts in ``segments[buffer_segments[...]]``;
      each buffer holds ``num_pages`` pages of ``geometry.chunk_bytes`` bytes, contiguous.
      It is the region list ``(segment, offset, chunk_bytes, chunk_bytes, l)``.

    With ``kind = "fd"``, ``segments[i]`` is the ``i``-th descriptor of the REGISTER's
    handover (as many segments as descriptors). With ``kind = "none"`` there is no memory
    (no segments, no buffers, no regions): the session may only LOOKUP.
    """

    kind: MemoryKind
    num_pages: PageCount
    segments: Annotated[list[MemorySegment], Meta(max_length=MAX_BUFFERS)]
    buffer_segments: SegmentIndices = []
    buffer_offsets: Offsets = []
    regions: Annotated[list[MemoryRegion], Meta(max_length=MAX_BUFFERS)] = []

    def layout_regions(self, geometry: Geometry) -> list[MemoryRegion]:
        """The regions of this export: ``regions``, or those of the per-buffer form."""
        if self.regions:
            return list(self.regions)
        chunk, comps = geometry.chunk_bytes, geometry.components
        return [
            MemoryRegion(segment=s, offset=o, page_stride=chunk, page_bytes=chunk, layer=i // comps)
            for i, (s, o) in enumerate(zip(self.buffer_segments, self.buffer_offsets, strict=False))
        ]
