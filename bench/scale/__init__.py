"""``kvtier bench scale``: eight engines, 128K-token contexts, a million pages.

Every figure is set against a baseline measured in the same run on the same machine, and
reported as a ratio (absolute figures on a shared machine are noise). A memcpy baseline is
measured right before and right after the kvtier figure it divides, and the faster of the
two is kept: a baseline caught in a busy moment of the machine never flatters kvtier. One
private kvtierd
(L3 off: the host pool alone; private runtime and state directories) serves:

- **transfer sizes** as engines issue them (1, 8, 64, 512 pages, one engine): STORE and
  LOAD latency p50 and GB/s per size. The fixed cost of a transfer is the 1-page LOAD's
  latency (``transfer_intercept_us`` is the line through all sizes extrapolated to 0 pages,
  for reference: it may come out negative on a noisy machine), set against a 1-key
  LOOKUP's round trip (``transfer_fixed_cost_over_lookup_rtt``);
  the 64-page LOAD's GB/s against memcpy (``transfer_64_over_memcpy``).
- **N engines** (1, 2, 4, 8 engine processes, :mod:`kvtier.bench.scale.worker`) storing
  fresh pages and loading them back in 64-page requests: aggregate GB/s against a memcpy
  of the same bytes by as many threads as the daemon copies with (``--copy-threads``):
  ``l2_aggregate_over_memcpy`` per N, and ``l2_aggregate_over_memcpy_8``. The daemon's CPU
  time (``/proc/<pid>/stat`` utime + stime) from each run's start to its last result,
  per GB moved, is ``daemon_cpu_s_per_gb``; over the whole part, the engines' sessions
  (REGISTER, first mapping, close) included, ``daemon_cpu_s_per_gb_with_sessions``. Per N, ``l2_cpu_s_per_gb`` splits the CPU time per GB into the
  daemon's and the engines' own (``time.process_time`` in each worker), and
  ``l2_cpu_bound_gbps`` is what all ``cpu_count`` CPUs doing nothing else could move at that
  cost: the ceiling when the engines and the daemon share few cores (the memcpy baseline
  has the CPUs to itself); ``l2_aggregate_over_cpu_bound_8`` is how close the largest N
  comes to it (1: the CPUs never idle). ``daemon_cpu_s_per_gb_over_memcpy`` sets the
  daemon's CPU per GB against a plain copy's between the same kinds of memory (shared
  memory and a memfd, both ways, as many threads: ``memcpy_cpu_s_per_gb``).
- **control plane**: 64-key LOOKUPs/s from 8 engine processes against a bare ZeroMQ ROUTER
  echo server (:mod:`kvtier.bench.echo_server`) sent the same payload by 8 clients, each
  answered with a reply as large as a LOOKUP's (``lookup_throughput_over_echo_8``: above 1
  is faster than the echo).
- **long contexts** (128K tokens: 8,192 pages): a LOOKUP of 8,192 keys against an echo sent
  the same payload and answering as a LOOKUP does (``lookup_8192_over_echo``: a latency ratio, 1 is the echo's); a LOAD of
  8,192 pages against memcpy of the same bytes (``load_8192_over_memcpy``).
- **stall**: another engine's 64-key LOOKUP p99 while this one stores 8,192-page chains
  into the full pool, against the same engine's p99 with the daemon idle
  (``stall_lookup_p99_over_idle``; :mod:`kvtier.bench.scale.stall`).
- **leave**: another engine's worst 64-key LOOKUP in the second after an engine of 2 GiB of
  KV memory, every page of it stored, UNREGISTERs, against its p99 before
  (``leave_lookup_max_after_over_p99_before``; :mod:`kvtier.bench.scale.leave`).
- **a million pages** in a second daemon (:mod:`kvtier.bench.scale.million`).

``--quick`` runs tiny sizes (N up to 2, a small "million" pool) in seconds; the field
names stay the same and ``lookup_clients``, ``long_context_pages`` and ``million_pages``
say what was run. ``--only PART,...`` runs some of the parts (:data:`PARTS`), e.g.
``--only stall`` (under a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.bench import write_json
from kvtier.bench.scale.baselines import (
    EchoServer,
    ScaleBenchError,
    cpu_seconds,
    echo_rtts,
    gbps,
    memcpy_cpu_s_per_gb,
    memcpy_gbps,
    p50,
)
from kvtier.bench.scale.leave import run_leave
from kvtier.bench.scale.million import run_million
from kvtier.bench.scale.report import plot, print_table
from kvtier.bench.scale.stall import run_stall
from kvtier.bench.scale.worker import run_workers
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.request_codec import lookup_request
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import MAX_KEYS
from kvtier.launch.daemon_process import DaemonProcess

__all__ = [
    "GEOMETRY",
    "ScaleSettings",
    "add_arguments",
    "main",
    "plot",
    "print_table",
    "run_from_args",
    "run_scale_bench",
]

GEOMETRY = P.Geometry(num_layers=2, page_size=16, kv_heads=8, head_dim=64, dtype="float16")
"""64 KiB pages of 16 KiB chunks: 2 layers x K,V x 16 tokens x 8 heads x 64 dims x fp16."""
SIZES = (1, 8, 64, 512)
"""Pages per transfer, as engines issue them."""
REQUEST_PAGES = 64
"""Pages per request of the N-engine and control-plane runs."""
PARTS = ("sizes", "engines", "control", "long", "stall", "leave", "million")
"""The bench's parts, in the order they run (``--only`` picks some)."""


@dataclass(frozen=True, slots=True)
class ScaleSettings:
    """How much the bench does (:meth:`full` or :meth:`quick`; every loop is bounded by these).

    Attributes:
        engines: engine counts of the N-engine run.
        engine_iters: STORE + LOAD pairs per engine per run.
        size_repeats: timed transfers per size; ``small_repeats`` for sizes of at most
            8 pages (their p50s make the fixed cost: a few microseconds of noise in 20
            samples moved it by a third between runs).
        lookup_clients: engines (and echo clients) of the control-plane run.
        lookup_iters: LOOKUPs (and echoes) per client.
        rtt_samples: timed round trips per latency p50.
        long_pages: pages of the long context (8,192: 128K tokens of 16-token pages).
        long_repeats: timed LOADs of the long context.
        stall_seconds: each span of the stall part (the other engine idle, then during
            back-to-back STOREs of ``long_pages`` into the full pool; see :mod:`kvtier.bench.scale.stall`).
        leave_bytes / leave_seconds: the KV memory of the engine that leaves, and how long
            the other engine measures (see :mod:`kvtier.bench.scale.leave`).
        million_pages / million_batch / million_samples: see :func:`run_million`.
        pool_bytes / extent_bytes: the main daemon's host pool.
        copy_threads: the daemons' ``--copy-threads`` (and the memcpy baselines' threads).
        timeout_s: bound on each daemon start and each multi-process run.
        parts: which of :data:`PARTS` run (all of them by default).
    """

    engines: tuple[int, ...] = (1, 2, 4, 8)
    engine_iters: int = 96
    size_repeats: int = 20
    small_repeats: int = 200
    lookup_clients: int = 8
    lookup_iters: int = 2000
    rtt_samples: int = 1000
    long_pages: int = 8192
    long_repeats: int = 5
    stall_seconds: float = 5.0
    leave_bytes: int = 2 << 30
    leave_seconds: float = 3.0
    million_pages: int = 1_000_000
    million_batch: int = 1024
    million_samples: int = 500
    pool_bytes: int = 1 << 30
    extent_bytes: int = 32 << 20
    copy_threads: int = 2
    timeout_s: float = 300.0
    parts: tuple[str, ...] = PARTS

    @classmethod
    def full(cls, **overrides: Any) -> ScaleSettings:
        """The full run (minutes)."""
        return cls(**overrides)

    @classmethod
    def quick(cls, **overrides: Any) -> ScaleSettings:
        """Tiny sizes (seconds): for tests and a first look."""
        small: dict[str, Any] = {
            "engines": (1, 2),
            "engine_iters": 3,
            "size_repeats": 3,
            "small_repeats": 3,
            "lookup_clients": 2,
            "lookup_iters": 100,
            "rtt_samples": 50,
            "long_pages": 256,
            "long_repeats": 2,
            "stall_seconds": 1.0,
            "leave_bytes": 64 << 20,
            "leave_seconds": 1.0,
            "million_pages": 4096,
            "million_batch": 512,
            "million_samples": 30,
            "pool_bytes": 128 << 20,
            "extent_bytes": 4 << 20,
            "timeout_s": 120.0,
        }
        return cls(**{**small, **overrides})


def run_scale_bench(settings: ScaleSettings) -> dict[str, Any]:
    """Run every part against daemons it starts; return the results dict.

    Raises:
        ScaleBenchError: a part could not be measured (a worker died, a transfer fell short).
        DaemonStartError: a daemon did not start.
    """
    s = settings
    if s.long_pages > MAX_KEYS:
        raise ScaleBenchError(f"long_pages must be at most {MAX_KEYS}")
    out: dict[str, Any] = {
        "page_bytes": GEOMETRY.page_bytes,
        "chunk_bytes": GEOMETRY.chunk_bytes,
        "copy_threads": s.copy_threads,
        "cpu_count": os.cpu_count(),
        "engines": list(s.engines),
        "lookup_clients": s.lookup_clients,
        "long_context_pages": s.long_pages,
    }
    with tempfile.TemporaryDirectory(prefix="kvs-", dir="/tmp") as tmp:
        root = Path(tmp)
        flags = [
            "--hicache-size",
            str(s.pool_bytes),
            "--extent-size",
            str(s.extent_bytes),
            "--log-level",
            "warning",
            "--copy-threads",
            str(s.copy_threads),
            "--hicache-storage-backend",
            "none",
            # its engines store fresh pages and load them at once, to measure the copy path:
            # under recency a page just stored is never the first victim of a full pool (the
            # million part measures eviction under the daemon's own policy)
            "--eviction-policy",
            "lru",
        ]  # the host pool alone
        daemon = DaemonProcess(root / "main", flags)
        daemon.start(timeout=s.timeout_s)
        try:
            cfg = ClientConfig(
                runtime_dir=daemon.runtime_dir, request_timeout_s=60, load_timeout_s=60
            )
            if "sizes" in s.parts:
                out.update(_transfer_sizes(cfg, s))
            if "engines" in s.parts:
                out.update(_engines(daemon, root, s))
            if "control" in s.parts or "long" in s.parts:
                with EchoServer(root) as echo:
                    if "control" in s.parts:
                        out.update(_control_plane(daemon, echo.endpoint, root, s))
                    if "long" in s.parts:
                        out.update(_long_context(cfg, echo.endpoint, s))
            if "stall" in s.parts:
                out.update(
                    run_stall(
                        daemon,
                        root,
                        cfg,
                        GEOMETRY,
                        s.long_pages,
                        s.pool_bytes,
                        s.stall_seconds,
                        s.timeout_s,
                    )
                )
            if "leave" in s.parts:
                out.update(
                    run_leave(
                        daemon, root, cfg, GEOMETRY, s.leave_bytes, s.leave_seconds, s.timeout_s
                    )
                )
        finally:
            daemon.discard()  # a benchmark's pool is not kept for a next start
        if "million" in s.parts:
            out.update(
                run_million(
                    root,
                    s.million_pages,
                    s.million_batch,
                    s.million_samples,
                    s.copy_threads,
                    timeout_s=max(s.timeout_s, 600.0),
                )
            )
    return out


def _transfer_sizes(cfg: ClientConfig, s: ScaleSettings) -> dict[str, Any]:
    """STORE and LOAD latency per size, one engine; the 1-key and 64-key LOOKUP round trips."""
    g, top = GEOMETRY, max(SIZES)
    store: dict[str, float] = {}
    load: dict[str, float] = {}
    memcpy_before = memcpy_gbps(64 * g.page_bytes * 16, s.copy_threads)
    with SharedKVPool(g, 2 * top) as kv, Connection(kv, model_id="scale-sizes", config=cfg) as conn:
        first = 0
        for size in SIZES:
            st, ld = [], []
            for _ in range(
                (s.small_repeats if size <= 8 else s.size_repeats) + 1
            ):  # the first warms up
                keys = conn.page_keys(range(first * g.page_size, (first + size) * g.page_size))
                first += size
                t0 = time.perf_counter()
                h = conn.store(keys, list(range(size)))
                if h.writing != size or not h.wait():
                    raise ScaleBenchError(f"store of {size} pages moved {h.writing}")
                t1 = time.perf_counter()
                h = conn.load(keys, list(range(top, top + size)))
                if h.count != size or not h.wait():
                    raise ScaleBenchError(f"load of {size} pages moved {h.count}")
                st.append(t1 - t0)
                ld.append(time.perf_counter() - t1)
            store[str(size)], load[str(size)] = p50(st[1:]), p50(ld[1:])
        rtt1 = p50(_lookup_rtts(conn, keys[:1], s.rtt_samples))
        rtt64 = p50(_lookup_rtts(conn, keys[:64], s.rtt_samples))
    memcpy = max(memcpy_before, memcpy_gbps(64 * g.page_bytes * 16, s.copy_threads))
    load_gbps = {k: gbps(int(k) * g.page_bytes, v) for k, v in load.items()}
    return {
        "transfer_store_us_p50": {k: round(v * 1e6, 1) for k, v in store.items()},
        "transfer_load_us_p50": {k: round(v * 1e6, 1) for k, v in load.items()},
        "transfer_store_gbps": {
            k: round(gbps(int(k) * g.page_bytes, v), 3) for k, v in store.items()
        },
        "transfer_load_gbps": {k: round(v, 3) for k, v in load_gbps.items()},
        "transfer_memcpy_gbps": round(memcpy, 3),
        "transfer_fixed_cost_us": round(load["1"] * 1e6, 1),
        "transfer_intercept_us": round(_intercept(load) * 1e6, 1),
        "lookup_rtt_us_p50": round(rtt1 * 1e6, 1),
        "lookup_64_rtt_us_p50": round(rtt64 * 1e6, 1),
        "transfer_fixed_cost_over_lookup_rtt": round(load["1"] / rtt1, 3),
        "transfer_64_over_memcpy": round(load_gbps["64"] / memcpy, 3),
    }


def _intercept(latency: dict[str, float]) -> float:
    """Latency extrapolated to 0 pages: the least-squares line through (pages, seconds)."""
    xs = [float(k) for k in latency]
    _slope, intercept = np.polyfit(xs, list(latency.values()), 1)
    return float(intercept)


def _lookup_rtts(conn: Connection, keys: list[bytes], n: int) -> list[float]:
    rtts = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        hit = conn.lookup(keys).l2
        if i >= 20:
            rtts.append(time.perf_counter() - t0)
        if hit != len(keys):
            raise ScaleBenchError(f"a lookup of stored pages found {hit}/{len(keys)}")
    return rtts


def _engines(daemon: DaemonProcess, root: Path, s: ScaleSettings) -> dict[str, Any]:
    """N engine processes storing and loading at once; the daemon's CPU per GB moved.

    The daemon's CPU is read from ``go`` to the last result of each N (its timed
    operations alone: ``daemon_cpu_s_per_gb``), and over the whole part, the engines'
    sessions opened, mapped and closed included (``daemon_cpu_s_per_gb_with_sessions``).
    """
    agg: dict[str, float] = {}
    memcpy: dict[str, float] = {}
    split: dict[str, dict[str, float]] = {}
    bound: dict[str, float] = {}
    cpu0, moved, cpu = cpu_seconds(daemon.pid), 0, 0.0
    sample = 2 * s.engine_iters * REQUEST_PAGES * GEOMETRY.page_bytes
    copy_cpu = memcpy_cpu_s_per_gb(sample, s.copy_threads)
    for n in s.engines:
        copy_before = memcpy_gbps(
            n * 2 * s.engine_iters * REQUEST_PAGES * GEOMETRY.page_bytes, s.copy_threads
        )
        a = run_workers(
            "transfer",
            n,
            _settings(daemon, f"n{n}", s.engine_iters),
            root,
            s.timeout_s,
            watch_pid=daemon.pid,
        )
        gb = a.nbytes / 1e9
        split[str(n)] = {
            "daemon": round(a.watched_cpu_seconds / gb, 4),
            "engines": round(a.cpu_seconds / gb, 4),
        }
        per_gb = split[str(n)]["daemon"] + split[str(n)]["engines"]
        bound[str(n)] = round((os.cpu_count() or 1) / per_gb, 3) if per_gb > 0 else 0.0
        moved += a.nbytes
        cpu += a.watched_cpu_seconds
        agg[str(n)] = a.gbps
        memcpy[str(n)] = max(copy_before, memcpy_gbps(a.nbytes, s.copy_threads))
    whole = cpu_seconds(daemon.pid) - cpu0
    copy_cpu = min(copy_cpu, memcpy_cpu_s_per_gb(sample, s.copy_threads))  # the cheaper one
    ratios = {k: round(agg[k] / memcpy[k], 3) for k in agg}
    top = str(max(s.engines))
    # below one clock tick the reading is the resolution, not zero
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    per_gb = max(cpu, tick) / (moved / 1e9)
    with_sessions = max(whole, tick) / (moved / 1e9)
    return {
        "l2_cpu_s_per_gb": split,
        "l2_cpu_bound_gbps": bound,
        "l2_aggregate_gbps": {k: round(v, 3) for k, v in agg.items()},
        "l2_memcpy_gbps": {k: round(v, 3) for k, v in memcpy.items()},
        "l2_aggregate_over_memcpy": ratios,
        "l2_aggregate_over_memcpy_8": ratios[top],
        "l2_aggregate_over_cpu_bound_8": round(agg[top] / bound[top], 3) if bound[top] else 0.0,
        "daemon_cpu_seconds": round(cpu, 3),
        "daemon_bytes_moved": moved,
        "daemon_cpu_s_per_gb": round(per_gb, 4),
        "memcpy_cpu_s_per_gb": round(copy_cpu, 4),
        "daemon_cpu_s_per_gb_over_memcpy": round(per_gb / copy_cpu, 3),
        "daemon_cpu_s_per_gb_with_sessions": round(with_sessions, 4),
        "daemon_cpu_s_per_gb_with_sessions_over_memcpy": round(with_sessions / copy_cpu, 3),
    }


def _settings(daemon: DaemonProcess, tag: str, iters: int) -> dict[str, Any]:
    g = GEOMETRY
    return {
        "runtime_dir": str(daemon.runtime_dir),
        "tag": tag,
        "pages": REQUEST_PAGES,
        "iters": iters,
        "geometry": {f: getattr(g, f) for f in g.__struct_fields__},
    }


def _control_plane(
    daemon: DaemonProcess, echo: str, root: Path, s: ScaleSettings
) -> dict[str, Any]:
    """LOOKUPs/s from ``lookup_clients`` engines against echoes/s from as many clients."""
    n = s.lookup_clients
    look = run_workers("lookup", n, _settings(daemon, "lookup", s.lookup_iters), root, s.timeout_s)
    bare = run_workers(
        "echo",
        n,
        {"endpoint": echo, "tag": "echo", "pages": REQUEST_PAGES, "iters": s.lookup_iters},
        root,
        s.timeout_s,
    )
    return {
        "lookups_per_s": round(look.ops_per_s),
        "echo_per_s": round(bare.ops_per_s),
        "lookup_throughput_over_echo_8": round(look.ops_per_s / bare.ops_per_s, 3),
    }


def _long_context(cfg: ClientConfig, echo: str, s: ScaleSettings) -> dict[str, Any]:
    """A LOOKUP of ``long_pages`` keys against an echo; a LOAD of them against memcpy."""
    g, n = GEOMETRY, s.long_pages
    with SharedKVPool(g, n) as kv, Connection(kv, model_id="scale-long", config=cfg) as conn:
        keys = conn.page_keys(range(n * g.page_size))
        h = conn.store(keys, list(range(n)))
        if h.writing != n or not h.wait():
            raise ScaleBenchError(f"store of the long context moved {h.writing}/{n} pages")
        look = p50(_lookup_rtts(conn, keys, max(10, s.rtt_samples // 5)))
        payload = P.encode(lookup_request(conn.session_id, keys, True))
        memcpy_before = memcpy_gbps(n * g.page_bytes, s.copy_threads)
        times = []
        for _ in range(s.long_repeats + 1):  # the first one warms up
            t0 = time.perf_counter()
            h = conn.load(keys, list(range(n)))
            if h.count != n or not h.wait():
                raise ScaleBenchError(f"load of the long context moved {h.count}/{n} pages")
            times.append(time.perf_counter() - t0)
        load = p50(times[1:])
    bare = p50(echo_rtts(echo, payload, max(10, s.rtt_samples // 5)))
    nbytes = n * g.page_bytes
    memcpy = max(memcpy_before, memcpy_gbps(nbytes, s.copy_threads))
    return {
        "lookup_long_us_p50": round(look * 1e6, 1),
        "echo_long_us_p50": round(bare * 1e6, 1),
        "lookup_8192_over_echo": round(look / bare, 3),
        "load_long_gbps": round(gbps(nbytes, load), 3),
        "load_long_memcpy_gbps": round(memcpy, 3),
        "load_8192_over_memcpy": round(gbps(nbytes, load) / memcpy, 3),
    }


# -- command line ----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``kvtier bench scale`` options to ``p``."""
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="draw the N-engine curves here (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds, not minutes")
    p.add_argument(
        "--million-pages",
        type=int,
        metavar="N",
        help="pages of the big pool (default 1,000,000; --quick: 4,096)",
    )
    p.add_argument(
        "--only",
        metavar="PART[,PART]",
        help=f"run only these parts, of {', '.join(PARTS)} (e.g. stall: under a minute)",
    )
    p.add_argument(
        "--copy-threads",
        type=int,
        default=2,
        help="the daemons' copy threads, and the memcpy baselines' (default 2)",
    )


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run the bench as the parsed options say; draw the plot if asked. Returns the results."""
    overrides: dict[str, Any] = {"copy_threads": args.copy_threads}
    if args.million_pages is not None:
        overrides["million_pages"] = args.million_pages
    if getattr(args, "only", None):
        parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise ScaleBenchError(f"--only {args.only!r}: the parts are {', '.join(PARTS)}")
        overrides["parts"] = parts
    make = ScaleSettings.quick if args.quick else ScaleSettings.full
    result = run_scale_bench(make(**overrides))
    if args.plot:
        plot(result, args.plot)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.scale [--json PATH] [--plot PNG] [--quick]``."""
    p = argparse.ArgumentParser(prog="kvtier bench scale", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    result = run_from_args(args)
    print_table(result)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
