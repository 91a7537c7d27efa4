"""The vLLM connector's settings: :class:`ConnectorSettings` reads ``kv_connector_extra_config``
(its link to kvtierd is :class:`kvtier.client.adapters.daemon_link.DaemonLink`)."""

from __future__ import annotations


import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from kvtier.client.adapters import positive_seconds
from kvtier.config import ClientConfig, ConfigError, KvtierError, client_config
from kvtier.config.models import PrefetchPolicy
from kvtier.ipc.limits import MAX_PAGES

__all__ = ["ConnectorSettings", "SettingsError"]

log = logging.getLogger("kvtier.vllm")


class SettingsError(KvtierError):
    """``kv_connector_extra_config`` holds a key the connector does not know, or a bad value."""


_CLIENT_KEYS = (
    "runtime_dir",
    "endpoint",
    "request_timeout_s",
    "load_timeout_s",
    "prefetch_threshold",
    "heartbeat_interval_s",
    "claim_timeout_s",
    "tenant",
    "token",
    "cache_salt",
    "tp_group",
)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from ``kv_connector_extra_config`` (every key optional).

    Attributes:
        client: the kvtier client settings: ``runtime_dir`` / ``endpoint`` (where kvtierd
            listens), ``request_timeout_s``, ``load_timeout_s``, ``heartbeat_interval_s``,
            ``claim_timeout_s``, ``tenant``, ``token``, ``cache_salt``, ``tp_group``.
        model_id: the model's name in the namespace (default: vLLM's model path or name).
        prefetch_policy: how the worker claims pages prefetched from L3 (``best_effort``,
            ``wait_complete``, ``timeout``; default: the daemon's policy).
        retry_interval_s: how often to try again to reach a daemon that is away.
        min_load_pages: hits shorter than this many pages are recomputed, not loaded.
        layerwise_loads: load a hit that is wholly in L2 in the step that schedules its
            request, the forward pass waiting for each layer (default True); False loads
            every hit asynchronously, as hits reaching into L3 always are.
        copy_mode: who copies pages between vLLM's KV cache and kvtierd's pool: ``daemon``
            (vLLM's KV cache is placed in shared memory that kvtierd maps and copies; CPU
            only), ``engine`` (vLLM allocates its KV cache as usual and copies pages to and
            from a staging area kvtierd maps: :mod:`kvtier.client.adapters.vllm.staged_worker`),
            or ``auto`` (default: ``daemon`` on the CPU, ``engine`` on CUDA).
        staging_pages: pages (vLLM blocks) the staging area of ``engine`` mode holds; a
            request loads at most half of them (the rest of a longer hit is computed), the
            other half is for stores.
        staging_wait_s: longest wait of a load for free staging pages; past it the load is
            recomputed (a store, on the I/O thread, waits longer:
            :data:`~kvtier.client.adapters.vllm.staged_worker.STORE_SLOT_WAIT_S`).
    """

    client: ClientConfig
    model_id: str | None = None
    prefetch_policy: PrefetchPolicy | Literal[""] = ""
    retry_interval_s: float = 1.0
    min_load_pages: int = 1
    layerwise_loads: bool = True
    copy_mode: str = "auto"
    staging_pages: int = 256
    staging_wait_s: float = 0.05

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``.

        Raises:
            SettingsError: an unknown key, or a value the client settings refuse.
        """
        extra = dict(extra or {})
        own = {
            "model_id",
            "prefetch_policy",
            "retry_interval_s",
            "min_load_pages",
            "layerwise_loads",
            "copy_mode",
            "staging_pages",
            "staging_wait_s",
        }
        unknown = sorted(set(extra) - own - set(_CLIENT_KEYS))
        if unknown:
            raise SettingsError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: "
                f"{sorted(own | set(_CLIENT_KEYS))}"
            )
        client_kw = {k: extra[k] for k in _CLIENT_KEYS if k in extra}
        if "runtime_dir" in client_kw:
            client_kw["runtime_dir"] = Path(client_kw["runtime_dir"])
        try:  # over the KVTIER_* environment
            client = client_config(client_kw, "kv_connector_extra_config")
        except ConfigError as err:
            raise SettingsError(str(err)) from err
        policy = str(extra.get("prefetch_policy", ""))
        if policy not in ("", "best_effort", "wait_complete", "timeout"):
            raise SettingsError(
                f"kv_connector_extra_config: prefetch_policy {policy!r} is not "
                "one of best_effort, wait_complete, timeout"
            )
        raw = extra.get("retry_interval_s", 1.0)
        retry = positive_seconds(raw)
        if retry is None:
            raise SettingsError(
                "kv_connector_extra_config: retry_interval_s must be a finite number of "
                f"seconds > 0, got {raw!r}"
            )
        min_pages = extra.get("min_load_pages", 1)
        if isinstance(min_pages, bool) or not isinstance(min_pages, int) or min_pages < 1:
            raise SettingsError(
                f"kv_connector_extra_config: min_load_pages must be an integer >= 1, got "
                f"{min_pages!r}"
            )
        layerwise = extra.get("layerwise_loads", True)
        if not isinstance(layerwise, bool):
            raise SettingsError("kv_connector_extra_config: layerwise_loads must be true or false")
        mode = extra.get("copy_mode", "auto")
        if mode not in ("auto", "daemon", "engine"):
            raise SettingsError(
                f"kv_connector_extra_config: copy_mode {mode!r} is not one of auto, daemon, engine"
            )
        staging = extra.get("staging_pages", 256)
        wait = extra.get("staging_wait_s", 0.05)
        if (
            isinstance(staging, bool)
            or not isinstance(staging, int)
            or not 1 <= staging <= MAX_PAGES
        ):
            raise SettingsError(
                f"kv_connector_extra_config: staging_pages {staging!r} must be an integer in "
                f"[1, {MAX_PAGES}]"
            )
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60:
            raise SettingsError(
                f"kv_connector_extra_config: staging_wait_s {wait!r} must be a "
                "number of seconds in [0, 60]"
            )
        return cls(
            client=client,
            model_id=extra.get("model_id"),
            prefetch_policy=cast("PrefetchPolicy | Literal['']", policy),
            retry_interval_s=retry,
            min_load_pages=min_pages,
            layerwise_loads=layerwise,
            copy_mode=mode,
            staging_pages=staging,
            staging_wait_s=float(wait),
        )
