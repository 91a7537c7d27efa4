"""Build an L3 backend by name from its extra config.

The daemon's ``hicache_storage_backend`` names a backend and
``hicache_storage_backend_extra_config`` carries its settings, as in SGLang HiCache::

    "redis"     {"url": "redis://10.0.0.7:6379/0", "ttl_s": 86400}
    "mooncake"  {"master_server_address": "10.0.0.7:50051", ...}
    "dynamic"   {"backend_name": "mine", "module_path": "pkg.mod", "class_name": "MyBackend", ...}

The extra config is parsed and each backend's keys validated in
:mod:`kvtier.daemon.storage.options` (re-exported here: :func:`parse_extra_config`,
:data:`EXTRA_CONFIG_FIELD`); this module maps a name to a backend class and loads
``dynamic`` plug-ins.

Backends are imported lazily: a daemon that uses the file backend never imports redis-py
or Mooncake.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvtier.config.errors import ConfigError, KvtierError, StorageError
from kvtier.daemon.storage.base import StorageBackend
from kvtier.daemon.storage.objects import HEADROOM_BYTES
from kvtier.daemon.storage.options import EXTRA_CONFIG_FIELD, parse_extra_config

__all__ = [
    "BACKEND_NAMES",
    "DYNAMIC_KEYS",
    "EXTRA_CONFIG_FIELD",
    "create_backend",
    "parse_extra_config",
    "slot_headroom",
]

BACKEND_FIELD = "hicache_storage_backend"
"""The configuration field that names the backend."""

BACKEND_NAMES = ("file", "redis", "mooncake", "dynamic")
"""Backends :func:`create_backend` can build."""

DYNAMIC_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
"""Extra-config keys the ``dynamic`` backend consumes; the rest go to the plug-in class."""

HEADROOM_BACKENDS = frozenset({"mooncake"})
"""Backends that move a page and its object header as one buffer when the host pool's
slots have headroom for the header (Mooncake: over its TCP transport every buffer of an
object is a separate round trip)."""


def slot_headroom(name: str) -> int:
    """Bytes of headroom the daemon's host pool gives each slot for backend ``name``:
    :data:`~kvtier.daemon.storage.objects.HEADROOM_BYTES` (the object header, rounded up
    to whole cache lines) for the backends in :data:`HEADROOM_BACKENDS`, 0 for the others
    (whose pools keep their whole capacity for pages; headroom costs about 3% of it)."""
    return HEADROOM_BYTES if name in HEADROOM_BACKENDS else 0


def create_backend(name: str, extra_config: Mapping[str, Any] | None = None) -> StorageBackend:
    """Construct (but do not open) the backend ``name``.

    Args:
        name: ``file``, ``redis``, ``mooncake`` or ``dynamic``.
        extra_config: parsed settings (see :func:`parse_extra_config`). For ``dynamic``:
            ``module_path`` and ``class_name`` (required) name a :class:`StorageBackend`
            subclass; ``backend_name`` (optional) becomes the instance's ``name``;
            ``interface_v1`` is accepted for SGLang compatibility and ignored; every other
            key is passed to the class.

    Returns:
        The backend, ready for ``await backend.open(arena)``.

    Raises:
        ConfigError: unknown backend, bad or missing keys, a plug-in that cannot be
            imported or is not a ``StorageBackend``.
        StorageError: a plug-in's constructor failed for another reason.
    """
    extra = dict(extra_config or {})
    if name == "file":
        from kvtier.daemon.storage.file import FileBackend

        return FileBackend(extra)
    if name == "redis":
        try:
            from kvtier.daemon.storage.redis import RedisBackend
        except ImportError as err:
            raise StorageError(
                f"the redis backend needs redis-py: pip install 'kvtier[redis]' ({err})"
            ) from err
        return RedisBackend(extra)
    if name == "mooncake":
        from kvtier.daemon.storage.mooncake import MooncakeBackend

        return MooncakeBackend(extra)
    if name == "dynamic":
        return _create_dynamic(extra)
    raise ConfigError(
        f"{BACKEND_FIELD}: unknown backend {name!r} (choose one of {', '.join(BACKEND_NAMES)})"
    )


def _create_dynamic(extra: dict[str, Any]) -> StorageBackend:
    """Import ``module_path``, check ``class_name`` and construct it with the other keys."""
    where = f"{EXTRA_CONFIG_FIELD} for 'dynamic'"
    for key in ("module_path", "class_name"):
        if not isinstance(extra.get(key), str) or not extra[key]:
            raise ConfigError(
                f"{where}: {key!r} must be a non-empty string, got {extra.get(key)!r}"
            )
    backend_name = extra.get("backend_name")
    if backend_name is not None and (not isinstance(backend_name, str) or not backend_name):
        raise ConfigError(
            f"{where}: 'backend_name' must be a non-empty string, got {backend_name!r}"
        )
    module_path, class_name = extra["module_path"], extra["class_name"]
    try:
        module = importlib.import_module(module_path)
    except ImportError as err:
        raise ConfigError(
            f"{where}: 'module_path' = {module_path!r} cannot be imported: {err}"
        ) from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(
            f"{where}: 'class_name' = {class_name!r} is not defined in {module_path!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigError(
            f"{where}: 'class_name' = {class_name!r} in {module_path!r} "
            "is not a StorageBackend subclass"
        )
    abstract: frozenset[str] = getattr(cls, "__abstractmethods__", frozenset())
    if abstract:
        missing = ", ".join(sorted(abstract))
        raise ConfigError(f"{where}: 'class_name' = {class_name!r} does not implement {missing}")
    rest = {key: value for key, value in extra.items() if key not in DYNAMIC_KEYS}
    try:
        backend = cls(rest)
    except KvtierError:
        raise
    except Exception as err:  # a plug-in's own failure, wrapped with its cause
        raise StorageError(
            f"dynamic backend {module_path}.{class_name} failed to initialise: {err}"
        ) from err
    if backend_name is not None:
        backend.name = backend_name
    return backend
