"""The Prometheus endpoint: scraped over real HTTP from a real kvtierd, and DaemonMetrics alone."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.daemon.service.metrics import DaemonMetrics
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonStartError
from prometheus_client.parser import text_string_to_metric_families

from tests.engines import SMALL, engine, fill_page, tokens
from tests.servers import free_port

pytestmark = pytest.mark.timeout(90)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """GET /metrics and return every sample, keyed by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as rep:
        assert rep.status == 200
        assert rep.headers["Content-Type"].startswith("text/plain")
        text = rep.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    """Samples of an exposition text, keyed by (name, labels)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; KeyError naming the series when it is absent."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels or ''}")
    return samples[key]


def names(samples: Samples) -> set[str]:
    """The sample names present."""
    return {name for name, _ in samples}


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``pred`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def listen_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: TCP_LISTEN
                found.add(addr)
    return found


# ---------------------------------------------------------------------------- live daemon
def test_scrape_counts_lookups_hits_saved_tokens_and_bytes(daemon_factory):
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    before = scrape(port)
    assert value(before, "kvtier_lookups_total") == 0
    assert value(before, "kvtier_lookup_hit_pages_total", tier="l2") == 0
    assert value(before, "kvtier_token_hit_ratio") == 0
    assert value(before, "kvtier_sessions") == 0
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(6 * SMALL.page_size))
        for p in range(4):
            fill_page(pool, p, seed=p + 7)
        assert conn.lookup(keys).l2 == 0
        assert conn.store(keys[:4], [0, 1, 2, 3]).wait()
        assert conn.lookup(keys).l2 == 4
        h = conn.load(keys, [10, 11, 12, 13, 14, 15])
        assert h.count == 4 and h.wait()
        after = scrape(port)
    finally:
        conn.close()
        pool.close()
    tok = SMALL.page_size
    assert value(after, "kvtier_lookups_total") == 2
    assert value(after, "kvtier_lookup_hits_total", tier="l2") == 1
    assert value(after, "kvtier_lookup_pages_total") == 12
    assert value(after, "kvtier_lookup_hit_pages_total", tier="l2") == 4
    assert value(after, "kvtier_lookup_tokens_total") == 12 * tok
    assert value(after, "kvtier_lookup_hit_tokens_total", tier="l2") == 4 * tok
    assert value(after, "kvtier_token_hit_ratio") == pytest.approx(4 / 12)
    assert value(after, "kvtier_saved_tokens_total") == 4 * tok
    assert value(after, "kvtier_store_pages_total", result="copied") == 4
    assert value(after, "kvtier_load_pages_total", result="copied") == 4
    assert value(after, "kvtier_transfer_bytes_total", direction="to_host") == 4 * SMALL.page_bytes
    assert (
        value(after, "kvtier_transfer_bytes_total", direction="to_engine") == 4 * SMALL.page_bytes
    )
    assert value(after, "kvtier_pool_pages", state="ready") == 4
    assert value(after, "kvtier_pool_pages", state="writing") == 0
    assert value(after, "kvtier_pool_used_bytes") >= 4 * SMALL.page_bytes
    assert value(after, "kvtier_pool_capacity_bytes") == 64 << 20
    # the default policy, reuse: the four loaded pages are used again; nothing evicted yet
    assert value(after, "kvtier_l2_t2_pages", policy="reuse") == 4
    assert value(after, "kvtier_l2_eviction_ghosts", policy="reuse") == 0
    # no eviction yet: the lifetime is its starting rule, four times the resident pages
    assert value(after, "kvtier_l2_reuse_lifetime_ratio", policy="reuse") == 4.0
    assert "kvtier_l2_t1_target_ratio" not in names(after)  # arc's
    assert value(after, "kvtier_sessions") == 1
    assert value(after, "kvtier_load_duration_seconds_count") == 1
    assert value(after, "kvtier_load_duration_seconds_sum") > 0
    assert value(after, "kvtier_metrics_snapshot_failures_total") == 0
    # no L3 configured: no backend series (the daemon's own L3 counters stay at 0)
    assert not {n for n, labels in after if dict(labels).get("backend")}
    assert "kvtier_l3_healthy" not in names(after)
    assert after.get(("kvtier_transfer_bytes_total", frozenset({("direction", "to_l3")})), 0) == 0


HISTOGRAMS = ("lookup", "claim", "store", "load")


def test_each_latency_histogram_is_fed_by_its_own_requests(daemon_factory):
    """Regression: only the load histogram was fed; lookup, claim and store stayed at 0."""
    port = free_port()
    d = daemon_factory(
        "--metrics-port",
        str(port),
        "--hicache-storage-backend",
        "file",
        "--prefetch-threshold",
        "0",
    )

    def count(name: str) -> float:
        return value(scrape(port), f"kvtier_{name}_duration_seconds_count")

    def grew(name: str, since: dict[str, float]) -> None:
        """Wait until histogram ``name`` has more samples than in ``since``; the others not."""
        wait_until(lambda: count(name) > since[name], f"kvtier_{name}_duration_seconds to grow")
        now = {h: count(h) for h in HISTOGRAMS}
        assert {h for h in HISTOGRAMS if now[h] != since[h]} == {name}, (since, now)
        since.update(now)

    seen = {h: count(h) for h in HISTOGRAMS}
    assert seen == dict.fromkeys(HISTOGRAMS, 0)
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(4 * SMALL.page_size))
        for p in range(4):
            fill_page(pool, p, seed=p + 3)
        assert conn.lookup(keys).l2 == 0  # L2 empty: L3 is asked too
        grew("lookup", seen)
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        grew("store", seen)
        with AdminClient(d.endpoint, timeout_s=10.0) as admin:
            assert admin.sync(timeout_s=10.0).left == 0
            rep = admin.call(P.Flush(req_id=0, tier="l2"))
            assert isinstance(rep, P.FlushReply) and rep.l2_pages == 4
        assert conn.prefetch(keys) == 4
        assert conn.claim(keys, policy="wait_complete") == 4  # waits for the prefetch
        grew("claim", seen)
        h = conn.load(keys, [10, 11, 12, 13])
        assert h.count == 4 and h.wait()
        grew("load", seen)
    finally:
        conn.close()
        pool.close()


def test_refused_requests_are_counted_by_code(daemon_factory):
    from kvtier.client.connection.admin import AdminClient
    from kvtier.ipc import protocol as P

    port = free_port()
    d = daemon_factory("--metrics-port", str(port), "--admin-token", "s3cret")
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token="nope") as admin:
        for _ in range(3):
            rep = admin.call(P.Stats(req_id=0, admin_token="nope"))
            assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.UNAUTHORIZED
    m = scrape(port)
    assert value(m, "kvtier_request_errors_total", code="UNAUTHORIZED") == 3
    assert value(m, "kvtier_requests_total") >= 3


def test_endpoint_listens_on_loopback_only_and_closes_with_the_daemon(daemon_factory):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to see the listening address")
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    assert listen_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    assert d.stop() == 0
    assert listen_addresses(port) == set()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_port_in_use_stops_the_daemon_with_a_clear_error(daemon_factory):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        d = daemon_factory("--metrics-port", str(port), start=False)
        with pytest.raises(DaemonStartError) as info:
            d.start(timeout=30)
    assert f"cannot serve metrics on 127.0.0.1:{port}" in str(info.value)
    assert not d.socket.exists()  # the control socket was closed on the way out


# ---------------------------------------------------------------------------- DaemonMetrics
FULL: dict[str, Any] = {
    "epoch": "ab12",
    "uptime_s": 12.5,
    "pool": {
        "capacity_bytes": 1 << 30,
        "used_bytes": 1 << 20,
        "pages_ready": 60,
        "pages_writing": 4,
        "pages_pinned": 2,
        "evictions": 9,
        "eviction_policy": "arc",
        "evictions_by_reason": {"t1": 7, "t2": 2},
        "eviction_split": {"t2_pages": 40, "t1_target_ratio": 0.25, "ghosts": 90},
        "extents_free": 3,
        "extents_total": 32,
        "classes": [{"class_id": 0, "page_bytes": 16384, "extents": 1}],
    },
    "window": {"seconds": 60, "lookup_keys": 50, "lookup_hit_keys": 20, "l2_page_hit_ratio": 0.4},
    "counters": {
        "lookups": 10,
        "lookup_hits": 6,
        "lookup_l3_hits": 3,
        "lookup_keys": 100,
        "lookup_hit_keys": 40,
        "lookup_l3_keys": 20,
        "lookup_tokens": 1600,
        "lookup_hit_tokens": 640,
        "lookup_l3_tokens": 320,
        "loaded_tokens": 500,
        "l3_prefetch_unused_pages": 5,
        "bytes_to_l3": 777,
        "l3_write_written_pages": 6,
        "l3_backend_errors": 2,
        "errors_by_code": {"BUSY": 1},
    },
    "sessions": [{"transfers": 2}, {"transfers": 1}],
    "l3": {
        "backend": "file",
        "healthy": False,
        "errors": 4,
        "corrupt": 1,
        "misses": 8,
        "put_bytes": 1,
        "get_bytes": 999,
        "write_queue": 12,
        "prefetching": 2,
        "tp_groups": 1,
    },
}


@pytest.fixture
def metrics_for() -> Iterator:
    """``metrics_for(snapshot)`` → a started DaemonMetrics on a free port (closed at the end)."""
    made: list[DaemonMetrics] = []

    def make(snapshot: Mapping[str, Any], **kw: Any) -> DaemonMetrics:
        m = DaemonMetrics(lambda: snapshot, **kw)
        made.append(m)
        m.start("127.0.0.1", 0)
        return m

    yield make
    for m in made:
        m.close()


def test_every_snapshot_section_maps_to_its_series(metrics_for):
    m = metrics_for(FULL)
    s = scrape(m.port)
    assert value(s, "kvtier_lookup_hits_total", tier="l3") == 3
    assert value(s, "kvtier_lookup_hit_pages_total", tier="l3") == 20
    assert value(s, "kvtier_lookup_hit_tokens_total", tier="l3") == 320
    assert value(s, "kvtier_token_hit_ratio") == pytest.approx((640 + 320) / 1600)
    assert value(s, "kvtier_prefetch_unused_pages_total") == 5
    assert value(s, "kvtier_l3_write_pages_total", result="written") == 6
    assert value(s, "kvtier_l3_backend_errors_total") == 2
    assert value(s, "kvtier_request_errors_total", code="BUSY") == 1
    # the daemon's counter wins; the backend's byte count is the fallback
    assert value(s, "kvtier_transfer_bytes_total", direction="to_l3") == 777
    assert value(s, "kvtier_transfer_bytes_total", direction="from_l3") == 999
    assert value(s, "kvtier_l3_healthy", backend="file") == 0
    assert value(s, "kvtier_l3_errors_total", backend="file") == 4
    assert value(s, "kvtier_l3_corrupt_objects_total", backend="file") == 1
    assert value(s, "kvtier_l3_misses_total", backend="file") == 8
    assert value(s, "kvtier_l3_write_queue_pages", backend="file") == 12
    assert value(s, "kvtier_l3_prefetch_fills", backend="file") == 2
    assert value(s, "kvtier_tp_groups") == 1
    assert value(s, "kvtier_pool_pinned_pages") == 2
    assert value(s, "kvtier_evictions_total") == 9
    assert value(s, "kvtier_l2_page_hit_ratio_window", seconds="60") == 0.4
    assert value(s, "kvtier_evictions_by_reason_total", policy="arc", reason="t1") == 7
    assert value(s, "kvtier_evictions_by_reason_total", policy="arc", reason="t2") == 2
    assert value(s, "kvtier_l2_t2_pages", policy="arc") == 40
    assert value(s, "kvtier_l2_t1_target_ratio", policy="arc") == 0.25
    assert value(s, "kvtier_l2_eviction_ghosts", policy="arc") == 90
    assert value(s, "kvtier_pool_free_extents") == 3
    assert value(s, "kvtier_pool_class_extents", page_bytes="16384") == 1
    assert value(s, "kvtier_sessions") == 2
    assert value(s, "kvtier_transfers_in_flight") == 3
    assert (
        value(s, "kvtier_daemon_info", epoch="ab12", protocol_version=str(P.PROTOCOL_VERSION)) == 1
    )
    assert value(s, "kvtier_uptime_seconds") == 12.5


def test_missing_sections_and_keys_omit_their_series(metrics_for):
    m = metrics_for({"counters": {"lookups": 1}})
    s = scrape(m.port)
    assert value(s, "kvtier_lookups_total") == 1
    present = names(s)
    for absent in (
        "kvtier_l3_healthy",
        "kvtier_pool_capacity_bytes",
        "kvtier_sessions",
        "kvtier_saved_tokens_total",
        "kvtier_token_hit_ratio",
        "kvtier_transfer_bytes_total",
        "kvtier_daemon_info",
    ):
        assert absent not in present
    # the histograms do not depend on the snapshot
    assert value(s, "kvtier_lookup_duration_seconds_count") == 0
    none_backend = metrics_for(
        {"l3": {"backend": "none", "healthy": False, "errors": 0, "write_queue": 0, "tp_groups": 0}}
    )
    s = scrape(none_backend.port)
    assert not {n for n in names(s) if n.startswith("kvtier_l3_")}
    assert value(s, "kvtier_tp_groups") == 0


def test_observations_land_in_their_buckets(metrics_for):
    """Bucket placement of each histogram (the daemon feeding them: the live test above)."""
    m = metrics_for({})
    m.observe_lookup(20e-6)
    m.observe_claim(0.3)
    m.observe_claim(0.7)
    m.observe_load(0.004)
    m.observe_store(2.0)
    s = parse(m.render().decode())
    assert value(s, "kvtier_lookup_duration_seconds_bucket", le="2.5e-05") == 1
    assert value(s, "kvtier_lookup_duration_seconds_bucket", le="1e-05") == 0
    assert value(s, "kvtier_claim_duration_seconds_count") == 2
    assert value(s, "kvtier_claim_duration_seconds_sum") == pytest.approx(1.0)
    assert value(s, "kvtier_load_duration_seconds_bucket", le="0.005") == 1
    assert value(s, "kvtier_store_duration_seconds_bucket", le="1.0") == 0
    assert value(s, "kvtier_store_duration_seconds_bucket", le="2.5") == 1


def test_two_instances_share_no_state():
    a, b = DaemonMetrics(dict), DaemonMetrics(dict)
    a.observe_load(1.0)
    assert value(parse(a.render().decode()), "kvtier_load_duration_seconds_count") == 1
    assert value(parse(b.render().decode()), "kvtier_load_duration_seconds_count") == 0


def test_snapshot_runs_on_the_event_loop_thread_and_a_stuck_loop_costs_only_its_series():
    seen: list[int] = []

    def snapshot() -> dict[str, Any]:
        seen.append(threading.get_ident())
        return {"counters": {"lookups": 5}}

    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    loop_thread.start()
    m = DaemonMetrics(snapshot, snapshot_timeout_s=0.5)

    async def start() -> int:
        return m.start("127.0.0.1", 0)

    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        s = scrape(port)
        assert value(s, "kvtier_lookups_total") == 5
        assert seen == [loop_thread.ident]
        # block the loop: the scrape still answers, without the snapshot's series
        release = threading.Event()
        loop.call_soon_threadsafe(release.wait, 20)
        try:
            s = scrape(port)
        finally:
            release.set()
        assert "kvtier_lookups_total" not in names(s)
        assert value(s, "kvtier_metrics_snapshot_failures_total") == 1
        assert value(s, "kvtier_load_duration_seconds_count") == 0
        assert value(scrape(port), "kvtier_lookups_total") == 5  # the loop is back
    finally:
        m.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=10)
        loop.close()


def test_a_failing_snapshot_is_counted_not_fatal(metrics_for):
    def broken() -> dict[str, Any]:
        raise RuntimeError("bug in snapshot")

    m = DaemonMetrics(broken)
    try:
        port = m.start("127.0.0.1", 0)
        s = scrape(port)
        assert value(s, "kvtier_metrics_snapshot_failures_total") == 1
        assert "kvtier_lookups_total" not in names(s)
    finally:
        m.close()


def test_close_frees_the_port_and_is_idempotent():
    m = DaemonMetrics(dict)
    port = m.start("127.0.0.1", 0)
    assert port > 0 and m.port == port
    scrape(port)
    m.close()
    m.close()
    assert m.port == 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # would raise EADDRINUSE if still listening
    with pytest.raises(urllib.error.URLError):
        scrape(port)
