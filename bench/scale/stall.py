"""The stall part of ``kvtier bench scale``: what one engine waits while another stores
128K-token contexts into a full pool.

One engine process (a ``latency`` worker of :mod:`kvtier.bench.scale.worker`) LOOKUPs 64
keys over and over, pausing a millisecond between round trips, while this process fills
the pool and then takes turns, :data:`WINDOW_S` each: a window of nothing (the daemon
otherwise idle), then a window of STOREs of ``pages`` fresh pages back to back (each into
the full pool, so each evicts as many pages as it stores). The storing engine's keys are
hashed before any window, as a real engine's are when a request arrives (it looked them up
before its prefill, long before it stores): its STOREs take turns over a few chains, each
evicted again before its next turn, so every STORE is of pages the pool does not hold (the
daemon evicts by ``lru``, which keeps no trace of an evicted key) and a window holds what
storing costs, not the storing engine's hashing on a shared core. A round trip that
overlaps a STORE window (from its first request to its last one's completion) is a busy
sample, the others idle ones: both kinds are taken in the same seconds, so a machine whose
other load comes and goes weighs on both alike. The ratio is the p99 round trip of the busy
samples against the idle ones'. Each STORE's accept time (the request until its reply,
before the copy) is what the daemon's allocation costs the storing engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.bench.scale.baselines import ScaleBenchError, p50
from kvtier.bench.scale.worker import Aggregate, run_workers
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
WINDOW_S = 0.5
"""Each idle window and each STORE window (a STORE window ends with the STORE running at
its end)."""


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
        seconds: idle windows and STORE windows, each kind in all (the worker measures
            twice as long).
        timeout_s: bound on each worker run.

    Raises:
        ScaleBenchError: a STORE moved less than asked, or the worker failed.
    """
    g = geometry
    settings = {
        "runtime_dir": str(daemon.runtime_dir),
        "pages": LOOKUP_KEYS,
        "iters": int(2 * seconds / PAUSE_S) + 1,
        "seconds": 2 * seconds,
        "pause_s": PAUSE_S,
        "geometry": {f: getattr(g, f) for f in g.__struct_fields__},
    }
    fit = pool_bytes // (pages * g.page_bytes)  # chains the pool holds
    with SharedKVPool(g, pages) as kv, Connection(kv, model_id="scale-stall", config=cfg) as conn:
        tokens = pages * g.page_size
        chains = [conn.page_keys(range(c * tokens, (c + 1) * tokens)) for c in range(fit + 3)]
        turn = [0]

        def store() -> float:
            # a chain comes back after fit + 2 others: evicted by then (the pool holds fit)
            keys = chains[turn[0] % len(chains)]
            turn[0] += 1
            t0 = time.perf_counter()
            h = conn.store(keys, list(range(pages)))
            accept = time.perf_counter() - t0
            if h.writing != pages or not h.wait():
                raise ScaleBenchError(f"a STORE into the full pool moved {h.writing}/{pages} pages")
            return accept

        for _ in range(fit + 1):  # the pool is full after
            store()
        accepts: list[float] = []
        lat, at, windows = _alternating(
            root, {**settings, "tag": "stall"}, lambda: accepts.append(store()), timeout_s
        )
    if not accepts:
        raise ScaleBenchError("no STORE ran while the other engine measured")
    idle, busy = _split(lat, at, windows)
    if not idle or not busy:
        raise ScaleBenchError(f"{len(idle)} idle and {len(busy)} busy round trips: too few")
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
        "stall_windows": len(windows),
    }


def _alternating(
    root: Path, settings: dict[str, Any], action: Callable[[], None], timeout_s: float
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """One ``latency`` worker's round trips (µs) and their starts (``time.monotonic``), while
    this thread takes turns: :data:`WINDOW_S` of nothing, then ``action`` repeated for as
    long; returns them with the (start, end) of each ``action`` window."""
    done: list[Aggregate] = []
    failed: list[Exception] = []

    def measure() -> None:
        try:
            done.append(run_workers("latency", 1, settings, root, timeout_s))
        except Exception as err:
            failed.append(err)

    windows: list[tuple[float, float]] = []
    t = threading.Thread(target=measure, name="kvtier-bench-stall")
    t.start()
    try:
        while t.is_alive():
            t.join(WINDOW_S)  # an idle window
            if not t.is_alive():
                break
            start = time.monotonic()
            while time.monotonic() < start + WINDOW_S and t.is_alive():
                action()
            windows.append((start, time.monotonic()))
    finally:
        t.join(timeout_s)
    if failed:
        raise failed[0]
    detail = done[0].details[0] if done else {}
    lat, at = list(detail.get("lat_us", [])), list(detail.get("at", []))
    if not lat or len(at) != len(lat):
        raise ScaleBenchError("the latency worker measured no round trip")
    return lat, at, windows


def _split(
    lat: list[float], at: list[float], windows: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """(idle, busy) round trips: busy those that overlap a STORE window."""
    starts = np.asarray([w[0] for w in windows])
    ends = np.asarray([w[1] for w in windows])
    idle: list[float] = []
    busy: list[float] = []
    for us, t in zip(lat, at, strict=True):
        overlap = bool(((starts < t + us / 1e6) & (ends > t)).any()) if windows else False
        (busy if overlap else idle).append(us)
    return idle, busy
