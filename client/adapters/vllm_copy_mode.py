"""Which copy mode the vLLM connector runs, and how vLLM's KV tensors split into pages.

``copy_mode`` (see :class:`~kvtier.client.adapters.vllm_link.ConnectorSettings`): ``daemon``
places vLLM's KV memory where kvtierd maps it and kvtierd copies (the CPU backend); ``engine``
leaves vLLM's allocation alone and copies through a staging area
(:mod:`~kvtier.client.adapters.vllm_staging`), the only mode on CUDA until the daemon's
CUDA path is wired into the connector. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch
from kvtier.client.adapters.vllm_namespace import CPU_LAYOUT
from kvtier.ipc.protocol import Geometry

__all__ = ["CUDA_LAYOUT", "copy_mode_for", "engine_parts", "layout_for"]

CUDA_LAYOUT = "vllm_cuda_nhd"
"""Layout label of a staged page of vLLM's CUDA KV cache: per layer, K ``[block_size,
kv_heads, head_dim]`` then V (whatever the attention backend's own block layout)."""


def copy_mode_for(setting: str, platform: str) -> str | None:
    """The copy mode to run, or None when this platform has none of the kind asked for.

    Args:
        setting: ``copy_mode`` from the connector settings (``auto``, ``daemon``, ``engine``).
        platform: ``cpu``, ``cuda`` or another device type.
    """
    if platform == "cpu":
        return "daemon" if setting == "auto" else setting
    if platform == "cuda":
        # the daemon's CUDA IPC path is not wired into the connector: engine copies only
        return "engine" if setting in ("auto", "engine") else None
    return None


def layout_for(platform: str) -> str:
    """The layout label of vLLM's pages on ``platform`` (it enters the namespace)."""
    return CPU_LAYOUT if platform == "cpu" else CUDA_LAYOUT


def engine_parts(t: torch.Tensor, geometry: Geometry) -> list[torch.Tensor]:
    """One layer's KV tensor split into staging parts ``[num_blocks, *page part]``.

    Layouts: vLLM's CPU ``[blocks, kv_heads, block_size, 2 × head_dim]`` (one part); on
    CUDA, ``[2, blocks, block_size, kv_heads, head_dim]`` (FlashAttention) or ``[blocks, 2,
    block_size, kv_heads, head_dim]`` (FlashInfer): two parts, K and V, whatever the
    physical stride order.

    Raises:
        ValueError: none of these shapes.
    """
    g = geometry
    shape = tuple(t.shape)
    if t.device.type == "cpu" and len(shape) == 4 and shape[1:] == (g.kv_heads, g.page_size,
                                                                     2 * g.head_dim):
        return [t]
    nhd = (g.page_size, g.kv_heads, g.head_dim)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == nhd:
        return [t[0], t[1]]
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == nhd:
        return [t[:, 0], t[:, 1]]
    raise ValueError(f"KV tensor of shape {shape} on {t.device} is none of vLLM's layouts "
                     f"kvtier stages (pages of {g.page_size} tokens, {g.kv_heads} heads, "
                     f"head size {g.head_dim})")
