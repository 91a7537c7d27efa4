"""The kvtier backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the backend every key of the extra config except the ones it keeps for itself
(``prefetch_threshold``, ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token``,
``hicache_storage_pass_prefix_keys``, ``tp_lcm_size``); the loader's own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``allocator``) are
ignored here. Any other key must be one of :data:`KNOWN_KEYS`, so a typo stops SGLang at
start with a message naming it instead of leaving kvtier silently misconfigured.

SGLang's prefetch timeout (``timeout`` policy: ``prefetch_timeout_base +
prefetch_timeout_per_ki_token × tokens / 1024`` seconds from the request's prefetch) bounds
how long a read from L3 may keep SGLang's prefetch I/O thread: :func:`prefetch_timeout`
takes the two numbers from the published server arguments, as SGLang does.
"""

from __future__ import annotations


import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.client.adapters import positive_seconds
from kvtier.config import ClientConfig, ConfigError, KvtierError, client_config

__all__ = ["KNOWN_KEYS", "BackendSettings", "PrefetchTimeout", "SettingsError", "prefetch_timeout"]

_LOADER_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
_CLIENT_KEYS = (
    "runtime_dir",
    "endpoint",
    "request_timeout_s",
    "load_timeout_s",
    "heartbeat_interval_s",
    "tenant",
    "token",
    "cache_salt",
    "tp_group",
)
_OWN_KEYS = ("model_id", "retry_interval_s")
KNOWN_KEYS = frozenset(_CLIENT_KEYS + _OWN_KEYS)
"""The kvtier keys the extra config may carry (see :class:`BackendSettings`)."""


class SettingsError(KvtierError):
    """The extra config holds a key kvtier does not know, or a bad value."""


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """The backend's settings (every key optional).

    Attributes:
        client: kvtier client settings: ``runtime_dir`` / ``endpoint`` (where kvtierd
            listens), ``request_timeout_s`` (a request not answered by then is a miss),
            ``load_timeout_s``, ``heartbeat_interval_s``, ``tenant``, ``token``,
            ``cache_salt``, ``tp_group`` (names the engine's TP group in kvtierd; default: one
            derived from SGLang's port).
        model_id: the model's name in kvtier's namespace (default: SGLang's model name).
        retry_interval_s: how often to try again to reach a kvtierd that is away.
    """

    client: ClientConfig
    model_id: str | None = None
    retry_interval_s: float = 1.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Parse the backend's part of the extra config.

        Raises:
            SettingsError: an unknown key or a bad value (named in the message).
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _LOADER_KEYS - KNOWN_KEYS)
        if unknown:
            raise SettingsError(
                f"hicache storage extra config: unknown key(s) {unknown} for the "
                f"kvtier backend; known: {sorted(KNOWN_KEYS)}"
            )
        client_kw = {k: extra[k] for k in _CLIENT_KEYS if k in extra}
        if "runtime_dir" in client_kw:
            client_kw["runtime_dir"] = Path(str(client_kw["runtime_dir"]))
        try:  # over the KVTIER_* environment
            client = client_config(client_kw, "hicache storage extra config")
        except ConfigError as err:
            raise SettingsError(str(err)) from err
        raw = extra.get("retry_interval_s", 1.0)
        retry = positive_seconds(raw)
        if retry is None:
            raise SettingsError(
                "hicache storage extra config: retry_interval_s must be a finite number of "
                f"seconds > 0, got {raw!r}"
            )
        model = extra.get("model_id")
        return cls(client=client, model_id=str(model) if model else None, retry_interval_s=retry)


@dataclass(frozen=True, slots=True)
class PrefetchTimeout:
    """SGLang's prefetch deadline: ``base_s + per_ki_token_s × tokens / 1024`` seconds."""

    base_s: float = 1.0
    per_ki_token_s: float = 0.25

    def seconds(self, tokens: int) -> float:
        """The deadline for a prefetch of ``tokens`` tokens."""
        return self.base_s + self.per_ki_token_s * tokens / 1024


def _server_extra_config() -> Mapping[str, Any]:
    """SGLang's extra config as the server was given it (before SGLang popped its keys)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        raw = get_server_args().hicache_storage_backend_extra_config
    except (ImportError, ValueError, AttributeError):
        return {}
    if not raw:
        return {}
    try:
        if raw.startswith("@"):
            path = Path(raw[1:])
            if path.suffix.lower() == ".toml":
                import tomllib

                return tomllib.loads(path.read_text())
            return json.loads(path.read_text())  # yaml is left to SGLang: defaults then
        return json.loads(raw)
    except (OSError, ValueError):
        return {}


def prefetch_timeout() -> PrefetchTimeout:
    """SGLang's prefetch timeout settings of this server (its defaults when none are set)."""
    extra = _server_extra_config()
    try:
        return PrefetchTimeout(
            float(extra.get("prefetch_timeout_base", 1.0)),
            float(extra.get("prefetch_timeout_per_ki_token", 0.25)),
        )
    except (TypeError, ValueError):
        return PrefetchTimeout()
