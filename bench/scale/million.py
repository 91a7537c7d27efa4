"""The million-page part of ``kvtier bench scale``: an index of ``pages`` small pages.

One private kvtierd (L3 off) gets a host pool sized to hold exactly ``pages`` pages of
:data:`GEOMETRY` (4 KiB: a pool without an L3 backend aligns every slot to 4 KiB, so a
smaller page would cost the same pool bytes). One engine then:

1. stores one batch and times 64-key LOOKUPs at random places in it: the small pool's p50,
   the baseline;
2. fills the pool to ``pages`` (the store rate: pages/s, timing the requests only, not
   the hashing of keys) and times the same LOOKUPs at random places in the whole pool;
3. reads the daemon's resident memory beyond shared memory (``VmRSS - RssShmem``: not
   the pool, not the engines' mapped KV pools) before and after the fill;
4. unregisters, SIGKILLs the daemon, starts a new one on the same runtime directory and
   times until HEALTH answers and a new connection finds every page (adoption). Both
   daemons read kvtier's bytecode from a private cache the first one wrote, as an installed
   kvtier does (see :mod:`kvtier.bench.restart`);
5. stores fresh pages into the full pool, a tenth of ``pages`` beyond its capacity (the
   eviction rate: pages evicted per second of the stores that evicted, from the daemon's
   ``evictions`` counter).

Run alone (the million-page part of ``kvtier bench scale`` only)::

    python -m kvtier.bench.scale.million [--pages N] [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench import write_json
from kvtier.bench.scale.baselines import ScaleBenchError, memory_status, p50
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig, DaemonConfig
from kvtier.config.loader import load_config
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["GEOMETRY", "LOOKUP_KEYS", "main", "run_million"]

GEOMETRY = P.Geometry(num_layers=1, page_size=16, kv_heads=1, head_dim=64, dtype="float16")
"""4 KiB pages: 1 layer x K,V x 16 tokens x 1 head x 64 dims x fp16."""
SLOT_ALIGN = 4096
"""Slot alignment of a pool without L3 headroom (see :class:`~kvtier.daemon.pool.layout.PoolLayout`)."""
LOOKUP_KEYS = 64
"""Keys per timed LOOKUP."""
MODEL = "scale-million"


STRIDE = -(-GEOMETRY.page_bytes // SLOT_ALIGN) * SLOT_ALIGN
"""Pool bytes one page takes."""


def pool_geometry(pages: int) -> tuple[int, int]:
    """``(hicache_size, extent_size)`` of a pool that holds at least ``pages`` pages."""
    stride = STRIDE
    extent = (32 << 20) if pages * stride >= (256 << 20) else (4 << 20)
    per_extent = extent // stride
    return -(-pages // per_extent) * extent, extent


def run_million(
    root: Path, pages: int, batch: int, samples: int, copy_threads: int, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Fill a pool with ``pages`` pages and measure lookup, store, eviction and adoption.

    Args:
        root: a short private directory (the daemon's runtime and state directories).
        pages: pages the fill stores (rounded up to whole batches); the pool holds them.
        batch: pages per STORE (and the engine's KV pool size).
        samples: timed LOOKUPs per p50.
        copy_threads: the daemon's ``--copy-threads``.
        timeout_s: bound on each daemon start.

    Returns:
        The ``million_*`` fields of the results (see :mod:`kvtier.bench.scale`).

    Raises:
        ScaleBenchError: a store fell short or the restarted daemon lost pages.
    """
    if pages < 2 * batch:
        raise ScaleBenchError(f"million pages ({pages}) must be at least twice the batch ({batch})")
    n_chains = -(-pages // batch)  # whole batches: at least ``pages`` pages are stored
    size, extent = pool_geometry(n_chains * batch)
    rdir = root / "million"
    flags = [
        "--hicache-size",
        str(size),
        "--extent-size",
        str(extent),
        "--log-level",
        "warning",
        "--hicache-storage-backend",
        "none",
        "--copy-threads",
        str(copy_threads),
    ]
    cfg = ClientConfig(runtime_dir=rdir, request_timeout_s=60, load_timeout_s=60)
    rng = random.Random(7)
    out: dict[str, Any] = {
        "million_pages": pages,
        "million_page_bytes": GEOMETRY.page_bytes,
        "million_pool_bytes": size,
        "million_eviction_policy": load_config(DaemonConfig).eviction_policy,
    }
    # an installed kvtier reads cached bytecode (pip compiles it): the first daemon writes it
    # to a private cache the restarted one reads, as `kvtier bench restart` does
    cached = {"PYTHONPYCACHEPREFIX": str(root / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
    first, second = DaemonProcess(rdir, flags, env=cached), DaemonProcess(rdir, flags, env=cached)
    try:
        t0 = time.perf_counter()
        first.start(timeout=timeout_s)
        out["million_start_seconds"] = round(time.perf_counter() - t0, 3)
        with SharedKVPool(GEOMETRY, batch) as kv:
            with Connection(kv, model_id=MODEL, config=cfg) as conn:
                empty = memory_status(first.pid)
                chains = [_store(conn, i, batch)[0] for i in range(1)]
                small = _lookup_p50(conn, chains, samples, rng)
                busy = 0.0
                for i in range(1, n_chains):
                    keys, seconds = _store(conn, i, batch)
                    chains.append(keys)
                    busy += seconds
                stored = len(chains) * batch
                big = _lookup_p50(conn, chains, samples, rng)
                full = memory_status(first.pid)
            first.kill()  # SIGKILL: no chance to save anything
            t0 = time.perf_counter()
            second.start(timeout=timeout_s)
            healthy = time.perf_counter() - t0
            with Connection(kv, model_id=MODEL, config=cfg) as conn:
                t1 = time.perf_counter()
                found = sum(conn.lookup(keys).l2 for keys in chains)
                adopt_s = time.perf_counter() - t0
                find_s = time.perf_counter() - t1
                adopted = memory_status(second.pid)
                stats = conn.stats()
                evicted, evict_busy = _overflow(
                    conn, len(chains), batch, size // STRIDE - stored + pages // 10
                )
    finally:
        second.stop()
        first.kill()
        first.remove_pool()
    if found != stored:
        raise ScaleBenchError(f"the restarted daemon found {found} of {stored} pages")
    beyond = [m["rss"] - m["shmem"] for m in (empty, full, adopted)]
    adopt = stats.get("adopt", {})
    out.update(
        {
            "million_pages_stored": stored,
            "million_store_pages_per_s": round((stored - batch) / max(busy, 1e-9)),
            "million_small_lookup_p50_us": round(small * 1e6, 1),
            "million_lookup_p50_us": round(big * 1e6, 1),
            "million_lookup_p50_over_small": round(big / small, 3),
            "million_restart_to_healthy_seconds": round(healthy, 3),
            "million_adopt_seconds": round(adopt_s, 3),
            "million_find_all_seconds": round(find_s, 6),  # small runs take well under 1 ms
            "million_daemon_adopt_seconds": round(float(adopt.get("seconds", 0.0)), 4)
            if isinstance(adopt, dict)
            else 0.0,
            "million_pages_found_after_restart": found,
            "million_evicted_pages": evicted,
            "million_evict_pages_per_s": round(evicted / max(evict_busy, 1e-9)),
            "million_rss_beyond_pool_empty_bytes": beyond[0],
            "million_rss_beyond_pool_bytes": beyond[1],
            "million_rss_beyond_pool_adopted_bytes": beyond[2],
            "million_rss_per_page_bytes": round((beyond[1] - beyond[0]) / stored, 1),
        }
    )
    if evicted <= 0:
        raise ScaleBenchError("storing into the full pool evicted nothing")
    return out


def _store(conn: Connection, chain: int, batch: int) -> tuple[list[bytes], float]:
    """Store chain number ``chain`` (``batch`` fresh pages); return its keys and the seconds
    the request took (hashing the keys is not timed)."""
    ps = GEOMETRY.page_size
    keys = conn.page_keys(range(chain * batch * ps, (chain + 1) * batch * ps))
    t0 = time.perf_counter()
    h = conn.store(keys, list(range(batch)))
    if h.writing != batch or not h.wait():
        raise ScaleBenchError(f"store of chain {chain} moved {h.writing}/{batch} pages")
    return keys, time.perf_counter() - t0


def _overflow(conn: Connection, first_chain: int, batch: int, extra: int) -> tuple[int, float]:
    """Store ``extra`` more pages (whole batches) into a filled pool; return the pages
    evicted and the seconds of the stores that evicted (those into free slots left over
    from the last extent, or under the eviction watermark, do not count)."""
    evicted, busy = 0, 0.0
    before = _evictions(conn)
    for i in range(first_chain, first_chain + max(1, -(-extra // batch))):
        seconds = _store(conn, i, batch)[1]
        now = _evictions(conn)
        if now > before:
            evicted, busy, before = evicted + now - before, busy + seconds, now
    return evicted, busy


def _lookup_p50(
    conn: Connection, chains: list[list[bytes]], samples: int, rng: random.Random
) -> float:
    """p50 seconds of a LOOKUP of :data:`LOOKUP_KEYS` keys at random places in ``chains``."""
    batch = len(chains[0])
    windows = [
        chains[rng.randrange(len(chains))][s : s + LOOKUP_KEYS]
        for s in (rng.randrange(batch - LOOKUP_KEYS + 1) for _ in range(samples + 20))
    ]
    rtts = []
    for i, keys in enumerate(windows):
        t0 = time.perf_counter()
        hit = conn.lookup(keys).l2
        if i >= 20:
            rtts.append(time.perf_counter() - t0)
        if hit != LOOKUP_KEYS:
            raise ScaleBenchError(f"a lookup of stored pages found {hit}/{LOOKUP_KEYS}")
    return p50(rtts)


def _evictions(conn: Connection) -> int:
    pool = conn.stats().get("pool")
    if not isinstance(pool, dict):
        raise ScaleBenchError(f"STATS has no pool section (got {type(pool).__name__})")
    return int(pool["evictions"])


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.scale.million [--pages N] [--json PATH]``: print the results."""
    p = argparse.ArgumentParser(
        prog="python -m kvtier.bench.scale.million",
        description="the million-page part of kvtier bench scale",
    )
    p.add_argument("--pages", type=int, default=1_000_000, help="pages (default 1,000,000)")
    p.add_argument("--batch", type=int, default=1024, help="pages per STORE (default 1024)")
    p.add_argument("--samples", type=int, default=500, help="timed LOOKUPs per p50 (default 500)")
    p.add_argument("--copy-threads", type=int, default=2, help="the daemon's copy threads")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvm-", dir="/tmp") as tmp:
        out = run_million(Path(tmp), args.pages, args.batch, args.samples, args.copy_threads)
    for name, value in out.items():
        print(f"{name:44} {value}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
