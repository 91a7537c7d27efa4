"""``kvtier bench trace``: replay real traffic through a real kvtierd, per pool size.

For each size N (in trace blocks), a private kvtierd whose host pool holds exactly N pages
(L3 off) serves ``--engines`` engine processes (:mod:`kvtier.bench.trace_worker`) that
replay the trace as engines would: each request LOOKUPs its chain of blocks, LOADs the
leading hit (every byte checked) and STOREs the rest, at its arrival time compressed
``--speedup`` times (or as soon as its engine is free). One trace block is one 4 KiB page.

Printed per size: the daemon's hit rate (pages loaded / all blocks of all requests) and,
over the same access sequence (the requests in the order their LOOKUPs were sent), the
simulated hit rates of leaf-only LRU and of Belady's MIN (:mod:`kvtier.bench.trace_sim`),
and ``gap_closed`` = (kvtier - LRU) / (MIN - LRU); the daemon's CPU seconds per request;
LOOKUP, LOAD and STORE latencies (p50, p99) seen by the engines.

Default trace: the Mooncake FAST'25 conversation trace shipped gzipped in ``bench/data``
(Apache-2.0; see its NOTICE). JSON fields: ``sizes``, ``hit_rate``, ``lru_hit_rate``,
``min_hit_rate``, ``gap_closed`` (lists aligned with ``sizes``), ``mismatched_bytes``,
``requests``, and ``eviction_policy``, ``engines``, ``speedup``, ``daemon_cpu_ms_per_request``,
``latency_ms`` (per size and operation: p50, p99).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench import write_json
from kvtier.bench.scale_baselines import ScaleBenchError, cpu_seconds, read_line
from kvtier.bench.trace_sim import DEFAULT_TRACE, load_trace, lru_hit_rate, min_hit_rate

__all__ = ["TraceBenchError", "add_arguments", "main", "run_from_args", "run_trace_bench"]

PAGE_BYTES = 4096  # GEOMETRY.page_bytes: one slot of the host pool


class TraceBenchError(RuntimeError):
    """The replay could not run (a worker or the daemon failed, or it ran out of time)."""


def _extent_pages(n: int) -> int:
    """Pages per extent: the largest divisor of ``n`` up to 64, so the pool is exactly n."""
    return max(d for d in range(1, 65) if n % d == 0)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(q * len(v)) - 1)]


def _replay(root: Path, chains: list[list[int]], stamps: list[int], size: int, engines: int,
            speedup: float, policy: str | None, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """One daemon of ``size`` pages, ``engines`` workers; what they saw."""
    from kvtier.launch.daemon_process import DaemonProcess

    ext = _extent_pages(size) * PAGE_BYTES
    flags = [
        "--hicache-size",
        str(size * PAGE_BYTES),
        "--extent-size",
        str(ext),
        "--log-level",
        "warning",
        "--hicache-storage-backend",
        "none",
    ]
    if policy is not None:
        flags += ["--eviction-policy", policy]
    daemon = DaemonProcess(root / f"d{size}", flags)
    daemon.start(timeout=60)
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen[bytes]] = []
    logs = [root / f"engine-{size}-{i}.log" for i in range(engines)]
    t_first = stamps[0] if stamps else 0
    try:
        for i in range(engines):
            mine = range(i, len(chains), engines)
            s = {
                "runtime_dir": str(daemon.runtime_dir),
                "chains": [chains[r] for r in mine],
                "due": [(stamps[r] - t_first) / 1000.0 / speedup for r in mine],
            }
            with open(logs[i], "wb") as log:
                p = subprocess.Popen(
                    [sys.executable, "-m", "kvtier.bench.trace_worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            procs.append(p)
            assert p.stdin is not None
            p.stdin.write(json.dumps(s).encode() + b"\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            _expect(p, deadline, logs[i], b"ready")
        cpu0 = cpu_seconds(daemon.pid)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        results = [json.loads(_expect(p, deadline, logs[i], None)) for i, p in enumerate(procs)]
        cpu = cpu_seconds(daemon.pid) - cpu0
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        daemon.stop()
        daemon.remove_pool()
    order: list[tuple[float, int]] = []  # (LOOKUP sent, request), every engine's
    hits = [0] * len(chains)
    for i, r in enumerate(results):
        for j, (t, h) in enumerate(zip(r["sent"], r["hits"], strict=True)):
            req = i + j * engines
            order.append((t, req))
            hits[req] = h
    order.sort()
    return {"order": [req for _, req in order], "hits": sum(hits),
            "mismatched_bytes": sum(r["mismatched_bytes"] for r in results), "cpu": cpu,
            "lat": {op: [x for r in results for x in r["lat"][op]]
                    for op in ("lookup", "load", "store")}}  # fmt: skip


def _expect(p: subprocess.Popen[bytes], deadline: float, log: Path, want: bytes | None) -> bytes:
    assert p.stdout is not None
    try:
        line = read_line(p.stdout, deadline, f"trace engine {log.stem}")
    except ScaleBenchError as err:
        raise TraceBenchError(f"{err}:\n{log.read_text(errors='replace')[-2000:]}") from err
    if want is not None and line != want:
        raise TraceBenchError(f"trace engine {log.stem} said {line[:200]!r}")
    return line


def run_trace_bench(trace: str | Path = DEFAULT_TRACE, sizes: Sequence[int] = (2000, 5000,
                    10000, 20000), engines: int = 4, speedup: float = 100.0,
                    policy: str | None = None, limit: int | None = None,
                    timeout_s: float = 1800.0) -> dict[str, Any]:  # fmt: skip
    """Replay ``trace`` once per size (see the module docstring); return the JSON result.

    Args:
        trace: a Mooncake-format trace file.
        sizes: pool sizes, in pages (= trace blocks).
        engines: engine processes.
        speedup: arrival times are divided by this.
        policy: the daemon's ``eviction_policy`` (None: its default, ``KVTIER_EVICTION_POLICY``
            or the config's).
        limit: replay only the first ``limit`` requests.
        timeout_s: bound on each size's replay.
    """
    if policy is None:  # the daemon's own default, as the environment may set it
        from kvtier.config import DaemonConfig
        from kvtier.config.loader import load_config

        policy = load_config(DaemonConfig).eviction_policy
    chains, stamps = load_trace(trace, limit)
    total = sum(map(len, chains))
    out: dict[str, Any] = {
        "trace": Path(trace).name,
        "requests": len(chains),
        "blocks": total,
        "engines": engines,
        "speedup": speedup,
        "eviction_policy": policy,
        "sizes": list(sizes),
        "hit_rate": [],
        "lru_hit_rate": [],
        "min_hit_rate": [],
        "gap_closed": [],
        "mismatched_bytes": 0,
        "daemon_cpu_ms_per_request": [],
        "latency_ms": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvt-trace-", dir="/tmp") as d:
        for size in sizes:
            r = _replay(Path(d), chains, stamps, size, engines, speedup, policy, timeout_s)
            seq = [chains[i] for i in r["order"]]
            hit, lru, best = r["hits"] / total, lru_hit_rate(seq, size), min_hit_rate(seq, size)
            out["hit_rate"].append(round(hit, 4))
            out["lru_hit_rate"].append(round(lru, 4))
            out["min_hit_rate"].append(round(best, 4))
            out["gap_closed"].append(round((hit - lru) / (best - lru), 3) if best > lru else 0.0)
            out["mismatched_bytes"] += r["mismatched_bytes"]
            out["daemon_cpu_ms_per_request"].append(round(1000 * r["cpu"] / len(chains), 3))
            out["latency_ms"].append({op: {"p50": round(1000 * _pct(v, 0.5), 3),
                                           "p99": round(1000 * _pct(v, 0.99), 3)}
                                      for op, v in r["lat"].items()})  # fmt: skip
    return out


def print_table(r: dict[str, Any]) -> None:
    """Print the result, one line per size."""
    print(
        f"trace {r['trace']}: {r['requests']} requests, {r['blocks']} blocks, "
        f"{r['engines']} engines, eviction_policy {r['eviction_policy']}"
    )
    print(
        f"{'blocks':>7} {'kvtier':>7} {'lru':>7} {'min':>7} {'gap_closed':>10} "
        f"{'cpu ms/req':>10}  lookup/load/store p50 ms (p99)"
    )
    for i, size in enumerate(r["sizes"]):
        lat = r["latency_ms"][i]
        ops = "  ".join(
            f"{lat[op]['p50']:.2f} ({lat[op]['p99']:.1f})" for op in ("lookup", "load", "store")
        )
        print(
            f"{size:>7} {r['hit_rate'][i]:7.3f} {r['lru_hit_rate'][i]:7.3f} "
            f"{r['min_hit_rate'][i]:7.3f} {r['gap_closed'][i]:10.2f} "
            f"{r['daemon_cpu_ms_per_request'][i]:10.2f}  {ops}"
        )
    print(f"mismatched bytes: {r['mismatched_bytes']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench trace``."""
    p.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="Mooncake-format trace "
        "(.jsonl or .jsonl.gz; default: the conversation trace in bench/data)",
    )
    p.add_argument(
        "--blocks",
        default="2000,5000,10000,20000",
        help="pool sizes in trace blocks (pages), comma-separated",
    )
    p.add_argument("--engines", type=int, default=4, help="engine processes")
    p.add_argument("--speedup", type=float, default=100.0, help="time compression")
    p.add_argument(
        "--policy",
        choices=("lru", "arc", "reuse"),
        default=None,
        help="the daemon's eviction_policy (default: its default)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG of hit rate per size here")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run with parsed flags; print, write the JSON and the plot."""
    sizes = [int(x) for x in str(args.blocks).split(",") if x.strip()]
    if not sizes or min(sizes) <= 0 or args.engines <= 0 or args.speedup <= 0:
        raise SystemExit("kvtier bench trace: --blocks, --engines and --speedup must be > 0")
    r = run_trace_bench(args.trace, sizes, args.engines, args.speedup, args.policy, args.limit)
    print_table(r)
    if args.json:
        write_json(args.json, r)
    if args.plot:
        _plot(r, args.plot)
    return r


def _plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("hit_rate", "kvtier"),
        ("lru_hit_rate", "LRU (simulated)"),
        ("min_hit_rate", "Belady MIN (offline)"),
    ):
        ax.plot(r["sizes"], r[key], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("pool size (trace blocks)")
    ax.set_ylabel("prefix hit rate")
    ax.set_title(f"{r['trace']}, {r['engines']} engines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtier.bench.trace`` / ``kvtier bench trace``."""
    p = argparse.ArgumentParser(
        prog="kvtier bench trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    run_from_args(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
