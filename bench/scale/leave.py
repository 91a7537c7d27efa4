"""The leave part of ``kvtier bench scale``: what one engine waits while another leaves.

An engine's memory is mapped by the daemon, its page tables built (the prefault, and every
copy), and unmapped when its session ends. This part registers an engine of ``nbytes`` of
KV memory from this process and stores every page of it, so the daemon's page tables cover
it all. One engine process (a ``latency`` worker of :mod:`kvtier.bench.scale.worker`)
LOOKUPs 64 keys over and over, pausing a millisecond between round trips; about halfway
through (the daemon's LOOKUP count tells), this process UNREGISTERs the big engine. The figures: the worst round trip that starts in
the :data:`AFTER_S` after the UNREGISTER, against the p99 of those before it, and the
UNREGISTER's own round trip. The leaving engine keeps its memory mapped until the worker is
done, so its own unmap does not compete for the cores.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.bench.scale.baselines import ScaleBenchError
from kvtier.bench.scale.stall import LOOKUP_KEYS, PAUSE_S
from kvtier.bench.scale.worker import run_workers
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["run_leave"]

ROUND_TRIP_S = 0.0013
"""About one round trip of the other engine (64 keys, :data:`~kvtier.bench.scale.stall.PAUSE_S`
after it): how many it has made tells how long it has measured."""
AFTER_S = 1.0
"""How long after the UNREGISTER a round trip counts as 'after'."""
BATCH = 4096
"""Pages per STORE while the big engine fills its memory."""


def run_leave(
    daemon: DaemonProcess,
    root: Path,
    cfg: ClientConfig,
    geometry: P.Geometry,
    nbytes: int,
    seconds: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Measure another engine's LOOKUPs before and after an engine of ``nbytes`` leaves.

    Args:
        daemon: the running daemon.
        root: where the worker's log goes.
        cfg: this process's client settings for ``daemon``.
        geometry: the engines' page geometry.
        nbytes: the leaving engine's KV memory (whole pages of ``geometry``).
        seconds: how long the other engine measures; the engine leaves halfway.
        timeout_s: bound on the worker run.

    Raises:
        ScaleBenchError: a STORE moved less than asked, or too few round trips were taken.
    """
    g = geometry
    pages = max(1, nbytes // g.page_bytes)
    settings = {
        "runtime_dir": str(daemon.runtime_dir),
        "tag": "leave",
        "pages": LOOKUP_KEYS,
        "iters": int(seconds / PAUSE_S) + 1,
        "seconds": seconds,
        "pause_s": PAUSE_S,
        "geometry": {f: getattr(g, f) for f in g.__struct_fields__},
    }
    with SharedKVPool(g, pages) as kv:
        conn = Connection(kv, model_id="scale-leave", config=cfg)
        try:
            for first in range(0, pages, BATCH):
                n = min(BATCH, pages - first)
                keys = conn.page_keys(range(first * g.page_size, (first + n) * g.page_size))
                h = conn.store(keys, list(range(first, first + n)))
                if h.writing != n or not h.wait():
                    raise ScaleBenchError(f"the leaving engine's STORE moved {h.writing}/{n}")
            done: list[Any] = []
            worker = threading.Thread(
                target=lambda: done.append(run_workers("latency", 1, settings, root, timeout_s)),
                name="kvtier-bench-leave",
            )
            with AdminClient(daemon.endpoint) as admin:
                start = _lookups(admin)
                worker.start()
                # the worker registers and stores before it measures: leave once it has
                # measured for about half its time
                want = start + int(seconds / 2 / ROUND_TRIP_S)
                deadline = time.monotonic() + timeout_s
                while _lookups(admin) < want and worker.is_alive():
                    if time.monotonic() > deadline:
                        raise ScaleBenchError("the latency worker never got going")
                    time.sleep(0.01)
            left = time.monotonic()
            conn.close()  # UNREGISTER
            unregister = time.monotonic() - left
            worker.join(timeout_s)
        finally:
            conn.close()
    if not done:
        raise ScaleBenchError("the latency worker measured nothing")
    detail = done[0].details[0]
    lat, at = np.asarray(detail["lat_us"]), np.asarray(detail["at"])
    before = lat[at < left]
    after = lat[(at >= left) & (at < left + AFTER_S)]
    if len(before) < 100 or len(after) < 10:
        raise ScaleBenchError(f"{len(before)} round trips before and {len(after)} after: too few")
    p99 = float(np.percentile(before, 99))
    worst = float(after.max())
    return {
        "leave_engine_bytes": pages * g.page_bytes,
        "leave_unregister_ms": round(unregister * 1e3, 2),
        "leave_lookup_p99_before_us": round(p99, 1),
        "leave_lookup_max_after_us": round(worst, 1),
        "leave_lookup_max_after_over_p99_before": round(worst / p99, 3),
    }


def _lookups(admin: AdminClient) -> int:
    """The LOOKUPs the daemon has answered (its STATS counters)."""
    counters = admin.stats()["counters"]
    if not isinstance(counters, dict):
        raise ScaleBenchError(f"STATS counters are not a dict: {counters!r}")
    return int(counters["lookups"])
