"""kvtier as SGLang's HiCache storage backend.

SGLang's dynamic loader imports :class:`~kvtier.client.adapters.sglang.backend.KvtierHiCacheStorage`
by ``"module_path": "kvtier.client.adapters.sglang", "class_name": "KvtierHiCacheStorage"``:
the class is imported from here on first use, so the settings module loads without SGLang.

- :mod:`~.backend`: the backend SGLang's HiCache threads call;
- :mod:`~.host_pool`: SGLang's host pool described to kvtierd;
- :mod:`~.settings`: the backend's extra config read and checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.client.adapters.sglang.backend import KvtierHiCacheStorage

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    """``KvtierHiCacheStorage``, imported on first use (PEP 562)."""
    if name == "KvtierHiCacheStorage":
        from kvtier.client.adapters.sglang.backend import KvtierHiCacheStorage

        return KvtierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
