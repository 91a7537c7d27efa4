"""kvtier as a vLLM V1 KV connector.

vLLM loads :class:`~kvtier.client.adapters.vllm.connector.KvtierConnector` by the path
``"kv_connector_module_path": "kvtier.client.adapters.vllm"``: the class is imported from here
on first use, so the modules that import nothing of vLLM (settings, copy mode, namespace,
metadata) load without it.

- :mod:`~.connector`: the connector vLLM calls, one instance per role;
- :mod:`~.scheduler` / :mod:`~.worker`: its scheduler side and worker side;
  :mod:`~.staged_worker`: the worker side copying through a staging area;
- :mod:`~.settings`: ``kv_connector_extra_config`` read and checked;
- :mod:`~.copy_mode`, :mod:`~.namespace`, :mod:`~.metadata`, :mod:`~.memfd`,
  :mod:`~.events`: the copy mode, page geometry and key chain, the step's metadata, vLLM's KV
  cache in a memfd, the KV events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.client.adapters.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    """``KvtierConnector``, imported on first use (PEP 562)."""
    if name == "KvtierConnector":
        from kvtier.client.adapters.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
