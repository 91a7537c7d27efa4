"""SGLang's HiCache host pool described to kvtierd: its geometry and where each page lies.

With ``"allocator": "shm"`` in the storage backend's extra config, SGLang allocates its host
pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) in a memfd
(``ShmHostTensorAllocator``: one memfd per allocation, created without
``MFD_ALLOW_SEALING``, kept open by the allocator). kvtierd takes those descriptors once and
copies pages between SGLang's host pool and its own (positional I/O on the descriptor, since
it is not sealed).

Where the bytes of a page lie comes from SGLang itself: ``get_page_buffer_meta(indices)``,
the pool's zero-copy description for storage backends, gives per host page a list of
``(pointer, bytes)`` pieces, the same number and sizes for every page, each at a fixed
stride from one page to the next. Each piece becomes one :class:`MemoryRegion`; a kvtier
page is the pieces concatenated in SGLang's order. For the layouts of 0.5.23 (host pool
dims in brackets, ``P`` = page_size tokens, ``S`` = tokens, ``N`` = pages)::

    MHA layer_first        [2, L, S, H, D]      2·L regions: L0.K L0.V L1.K ...  (layer l each)
    MHA page_first         [2, S, L, H, D]      2 regions: K, V   (a page: P·L·H·D contiguous)
    MHA page_first_direct  [2, N, L, P, H, D]   2 regions: K, V
    MHA page_head          [2, N, H, P, L, D]   2 regions: K, V
    MLA layer_first        [L, S, 1, C]         L regions (layer l each)
    MLA page_first(_direct) [S, L, 1, C] / [N, L, P, 1, C]   1 region

(``C`` = kv_lora_rank + qk_rope_head_dim.) Every region is checked: same stride for the
first, second and last page, inside one of the allocator's memfds, and the pieces add up to
the geometry's page. The geometry's ``layout`` is ``sglang_<layout>``, so pages of two
layouts never share a namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.config import KvtierError
from kvtier.ipc.protocol import Geometry, MemoryRegion

__all__ = ["HostPoolError", "HostPoolMemory", "describe_host_pool", "torch_dtype_name"]

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


class HostPoolError(KvtierError):
    """SGLang's host pool cannot be handed to kvtierd (no shm allocator, an unknown layout,
    a dtype kvtier does not carry); the message says what to change."""


@dataclass(frozen=True, slots=True)
class HostPoolMemory:
    """What registration needs from the host pool.

    Attributes:
        geometry: the page geometry (``layout = sglang_<layout>``).
        memory: the descriptors and regions (:class:`RegionMemory`), as
            :class:`~kvtier.client.connection.connection.Connection` takes them.
        page_size: tokens per page (host index ``i`` is in page ``i // page_size``).
    """

    geometry: Geometry
    memory: RegionMemory
    page_size: int


def torch_dtype_name(dtype: torch.dtype) -> str:
    """kvtier's name of a torch dtype.

    Raises:
        HostPoolError: kvtier does not carry this dtype.
    """
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise HostPoolError(
            f"kvtier does not carry KV pages of dtype {dtype}; "
            f"supported: {sorted(_DTYPES.values())}"
        ) from None


def _segments(host_pool: Any) -> list[tuple[int, int, int]]:
    """``(fd, base address, size)`` of each memfd of the host pool's allocator."""
    allocator = getattr(host_pool, "allocator", None)
    fds = list(getattr(allocator, "fds", None) or [])
    mms = list(getattr(allocator, "mms", None) or [])
    if not fds or len(fds) != len(mms):
        raise HostPoolError(
            'SGLang\'s host pool is not in shared memory: add "allocator": "shm" to '
            "--hicache-storage-backend-extra-config (kvtierd copies pages straight from and "
            "into SGLang's host pool, which it can reach only as a memfd)"
        )
    out = []
    for fd, mm in zip(fds, mms, strict=True):
        view = np.frombuffer(mm, dtype=np.uint8)  # no copy: only to read the address
        base = int(view.ctypes.data)
        del view
        out.append((fd, base, os.fstat(fd).st_size))
    return out


def _geometry(host_pool: Any, mla: bool) -> Geometry:
    layout = str(host_pool.layout)
    dtype = torch_dtype_name(host_pool.dtype)
    if mla:
        head_dim, heads = int(host_pool.kv_cache_dim), 1
    else:
        head_dim, heads = int(host_pool.head_dim), int(host_pool.head_num)
        v_dim = int(getattr(host_pool, "v_head_dim", head_dim))
        if v_dim != head_dim:
            raise HostPoolError(
                f"K and V head dims differ ({head_dim} and {v_dim}); kvtier pages "
                "hold equal K and V rows"
            )
    label = f"sglang_{layout}"
    try:
        geometry = Geometry(
            num_layers=int(host_pool.layer_num),
            page_size=int(host_pool.page_size),
            kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,  # type: ignore[arg-type]
            attention="mla" if mla else "mha",
            layout=label,
        )
        geometry.validate()
    except (ValueError, TypeError) as err:
        raise HostPoolError(f"SGLang host pool ({layout}): {err}") from err
    return geometry


def _pieces(host_pool: Any, page: int) -> tuple[list[int], list[int]]:
    """SGLang's zero-copy pieces (pointers, bytes) of host page ``page``."""
    ps = int(host_pool.page_size)
    idx = torch.arange(page * ps, (page + 1) * ps, dtype=torch.int64)
    ptrs, sizes = host_pool.get_page_buffer_meta(idx)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def describe_host_pool(host_pool: Any, mla: bool) -> HostPoolMemory:
    """Geometry and regions of SGLang's host pool.

    Args:
        host_pool: SGLang's ``HostKVCache`` (allocated with the shm allocator).
        mla: the pool holds MLA latents (one per token and layer, the same on every rank).

    Raises:
        HostPoolError: not in shared memory, a layout whose pages are not evenly strided
            pieces of the memfds, or pieces that do not add up to the geometry's page.
    """
    segments = _segments(host_pool)
    geometry = _geometry(host_pool, mla)
    layout = host_pool.layout
    num_pages = int(host_pool.size) // int(host_pool.page_size)
    if num_pages < 2:
        raise HostPoolError(f"SGLang's host pool has {num_pages} page(s); kvtier needs two or more")
    try:
        first, sizes = _pieces(host_pool, 0)
        second, sizes2 = _pieces(host_pool, 1)
        last, sizes_n = _pieces(host_pool, num_pages - 1)
    except (ValueError, NotImplementedError, AttributeError) as err:
        raise HostPoolError(
            f"SGLang host pool layout {layout!r} has no zero-copy page description: {err}"
        ) from err
    if (
        not first
        or not (len(first) == len(second) == len(last))
        or not (sizes == sizes2 == sizes_n)
    ):
        raise HostPoolError(
            f"SGLang host pool layout {layout!r}: pages are not made of the same pieces"
        )
    regions = []
    for a, b, z, size in zip(first, second, last, sizes, strict=True):
        stride = b - a
        if stride < size or z != a + (num_pages - 1) * stride:
            raise HostPoolError(
                f"SGLang host pool layout {layout!r}: a page piece is not evenly "
                f"strided (stride {stride}, {size} bytes)"
            )
        for i, (_, base, seg_size) in enumerate(segments):
            if base <= a and z + size <= base + seg_size:
                regions.append(
                    MemoryRegion(
                        segment=i, offset=a - base, page_stride=stride, page_bytes=size, layer=-1
                    )
                )
                break
        else:
            raise HostPoolError(
                f"SGLang host pool layout {layout!r}: a page piece lies outside "
                "the allocator's shared memory"
            )
    if sum(sizes) != geometry.page_bytes:
        raise HostPoolError(
            f"SGLang host pool layout {layout!r}: a page is {sum(sizes)} bytes, "
            f"the geometry says {geometry.page_bytes}"
        )
    if layout == "layer_first" and len(regions) == geometry.num_layers * geometry.components:
        # one piece per (layer, component), in layer order: a load may signal layers early
        regions = [
            MemoryRegion(
                segment=r.segment,
                offset=r.offset,
                page_stride=r.page_stride,
                page_bytes=r.page_bytes,
                layer=i // geometry.components,
            )
            for i, r in enumerate(regions)
        ]
    memory = RegionMemory(
        geometry,
        num_pages,
        [s[0] for s in segments],
        [s[2] for s in segments],
        regions,
        labels=[f"sglang-host-{os.getpid()}-{i}" for i in range(len(segments))],
    )
    return HostPoolMemory(geometry=geometry, memory=memory, page_size=geometry.page_size)
