"""Extra-config keys of the ``redis`` backend."""

from __future__ import annotations

from kvtier.daemon.storage.options import redact_url
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RedisOptions"]


class RedisOptions(BaseModel):
    """Extra-config keys of the ``redis`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(default="redis://127.0.0.1:6379/0")
    """Server URL (``redis://``, ``rediss://`` or ``unix://``); may carry user, password and db."""
    host: str | None = Field(default=None, min_length=1)
    """Server host; with ``port`` and ``db``, an alternative to ``url``."""
    port: int = Field(default=6379, ge=1, le=65535)
    """Server port when ``host`` is given."""
    db: int = Field(default=0, ge=0)
    """Database number when ``host`` is given."""
    prefix: str = Field(default="kvtier", min_length=1, max_length=128, pattern=r"^\S+$")
    """First component of every key; lets several kvtier deployments share a server."""
    timeout_s: float = Field(default=2.0, gt=0, le=3600)
    """Bound on each connect, each socket read or write and each wait for a pooled connection."""
    ttl_s: float | None = Field(default=None, gt=0)
    """Optional expiry of pages, refreshed by every read (sliding); ``None`` keeps them until
    the server evicts them (configure ``maxmemory-policy allkeys-lru`` on the server)."""
    watch_drops: bool = False
    """Follow the server's keyspace notifications of evicted and expired keys, so KV events
    announce the pages Redis drops on its own (see :mod:`.drops`; the server's
    ``notify-keyspace-events`` gets ``Eex`` added when it allows ``CONFIG SET``)."""
    max_connections: int = Field(default=16, ge=1, le=4096)
    """Connections in the pool; concurrent batches beyond it wait up to ``timeout_s``."""

    @model_validator(mode="after")
    def _one_address(self) -> RedisOptions:
        if self.host is not None and "url" in self.model_fields_set:
            raise ValueError("give 'url' or 'host'/'port'/'db', not both")
        if self.host is None and {"port", "db"} & self.model_fields_set:
            raise ValueError("'port' and 'db' need 'host' (or put them in 'url')")
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "'url' must start with redis://, rediss:// or unix://, got "
                f"{redact_url(self.url)!r}"
            )
        return self

    @property
    def address(self) -> str:
        """The URL the client connects to."""
        if self.host is not None:
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"redis://{host}:{self.port}/{self.db}"
        return self.url
