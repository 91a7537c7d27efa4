"""An engine's paged KV pool in GPU memory, exported to kvtierd once by CUDA IPC.

The GPU counterpart of :class:`kvtier.client.kv_pool.shared.SharedKVPool`, with the same attributes and
the same ``layer_first`` layout: for each layer, K and V (MHA) or one latent (MLA), each
``[num_pages, page_size, kv_heads, head_dim]``, all in ONE device allocation::

    allocation: | L0.K | L0.V | L1.K | L1.V | ... |   each buffer = num_pages x chunk_bytes,
                                                       starting on a 256-byte boundary

One allocation means one IPC handle, one ``cudaIpcOpenMemHandle`` in the daemon, and one check
of IPC capability. Allocators:

- ``torch``: ``torch.empty`` through torch's caching allocator (plain ``cudaMalloc`` segments
  unless ``PYTORCH_CUDA_ALLOC_CONF`` asks for ``expandable_segments:True`` or
  ``backend:cudaMallocAsync``, whose memory has no IPC handle: :meth:`CudaKVPool.export` then
  raises a :class:`~kvtier.ipc.cuda_ipc.CudaIpcError` that says so).
- ``cudamalloc``: ``cudaMalloc`` through cupy, whatever torch is configured to do.
- ``auto`` (default): ``torch``, unless the environment asks torch for memory that cannot be
  exported; then ``cudamalloc``.

Close the :class:`~kvtier.client.connection.connection.Connection` before the pool: the daemon keeps the
memory mapped until the session ends, and torch would hand freed memory to other tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from kvtier.client.kv_pool.shared import TORCH_DTYPES
from kvtier.ipc import cuda_ipc
from kvtier.ipc.cuda_backend import EngineCudaBackend, TorchEngineBackend
from kvtier.ipc.cuda_ipc import CudaExport, CudaIpcError, CudaUnavailable
from kvtier.ipc.protocol import Geometry, KVMemory

__all__ = ["Allocator", "CudaKVPool", "unexportable_allocator_requested"]

Allocator = Literal["auto", "torch", "cudamalloc"]
_ALIGN = 256


def unexportable_allocator_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment tells torch to allocate memory that CUDA IPC cannot export.

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        True when ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) holds
        ``expandable_segments:True`` or ``backend:cudaMallocAsync``.
    """
    env = os.environ if environ is None else environ
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            key, value = key.strip().lower(), value.strip().lower()
            if key == "expandable_segments" and value == "true":
                return True
            if key == "backend" and value == "cudamallocasync":
                return True
    return False


class CudaKVPool:
    """Per-layer KV buffers in one CUDA allocation, exportable to kvtierd.

    Args:
        geometry: the page geometry (validated here).
        num_pages: pages per buffer (> 0).
        device: the GPU (``"cuda"``: the current device).
        allocator: ``auto``, ``torch`` or ``cudamalloc`` (see the module docstring).
        backend: the CUDA operations; None (the default) is torch and CuPy. Another one
            allocates and exports the memory itself (``allocator`` is then not used).

    Attributes:
        geometry / num_pages: as given.
        device: the GPU, with its index.
        allocator: the allocator actually used (``torch`` or ``cudamalloc``).
        cuda_backend: the CUDA operations (the connection opens the daemon's events with it).
        k / v: per-layer tensors ``[num_pages, page_size, kv_heads, head_dim]`` of the
            geometry's dtype (MHA); for MLA ``k`` holds the latent and ``v`` is empty. Zeroed.

    Raises:
        ValueError: a bad geometry or page count.
        CudaUnavailable: no GPU or no cupy.
        CudaIpcError: the allocation failed.
    """

    def __init__(
        self,
        geometry: Geometry,
        num_pages: int,
        device: torch.device | int | str = "cuda",
        *,
        allocator: Allocator = "auto",
        backend: EngineCudaBackend | None = None,
    ) -> None:
        geometry.validate()
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if allocator not in ("auto", "torch", "cudamalloc"):
            raise ValueError(
                f"allocator must be 'auto', 'torch' or 'cudamalloc', got {allocator!r}"
            )
        self.cuda_backend: EngineCudaBackend = backend or TorchEngineBackend()
        reason = self.cuda_backend.unavailable_reason()
        if reason is not None:
            raise CudaUnavailable(f"CudaKVPool {reason}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = torch.device("cuda", self.cuda_backend.ordinal_of(device))
        if allocator == "auto":
            allocator = "cudamalloc" if unexportable_allocator_requested() else "torch"
        self.allocator: Literal["torch", "cudamalloc"] = allocator
        g = geometry
        self._buf_bytes = num_pages * g.chunk_bytes
        self._stride = -(-self._buf_bytes // _ALIGN) * _ALIGN
        n_buf = g.num_layers * g.components
        total = n_buf * self._stride
        self._known: Any = ()
        if backend is not None:
            flat, self._known = backend.allocate(total, self.device.index or 0)
        elif allocator == "torch":
            try:
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError as err:
                raise CudaIpcError(
                    f"cannot allocate the KV pool ({total} bytes) on {self.device}: {err}"
                ) from err
        else:
            flat, rng = cuda_ipc.empty_ipc_capable(total, self.device)
            self._known = (rng,)
        flat.zero_()
        self._flat: torch.Tensor | None = flat
        self._export: CudaExport | None = None
        dtype = TORCH_DTYPES[g.dtype]
        shape = (num_pages, g.page_size, g.kv_heads, g.head_dim)
        bufs = [
            flat[i * self._stride : i * self._stride + self._buf_bytes].view(dtype).view(shape)
            for i in range(n_buf)
        ]
        self.k: list[torch.Tensor] = bufs[:: g.components]
        self.v: list[torch.Tensor] = bufs[1 :: g.components] if g.components == 2 else []

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's allocation (padding included)."""
        return 0 if self._flat is None else self._flat.numel()

    def export(self) -> KVMemory:
        """Describe the pool for REGISTER: one CUDA IPC handle, one offset per buffer.

        The handle is made once and reused by every registration (re-registrations included).

        Raises:
            CudaIpcError: the memory cannot be exported (expandable segments, cudaMallocAsync),
                or the pool is closed.
        """
        if self._flat is None:
            raise CudaIpcError("the CudaKVPool is closed")
        if self._export is None:
            segment, base = self.cuda_backend.export(self._flat, self._known)
            n_buf = self.geometry.num_layers * self.geometry.components
            self._export = CudaExport(
                [segment], [0] * n_buf, [base + i * self._stride for i in range(n_buf)]
            )
        return self._export.memory(self.num_pages)

    def close(self) -> None:
        """Drop the tensors; the memory is freed once no other tensor views it. Idempotent.

        Unregister first (close the Connection): the daemon maps the memory until then.
        """
        self.k = []
        self.v = []
        self._flat = None
        self._export = None

    def __enter__(self) -> CudaKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
