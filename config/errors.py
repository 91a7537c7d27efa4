"""The kvtier error hierarchy.

Three tiers of errors are used throughout kvtier: ``assert`` for invariants, the
:class:`KvtierError` hierarchy below for misuse and bad input, and plain return
values for expected shortfalls (pool full, cache miss). Foreign errors are wrapped
with ``raise ... from err``.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value, file or flag is invalid; the message names the key and value."""


class ProtocolError(KvtierError):
    """A message could not be decoded or does not follow the wire protocol."""


class StorageError(KvtierError):
    """An L3 backend could not be set up (bad extra config, unreachable at start)."""
