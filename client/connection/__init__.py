"""The client's connections to kvtierd.

- :mod:`~kvtier.client.connection.connection`: the engine's session (register, LOOKUP,
  prefetch, LOAD, STORE), with :mod:`~.channel` (its socket and the daemon's liveness),
  :mod:`~.request_codec` (the requests it sends, packed), :mod:`~.replies` (the replies it
  checks), :mod:`~.slots` (its completion slots), :mod:`~.transfer_handle` (a transfer in
  flight, waited on layer by layer) and :mod:`~.cuda_wait` (the same waits on a GPU's
  streams);
- :mod:`~kvtier.client.connection.admin`: HEALTH, STATS and the admin operations;
- :mod:`~kvtier.client.connection.events`: a subscriber to the daemon's KV events.

``from kvtier.client.connection import Connection`` works as well: the class is imported on
first use, so the admin client and the event subscriber load without the session's imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.client.connection.connection import Connection

__all__ = ["Connection"]


def __getattr__(name: str) -> Any:
    """``Connection``, imported on first use (PEP 562)."""
    if name == "Connection":
        from kvtier.client.connection.connection import Connection

        return Connection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
