"""What kvtierd exports to operators, checked as a hostile scraper and a demanding operator:
the Prometheus exposition parsed whole by prometheus_client's own text parser, its
agreement with docs/metrics.md, counters across scrapes and a SIGHUP reload, and the
endpoint under concurrent, idle and half-open HTTP clients."""

from __future__ import annotations

import re
import signal
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from tests.engines import SMALL, engine, fill_page, tokens
from tests.servers import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


# ---------------------------------------------------------------------------- helpers
def get(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> str:
    """GET /metrics and return the exposition text."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as rep:
        assert rep.status == 200
        return rep.read().decode("utf-8")


def check_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse ``text`` whole with prometheus_client's parser and check what Prometheus
    needs: HELP and TYPE before every family's samples, no series twice, histograms
    cumulative with +Inf == _count. Returns every sample keyed by (name, labels)."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    raw_keys: list[str] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"HELP twice for {name}"
            helps[name] = line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"TYPE twice for {name}"
            types[name] = kind
        elif line and not line.startswith("#"):
            raw_keys.append(line.rsplit(" ", 1)[0])
    dupes = {k for k in raw_keys if raw_keys.count(k) > 1}
    assert not dupes, f"series exported twice: {sorted(dupes)[:5]}"
    assert set(helps) == set(types), set(helps) ^ set(types)
    out: dict[tuple[str, frozenset], float] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.type != "unknown", f"{fam.name}: no TYPE"
        assert fam.documentation, f"{fam.name}: no HELP"
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
        if fam.type == "histogram":
            buckets = [
                (float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")
            ]
            assert buckets == sorted(buckets), f"{fam.name}: buckets out of order"
            values = [v for _, v in buckets]
            assert values == sorted(values), f"{fam.name}: buckets not cumulative {values}"
            assert buckets[-1][0] == float("inf"), f"{fam.name}: no +Inf bucket"
            count = next(s.value for s in fam.samples if s.name == fam.name + "_count")
            assert buckets[-1][1] == count, f"{fam.name}: +Inf {buckets[-1][1]} != count {count}"
    return out


def counters_of(text: str) -> dict[tuple[str, frozenset], float]:
    """The counter samples (``*_total``) of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("counter", "histogram"):
            for s in fam.samples:
                if s.name.endswith(("_total", "_count", "_bucket")):
                    out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def family_names(text: str) -> set[str]:
    """Exported metric names as docs/metrics.md writes them (counters with _total)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):
            continue
        out.add(fam.name + ("_total" if fam.type == "counter" else ""))
    return out


def documented_names() -> set[str]:
    """The metric names in docs/metrics.md's tables (first column)."""
    return set(re.findall(r"^\| `(kvtier_[a-z0-9_]+)` \|", DOCS.read_text(), re.M))


def traffic(conn, pool, rounds: int, salt: int) -> None:
    """LOOKUP, STORE, LOAD of a few pages, ``rounds`` times."""
    for r in range(rounds):
        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=salt * 1000 + r))
        conn.lookup(keys)
        assert conn.store(keys, [0, 1, 2, 3]).wait()
        h = conn.load(keys, [8, 9, 10, 11])
        h.wait()


def lookup_rtts(conn, n: int) -> list[float]:
    """``n`` LOOKUP round trips, seconds each."""
    keys = conn.page_keys(tokens(8 * SMALL.page_size, salt=77))
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.lookup(keys)
        out.append(time.perf_counter() - t0)
    return out


@pytest.fixture
def metrics_daemon(daemon_factory) -> Iterator:
    """A daemon with the file L3 backend, ARC and metrics on a free loopback port."""

    def make(*flags: str, **kw):
        port = free_port()
        d = daemon_factory(
            "--metrics-port",
            str(port),
            "--hicache-storage-backend",
            "file",
            *flags,
            **kw,
        )
        return d, port

    return make


# ---------------------------------------------------------------------------- exposition
@pytest.mark.timeout(120)
def test_exposition_parses_and_counters_never_go_down_under_load_and_sighup(metrics_daemon):
    """Every scrape, taken by several scrapers at once while an engine stores and loads
    and while the daemon reloads on SIGHUP, parses with Prometheus' parser, has HELP and
    TYPE for every family, no duplicate series, sane histograms, and no counter sample
    smaller than in an earlier scrape."""
    d, port = metrics_daemon("--eviction-policy", "arc")
    pool, conn = engine(d.runtime_dir)
    for p in range(16):
        fill_page(pool, p, seed=p)
    stop = threading.Event()
    errors: list[BaseException] = []
    texts: list[list[str]] = [[] for _ in range(4)]

    def scraper(i: int) -> None:
        try:
            while not stop.is_set() and len(texts[i]) < 200:
                texts[i].append(get(port))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=scraper, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        traffic(conn, pool, 5, salt=1)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        traffic(conn, pool, 5, salt=2)
        d.proc.send_signal(signal.SIGHUP)
        traffic(conn, pool, 5, salt=3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        conn.close()
        pool.close()
    assert not errors, errors
    for seq in texts:
        assert seq
        previous: dict = {}
        for text in seq:
            check_exposition(text)
            now = counters_of(text)
            went_down = {k: (previous[k], v) for k, v in now.items() if v < previous.get(k, v)}
            assert not went_down, went_down
            previous = now
    last = check_exposition(get(port))
    assert last[("kvtier_stores_total", frozenset())] >= 15
    assert d.proc.poll() is None


@pytest.mark.timeout(120)
def test_docs_list_exactly_the_families_exported(metrics_daemon):
    """docs/metrics.md documents every family the daemon exports, and every documented
    family is exported by some configuration (arc for its target ratio, reuse for its
    lifetime ratio, the file backend for the L3 series)."""
    seen: set[str] = set()
    for policy, name in (("arc", "a"), ("reuse", "r")):
        d, port = metrics_daemon("--eviction-policy", policy, name=name)
        pool, conn = engine(d.runtime_dir)
        try:
            fill_page(pool, 0, seed=1)
            traffic(conn, pool, 1, salt=5)
            seen |= family_names(get(port))
        finally:
            conn.close()
            pool.close()
        d.stop()
    docs = documented_names()
    assert seen - docs == set(), "exported but not documented"
    assert docs - seen == set(), "documented but never exported"


# ---------------------------------------------------------------------------- HTTP clients
@pytest.mark.timeout(120)
def test_idle_and_half_open_http_clients_block_nothing(metrics_daemon):
    """Clients that connect to the metrics port and send nothing, or half a request line,
    block neither other scrapes nor the daemon's event loop: a scrape still answers, and
    LOOKUP round trips stay in the range of a baseline measured in the same test."""
    d, port = metrics_daemon()
    pool, conn = engine(d.runtime_dir)
    idle: list[socket.socket] = []
    try:
        get(port)
        base = statistics.median(lookup_rtts(conn, 200))
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metr")  # half a request line, never finished
            idle.append(s)
        check_exposition(get(port, timeout=10))
        hung = statistics.median(lookup_rtts(conn, 200))
        assert hung < 10 * base + 0.002, (base, hung)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            assert admin.health().status == "ok"
    finally:
        for s in idle:
            s.close()
        conn.close()
        pool.close()


def daemon_threads(pid: int) -> int:
    """Threads of process ``pid`` (from /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("Threads:")[1].split()[0])


@pytest.mark.timeout(90)
def test_idle_metrics_connections_do_not_pin_a_daemon_thread_each_forever(metrics_daemon):
    """A local client (the endpoint has no authentication) that opens connections to the
    metrics port and sends nothing, or half a request, does not make kvtierd hold a thread
    for each of them forever: like the handover socket (CONNECTION_DEADLINE_S to send a
    request), an idle HTTP connection is closed after a deadline, and the threads serving
    scrapes are bounded. 100 idle connections are all closed within 12 s (or leave fewer
    than 50 extra threads), and a scrape is still answered afterwards."""
    d, port = metrics_daemon()
    get(port)
    before = daemon_threads(d.pid)
    idle: list[socket.socket] = []
    try:
        for i in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")  # never finished
            s.setblocking(False)
            idle.append(s)
        deadline = time.monotonic() + 12.0
        closed = 0
        while time.monotonic() < deadline:
            time.sleep(0.5)
            closed = 0
            for s in idle:
                try:
                    closed += s.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            if closed == len(idle):
                break
        grown = daemon_threads(d.pid) - before
        check_exposition(get(port))  # others are still served meanwhile
    finally:
        for s in idle:
            s.close()
    assert closed == len(idle) or grown < 50, (
        f"after 12 s, {len(idle) - closed} of {len(idle)} idle connections still open and "
        f"the daemon holds {grown} more threads than before them"
    )


@pytest.mark.timeout(90)
def test_a_burst_of_concurrent_scrapes_is_not_stalled_by_the_listen_backlog(metrics_daemon):
    """Scrapes that arrive together (several Prometheus servers, agents, a person with
    curl) are each answered about as fast as a lone scrape: even served strictly one after
    the other, 32 of them take at most 32 times the slowest lone scrape. The listen backlog
    holds the whole burst, so no connect is dropped by the kernel to wait for the client's
    SYN retransmit (1 s and more)."""
    _d, port = metrics_daemon()
    n = 32

    def timed(out: list[float]) -> None:
        t0 = time.perf_counter()
        get(port, timeout=30)
        out.append(time.perf_counter() - t0)

    base: list[float] = []
    for _ in range(10):
        timed(base)
    burst: list[float] = []
    barrier = threading.Barrier(n)

    def one() -> None:
        barrier.wait(timeout=30)
        timed(burst)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(burst) == n
    slow = sorted(burst)[-5:]
    assert max(burst) < n * max(base), (
        f"slowest lone scrape {max(base):.4f}s; slowest of a burst of {n}: {slow}"
    )
