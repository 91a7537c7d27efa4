"""An engine's paged KV pool in shared memory, for machines without a GPU.

The engine computes in these tensors as it would in GPU memory; the daemon maps the same
memory and copies pages in and out of it. The memory is an anonymous memfd, sealed against
shrinking and growing (no file in /dev/shm, nothing left behind by a crash); the connection
hands its descriptor to the daemon at registration (:func:`kvtier.ipc.fdpass.hand_over`),
so no other process can reach it by a name. Layout
"layer_first": for each layer, K and V (MHA) or one latent (MLA), each
``[num_pages, page_size, kv_heads, head_dim]``, all in one segment::

    segment: | L0.K | L0.V | L1.K | L1.V | ... |     each buffer = num_pages × chunk_bytes
"""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING

import torch
from kvtier.ipc.limits import MAX_PAGES, DType
from kvtier.ipc.protocol import Geometry, KVMemory, MemorySegment
from kvtier.ipc.shm import SharedMemorySegment

if TYPE_CHECKING:
    from typing import Self

TORCH_DTYPES: dict[DType, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


class SharedKVPool:
    """Per-layer KV buffers in one sealed memfd segment.

    Attributes:
        geometry: the page geometry.
        num_pages: pages per buffer.
        k / v: per-layer tensors ``[num_pages, page_size, kv_heads, head_dim]`` (MHA);
            for MLA ``k`` holds the latent and ``v`` is empty.

    Raises:
        TypeError / ValueError: ``num_pages`` not an integer in ``[1, 2**26]``.
        SharedMemoryError: the memory cannot be made, or ``prefault`` asks for more than
            the memory available.
    """

    def __init__(self, geometry: Geometry, num_pages: int, prefault: bool = True) -> None:
        geometry.validate()
        try:
            if isinstance(num_pages, bool):
                raise TypeError
            num_pages = operator.index(num_pages)
        except TypeError:
            raise TypeError(f"num_pages = {num_pages!r}: must be an integer") from None
        if not 0 < num_pages <= MAX_PAGES:
            raise ValueError(f"num_pages = {num_pages!r}: must be in [1, {MAX_PAGES}]")
        self.geometry = geometry
        self.num_pages = num_pages
        g = geometry
        self._buf_bytes = num_pages * g.chunk_bytes
        n_buf = g.num_layers * g.components
        self.segment = SharedMemorySegment.create_memfd(
            f"kvtier-engine-{os.getpid()}", n_buf * self._buf_bytes, prefault=prefault
        )
        dtype = TORCH_DTYPES[g.dtype]
        shape = (num_pages, g.page_size, g.kv_heads, g.head_dim)
        bufs = [
            self.segment.tensor(i * self._buf_bytes, self._buf_bytes).view(dtype).view(shape)
            for i in range(n_buf)
        ]
        self.k: list[torch.Tensor] = bufs[:: g.components]
        self.v: list[torch.Tensor] = bufs[1 :: g.components] if g.components == 2 else []

    def memory_fds(self) -> list[int]:
        """The descriptors to hand over, in the order of :meth:`export`'s segments."""
        fd = self.segment.fd
        if fd is None:
            raise ValueError("the pool is closed")
        return [fd]

    def export(self) -> KVMemory:
        """Describe the pool for REGISTER (segment 0 is the handover's descriptor 0)."""
        g = self.geometry
        n_buf = g.num_layers * g.components
        return KVMemory(
            kind="fd",
            num_pages=self.num_pages,
            segments=[MemorySegment(name=self.segment.path, size=self.segment.size)],
            buffer_segments=[0] * n_buf,
            buffer_offsets=[i * self._buf_bytes for i in range(n_buf)],
        )

    def close(self) -> None:
        """Drop the tensors, unmap and close the memfd."""
        self.k = []
        self.v = []
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
