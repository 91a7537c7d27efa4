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

Keys the snapshot lacks are skipped, series by series: a daemon without an ``l3``
section (or with backend ``none``) has no backend series (``kvtier_l3_healthy`` and the
others labelled ``backend``), and a counter that a daemon version does not keep is simply
absent. Every name, type and label is documented in ``docs/metrics.md``.

Typical use in the daemon::

    metrics = DaemonMetrics(daemon.snapshot)
    metrics.start(cfg.metrics_host, cfg.metrics_port)    # from the event loop
    ...
    metrics.observe_load(time.monotonic() - transfer.started)
    ...
    metrics.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvtier.config import KvtierError
from kvtier.ipc.protocol import PROTOCOL_VERSION

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import start_http_server
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
# CLAIM may wait for a prefetch up to ``prefetch_timeout_max`` (30 s by default).
LOOKUP_BUCKETS: tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5,
)
TRANSFER_BUCKETS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0,
)
CLAIM_BUCKETS: tuple[float, ...] = (
    1e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

# Counters read from ``snapshot["counters"]``:
#   (metric name without _total, help, label names, [(label values, counter key), ...])
# A key the snapshot lacks leaves its sample out; a family with no sample is not emitted.
_Spec = tuple[str, str, tuple[str, ...], tuple[tuple[tuple[str, ...], str], ...]]
_COUNTER_SPECS: tuple[_Spec, ...] = (
    ("kvtier_requests", "Control requests received (every kind, refused ones included).",
     (), (((), "requests"),)),
    ("kvtier_lookups", "LOOKUP requests answered.", (), (((), "lookups"),)),
    ("kvtier_lookup_hits",
     "LOOKUP requests whose leading run in the tier was not empty (tiers overlap: do not sum).",
     ("tier",), ((("l2",), "lookup_hits"), (("l3",), "lookup_l3_hits"))),
    ("kvtier_lookup_pages", "Page keys asked for by LOOKUP requests.", (), (((), "lookup_keys"),)),
    ("kvtier_lookup_hit_pages",
     "Page keys LOOKUP found, per tier (the L3 run follows the L2 run: tiers are disjoint).",
     ("tier",), ((("l2",), "lookup_hit_keys"), (("l3",), "lookup_l3_keys"))),
    ("kvtier_lookup_tokens", "Tokens covered by the page keys LOOKUP requests asked for.",
     (), (((), "lookup_tokens"),)),
    ("kvtier_lookup_hit_tokens", "Tokens covered by the pages LOOKUP found, per tier (disjoint).",
     ("tier",), ((("l2",), "lookup_hit_tokens"), (("l3",), "lookup_l3_tokens"))),
    ("kvtier_saved_tokens",
     "Tokens whose KV an engine loaded from the cache instead of computing (completed loads).",
     (), (((), "loaded_tokens"),)),
    ("kvtier_prefetch_unused_pages",
     ("Pages read from L3 into L2 that no LOAD used: evicted or flushed before any load, "
      "or read and then discarded at a CLAIM."),
     (), (((), "l3_prefetch_unused_pages"),)),
    ("kvtier_stores", "STORE requests accepted.", (), (((), "stores"),)),
    ("kvtier_store_pages",
     ("Pages named by STORE requests, by result: copied to L2, skipped (already there), "
      "failed (no room, cancelled, engine gone)."),
     ("result",), ((("copied",), "store_pages"), (("skipped",), "store_skipped_pages"),
                   (("failed",), "store_failed_pages"))),
    ("kvtier_loads", "LOAD requests accepted (misses included).", (), (((), "loads"),)),
    ("kvtier_load_pages", "Pages LOAD copied to engines, by result: copied, failed.",
     ("result",), ((("copied",), "load_pages"), (("failed",), "load_failed_pages"))),
    ("kvtier_sessions_opened", "Engine sessions registered.", (), (((), "sessions_opened"),)),
    ("kvtier_sessions_closed", "Engine sessions ended (any reason).", (), (((), "sessions_closed"),)),
    ("kvtier_sessions_expired", "Engine sessions ended because their lease expired.",
     (), (((), "sessions_expired"),)),
    ("kvtier_l3_lookups", "LOOKUP requests that asked L3 (the L2 run was not the whole chain).",
     (), (((), "l3_lookups"),)),
    ("kvtier_prefetches", "PREFETCH requests accepted.", (), (((), "prefetches"),)),
    ("kvtier_claims", "CLAIM requests answered.", (), (((), "claims"),)),
    ("kvtier_claim_pages", "Pages of the L2 runs CLAIM answered.", (), (((), "claim_pages"),)),
    ("kvtier_l3_prefetch_pages",
     ("Pages a PREFETCH read from L3, by result: started (slot allocated), completed "
      "(verified and READY in L2), cancelled (a CLAIM or the session ended first), failed "
      "(the read did not verify; the rest of the chain included)."),
     ("result",), ((("started",), "l3_prefetch_started_pages"),
                   (("completed",), "l3_prefetch_completed_pages"),
                   (("cancelled",), "l3_prefetch_cancelled_pages"),
                   (("failed",), "l3_prefetch_failed_pages"))),
    ("kvtier_l3_write_pages",
     ("Pages on their way from L2 to L3, by result: queued, written, skipped (already in "
      "L3), failed (given up after retries), dropped (queue full, or evicted first)."),
     ("result",), ((("queued",), "l3_write_queued_pages"),
                   (("written",), "l3_write_written_pages"),
                   (("skipped",), "l3_write_skipped_pages"),
                   (("failed",), "l3_write_failed_pages"),
                   (("dropped",), "l3_write_dropped_pages"))),
    ("kvtier_l3_write_retries", "L3 write batches tried again after a failure.",
     (), (((), "l3_write_retries"),)),
    ("kvtier_l3_flushed_pages", "Pages FLUSH deleted from L3.", (), (((), "l3_flushed_pages"),)),
    ("kvtier_l3_backend_errors",
     "L3 backend calls that raised or timed out, as the daemon saw them (each read as a miss).",
     (), (((), "l3_backend_errors"),)),
    ("kvtier_tp_rounds", "Tensor-parallel rank-group agreements (CLAIM answered to all ranks).",
     (), (((), "tp_rounds"),)),
    ("kvtier_tp_round_timeouts",
     "Rank-group agreements a missing rank ended with a 0 answer.",
     (), (((), "tp_round_timeouts"),)),
)
# Bytes per direction: (direction label, counter key, fallback key in snapshot["l3"]).
_BYTE_SPECS: tuple[tuple[str, str, str | None], ...] = (
    ("to_host", "bytes_to_host", None),
    ("to_engine", "bytes_to_engine", None),
    ("to_l3", "bytes_to_l3", "put_bytes"),
    ("from_l3", "bytes_from_l3", "get_bytes"),
)
# L3 gauges read from snapshot["l3"]: (metric name, help, key).
_L3_GAUGE_SPECS: tuple[tuple[str, str, str], ...] = (
    ("kvtier_l3_write_queue_pages", "Pages waiting, retrying or being written to L3 now.",
     "write_queue"),
    ("kvtier_l3_prefetch_fills", "L3 to L2 prefetch fills not finished yet.", "prefetching"),
)
# L3 backend counters read from snapshot["l3"]: (metric name without _total, help, key).
_L3_SPECS: tuple[tuple[str, str, str], ...] = (
    ("kvtier_l3_errors",
     "L3 operations that failed inside the backend (I/O error, connection lost), per backend.",
     "errors"),
    ("kvtier_l3_corrupt_objects",
     "L3 objects whose header or checksum did not verify (read as misses).", "corrupt"),
    ("kvtier_l3_misses", "L3 keys asked for and not found.", "misses"),
    ("kvtier_l3_puts", "Objects written to L3.", "puts"),
    ("kvtier_l3_gets", "Objects read from L3 and verified.", "gets"),
)


class MetricsError(KvtierError):
    """The metrics endpoint cannot start (port in use, bad address, library missing)."""


def _number(value: object) -> float | None:
    """``value`` as a float when it is a real number (bools count as 0/1), else None."""
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _section(snap: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``snap[name]`` when it is a mapping, else an empty one (a missing section)."""
    value = snap.get(name)
    return value if isinstance(value, Mapping) else {}


class _SnapshotCollector:
    """Turns one daemon snapshot per scrape into metric families.

    Args:
        take: returns the snapshot, or None when none could be taken this time.
    """

    def __init__(self, take: Callable[[], Mapping[str, Any] | None]) -> None:
        self._take = take

    def collect(self) -> Iterator[Metric]:
        """Yield the families the current snapshot supports (none when it failed)."""
        snap = self._take()
        if snap is None:
            return
        yield from _daemon_families(snap)
        yield from _pool_families(_section(snap, "pool"))
        counters = _section(snap, "counters")
        yield from _counter_families(counters)
        l3 = _section(snap, "l3")
        yield from _byte_families(counters, l3)
        yield from _l3_families(l3)
        yield from _session_families(snap.get("sessions"))


def _daemon_families(snap: Mapping[str, Any]) -> Iterator[Metric]:
    """``kvtier_daemon_info`` and ``kvtier_uptime_seconds``."""
    if "epoch" in snap:
        info = InfoMetricFamily("kvtier_daemon", "This kvtierd's boot epoch and protocol version.")
        info.add_metric([], {"epoch": str(snap["epoch"]), "protocol_version": str(PROTOCOL_VERSION)})
        yield info
    uptime = _number(snap.get("uptime_s"))
    if uptime is not None:
        yield GaugeMetricFamily("kvtier_uptime_seconds", "Seconds since this kvtierd started.",
                                value=uptime)


def _pool_families(pool: Mapping[str, Any]) -> Iterator[Metric]:
    """The L2 host pool: bytes, pages by state, pinned pages, extents, evictions, classes."""
    simple = (
        ("kvtier_pool_capacity_bytes", "Bytes of the L2 host pool.", "capacity_bytes"),
        ("kvtier_pool_used_bytes", "Bytes of L2 slots holding a READY or WRITING page.",
         "used_bytes"),
        ("kvtier_pool_pinned_pages", "READY L2 pages pinned by a load in flight.", "pages_pinned"),
        ("kvtier_pool_extents", "Extents (page-class allocation units) in the L2 pool.",
         "extents_total"),
        ("kvtier_pool_free_extents", "Extents not yet handed to a page class.", "extents_free"),
    )
    for name, text, key in simple:
        value = _number(pool.get(key))
        if value is not None:
            yield GaugeMetricFamily(name, text, value=value)
    pages = GaugeMetricFamily("kvtier_pool_pages", "L2 pages by state (ready: visible to "
                              "lookups; writing: being filled, invisible).", labels=["state"])
    for state in ("ready", "writing"):
        value = _number(pool.get(f"pages_{state}"))
        if value is not None:
            pages.add_metric([state], value)
    if pages.samples:
        yield pages
    evictions = _number(pool.get("evictions"))
    if evictions is not None:
        yield CounterMetricFamily("kvtier_evictions", "L2 pages evicted to make room "
                                  "(flushes not counted).", value=evictions)
    classes = pool.get("classes")
    if isinstance(classes, Sequence) and not isinstance(classes, (str, bytes)):
        ext = GaugeMetricFamily("kvtier_pool_class_extents", "Extents held by each page class.",
                                labels=["page_bytes"])
        for c in classes:
            if isinstance(c, Mapping) and _number(c.get("extents")) is not None:
                ext.add_metric([str(c.get("page_bytes", ""))], float(c["extents"]))
        if ext.samples:
            yield ext


def _counter_families(counters: Mapping[str, Any]) -> Iterator[Metric]:
    """The daemon's request, hit, token and page counters, and the token hit ratio."""
    for name, text, labels, samples in _COUNTER_SPECS:
        fam = CounterMetricFamily(name, text, labels=list(labels))
        for values, key in samples:
            value = _number(counters.get(key))
            if value is not None:
                fam.add_metric(list(values), value)
        if fam.samples:
            yield fam
    by_code = counters.get("errors_by_code")
    if isinstance(by_code, Mapping):
        fam = CounterMetricFamily("kvtier_request_errors",
                                  "Requests refused with an error reply, by error code.",
                                  labels=["code"])
        for code, count in sorted(by_code.items()):
            value = _number(count)
            if value is not None:
                fam.add_metric([str(code)], value)
        yield fam
    asked = _number(counters.get("lookup_tokens"))
    hit = [_number(counters.get(k)) for k in ("lookup_hit_tokens", "lookup_l3_tokens")]
    if asked is not None and hit[0] is not None:
        found = sum(h for h in hit if h is not None)
        yield GaugeMetricFamily(
            "kvtier_token_hit_ratio",
            "Tokens found in L2 or L3 over tokens looked up, since the daemon started "
            "(0 before the first lookup). For a windowed ratio use the _total counters.",
            value=found / asked if asked > 0 else 0.0)


def _byte_families(counters: Mapping[str, Any], l3: Mapping[str, Any]) -> Iterator[Metric]:
    """``kvtier_transfer_bytes_total{direction}``."""
    fam = CounterMetricFamily("kvtier_transfer_bytes", "Page bytes copied, by direction: "
                              "to_host (engine to L2), to_engine (L2 to engine), "
                              "to_l3 (L2 to L3), from_l3 (L3 to L2).", labels=["direction"])
    for direction, key, l3_key in _BYTE_SPECS:
        value = _number(counters.get(key))
        if value is None and l3_key is not None:
            value = _number(l3.get(l3_key))
        if value is not None:
            fam.add_metric([direction], value)
    if fam.samples:
        yield fam


def _l3_families(l3: Mapping[str, Any]) -> Iterator[Metric]:
    """L3 health, queues and backend counters, labelled with the backend's name.

    No section, or one naming backend ``none``, means no L3: no backend series (the
    tensor-parallel group count, which the section also carries, is emitted either way).
    """
    groups = _number(l3.get("tp_groups"))
    if groups is not None:
        yield GaugeMetricFamily("kvtier_tp_groups", "Tensor-parallel rank groups registered now.",
                                value=groups)
    backend = str(l3.get("backend", ""))
    if not l3 or backend == "none":
        return
    for name, text, key in _L3_GAUGE_SPECS:
        value = _number(l3.get(key))
        if value is not None:
            yield _gauge(name, text, "backend", backend, value)
    healthy = l3.get("healthy")
    if isinstance(healthy, (bool, int)):
        yield _gauge("kvtier_l3_healthy", "1 when the L3 backend answers, else 0.", "backend",
                     backend, float(bool(healthy)))
    for name, text, key in _L3_SPECS:
        value = _number(l3.get(key))
        if value is not None:
            fam = CounterMetricFamily(name, text, labels=["backend"])
            fam.add_metric([backend], value)
            yield fam


def _gauge(name: str, text: str, label: str, label_value: str, value: float) -> Metric:
    """A gauge family with one labelled sample."""
    fam = GaugeMetricFamily(name, text, labels=[label])
    fam.add_metric([label_value], value)
    return fam


def _session_families(sessions: object) -> Iterator[Metric]:
    """Open sessions and the transfers they have in flight."""
    if not isinstance(sessions, Sequence) or isinstance(sessions, (str, bytes)):
        return
    yield GaugeMetricFamily("kvtier_sessions", "Engine sessions registered now.",
                            value=float(len(sessions)))
    running = sum(int(s.get("transfers", 0)) for s in sessions if isinstance(s, Mapping))
    yield GaugeMetricFamily("kvtier_transfers_in_flight",
                            "LOAD and STORE transfers running or queued now.", value=float(running))


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

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]],
                 snapshot_timeout_s: float = 2.0) -> None:
        if _IMPORT_ERROR is not None:
            raise MetricsError("metrics_port is set but prometheus_client is not installed "
                               "(pip install 'kvtier[metrics]')") from _IMPORT_ERROR
        if not snapshot_timeout_s > 0:
            raise ValueError(f"snapshot_timeout_s must be > 0, got {snapshot_timeout_s!r}")
        self._snapshot = snapshot
        self._timeout_s = snapshot_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(self._take_snapshot))
        self._failures = Counter(
            "kvtier_metrics_snapshot_failures",
            "Scrapes that served no snapshot series: the event loop did not answer in time "
            "or taking the snapshot failed.", registry=self.registry)
        self._lookup = Histogram(
            "kvtier_lookup_duration_seconds",
            "Time kvtierd spent answering a LOOKUP (L2 index, and L3 when asked).",
            buckets=LOOKUP_BUCKETS, registry=self.registry)
        self._claim = Histogram(
            "kvtier_claim_duration_seconds",
            "Time from a CLAIM's arrival to its reply (includes waiting for a prefetch).",
            buckets=CLAIM_BUCKETS, registry=self.registry)
        self._load = Histogram(
            "kvtier_load_duration_seconds",
            "Time from a LOAD's acceptance until its pages were in the engine (completed "
            "loads only).", buckets=TRANSFER_BUCKETS, registry=self.registry)
        self._store = Histogram(
            "kvtier_store_duration_seconds",
            "Time from a STORE's acceptance until its pages were READY in L2 (completed "
            "stores only).", buckets=TRANSFER_BUCKETS, registry=self.registry)

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

        Call it from the daemon's event loop so that snapshots are taken there.

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
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise MetricsError(f"cannot serve metrics on {host}:{port} (metrics_host / "
                               f"metrics_port): {err.strerror or err}") from err
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

    def __enter__(self) -> DaemonMetrics:  # noqa: PYI034
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
            except Exception as err:  # noqa: BLE001 -- re-raised in the scrape thread by fut.result()
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
            log.warning("metrics scrape: the event loop did not answer within %.1fs",
                        self._timeout_s)
            self._failures.inc()
            return None

