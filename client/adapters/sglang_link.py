"""The SGLang backend's link to kvtierd, which may be absent, die or restart at any time.

:class:`DaemonLink` owns at most one registered
:class:`~kvtier.client.connection.Connection`. :meth:`DaemonLink.get` returns it, or None
while no kvtierd answers; the backend then answers misses at once. It never waits for long:

- no kvtierd at start (no socket file): registration fails at once; it is tried again at
  most once per ``retry_interval_s``, from whichever SGLang thread asks next;
- kvtierd killed: its pid is gone, which :meth:`get` notices before each use (same host),
  so no call waits out a request timeout on a dead daemon; the connection is dropped and a
  new one registers once a daemon is back (a restarted kvtierd serves the pages its pool
  file kept);
- kvtierd stuck: a request times out after ``request_timeout_s`` and the connection
  reports misses for the next second without asking (the client's own back-off).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.client.connection import Connection, DaemonError, DaemonUnavailable
from kvtier.client.memory_export import RegionMemory
from kvtier.config import ClientConfig

__all__ = ["DaemonLink"]

log = logging.getLogger("kvtier.sglang")


class DaemonLink:
    """One connection to kvtierd, made, dropped and made again as the daemon comes and goes.

    Args:
        make_memory: returns the host pool's :class:`RegionMemory` (called per registration).
        model_id: the namespace's model.
        config: the client settings.
        tp_rank / tp_size: this process's tensor-parallel position.
        retry_interval_s: the least time between two registration attempts.
    """

    def __init__(self, make_memory: Callable[[], RegionMemory], model_id: str,
                 config: ClientConfig, tp_rank: int, tp_size: int,
                 retry_interval_s: float) -> None:
        self._make_memory = make_memory
        self._model_id = model_id
        self._config = config
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._retry_s = retry_interval_s
        self._conn: Connection | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        self.registrations = 0
        """Successful registrations so far (1 + the times kvtierd came back)."""

    def get(self) -> Connection | None:
        """The registered connection, or None while no kvtierd answers (at most one
        registration attempt per ``retry_interval_s``, bounded by ``request_timeout_s``)."""
        with self._lock:
            if self._closed:
                return None
            conn = self._conn
            if conn is not None and not conn.daemon_alive():
                log.warning("kvtierd (pid %d) is gone; kvtier answers misses until one is back",
                            conn.daemon_pid)
                conn.session_id = 0  # nobody to unregister from: close without asking
                self._drop()
                conn = None
            if conn is not None:
                return conn
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self._retry_s
            return self._register()

    def _register(self) -> Connection | None:
        conn = Connection(self._make_memory(), model_id=self._model_id, config=self._config,
                          tp_rank=self._tp_rank, tp_size=self._tp_size, register=False)
        try:
            conn.register()
        except (DaemonUnavailable, DaemonError) as err:
            conn.close()
            level = logging.DEBUG if self._warned else logging.WARNING
            log.log(level, "kvtierd not reachable (retrying every %.1fs; misses meanwhile): %s",
                    self._retry_s, err)
            self._warned = True
            return None
        self._conn = conn
        self._warned = False
        self.registrations += 1
        log.info("kvtier: registered with kvtierd pid %d (session %d, rank %d/%d)",
                 conn.daemon_pid, conn.session_id, self._tp_rank, self._tp_size)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    def close(self) -> None:
        """Unregister and close. Idempotent."""
        with self._lock:
            self._closed = True
            self._drop()
