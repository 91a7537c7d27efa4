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

__all__ = ["CPU_LAYOUT", "chain_seed", "geometry_from_spec", "request_lora", "unkeyable"]

CPU_LAYOUT = "vllm_cpu"
"""Layout label of vLLM's CPU KV cache (per layer ``[blocks, kv_heads, block_size, 2 ×
head_dim]``, K then V within each block and head); it enters the namespace."""

_DTYPE_NAMES: dict[torch.dtype, DType] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


_FP8_CACHE_DTYPES: dict[str, DType] = {
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}
"""vLLM's ``kv_cache_dtype`` values of fp8 caches (vLLM keeps each in ``uint8`` tensors, so
the tensors alone do not tell them apart) and the kvtier dtype each is stored as."""


def geometry_from_spec(
    spec: Any, num_layers: int, layout: str = CPU_LAYOUT, cache_dtype: str = "auto"
) -> Geometry:
    """The kvtier page geometry of a vLLM attention KV cache spec.

    Args:
        spec: vLLM's ``FullAttentionSpec`` of the (single) KV cache group.
        num_layers: attention layers in the group.
        layout: the engine layout label.
        cache_dtype: vLLM's ``cache_config.cache_dtype`` (``auto``: the tensors' dtype):
            an fp8 cache is named by its format, so caches of two formats never share pages.

    Raises:
        ValueError: a dtype kvtier has no name for (an fp8 format included), or K and V
            head sizes that differ.
    """
    if cache_dtype.startswith("fp8"):
        fp8 = _FP8_CACHE_DTYPES.get(cache_dtype)
        if fp8 is None:
            raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not one kvtier stores")
        dtype: DType | None = fp8
    else:
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


def chain_seed(ns_fingerprint: bytes, salt: str, lora: str = "") -> bytes:
    """The seed of a request's page-key chain: the namespace, salted per request.

    A request's ``cache_salt`` (vLLM's per-request isolation) and its LoRA adapter's name
    enter the chain's seed, so requests with different salts, or computed under different
    adapters (or none), never share a page.
    """
    if lora:
        s = salt.encode()
        return hashlib.sha256(
            ns_fingerprint + b"\x00lora\x00" + len(s).to_bytes(4, "big") + s + lora.encode()
        ).digest()
    if not salt:
        return ns_fingerprint
    return hashlib.sha256(ns_fingerprint + b"\x00cache_salt\x00" + salt.encode()).digest()


def request_lora(request: Any) -> str:
    """The name of the LoRA adapter a vLLM request runs under ("" for none)."""
    lora = getattr(request, "lora_request", None)
    return str(lora.lora_name) if lora is not None else ""


def unkeyable(request: Any) -> bool:
    """Whether a vLLM request's KV depends on more than its token ids: prompt embeddings
    (vLLM gives such a prompt's tokens as zeros) or multimodal inputs (their placeholder
    tokens are the same for every image). kvtier neither loads nor stores those."""
    return getattr(request, "prompt_embeds", None) is not None or bool(
        getattr(request, "mm_features", None)
    )
