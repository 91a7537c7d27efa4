"""Prometheus metrics of kvtierd, served over HTTP on 127.0.0.1 (``metrics_port``).

Counters live in one place, the daemon: this module keeps no copy of them. At each
scrape a collector asks the daemon for its :meth:`~kvtier.daemon.service.server.Daemon.snapshot`
(the same dict ``STATS`` and ``kvtier stats`` report) and turns it into metric families.
The only state kept here is the latency histograms, which a snapshot cannot carry::

    Prometheus ──GET /metrics──▶ HTTP thread ──call_soon_threadsafe──▶ event loop
                                      ▲                                   │ snapshot()
                                      └──────────── dict ◀────────────────┘
    event loop ──observe_lookup/claim/load/store(seconds)──▶ histograms (thread-safe)

The snapshot is taken on the event loop thread, so it never races the loop's own
changes to sessions, counters and the pool; a loop that does not answer within
``snapshot_timeout_s`` costs that scrape its snapshot series (the histograms are still
served and ``kvtier_metrics_snapshot_failures_total`` counts the failure).

Which snapshot key becomes which series is :mod:`~kvtier.daemon.service.metric_families`;
the HTTP server, and what bounds the cost of each client, is
:mod:`~kvtier.daemon.service.metrics_http`.
Every name, type and label is documented in ``docs/metrics.md``.

Typical use in the daemon::

    metrics = DaemonMetrics(daemon.snapshot)
    metrics.start(cfg.metrics_host, cfg.metrics_port)    # from the event loop
    ...
    metrics.observe_lookup(seconds)    # the handlers: LOOKUP and CLAIM, arrival to reply
    metrics.observe_load(seconds)      # the transfers: LOAD and STORE, acceptance to end
    ...
    metrics.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvtier.config import ConfigError

try:
    from kvtier.daemon.service.metric_families import SnapshotCollector
    from kvtier.daemon.service.metrics_http import MetricsHTTPServer, serve_metrics
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
except ImportError as _err:  # the optional ``metrics`` extra is not installed
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

__all__ = [
    "CLAIM_BUCKETS",
    "LOOKUP_BUCKETS",
    "TRANSFER_BUCKETS",
    "DaemonMetrics",
    "MetricsError",
]

log = logging.getLogger("kvtier.daemon.service.metrics")

# Bucket upper bounds in seconds. A LOOKUP is answered in microseconds from the L2 index
# (longer when L3 is asked too); a LOAD or STORE copies pages (milliseconds to seconds); a
# CLAIM may wait for a prefetch up to ``prefetch_timeout_max``.
LOOKUP_BUCKETS: tuple[float, ...] = (
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    0.1,
    0.5,
)
TRANSFER_BUCKETS: tuple[float, ...] = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
CLAIM_BUCKETS: tuple[float, ...] = (
    1e-4,
    1e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class MetricsError(ConfigError):
    """The metrics endpoint cannot start (port in use, bad address, library missing): a
    setting the start cannot apply, so kvtierd exits 2 (a restart would not help)."""


class DaemonMetrics:
    """The daemon's Prometheus registry, collector, latency histograms and HTTP endpoint.

    Each instance has its own :class:`CollectorRegistry`: nothing is registered in
    prometheus_client's global registry, so two daemons (or tests) in one process do not
    see each other's series.

    Args:
        snapshot: returns the daemon's snapshot dict (see ``Daemon.snapshot()``). When
            :meth:`start` is called from a running event loop, scrapes call it on that
            loop's thread; otherwise on the scraping thread.
        snapshot_timeout_s: how long a scrape waits for the event loop to take the
            snapshot before it gives up on the snapshot series.

    Raises:
        MetricsError: prometheus_client is not installed (``pip install kvtier[metrics]``).
    """

    def __init__(
        self, snapshot: Callable[[], Mapping[str, Any]], snapshot_timeout_s: float = 2.0
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise MetricsError(
                "metrics_port is set but prometheus_client is not installed "
                "(pip install 'kvtier[metrics]')"
            ) from _IMPORT_ERROR
        if not snapshot_timeout_s > 0:
            raise ValueError(f"snapshot_timeout_s must be > 0, got {snapshot_timeout_s!r}")
        self._snapshot = snapshot
        self._timeout_s = snapshot_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._server: MetricsHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(self._take_snapshot))
        self._failures = Counter(
            "kvtier_metrics_snapshot_failures",
            "Scrapes that served no snapshot series: the event loop did not answer in time "
            "or taking the snapshot failed.",
            registry=self.registry,
        )
        self._lookup = Histogram(
            "kvtier_lookup_duration_seconds",
            "Time kvtierd spent answering a LOOKUP (L2 index, and L3 when asked).",
            buckets=LOOKUP_BUCKETS,
            registry=self.registry,
        )
        self._claim = Histogram(
            "kvtier_claim_duration_seconds",
            "Time from a CLAIM's arrival to its reply (includes waiting for a prefetch).",
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self._load = Histogram(
            "kvtier_load_duration_seconds",
            "Time from a LOAD's acceptance until its pages were in the engine (completed "
            "loads only).",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self._store = Histogram(
            "kvtier_store_duration_seconds",
            "Time from a STORE's acceptance until its pages were READY in L2 (completed "
            "stores only).",
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )

    # ------------------------------------------------------------------ observations
    def observe_lookup(self, seconds: float) -> None:
        """Record how long one LOOKUP took to answer (thread-safe, non-blocking)."""
        self._lookup.observe(seconds)

    def observe_claim(self, seconds: float) -> None:
        """Record how long one CLAIM took, waiting for its prefetch included."""
        self._claim.observe(seconds)

    def observe_load(self, seconds: float) -> None:
        """Record how long one completed LOAD took, acceptance to last layer."""
        self._load.observe(seconds)

    def observe_store(self, seconds: float) -> None:
        """Record how long one completed STORE took, acceptance to commit."""
        self._store.observe(seconds)

    # ------------------------------------------------------------------ endpoint
    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` from a daemon thread.

        Call it from the daemon's event loop so that snapshots are taken there. Each
        client costs a bounded share of the daemon: a connection silent for
        ``CONNECTION_TIMEOUT_S`` is closed, and at most ``MAX_CONNECTIONS`` are served at
        once (see :mod:`~kvtier.daemon.service.metrics_http`).

        Args:
            host: bind address; loopback by default (the endpoint has no authentication).
            port: TCP port; 0 picks a free one.

        Returns:
            The port actually bound.

        Raises:
            MetricsError: already started, or the address cannot be bound (the message
                names ``host:port`` and the reason).
        """
        if self._server is not None:
            raise MetricsError(f"metrics endpoint already serving on port {self.port}")
        try:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        except RuntimeError:
            self._loop, self._loop_thread = None, 0
        try:
            self._server, self._thread = serve_metrics(host, port, self.registry)
        except OSError as err:
            raise MetricsError(
                f"cannot serve metrics on {host}:{port} (metrics_host / "
                f"metrics_port): {err.strerror or err}"
            ) from err
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    @property
    def port(self) -> int:
        """The TCP port being served, 0 when not serving."""
        if self._server is None:
            return 0
        return int(self._server.server_address[1])

    def render(self) -> bytes:
        """The current exposition text, exactly as a scrape would receive it."""
        return generate_latest(self.registry)

    def close(self) -> None:
        """Stop serving and free the port; idempotent. Scrapes in progress may still end."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()  # returns once serve_forever() has left its poll loop
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> DaemonMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ snapshots
    def _take_snapshot(self) -> Mapping[str, Any] | None:
        """Take the daemon's snapshot on its event loop thread; None on failure (counted)."""
        loop = self._loop
        try:
            if loop is None or threading.get_ident() == self._loop_thread:
                return self._snapshot()
            return self._on_loop(loop)
        except Exception:  # scrape boundary: serve the histograms, count the failure
            log.warning("metrics scrape: taking the snapshot failed", exc_info=True)
            self._failures.inc()
            return None

    def _on_loop(self, loop: asyncio.AbstractEventLoop) -> Mapping[str, Any] | None:
        """Run ``snapshot()`` on ``loop`` and wait for it; None on timeout or closed loop."""
        fut: concurrent.futures.Future[Mapping[str, Any]] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(self._snapshot())
            except Exception as err:
                fut.set_exception(err)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed: the daemon is shutting down
            self._failures.inc()
            return None
        try:
            return fut.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            log.warning(
                "metrics scrape: the event loop did not answer within %.1fs", self._timeout_s
            )
            self._failures.inc()
            return None
