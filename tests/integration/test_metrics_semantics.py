"""What the numbers on kvtierd's Prometheus endpoint mean, checked against docs/metrics.md
with a real kvtierd (``--metrics-port`` on 127.0.0.1), real engines (shared-memory KV
pools, real connections), a real redis-server as L3 where one is needed, and scrapes
compared with STATS and with what the test itself did."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.daemon.service.metrics import CLAIM_BUCKETS, LOOKUP_BUCKETS, TRANSFER_BUCKETS
from prometheus_client.parser import text_string_to_metric_families

from tests.engines import SMALL, client_config, engine, fill_page, tokens
from tests.servers import RedisServer, free_port, serve_redis

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---------------------------------------------------------------------------- helpers
def scrape(port: int) -> Samples:
    """GET /metrics, parse it whole with prometheus_client's parser, every sample by
    (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as rep:
        text = rep.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels or ''}"
    return samples[key]


def buckets(samples: Samples, name: str) -> list[float]:
    """The finite ``le`` bounds of histogram ``name``, in order."""
    les = [
        float(dict(labels)["le"])
        for n, labels in samples
        if n == name + "_bucket" and dict(labels)["le"] != "+Inf"
    ]
    return sorted(les)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


class Ranks:
    """Two tensor-parallel ranks of one engine in this process (a pool and a connection
    each), asking at once as separate rank processes would."""

    def __init__(self, rdir, tp_size: int = 2) -> None:
        self.pools: list[SharedKVPool] = []
        self.conns: list[Connection] = []
        self._ex = ThreadPoolExecutor(tp_size)
        for rank in range(tp_size):
            self.pools.append(SharedKVPool(SMALL, 64))
            self.conns.append(
                Connection(
                    self.pools[-1],
                    model_id="tp-metrics",
                    config=client_config(rdir),
                    tp_rank=rank,
                    tp_size=tp_size,
                )
            )

    def each(self, fn):
        return list(self._ex.map(fn, range(len(self.conns))))

    def close(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.pools:
            p.close()
        self._ex.shutdown()


# ---------------------------------------------------------------------------- bugs
@pytest.mark.timeout(90)
def test_tp_lookup_hits_count_what_the_ranks_were_answered(daemon_factory):
    """For a tensor-parallel engine, every rank is answered the group's minimum
    L2 run (docs/protocol.md), so the hit series count the pages the engine was told were
    found: ``kvtier_lookup_hit_pages_total{tier="l2"}``, ``kvtier_lookup_hits_total``,
    ``kvtier_token_hit_ratio`` and the windowed page hit ratio stay at 0 when both ranks
    are answered l2=0, as ``kvtier_claim_pages_total`` does for CLAIM (which counts the
    agreed minimum)."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    r = Ranks(d.runtime_dir)
    try:
        keys = [c.page_keys(tokens(4 * SMALL.page_size, salt=11)) for c in r.conns]
        for p in range(4):
            fill_page(r.pools[0], p, seed=p + 1)
        assert r.conns[0].store(keys[0], [0, 1, 2, 3]).wait()  # rank 0 only
        answers = r.each(lambda i: r.conns[i].lookup(keys[i]))
        assert [a.l2 for a in answers] == [0, 0], answers  # the group's minimum
        claimed = r.each(lambda i: r.conns[i].claim(keys[i]))
        assert claimed == [0, 0]
        s = scrape(port)
    finally:
        r.close()
    assert val(s, "kvtier_lookups_total") == 2
    assert val(s, "kvtier_claim_pages_total") == 0  # CLAIM counts what it answered
    hit = {
        "lookup_hit_pages{l2}": val(s, "kvtier_lookup_hit_pages_total", tier="l2"),
        "lookup_hits{l2}": val(s, "kvtier_lookup_hits_total", tier="l2"),
        "lookup_hit_tokens{l2}": val(s, "kvtier_lookup_hit_tokens_total", tier="l2"),
        "token_hit_ratio": val(s, "kvtier_token_hit_ratio"),
        "l2_page_hit_ratio_window": val(s, "kvtier_l2_page_hit_ratio_window", seconds="60"),
    }
    assert hit == dict.fromkeys(hit, 0.0), f"hits reported that no rank was answered: {hit}"


@pytest.mark.timeout(90)
def test_tp_rounds_count_lookup_and_claim_agreements_as_documented(daemon_factory):
    """docs/metrics.md: ``kvtier_tp_rounds_total`` counts rank-group agreements, each LOOKUP
    and each CLAIM answered to every rank with the minimum: one LOOKUP per rank makes it
    1, one CLAIM per rank then 2."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    r = Ranks(d.runtime_dir)
    try:
        keys = [c.page_keys(tokens(4 * SMALL.page_size, salt=12)) for c in r.conns]
        r.each(lambda i: r.conns[i].lookup(keys[i]))
        after_lookups = val(scrape(port), "kvtier_tp_rounds_total")
        r.each(lambda i: r.conns[i].claim(keys[i]))
        after_claims = val(scrape(port), "kvtier_tp_rounds_total")
    finally:
        r.close()
    assert (after_lookups, after_claims) == (1, 2), (
        f"tp_rounds_total: {after_lookups} after one LOOKUP per rank, {after_claims} after "
        "one CLAIM per rank"
    )


@pytest.mark.timeout(90)
def test_pinned_pages_gauge_counts_the_pins_of_l3_writes_as_documented(
    daemon_factory, redis_server
):
    """docs/metrics.md: ``kvtier_pool_pinned_pages`` counts READY pages pinned by a load in
    flight or by an L3 write or flush reading them. With no LOAD ever sent and the L3
    server slow to answer (frozen with SIGSTOP), the 8 pages just stored stay pinned while
    their write-through waits, and none once it has ended."""
    port = free_port()
    d = daemon_factory(
        "--metrics-port",
        str(port),
        "--hicache-storage-backend",
        "redis",
        "--hicache-storage-backend-extra-config",
        json.dumps({"url": redis_server.url}),
        "--storage-timeout-s",
        "10",
    )
    pool, conn = engine(d.runtime_dir)
    redis_server.pause()
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=13))
        for p in range(8):
            fill_page(pool, p, seed=p + 3)
        assert conn.store(keys, list(range(8))).wait()
        seen = []
        for _ in range(10):  # bounded: the write is stuck for storage_timeout_s (10 s)
            s = scrape(port)
            seen.append((val(s, "kvtier_pool_pinned_pages"), val(s, "kvtier_loads_total")))
            time.sleep(0.1)
    finally:
        redis_server.resume()
    try:
        deadline = time.monotonic() + 30
        while val(scrape(port), "kvtier_pool_pinned_pages") and time.monotonic() < deadline:
            time.sleep(0.1)
        after = val(scrape(port), "kvtier_pool_pinned_pages")
    finally:
        conn.close()
        pool.close()
    assert all(loads == 0 for _, loads in seen), seen
    assert max(pinned for pinned, _ in seen) == 8, seen  # held by the write, not by a load
    assert after == 0


# ---------------------------------------------------------------------------- guards
@pytest.mark.timeout(90)
def test_histograms_count_each_operation_once_in_seconds_with_documented_buckets(
    daemon_factory,
):
    """Guard: the four latency histograms have the buckets docs/metrics.md lists, their
    ``_count`` equals the operations the test did (LOOKUPs answered, CLAIMs answered,
    completed STOREs and LOADs), their ``_sum`` is in seconds (each observation below the
    round trip the client saw), and the gauges equal STATS taken right after."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    pool, conn = engine(d.runtime_dir)
    try:
        for p in range(8):
            fill_page(pool, p, seed=p + 20)
        t0 = time.perf_counter()
        for r in range(3):
            keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=100 + r))
            conn.lookup(keys)
            assert conn.store(keys, [0, 1, 2, 3]).wait()
            assert conn.claim(keys) == 4
            h = conn.load(keys, [8, 9, 10, 11])
            assert h.count == 4 and h.wait()
        wall = time.perf_counter() - t0
        s = scrape(port)
        with AdminClient(d.endpoint) as admin:
            st = admin.stats()
    finally:
        conn.close()
        pool.close()
    assert buckets(s, "kvtier_lookup_duration_seconds") == list(LOOKUP_BUCKETS)
    assert buckets(s, "kvtier_claim_duration_seconds") == list(CLAIM_BUCKETS)
    assert buckets(s, "kvtier_load_duration_seconds") == list(TRANSFER_BUCKETS)
    assert buckets(s, "kvtier_store_duration_seconds") == list(TRANSFER_BUCKETS)
    assert len(TRANSFER_BUCKETS) == 16 and TRANSFER_BUCKETS[0] == 1e-4
    for op, counter in (
        ("lookup", "kvtier_lookups_total"),
        ("claim", "kvtier_claims_total"),
        ("store", "kvtier_stores_total"),
        ("load", "kvtier_loads_total"),
    ):
        assert val(s, f"kvtier_{op}_duration_seconds_count") == 3 == val(s, counter), op
        total = val(s, f"kvtier_{op}_duration_seconds_sum")
        assert 0 < total < wall, (op, total, wall)
    pool_st = st["pool"]
    assert val(s, "kvtier_pool_pages", state="ready") == pool_st["pages_ready"] == 12
    assert val(s, "kvtier_pool_pages", state="writing") == pool_st["pages_writing"] == 0
    assert val(s, "kvtier_pool_used_bytes") == pool_st["used_bytes"]
    assert val(s, "kvtier_mapped_bytes") == st["limits"]["mapped_bytes"] > 0


@pytest.mark.timeout(120)
def test_adopted_pool_shows_in_gauges_at_once_and_counters_restart(daemon_factory):
    """Guard: after a restart that adopts the pool file, the very first scrape (before
    any request) shows the adopted pages as READY with their bytes and extents, counters
    start again at 0 and ``kvtier_daemon_info{epoch}`` changes."""
    port = free_port()
    flags = ("--metrics-port", str(port), "--eviction-policy", "arc")
    d = daemon_factory(*flags)
    pool, conn = engine(d.runtime_dir)
    try:
        keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=14))
        for p in range(8):
            fill_page(pool, p, seed=p + 40)
        assert conn.store(keys, list(range(8))).wait()
        before = scrape(port)
    finally:
        conn.close()
        pool.close()
    d.kill()
    d2 = daemon_factory(*flags)
    after = scrape(port)
    with AdminClient(d2.endpoint) as admin:
        adopt = admin.stats()["adopt"]
    assert adopt["adopted"] and adopt["pages_adopted"] == 8, adopt
    assert val(after, "kvtier_pool_pages", state="ready") == 8
    assert val(after, "kvtier_pool_used_bytes") == val(before, "kvtier_pool_used_bytes")
    assert val(after, "kvtier_pool_class_extents", page_bytes=str(SMALL.page_bytes)) == 1
    assert val(after, "kvtier_stores_total") == 0
    epochs = {dict(labels)["epoch"] for n, labels in before if n == "kvtier_daemon_info"}
    epochs |= {dict(labels)["epoch"] for n, labels in after if n == "kvtier_daemon_info"}
    assert len(epochs) == 2
