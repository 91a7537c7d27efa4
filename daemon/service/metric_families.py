"""The metric families of a daemon snapshot: which key of ``Daemon.snapshot()`` becomes
which Prometheus series.

The daemon's counters live in one place, the daemon; a scrape turns its snapshot (the dict
``STATS`` reports) into families here, and keeps no copy. Keys the snapshot lacks are
skipped, series by series: a daemon without an ``l3`` section (or with backend ``none``)
has no backend series, and a counter a daemon version does not keep is simply absent.
Every name, type and label is documented in ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvtier.ipc.protocol import PROTOCOL_VERSION
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

__all__ = ["SnapshotCollector"]

# Counters read from ``snapshot["counters"]``:
#   (metric name without _total, help, label names, [(label values, counter key), ...])
# A key the snapshot lacks leaves its sample out; a family with no sample is not emitted.
_Spec = tuple[str, str, tuple[str, ...], tuple[tuple[tuple[str, ...], str], ...]]
_COUNTER_SPECS: tuple[_Spec, ...] = (
    (
        "kvtier_requests",
        "Control requests received (every kind, refused ones included).",
        (),
        (((), "requests"),),
    ),
    ("kvtier_lookups", "LOOKUP requests answered.", (), (((), "lookups"),)),
    (
        "kvtier_lookup_hits",
        "LOOKUP requests whose leading run in the tier was not empty (tiers overlap: do not sum).",
        ("tier",),
        ((("l2",), "lookup_hits"), (("l3",), "lookup_l3_hits")),
    ),
    ("kvtier_lookup_pages", "Page keys asked for by LOOKUP requests.", (), (((), "lookup_keys"),)),
    (
        "kvtier_lookup_hit_pages",
        "Page keys LOOKUP found, per tier (the L3 run follows the L2 run: tiers are disjoint).",
        ("tier",),
        ((("l2",), "lookup_hit_keys"), (("l3",), "lookup_l3_keys")),
    ),
    (
        "kvtier_lookup_tokens",
        "Tokens covered by the page keys LOOKUP requests asked for.",
        (),
        (((), "lookup_tokens"),),
    ),
    (
        "kvtier_lookup_hit_tokens",
        "Tokens covered by the pages LOOKUP found, per tier (disjoint).",
        ("tier",),
        ((("l2",), "lookup_hit_tokens"), (("l3",), "lookup_l3_tokens")),
    ),
    (
        "kvtier_saved_tokens",
        "Tokens whose KV an engine loaded from the cache instead of computing (completed loads).",
        (),
        (((), "loaded_tokens"),),
    ),
    (
        "kvtier_prefetch_unused_pages",
        (
            "Pages read from L3 into L2 that no LOAD used: evicted or flushed before any load, "
            "or read and then discarded at a CLAIM."
        ),
        (),
        (((), "l3_prefetch_unused_pages"),),
    ),
    (
        "kvtier_kv_events_batches",
        (
            "KV event batches published, by result: sent (a subscriber whose queue was full "
            "missed it, and replays it from the buffer)."
        ),
        ("result",),
        ((("sent",), "kv_events_batches"),),
    ),
    (
        "kvtier_kv_events_blocks",
        "Blocks announced in KV events, by event: stored, removed.",
        ("event",),
        ((("stored",), "kv_events_stored_blocks"), (("removed",), "kv_events_removed_blocks")),
    ),
    ("kvtier_stores", "STORE requests accepted.", (), (((), "stores"),)),
    (
        "kvtier_store_pages",
        (
            "Pages named by STORE requests, by result: copied to L2, skipped (already there), "
            "failed (no room, cancelled, engine gone)."
        ),
        ("result",),
        (
            (("copied",), "store_pages"),
            (("skipped",), "store_skipped_pages"),
            (("failed",), "store_failed_pages"),
        ),
    ),
    ("kvtier_loads", "LOAD requests accepted (misses included).", (), (((), "loads"),)),
    (
        "kvtier_load_pages",
        "Pages LOAD copied to engines, by result: copied, failed.",
        ("result",),
        ((("copied",), "load_pages"), (("failed",), "load_failed_pages")),
    ),
    (
        "kvtier_transfers_split",
        "STORE and LOAD copies split over several copy threads at once.",
        (),
        (((), "transfers_split"),),
    ),
    (
        "kvtier_transfers_shared",
        "STORE and LOAD copies the event loop copied half of while the copy threads were idle.",
        (),
        (((), "transfers_shared"),),
    ),
    (
        "kvtier_transfers_inline",
        "STORE and LOAD copies done on the event loop before the reply (small ones).",
        (),
        (((), "transfers_inline"),),
    ),
    (
        "kvtier_transfers_expired",
        "STORE and LOAD copies not started: the engine had stopped waiting for the reply.",
        (),
        (((), "transfers_expired"),),
    ),
    (
        "kvtier_transfers_cuda",
        "STORE and LOAD copies of CUDA sessions, on each session's own CUDA stream.",
        (),
        (((), "transfers_cuda"),),
    ),
    (
        "kvtier_cuda_held_pages",
        "Host pages of failed CUDA stores kept out of use: their copies may still write them.",
        (),
        (((), "cuda_held_pages"),),
    ),
    (
        "kvtier_requests_sliced",
        "STOREs and LOADs of more than slice_pages pages, whose page-table work went in slices.",
        (),
        (((), "requests_sliced"),),
    ),
    ("kvtier_sessions_opened", "Engine sessions registered.", (), (((), "sessions_opened"),)),
    (
        "kvtier_sessions_closed",
        "Engine sessions ended (any reason).",
        (),
        (((), "sessions_closed"),),
    ),
    (
        "kvtier_sessions_expired",
        "Engine sessions ended because their lease expired.",
        (),
        (((), "sessions_expired"),),
    ),
    (
        "kvtier_l3_lookups",
        "LOOKUP requests that asked L3 (the L2 run was not the whole chain).",
        (),
        (((), "l3_lookups"),),
    ),
    ("kvtier_prefetches", "PREFETCH requests accepted.", (), (((), "prefetches"),)),
    ("kvtier_claims", "CLAIM requests answered.", (), (((), "claims"),)),
    ("kvtier_claim_pages", "Pages of the L2 runs CLAIM answered.", (), (((), "claim_pages"),)),
    (
        "kvtier_l3_prefetch_pages",
        (
            "Pages a PREFETCH read from L3, by result: started (slot allocated), completed "
            "(verified and READY in L2), cancelled (a CLAIM or the session ended first), failed "
            "(the read did not verify; the rest of the chain included)."
        ),
        ("result",),
        (
            (("started",), "l3_prefetch_started_pages"),
            (("completed",), "l3_prefetch_completed_pages"),
            (("cancelled",), "l3_prefetch_cancelled_pages"),
            (("failed",), "l3_prefetch_failed_pages"),
        ),
    ),
    (
        "kvtier_l3_write_pages",
        (
            "Pages on their way from L2 to L3, by result: queued, written, skipped (already in "
            "L3), failed (given up after retries), dropped (queue full, or evicted first)."
        ),
        ("result",),
        (
            (("queued",), "l3_write_queued_pages"),
            (("written",), "l3_write_written_pages"),
            (("skipped",), "l3_write_skipped_pages"),
            (("failed",), "l3_write_failed_pages"),
            (("dropped",), "l3_write_dropped_pages"),
        ),
    ),
    (
        "kvtier_l3_write_retries",
        "L3 write batches tried again after a failure.",
        (),
        (((), "l3_write_retries"),),
    ),
    ("kvtier_l3_flushed_pages", "Pages FLUSH deleted from L3.", (), (((), "l3_flushed_pages"),)),
    (
        "kvtier_l3_backend_errors",
        "L3 backend calls that raised or timed out, as the daemon saw them (each read as a miss).",
        (),
        (((), "l3_backend_errors"),),
    ),
    (
        "kvtier_tp_rounds",
        "Tensor-parallel rank-group agreements (a LOOKUP or CLAIM answered to all ranks).",
        (),
        (((), "tp_rounds"),),
    ),
    (
        "kvtier_tp_round_timeouts",
        "Rank-group agreements a missing rank ended with a 0 answer.",
        (),
        (((), "tp_round_timeouts"),),
    ),
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
    (
        "kvtier_l3_write_queue_pages",
        "Pages waiting, retrying or being written to L3 now.",
        "write_queue",
    ),
    ("kvtier_l3_prefetch_fills", "L3 to L2 prefetch fills not finished yet.", "prefetching"),
)
# L3 backend counters read from snapshot["l3"]: (metric name without _total, help, key).
_L3_SPECS: tuple[tuple[str, str, str], ...] = (
    (
        "kvtier_l3_errors",
        "L3 operations that failed inside the backend (I/O error, connection lost), per backend.",
        "errors",
    ),
    (
        "kvtier_l3_corrupt_objects",
        "L3 objects whose header or checksum did not verify (read as misses).",
        "corrupt",
    ),
    ("kvtier_l3_misses", "L3 keys asked for and not found.", "misses"),
    ("kvtier_l3_puts", "Objects written to L3.", "puts"),
    ("kvtier_l3_gets", "Objects read from L3 and verified.", "gets"),
)

_SPLIT_GAUGES = (
    ("kvtier_l2_t2_pages", "L2 pages used again (T2 of arc and reuse), by policy.", "t2_pages"),
    (
        "kvtier_l2_t1_target_ratio",
        "The share of L2 that pages stored once may hold before they are evicted first "
        "(arc adapts it).",
        "t1_target_ratio",
    ),
    (
        "kvtier_l2_reuse_lifetime_ratio",
        "How long a page used again keeps its place under reuse, in access-clock ticks, over "
        "the pages L2 held at its last eviction (the measured 0.95 quantile of the re-use "
        "distances).",
        "lifetime_ratio",
    ),
    (
        "kvtier_l2_eviction_ghosts",
        "Keys of recent L2 evictions the policy remembers (arc and reuse).",
        "ghosts",
    ),
)
"""The two-list policies' gauges: ``(name, help, key of pool.eviction_split)``."""


def _number(value: object) -> float | None:
    """``value`` as a float when it is a real number (bools count as 0/1), else None."""
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _section(snap: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``snap[name]`` when it is a mapping, else an empty one (a missing section)."""
    value = snap.get(name)
    return value if isinstance(value, Mapping) else {}


class SnapshotCollector:
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
        yield from _window_families(_section(snap, "window"))
        l3 = _section(snap, "l3")
        yield from _byte_families(counters, l3)
        yield from _l3_families(l3)
        yield from _session_families(snap.get("sessions"))
        yield from _limit_families(_section(snap, "limits"))


def _daemon_families(snap: Mapping[str, Any]) -> Iterator[Metric]:
    """``kvtier_daemon_info`` and ``kvtier_uptime_seconds``."""
    if "epoch" in snap:
        info = InfoMetricFamily("kvtier_daemon", "This kvtierd's boot epoch and protocol version.")
        info.add_metric(
            [], {"epoch": str(snap["epoch"]), "protocol_version": str(PROTOCOL_VERSION)}
        )
        yield info
    uptime = _number(snap.get("uptime_s"))
    if uptime is not None:
        yield GaugeMetricFamily(
            "kvtier_uptime_seconds", "Seconds since this kvtierd started.", value=uptime
        )


def _pool_families(pool: Mapping[str, Any]) -> Iterator[Metric]:
    """The L2 host pool: bytes, pages by state, pinned pages, extents, evictions, classes."""
    simple = (
        ("kvtier_pool_capacity_bytes", "Bytes of the L2 host pool.", "capacity_bytes"),
        (
            "kvtier_pool_used_bytes",
            "Bytes of L2 slots holding a READY or WRITING page.",
            "used_bytes",
        ),
        (
            "kvtier_pool_pinned_pages",
            "READY L2 pages pinned by a load in flight, or an L3 write or flush reading them.",
            "pages_pinned",
        ),
        (
            "kvtier_pool_extents",
            "Extents (page-class allocation units) in the L2 pool.",
            "extents_total",
        ),
        ("kvtier_pool_free_extents", "Extents not yet handed to a page class.", "extents_free"),
    )
    for name, text, key in simple:
        value = _number(pool.get(key))
        if value is not None:
            yield GaugeMetricFamily(name, text, value=value)
    pages = GaugeMetricFamily(
        "kvtier_pool_pages",
        "L2 pages by state (ready: visible to lookups; writing: being filled, invisible).",
        labels=["state"],
    )
    for state in ("ready", "writing"):
        value = _number(pool.get(f"pages_{state}"))
        if value is not None:
            pages.add_metric([state], value)
    if pages.samples:
        yield pages
    evictions = _number(pool.get("evictions"))
    if evictions is not None:
        yield CounterMetricFamily(
            "kvtier_evictions",
            "L2 pages evicted to make room (flushes not counted).",
            value=evictions,
        )
    reasons = pool.get("evictions_by_reason")
    if isinstance(reasons, Mapping):
        fam = CounterMetricFamily(
            "kvtier_evictions_by_reason",
            "L2 pages evicted, by eviction "
            "policy and the list the victim came from (lru: lru; arc, reuse: "
            "t1, stored once, or t2, used again).",
            labels=["policy", "reason"],
        )
        policy = str(pool.get("eviction_policy", ""))
        for reason, value in reasons.items():
            if _number(value) is not None:
                fam.add_metric([policy, str(reason)], float(value))
        if fam.samples:
            yield fam
    split = pool.get("eviction_split")
    if isinstance(split, Mapping):
        policy = str(pool.get("eviction_policy", ""))
        for name, text, key in _SPLIT_GAUGES:
            v = _number(split.get(key))
            if v is not None:
                yield _gauge(name, text, "policy", policy, v)
    classes = pool.get("classes")
    if isinstance(classes, Sequence) and not isinstance(classes, (str, bytes)):
        ext = GaugeMetricFamily(
            "kvtier_pool_class_extents", "Extents held by each page class.", labels=["page_bytes"]
        )
        for c in classes:  # a class holding no extent has nothing to report
            if isinstance(c, Mapping) and (_number(c.get("extents")) or 0) > 0:
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
        fam = CounterMetricFamily(
            "kvtier_request_errors",
            "Requests refused with an error reply, by error code.",
            labels=["code"],
        )
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
            value=found / asked if asked > 0 else 0.0,
        )


def _window_families(window: Mapping[str, Any]) -> Iterator[Metric]:
    """``kvtier_l2_page_hit_ratio_window``: the L2 page hit rate over the last window."""
    ratio, seconds = _number(window.get("l2_page_hit_ratio")), _number(window.get("seconds"))
    if ratio is not None and seconds is not None:
        fam = GaugeMetricFamily(
            "kvtier_l2_page_hit_ratio_window",
            "Page keys found in L2 over "
            "page keys looked up, over the last `seconds` (absent before "
            "a lookup in the window).",
            labels=["seconds"],
        )
        fam.add_metric([str(int(seconds))], ratio)
        yield fam


def _byte_families(counters: Mapping[str, Any], l3: Mapping[str, Any]) -> Iterator[Metric]:
    """``kvtier_transfer_bytes_total{direction}``."""
    fam = CounterMetricFamily(
        "kvtier_transfer_bytes",
        "Page bytes copied, by direction: "
        "to_host (engine to L2), to_engine (L2 to engine), "
        "to_l3 (L2 to L3), from_l3 (L3 to L2).",
        labels=["direction"],
    )
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
        yield GaugeMetricFamily(
            "kvtier_tp_groups", "Tensor-parallel rank groups registered now.", value=groups
        )
    backend = str(l3.get("backend", ""))
    if not l3 or backend == "none":
        return
    for name, text, key in _L3_GAUGE_SPECS:
        value = _number(l3.get(key))
        if value is not None:
            yield _gauge(name, text, "backend", backend, value)
    healthy = l3.get("healthy")
    if isinstance(healthy, (bool, int)):
        yield _gauge(
            "kvtier_l3_healthy",
            "1 when the L3 backend answers, else 0.",
            "backend",
            backend,
            float(bool(healthy)),
        )
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
    yield GaugeMetricFamily(
        "kvtier_sessions", "Engine sessions registered now.", value=float(len(sessions))
    )
    running = sum(int(s.get("transfers", 0)) for s in sessions if isinstance(s, Mapping))
    yield GaugeMetricFamily(
        "kvtier_transfers_in_flight",
        "LOAD and STORE transfers running or queued now.",
        value=float(running),
    )


_USE_KEYS = (
    "connections",
    "handover_connections",
    "handovers_waiting",
    "sessions",
    "mapped_bytes",
    "mapped_segments",
    "prefaults_queued",
)
"""Per-user use reported in ``snapshot["limits"]["users"]``, as ``resource`` label values."""


def _counter_by(name: str, text: str, label: str, counts: Mapping[str, Any]) -> Metric:
    """A counter family with one sample per key of ``counts`` (its label ``label``), the
    keys in order; values that are not numbers are left out."""
    fam = CounterMetricFamily(name, text, labels=[label])
    for key, count in sorted(counts.items()):
        value = _number(count)
        if value is not None:
            fam.add_metric([str(key)], value)
    return fam


def _limit_families(limits: Mapping[str, Any]) -> Iterator[Metric]:
    """The per-user bounds, each user's use of them, and the refusals they caused."""
    if not limits:
        return
    bounds = _section(limits, "bounds")
    fam = GaugeMetricFamily(
        "kvtier_limit",
        "Each per-user or total bound in force, by its setting name (bytes for the *_bytes ones).",
        labels=["setting"],
    )
    for name, value in sorted(bounds.items()):
        if _number(value) is not None:
            fam.add_metric([str(name)], float(value))
    if fam.samples:
        yield fam
    use = GaugeMetricFamily(
        "kvtier_user_use",
        "What each user id holds now, by resource: connections (ZeroMQ; uid -1: tcp peers), "
        "handover_connections, handovers_waiting, sessions, mapped_bytes, "
        "mapped_segments, prefaults_queued.",
        labels=["uid", "resource"],
    )
    for uid, held in sorted(_section(limits, "users").items()):
        if isinstance(held, Mapping):
            for key in _USE_KEYS:
                value = _number(held.get(key))
                if value is not None:
                    use.add_metric([str(uid), key], value)
    yield use
    simple = (
        (
            "kvtier_mapped_bytes",
            "Bytes of engine memory open sessions map now, all users together (bounded, with "
            "kvtier_unmap_pending_bytes, by max_mapped_bytes).",
            "mapped_bytes",
        ),
        (
            "kvtier_unmap_pending_bytes",
            "Bytes of closed sessions' engine memory waiting to be unmapped off the event loop "
            "(counted with kvtier_mapped_bytes against max_mapped_bytes).",
            "unmap_pending_bytes",
        ),
    )
    for name, text, key in simple:
        value = _number(limits.get(key))
        if value is not None:
            yield GaugeMetricFamily(name, text, value=value)
    unmaps = _counter_by(
        "kvtier_unmaps",
        "Closed sessions' engine memories unmapped, by where: thread (the unmap thread, off "
        "the event loop), at_once (no room under max_mapped_bytes for them to wait).",
        "on",
        _section(limits, "unmaps"),
    )
    if unmaps.samples:
        yield unmaps
    yield _counter_by(
        "kvtier_limit_refusals",
        "Handovers and registrations "
        "refused because a bound was reached, by setting (memory: "
        "the daemon was short of memory or descriptors).",
        "setting",
        _section(limits, "refusals"),
    )
    short = _number(limits.get("shortages"))
    if short is not None:
        yield CounterMetricFamily(
            "kvtier_resource_shortages",
            "Times the daemon ran short of "
            "address space, memory or descriptors (each refused one "
            "request; HEALTH says degraded for a minute after).",
            value=short,
        )
