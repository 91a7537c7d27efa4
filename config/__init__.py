"""Configuration: frozen pydantic models and their loader (TOML file, ``KVTIER_*`` env, CLI)."""

from kvtier.config.errors import ConfigError, KvtierError, ProtocolError, StorageError
from kvtier.config.loader import client_config, load_config, runtime_dir, socket_path
from kvtier.config.models import ClientConfig, DaemonConfig, TenantConfig
from kvtier.config.sizes import ByteSize, format_size, parse_size

__all__ = [
    "ByteSize",
    "ClientConfig",
    "ConfigError",
    "DaemonConfig",
    "KvtierError",
    "ProtocolError",
    "StorageError",
    "TenantConfig",
    "client_config",
    "format_size",
    "load_config",
    "parse_size",
    "runtime_dir",
    "socket_path",
]
