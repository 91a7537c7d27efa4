"""``kvtier bench trace``: replay real traffic through a real kvtierd, per pool size.

For each size N (in trace blocks), a private kvtierd whose host pool holds exactly N pages
(L3 off) serves ``--engines`` engine processes (:mod:`kvtier.bench.trace.worker`) that
replay the trace as engines would: each request LOOKUPs its chain of blocks, LOADs the
leading hit (every byte checked) and STOREs the rest, at its arrival time compressed
``--speedup`` times (or as soon as its engine is free). One trace block is one 4 KiB page.

Printed per size: the daemon's hit rate (pages loaded / all blocks of all requests) and,
over the same access sequence (the requests in the order their LOOKUPs were sent), the
simulated hit rates of leaf-only LRU and of Belady's MIN (:mod:`kvtier.bench.trace.sim`),
and ``gap_closed`` = (kvtier - LRU) / (MIN - LRU); the daemon's CPU seconds per request;
LOOKUP, LOAD and STORE latencies (p50, p99) seen by the engines.

Default trace: the Mooncake FAST'25 conversation trace shipped gzipped in ``bench/data``
(Apache-2.0; see its NOTICE). JSON fields: ``sizes``, ``hit_rate``, ``lru_hit_rate``,
``min_hit_rate``, ``gap_closed`` (lists aligned with ``sizes``), ``mismatched_bytes``,
``requests``, and ``eviction_policy``, ``engines``, ``speedup``, ``daemon_cpu_ms_per_request``,
``latency_ms`` (per size and operation: p50, p99).

``--restart``: each size is replayed twice, in two phases over the same requests: the
first half (every engine's requests before the midpoint, in trace order) to completion,
then the second half by fresh engine processes. In one run the same daemon serves both
phases; in the other it is killed with SIGKILL between them and a new kvtierd, same flags
and runtime directory, adopts the pool (:mod:`kvtier.bench.trace.replay`). The fields
above come from the run without the restart; added: ``restart_window`` (the first
``min(1000, N / 4)`` requests after the midpoint), ``pages_adopted`` (by the new daemon),
``hit_rate_after_restart`` and ``hit_rate_after_no_restart`` (pages loaded over the
prompt blocks of those requests, in each run) and ``restart_hit_ratio`` (the first over
the second): what an eviction policy's private state, lost at a restart, is worth.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench import write_json
from kvtier.bench.trace.replay import TraceBenchError, replay
from kvtier.config.arg_types import CliError, OneLineParser, positive_int, positive_number
from kvtier.bench.trace.sim import (
    DEFAULT_TRACE,
    TraceError,
    load_trace,
    lru_hit_rate,
    min_hit_rate,
)

__all__ = ["TraceBenchError", "add_arguments", "main", "run_from_args", "run_trace_bench"]

RESTART_WINDOW = 1000
"""``--restart``: phase 2's first requests counted, at most (and at most a quarter of them)."""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(q * len(v)) - 1)]


def run_trace_bench(
    trace: str | Path = DEFAULT_TRACE,
    sizes: Sequence[int] = (2000, 5000, 10000, 20000),
    engines: int = 4,
    speedup: float = 100.0,
    policy: str | None = None,
    limit: int | None = None,
    timeout_s: float = 1800.0,
    restart: bool = False,
) -> dict[str, Any]:
    """Replay ``trace`` once per size (see the module docstring); return the JSON result.

    Args:
        trace: a Mooncake-format trace file.
        sizes: pool sizes, in pages (= trace blocks).
        engines: engine processes.
        speedup: arrival times are divided by this.
        policy: the daemon's ``eviction_policy`` (None: its default, ``KVTIER_EVICTION_POLICY``
            or the config's).
        limit: replay only the first ``limit`` requests.
        timeout_s: bound on each size's replay (each of the two with ``restart``).
        restart: replay each size twice in two phases, the daemon killed and restarted on
            its pool between them in the second (the ``restart_*`` fields).
    """
    if policy is None:  # the daemon's own default, as the environment may set it
        from kvtier.config import DaemonConfig
        from kvtier.config.loader import load_config

        policy = load_config(DaemonConfig).eviction_policy
    chains, stamps = load_trace(trace, limit)
    total = sum(map(len, chains))
    if total == 0:
        raise TraceError(f"{trace}: no request with a block to replay")
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
    mid = len(chains) // 2
    window = range(mid, mid + min(RESTART_WINDOW, len(chains) // 4))
    if restart:
        out.update(
            restart_window=len(window),
            pages_adopted=[],
            hit_rate_after_restart=[],
            hit_rate_after_no_restart=[],
            restart_hit_ratio=[],
        )
    with tempfile.TemporaryDirectory(prefix="kvt-trace-", dir="/tmp") as d:
        for size in sizes:
            split = mid if restart else None
            r = replay(Path(d), chains, stamps, size, engines, speedup, policy, timeout_s, split)
            if restart:
                k = replay(
                    Path(d),
                    chains,
                    stamps,
                    size,
                    engines,
                    speedup,
                    policy,
                    timeout_s,
                    split,
                    restart=True,
                )
                out["mismatched_bytes"] += k["mismatched_bytes"]
                after, before = _window_rate(k, chains, window), _window_rate(r, chains, window)
                out["pages_adopted"].append(k["adopted"])
                out["hit_rate_after_restart"].append(round(after, 4))
                out["hit_rate_after_no_restart"].append(round(before, 4))
                out["restart_hit_ratio"].append(round(after / before, 3) if before else 0.0)
            seq = [chains[i] for i in r["order"]]
            hit = sum(r["hits"]) / total
            lru, best = lru_hit_rate(seq, size), min_hit_rate(seq, size)
            out["hit_rate"].append(round(hit, 4))
            out["lru_hit_rate"].append(round(lru, 4))
            out["min_hit_rate"].append(round(best, 4))
            out["gap_closed"].append(round((hit - lru) / (best - lru), 3) if best > lru else 0.0)
            out["mismatched_bytes"] += r["mismatched_bytes"]
            out["daemon_cpu_ms_per_request"].append(round(1000 * r["cpu"] / len(chains), 3))
            out["latency_ms"].append(
                {
                    op: {
                        "p50": round(1000 * _pct(v, 0.5), 3),
                        "p99": round(1000 * _pct(v, 0.99), 3),
                    }
                    for op, v in r["lat"].items()
                }
            )
    return out


def _window_rate(r: dict[str, Any], chains: list[list[int]], window: range) -> float:
    """Pages loaded over the prompt blocks of the requests in ``window``."""
    blocks = sum(len(chains[i]) for i in window)
    return sum(r["hits"][i] for i in window) / blocks if blocks else 0.0


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
    if "restart_hit_ratio" in r:
        print(
            f"restart after request {r['requests'] // 2}: hit rate of the next "
            f"{r['restart_window']} requests"
        )
        print(f"{'blocks':>7} {'adopted':>8} {'restart':>8} {'no restart':>10} {'ratio':>6}")
        for i, size in enumerate(r["sizes"]):
            print(
                f"{size:>7} {r['pages_adopted'][i]:>8} {r['hit_rate_after_restart'][i]:8.3f} "
                f"{r['hit_rate_after_no_restart'][i]:10.3f} {r['restart_hit_ratio'][i]:6.3f}"
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
        type=_sizes,
        default=_sizes("2000,5000,10000,20000"),
        help="pool sizes in trace blocks (pages), comma-separated",
    )
    p.add_argument("--engines", type=positive_int, default=4, help="engine processes")
    p.add_argument("--speedup", type=positive_number, default=100.0, help="time compression")
    p.add_argument(
        "--policy",
        choices=("lru", "arc", "reuse"),
        default=None,
        help="the daemon's eviction_policy (default: its default)",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="replay the first N requests")
    p.add_argument(
        "--restart",
        action="store_true",
        help="also measure the hit rate right after a SIGKILL and restart of kvtierd at the "
        "trace's midpoint (each size replayed twice: with and without the restart)",
    )
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--plot", default=None, help="write a PNG of hit rate per size here")


def _sizes(text: str) -> list[int]:
    """argparse type: comma-separated pool sizes, each >= 1 (at least one)."""
    sizes = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r} names no pool size")
    return sizes


def _writable(flag: str, path: str | None) -> None:
    """Refuse (TraceError naming ``flag``) an output path that cannot be written, before
    the replay: its figures would be lost."""
    if path is None:
        return
    target = Path(path).absolute()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TraceError(f"{flag} {path}: cannot make its directory: {err.strerror}") from err
    if target.is_dir() or not os.access(target.parent, os.W_OK | os.X_OK):
        raise TraceError(f"{flag} {path}: cannot be written there")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run with parsed flags; print, write the JSON and the plot.

    Raises:
        TraceError: the trace cannot be read or holds nothing to replay, or an output path
            cannot be written (checked before the replay).
    """
    sizes = args.blocks if isinstance(args.blocks, list) else _sizes(str(args.blocks))
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    r = run_trace_bench(
        args.trace,
        sizes,
        args.engines,
        args.speedup,
        args.policy,
        args.limit,
        restart=args.restart,
    )
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
    p = OneLineParser(
        prog="kvtier bench trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    try:
        run_from_args(p.parse_args(argv))  # a bad flag: one line, exit 2
    except (CliError, TraceError, TraceBenchError) as err:
        print(f"kvtier bench trace: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
