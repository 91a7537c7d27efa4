"""What both sides of the vLLM connector agree on: the page geometry and the key chain.

Both derive the same page geometry from vLLM's KV cache spec (:func:`geometry_from_spec`)
and the same key chain seed for a request (:func:`chain_seed`): the daemon's namespace
fingerprint, salted with the request's ``cache_salt`` when it has one. One kvtier page is
one vLLM block. Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from kvtier.client.kv_pool.shared import TORCH_DTYPES
from kvtier.ipc.limits import DType
from kvtier.ipc.protocol import Geometry

if TYPE_CHECKING:
    import torch

__all__ = ["CPU_LAYOUT", "chain_seed", "geometry_from_spec"]

CPU_LAYOUT = "vllm_cpu"
"""Layout label of vLLM's CPU KV cache (per layer ``[blocks, kv_heads, block_size, 2 ×
head_dim]``, K then V within each block and head); it enters the namespace."""

_DTYPE_NAMES: dict[torch.dtype, DType] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def geometry_from_spec(spec: Any, num_layers: int, layout: str = CPU_LAYOUT) -> Geometry:
    """The kvtier page geometry of a vLLM attention KV cache spec.

    Args:
        spec: vLLM's ``FullAttentionSpec`` of the (single) KV cache group.
        num_layers: attention layers in the group.
        layout: the engine layout label.

    Raises:
        ValueError: a dtype kvtier has no name for, or K and V head sizes that differ.
    """
    dtype = _DTYPE_NAMES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"KV cache dtype {spec.dtype} is not one kvtier stores")
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size:
        raise ValueError(f"K head size {spec.head_size} differs from V head size {head_size_v}")
    return Geometry(
        num_layers=num_layers,
        page_size=spec.block_size,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        attention="mha",
        layout=layout,
    )


def chain_seed(ns_fingerprint: bytes, salt: str) -> bytes:
    """The seed of a request's page-key chain: the namespace, salted per request.

    A request's ``cache_salt`` (vLLM's per-request isolation) enters the chain's seed,
    so requests with different salts never share a page.
    """
    if not salt:
        return ns_fingerprint
    return hashlib.sha256(ns_fingerprint + b"\x00cache_salt\x00" + salt.encode()).digest()
