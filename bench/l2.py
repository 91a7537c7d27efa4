"""``kvtier bench l2``: the host pool against memcpy, and LOOKUP against a bare ZeroMQ echo.

Everything is measured in one run on one machine and reported as ratios, since absolute
figures on a shared machine are noise:

- ``memcpy_gbps``: a numpy copy of the same total bytes in one process (prefaulted buffers),
  the faster of one thread and as many threads as the daemon copies with
  (``memcpy_threads``): a baseline that leaves the daemon's second copy thread out would
  flatter it.
- ``store_gbps`` / ``load_gbps``: engine → host and host → engine through a real kvtierd,
  page-layer chunks of 128 KiB, at least 256 MiB per measurement, measured from the
  request until the completion block says the last layer landed.
- ``zmq_echo_rtt_us_p50``: a DEALER → ROUTER echo over ipc:// to a uvloop server, sent the
  payload of a 64-key LOOKUP and answering with a reply as large as a LOOKUP's; ``lookup_rtt_us_p50``: a real 64-key LOOKUP.
- ``page_keys_us``: an engine keying a 128K-token prompt (8,192 pages of 16 tokens, from a
  list of ints), against the same keys hashed with hashlib in Python
  (``page_keys_hashlib_us``).

The daemon runs with L3 off (``--hicache-storage-backend none``, not the default ``file``):
this measures the host pool alone, without write-through to disk competing for the copies
(``kvtier bench l3`` measures that tier).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.request_codec import lookup_request
from kvtier.client.page_keys import page_keys
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.bench.scale.baselines import memcpy_gbps
from kvtier.config import ClientConfig, DaemonConfig
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

# 128 KiB per page-layer chunk: 64 tokens x 8 heads x 128 dims x fp16.
GEOMETRY = P.Geometry(num_layers=8, page_size=64, kv_heads=8, head_dim=128, dtype="float16")
REPEATS = 5
COPY_THREADS = DaemonConfig.model_fields["copy_threads"].default
"""The daemon's copy threads (its default), and the memcpy baseline's threads."""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_memcpy(nbytes: int, repeats: int = REPEATS) -> float:
    """Median GB/s of one numpy copy of ``nbytes`` between prefaulted buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return _gbps(nbytes, statistics.median(times))


def measure_echo(endpoint_dir: Path, payload: bytes, n: int) -> float:
    """p50 round trip (µs) of a minimal DEALER → ROUTER echo on uvloop over ipc://."""
    import zmq

    ep = f"ipc://{endpoint_dir}/echo.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.bench.echo_server", ep],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        said = proc.stdout.readline().strip() if proc.stdout is not None else b""
        if said != b"ready":
            raise RuntimeError(f"the echo server did not start: it wrote {said!r}, not b'ready'")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep)
        rtts = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            sock.send(payload)
            if not sock.poll(5000):
                raise RuntimeError("echo server did not answer")
            sock.recv()
            if i >= 100:
                rtts.append(time.perf_counter() - t0)
        sock.close(0)
        ctx.term()
        return statistics.median(rtts) * 1e6
    finally:
        proc.terminate()
        proc.wait(10)


KEYED_TOKENS = 131_072
"""Tokens of the prompt :func:`measure_page_keys` keys (a 128K-token context)."""
KEYED_PAGE_SIZE = 16
"""Its tokens per page (vLLM's default block size): 8,192 keys."""


def hashlib_page_keys(seed: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The page-key chain hashed with hashlib in Python, page by page: the baseline
    :func:`measure_page_keys` holds kvtier's (C) :func:`~kvtier.client.page_keys.page_keys`
    to (the same keys)."""
    pages = np.asarray(tokens, dtype=np.int64)
    n = pages.size // page_size
    raw = pages[: n * page_size].astype("<u4").tobytes()
    step = page_size * 4
    keys: list[bytes] = []
    prev = seed
    for i in range(n):
        h = hashlib.sha256(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys


def measure_page_keys(repeats: int = REPEATS) -> tuple[float, float]:
    """Median µs to key a :data:`KEYED_TOKENS`-token prompt given as a list of ints (as an
    engine's scheduler has it), as shipped (in C) and with hashlib in Python
    (:func:`hashlib_page_keys`), the two alternated in one run."""
    native: list[float] = []
    python: list[float] = []
    for rep in range(repeats):
        tokens = list(range(rep, rep + KEYED_TOKENS))
        for out, keyed in ((native, page_keys), (python, hashlib_page_keys)):
            t0 = time.perf_counter()
            keyed(b"\x00" * 32, tokens, KEYED_PAGE_SIZE)
            out.append(time.perf_counter() - t0)
    return statistics.median(native) * 1e6, statistics.median(python) * 1e6


def run_l2_bench(mib: int = 256, rtt_samples: int = 2000) -> dict:
    """Run the whole L2 benchmark against a daemon it starts; return the results dict."""
    g = GEOMETRY
    pages = max(1, (mib << 20) // g.page_bytes)
    nbytes = pages * g.page_bytes
    pool_bytes = max(3 * nbytes, 1 << 30)
    with tempfile.TemporaryDirectory(prefix="kvb-", dir="/tmp") as tmp:
        rdir = Path(tmp)
        daemon = DaemonProcess(
            rdir,
            [
                "--hicache-size",
                str(pool_bytes),
                "--log-level",
                "warning",
                "--extent-size",
                str(64 << 20),
                "--hicache-storage-backend",
                "none",
                "--copy-threads",
                str(COPY_THREADS),
            ],
        )  # L2 alone
        daemon.start(timeout=120)
        try:
            kv = SharedKVPool(g, pages)
            for t in kv.k + kv.v:
                t.fill_(1.0)
            cfg = ClientConfig(runtime_dir=rdir, request_timeout_s=10, load_timeout_s=60)
            conn = Connection(kv, model_id="bench-l2", config=cfg)
            try:
                page_ids = list(range(pages))
                store_t, load_t = [], []
                for rep in range(REPEATS):
                    toks = np.arange(pages * g.page_size, dtype=np.int64) + rep * 1_000_003
                    keys = conn.page_keys(toks)
                    t0 = time.perf_counter()
                    h = conn.store(keys, page_ids)
                    if h.writing != pages or not h.wait():
                        raise RuntimeError(f"store moved {h.writing}/{pages} pages")
                    store_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    h = conn.load(keys, page_ids)
                    if h.count != pages or not h.wait():
                        raise RuntimeError(f"load moved {h.count}/{pages} pages")
                    load_t.append(time.perf_counter() - t0)
                lookup_keys = keys[:64]
                rtts = []
                for i in range(rtt_samples + 100):
                    t0 = time.perf_counter()
                    r = conn.lookup(lookup_keys)
                    if i >= 100:
                        rtts.append(time.perf_counter() - t0)
                    if r.l2 != len(lookup_keys):
                        raise RuntimeError(
                            f"a lookup of {len(lookup_keys)} stored pages found {r.l2} in L2"
                        )
                lookup_p50 = statistics.median(rtts) * 1e6
                payload = P.encode(lookup_request(1, lookup_keys, True))  # as the client sends it
            finally:
                conn.close()
                kv.close()
            echo_p50 = measure_echo(rdir, payload, rtt_samples)
        finally:
            daemon.discard()  # a benchmark's pool is not kept for a next start
    memcpy = max(measure_memcpy(nbytes), memcpy_gbps(nbytes, COPY_THREADS, REPEATS))
    keys_us, keys_python_us = measure_page_keys()
    store = _gbps(nbytes, statistics.median(store_t))
    load = _gbps(nbytes, statistics.median(load_t))
    return {
        "bytes_per_measurement": nbytes,
        "chunk_bytes": g.chunk_bytes,
        "memcpy_gbps": round(memcpy, 3),
        "memcpy_threads": COPY_THREADS,
        "store_gbps": round(store, 3),
        "load_gbps": round(load, 3),
        "zmq_echo_rtt_us_p50": round(echo_p50, 1),
        "lookup_rtt_us_p50": round(lookup_p50, 1),
        "store_over_memcpy": round(store / memcpy, 3),
        "load_over_memcpy": round(load / memcpy, 3),
        "lookup_over_echo": round(lookup_p50 / echo_p50, 3),
        "page_keys_us": round(keys_us, 1),
        "page_keys_hashlib_us": round(keys_python_us, 1),
        "page_keys_over_hashlib": round(keys_us / keys_python_us, 3),
        "cpu_count": os.cpu_count(),
    }


def print_table(r: dict) -> None:
    """Print the results as a table with the targets."""
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"kvtier bench l2 ({r['bytes_per_measurement'] >> 20} MiB, "
        f"{r['chunk_bytes'] >> 10} KiB chunks)"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_row("memcpy_gbps", f"{r['memcpy_gbps']:.2f}", "1.00", "baseline")
    t.add_row("store_gbps", f"{r['store_gbps']:.2f}", f"{r['store_over_memcpy']:.2f}", ">= 0.80")
    t.add_row("load_gbps", f"{r['load_gbps']:.2f}", f"{r['load_over_memcpy']:.2f}", ">= 0.80")
    t.add_row("zmq_echo_rtt_us_p50", f"{r['zmq_echo_rtt_us_p50']:.1f}", "1.00", "baseline")
    t.add_row(
        "lookup_rtt_us_p50",
        f"{r['lookup_rtt_us_p50']:.1f}",
        f"{r['lookup_over_echo']:.2f}",
        "<= 1.30",
    )
    if "page_keys_us" in r:  # a results file without the keying figures shows the rest
        t.add_row(
            "page_keys_hashlib_us (8,192 keys)",
            f"{r['page_keys_hashlib_us']:.1f}",
            "1.00",
            "baseline",
        )
        t.add_row(
            "page_keys_us (8,192 keys)",
            f"{r['page_keys_us']:.1f}",
            f"{r['page_keys_over_hashlib']:.2f}",
            "",
        )
    Console().print(t)
