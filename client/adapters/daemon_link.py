"""An engine adapter's link to kvtierd, which may be absent, die or restart at any time.

Shared by the SGLang backend and both sides of the vLLM connector. :class:`DaemonLink`
makes the adapter's one :class:`~kvtier.client.connection.connection.Connection` once a
kvtierd answers; :meth:`DaemonLink.get` returns it, or None until then (the adapter then answers misses at once). It never waits
for long:

- no kvtierd at start (no socket file): registration fails at once; it is tried again at
  most once per ``retry_interval_s``, from whichever engine thread asks next;
- kvtierd killed or restarted later: the connection handles it by itself. It sees the
  daemon's process gone before each request and while waiting for a reply (every 20 ms),
  answers misses, and registers with the next kvtierd on the same socket (a restarted
  kvtierd serves the pages its pool file kept). :attr:`DaemonLink.registrations` counts
  the daemons it registered with;
- kvtierd stuck: a request times out after ``request_timeout_s`` and the connection
  reports misses for the next second without asking (the client's own back-off).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.client.connection.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.client.connection.replies import UnexpectedReply
from kvtier.config import ClientConfig

__all__ = ["DaemonLink"]

log = logging.getLogger("kvtier.adapters")


class DaemonLink:
    """An adapter's connection to kvtierd, made once a daemon answers.

    Args:
        make_pool: returns what :class:`Connection` takes as ``pool`` (a
            :class:`~kvtier.client.kv_pool.regions.RegionMemory`, or
            :class:`~kvtier.client.kv_pool.regions.ControlOnly` for a scheduler).
        model_id: the namespace's model.
        config: the client settings.
        tp_rank / tp_size: this process's tensor-parallel position.
        retry_interval_s: the least time between two attempts at the first registration.
        revision: the namespace's model revision.
    """

    def __init__(
        self,
        make_pool: Callable[[], Any],
        model_id: str,
        config: ClientConfig,
        tp_rank: int,
        tp_size: int,
        retry_interval_s: float,
        revision: str = "",
    ) -> None:
        self._make_pool = make_pool
        self._model_id, self._revision = model_id, revision
        self._config = config
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._retry_s = retry_interval_s
        self._conn: Connection | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        self._epoch = 0
        self._daemon_pid = 0
        self._registrations = 0

    @property
    def registrations(self) -> int:
        """kvtierd processes registered with so far (1 + the times one came back)."""
        with self._lock:
            if self._conn is not None:
                self._note_epoch(self._conn)
            return self._registrations

    def get(self) -> Connection | None:
        """The connection, or None while no kvtierd has answered yet (at most one
        registration attempt per ``retry_interval_s``, bounded by ``request_timeout_s``)."""
        with self._lock:
            if self._closed:
                return None
            if self._conn is None:
                now = time.monotonic()
                if now < self._next_try:
                    return None
                self._next_try = now + self._retry_s
                self._conn = self._register()
            if self._conn is not None:
                self._note_epoch(self._conn)
            return self._conn

    def _register(self) -> Connection | None:
        conn = Connection(
            self._make_pool(),
            model_id=self._model_id,
            revision=self._revision,
            config=self._config,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            register=False,
        )
        try:
            conn.register()
        except (DaemonUnavailable, DaemonError, UnexpectedReply) as err:
            conn.close()
            level = logging.DEBUG if self._warned else logging.WARNING
            log.log(
                level,
                "kvtierd not reachable (retrying every %.1fs; misses meanwhile): %s",
                self._retry_s,
                err,
            )
            self._warned = True
            return None
        return conn

    def _note_epoch(self, conn: Connection) -> None:
        """Count a registration with a new daemon (the connection makes them by itself)."""
        epoch = conn.epoch
        if epoch == self._epoch or not conn.session_id:
            return
        if self._registrations:
            log.warning(
                "kvtier: kvtierd pid %d went away; registered with kvtierd pid %d "
                "(misses meanwhile)",
                self._daemon_pid,
                conn.daemon_pid,
            )
        else:
            log.info(
                "kvtier: registered with kvtierd pid %d (session %d, rank %d/%d)",
                conn.daemon_pid,
                conn.session_id,
                self._tp_rank,
                self._tp_size,
            )
        self._epoch, self._daemon_pid = epoch, conn.daemon_pid
        self._registrations += 1

    def close(self) -> None:
        """Unregister and close. Idempotent."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                conn, self._conn = self._conn, None
                conn.close()
