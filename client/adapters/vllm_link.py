"""The vLLM connector's settings and its link to kvtierd, which may come and go.

:class:`ConnectorSettings` reads ``kv_connector_extra_config``. :class:`DaemonLink` owns one
:class:`~kvtier.client.connection.Connection` and hides the daemon's absence: while no
kvtierd answers, :meth:`DaemonLink.get` returns None (the connector then reports misses
and drops stores) and retries at most once per ``retry_interval_s``; a daemon whose process
is gone is noticed at once (same host), so no call waits out a request timeout on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from kvtier.client.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.config import ClientConfig, KvtierError

__all__ = ["ConnectorSettings", "DaemonLink", "SettingsError"]

log = logging.getLogger("kvtier.vllm")


class SettingsError(KvtierError):
    """``kv_connector_extra_config`` holds a key the connector does not know, or a bad value."""


_CLIENT_KEYS = ("runtime_dir", "endpoint", "request_timeout_s", "load_timeout_s", "prefetch_threshold",
                "heartbeat_interval_s", "claim_timeout_s", "tenant", "token", "cache_salt",
                "tp_group")


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
    """

    client: ClientConfig
    model_id: str | None = None
    prefetch_policy: str = ""
    retry_interval_s: float = 1.0
    min_load_pages: int = 1

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``.

        Raises:
            SettingsError: an unknown key, or a value the client settings refuse.
        """
        extra = dict(extra or {})
        own = {"model_id", "prefetch_policy", "retry_interval_s", "min_load_pages"}
        unknown = sorted(set(extra) - own - set(_CLIENT_KEYS))
        if unknown:
            raise SettingsError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: "
                                f"{sorted(own | set(_CLIENT_KEYS))}")
        client_kw = {k: extra[k] for k in _CLIENT_KEYS if k in extra}
        if "runtime_dir" in client_kw:
            client_kw["runtime_dir"] = Path(client_kw["runtime_dir"])
        try:
            client = ClientConfig(**client_kw)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise SettingsError(f"kv_connector_extra_config: {err}") from err
        policy = str(extra.get("prefetch_policy", ""))
        if policy not in ("", "best_effort", "wait_complete", "timeout"):
            raise SettingsError(f"kv_connector_extra_config: prefetch_policy {policy!r} is not "
                                "one of best_effort, wait_complete, timeout")
        retry = float(extra.get("retry_interval_s", 1.0))
        min_pages = int(extra.get("min_load_pages", 1))
        if retry <= 0 or min_pages < 1:
            raise SettingsError("kv_connector_extra_config: retry_interval_s must be > 0 and "
                                "min_load_pages >= 1")
        return cls(client=client, model_id=extra.get("model_id"), prefetch_policy=policy,
                   retry_interval_s=retry, min_load_pages=min_pages)


class DaemonLink:
    """One connection to kvtierd that is made, dropped and made again as the daemon comes
    and goes.

    Args:
        make_pool: returns what :class:`Connection` takes as ``pool`` (the worker's
            :class:`~kvtier.client.memory_export.RegionMemory`, the scheduler's
            :class:`~kvtier.client.memory_export.ControlOnly`).
        model_id / revision: the namespace's model.
        settings: the connector settings.
        tp_rank / tp_size: this process's tensor-parallel position.
    """

    def __init__(self, make_pool: Callable[[], Any], model_id: str, revision: str,
                 settings: ConnectorSettings, tp_rank: int = 0, tp_size: int = 1) -> None:
        self._make_pool = make_pool
        self._model_id, self._revision = model_id, revision
        self._settings = settings
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._conn: Connection | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self.registrations = 0
        """Successful registrations so far (a new daemon, or the same one after a gap)."""

    def get(self) -> Connection | None:
        """A registered connection, or None while no daemon answers (never blocks for long:
        at most one registration attempt, bounded by ``request_timeout_s``)."""
        with self._lock:
            if self._closed:
                return None
            conn = self._conn
            if conn is not None and not conn.daemon_alive():
                log.warning("kvtierd (pid %d) is gone; kvtier hits are misses until it is back",
                            conn.daemon_pid)
                conn.session_id = 0  # nobody to unregister from: close without waiting
                self._drop()
                conn = None
            if conn is not None:
                return conn
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self._settings.retry_interval_s
            conn = Connection(self._make_pool(), model_id=self._model_id, revision=self._revision,
                              config=self._settings.client, tp_rank=self._tp_rank,
                              tp_size=self._tp_size, register=False)
            try:
                conn.register()
            except (DaemonUnavailable, DaemonError) as err:
                log.debug("kvtierd not reachable: %s", err)
                conn.close()
                return None
            self._conn = conn
            self.registrations += 1
            log.info("kvtier connected to kvtierd pid %d (session %d)", conn.daemon_pid,
                     conn.session_id)
            return conn

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except zmq.ZMQError:  # at interpreter exit its context may be gone already
                pass

    def close(self) -> None:
        """Unregister and close. Idempotent."""
        with self._lock:
            self._closed = True
            self._drop()
