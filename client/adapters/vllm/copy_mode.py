"""Which copy mode the vLLM connector runs, and how vLLM's KV tensors split into pages.

``copy_mode`` (see :class:`~kvtier.client.adapters.vllm.settings.ConnectorSettings`): ``daemon``
places vLLM's KV memory where kvtierd maps it and kvtierd copies (the CPU backend); ``engine``
leaves vLLM's allocation alone and copies through a staging area
(:mod:`~kvtier.client.adapters.vllm.staged_worker`), the only mode on CUDA until the daemon's
CUDA path is wired into the connector. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch
from kvtier.client.adapters.vllm.namespace import CPU_LAYOUT
from kvtier.ipc.protocol import Geometry

__all__ = ["CUDA_LAYOUT", "copy_mode_for", "engine_parts", "layout_for"]

CUDA_LAYOUT = "vllm_cuda"
"""Layout label of a staged page of vLLM's CUDA KV cache: per layer, the block in vLLM's
logical order ``[kv_heads, block_size, 2 × head_dim]`` (K then V in the last dimension),
whatever the physical stride order (``VLLM_KV_CACHE_LAYOUT``). The bytes are those of a
``vllm_cpu`` page; the label is kept apart so that KV computed by one device's kernels is
never mixed into another's outputs."""


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
    """One layer's KV tensor as staging parts ``[num_blocks, *page part]``.

    vLLM's per-layer KV view is logically ``[blocks, kv_heads, block_size, 2 × head_dim]``
    on every platform, its physical order set by a stride permutation (``LBHNC``: the CPU's
    contiguous blocks; ``LBNHC``: CUDA's default NHD; block-first layouts spread a block's
    layers apart). One part, in that logical order: the copies gather and scatter through
    the strides, so the staged bytes are the same whatever the physical order.

    Raises:
        ValueError: another shape (vLLM's older CUDA layouts, MLA caches).
    """
    g = geometry
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[1:] == (g.kv_heads, g.page_size, 2 * g.head_dim):
        return [t]
    raise ValueError(
        f"KV tensor of shape {shape} on {t.device} is not vLLM's per-layer "
        f"layout [blocks, {g.kv_heads} heads, {g.page_size} tokens, "
        f"2 × {g.head_dim}]"
    )
