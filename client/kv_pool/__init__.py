"""The engine's KV memory as kvtierd reaches it.

- :mod:`~kvtier.client.kv_pool.shared`: a paged KV pool in shared memory (engines without a
  GPU, the reference engine);
- :mod:`~kvtier.client.kv_pool.cuda`: a paged KV pool in GPU memory, exported by CUDA IPC;
- :mod:`~kvtier.client.kv_pool.cuda_regions`: KV tensors an engine allocated on a GPU in its
  own layout, exported by CUDA IPC and described as regions;
- :mod:`~kvtier.client.kv_pool.regions`: memory an engine lays out itself, described page by
  page as regions (the adapters), or none at all (a control-only session).

``from kvtier.client.kv_pool import SharedKVPool`` works as well (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.client.kv_pool.shared import SharedKVPool

__all__ = ["SharedKVPool"]


def __getattr__(name: str) -> Any:
    """``SharedKVPool``, imported on first use (PEP 562)."""
    if name == "SharedKVPool":
        from kvtier.client.kv_pool.shared import SharedKVPool

        return SharedKVPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
