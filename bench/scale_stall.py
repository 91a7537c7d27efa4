"""The stall part of ``kvtier bench scale``: what one engine waits while another stores
128K-token contexts into a full pool.

One engine process (a ``latency`` worker of :mod:`kvtier.bench.scale_worker`) LOOKUPs 64
keys over and over, pausing a millisecond between round trips, twice: while the daemon is
otherwise idle (the baseline), then while this process stores chains of ``pages`` fresh
pages back to back into the full pool, so that every STORE evicts as many pages as it
stores. The daemon allocates (and later commits) a STORE's pages on its event loop, so the
other engine's LOOKUPs wait behind that work: the ratio is the p99 round trip during the
stores against the idle one. Each STORE's accept time (the request until its reply, before
the copy) is that work as the storing engine sees it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.bench.scale_baselines import ScaleBenchError, p50
from kvtier.bench.scale_worker import Aggregate, run_workers
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["run_stall"]

LOOKUP_KEYS = 64
"""Keys of the other engine's LOOKUPs."""
PAUSE_S = 0.001
"""Its pause between round trips."""


def run_stall(
    daemon: DaemonProcess,
    root: Path,
    cfg: ClientConfig,
    geometry: P.Geometry,
    pages: int,
    pool_bytes: int,
    seconds: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Measure the other engine's LOOKUPs idle and during back-to-back STOREs of ``pages``.

    Args:
        daemon: the running daemon (its pool of ``pool_bytes`` bytes; filled here first).
        root: where the worker's log goes.
        cfg: this process's client settings for ``daemon``.
        geometry: the engines' page geometry.
        pages: pages of each STORE (one chain).
        pool_bytes: the daemon's pool size, to know how many STOREs fill it.
        seconds: each of the two measuring spans.
        timeout_s: bound on each worker run.

    Raises:
        ScaleBenchError: a STORE moved less than asked, or the worker failed.
    """
    g = geometry
    settings = {
        "runtime_dir": str(daemon.runtime_dir),
        "pages": LOOKUP_KEYS,
        "iters": int(seconds / PAUSE_S) + 1,
        "seconds": seconds,
        "pause_s": PAUSE_S,
        "geometry": {f: getattr(g, f) for f in g.__struct_fields__},
    }
    with SharedKVPool(g, pages) as kv, Connection(kv, model_id="scale-stall", config=cfg) as conn:
        chains = [0]

        def store() -> float:
            first = chains[0] * pages * g.page_size
            chains[0] += 1
            keys = conn.page_keys(range(first, first + pages * g.page_size))
            t0 = time.perf_counter()
            h = conn.store(keys, list(range(pages)))
            accept = time.perf_counter() - t0
            if h.writing != pages or not h.wait():
                raise ScaleBenchError(f"a STORE into the full pool moved {h.writing}/{pages} pages")
            return accept

        for _ in range(pool_bytes // (pages * g.page_bytes) + 1):  # the pool is full after
            store()
        idle = _lookups(root, {**settings, "tag": "stall-idle"}, None, timeout_s)
        accepts: list[float] = []
        busy = _lookups(
            root, {**settings, "tag": "stall-busy"}, lambda: accepts.append(store()), timeout_s
        )
    if not accepts:
        raise ScaleBenchError("no STORE ran while the other engine measured")
    p99_idle, p99_busy = np.percentile(idle, 99), np.percentile(busy, 99)
    return {
        "stall_store_pages": pages,
        "stall_stores": len(accepts),
        "stall_store_accept_ms_p50": round(p50(accepts) * 1e3, 2),
        "stall_lookup_idle_us_p50": round(float(np.median(idle)), 1),
        "stall_lookup_idle_us_p99": round(float(p99_idle), 1),
        "stall_lookup_busy_us_p50": round(float(np.median(busy)), 1),
        "stall_lookup_busy_us_p99": round(float(p99_busy), 1),
        "stall_lookup_busy_us_max": round(float(max(busy)), 1),
        "stall_lookup_p99_over_idle": round(float(p99_busy / p99_idle), 3),
    }


def _lookups(
    root: Path, settings: dict[str, Any], action: Callable[[], None] | None, timeout_s: float
) -> list[float]:
    """One ``latency`` worker's round trips (µs), ``action`` repeated meanwhile if given."""
    done: list[Aggregate] = []
    failed: list[Exception] = []

    def measure() -> None:
        try:
            done.append(run_workers("latency", 1, settings, root, timeout_s))
        except Exception as err:
            failed.append(err)

    t = threading.Thread(target=measure, name="kvtier-bench-stall")
    t.start()
    try:
        while t.is_alive():
            if action is None:
                t.join(0.1)
            else:
                action()
    finally:
        t.join(timeout_s)
    if failed:
        raise failed[0]
    lat = list(done[0].details[0]["lat_us"]) if done else []
    if not lat:
        raise ScaleBenchError("the latency worker measured no round trip")
    return lat
