"""The replay of ``kvtier bench trace``: a private kvtierd and engine processes, per size.

:func:`replay` starts a kvtierd whose host pool holds exactly ``size`` pages (L3 off) and
runs ``engines`` engine processes (:mod:`kvtier.bench.trace.worker`) over the trace's
requests. With ``split``, it runs in two phases: requests ``[0, split)`` with one set of
engine processes, to completion, then ``[split, N)`` with fresh ones. With ``restart``
too, the daemon is killed with SIGKILL between the phases and a new one is started with
the same flags on the same runtime directory, so it adopts the pool left in shared memory
(the pages and their recency); the new daemon must report adopted pages, or the replay
fails. Without ``restart`` the same daemon serves both phases, so two runs differ only by
the restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.scale.baselines import ScaleBenchError, cpu_seconds, read_line, reap

__all__ = ["PAGE_BYTES", "TraceBenchError", "replay"]

PAGE_BYTES = 4096  # GEOMETRY.page_bytes: one slot of the host pool


class TraceBenchError(RuntimeError):
    """The replay could not run (a worker or the daemon failed, a restarted daemon did not
    adopt the pool, or it ran out of time)."""


def _extent_pages(n: int) -> int:
    """Pages per extent: the largest divisor of ``n`` up to 64, so the pool is exactly n."""
    return max(d for d in range(1, 65) if n % d == 0)


def _flags(size: int, policy: str | None) -> list[str]:
    """kvtierd's flags for a pool of exactly ``size`` pages, L3 off."""
    flags = [
        "--hicache-size",
        str(size * PAGE_BYTES),
        "--extent-size",
        str(_extent_pages(size) * PAGE_BYTES),
        "--log-level",
        "warning",
        "--hicache-storage-backend",
        "none",
    ]
    return flags if policy is None else [*flags, "--eviction-policy", policy]


def replay(
    root: Path,
    chains: list[list[int]],
    stamps: list[int],
    size: int,
    engines: int,
    speedup: float,
    policy: str | None,
    timeout_s: float,
    split: int | None = None,
    restart: bool = False,
) -> dict[str, Any]:
    """Replay the trace through a daemon of ``size`` pages (see the module docstring).

    Args:
        root: a private directory (the daemon's runtime directory goes under it).
        chains: each request's trace blocks; ``stamps``: their arrival times (ms).
        size: pool pages. ``engines``: engine processes. ``speedup``: time compression.
        policy: the daemon's ``eviction_policy`` (None: its default).
        timeout_s: bound on the whole replay.
        split: run requests ``[0, split)`` then ``[split, N)`` (None: one phase).
        restart: SIGKILL the daemon between the phases and start a new one on its pool.

    Returns:
        ``order`` (requests in the order their LOOKUPs were sent), ``hits`` (pages loaded,
        per request), ``mismatched_bytes``, ``cpu`` (the daemons' CPU seconds over the
        replay), ``lat`` (per operation, every latency seen) and ``adopted`` (pages the
        restarted daemon adopted; 0 without a restart).

    Raises:
        TraceBenchError: an engine or the daemon failed, or the new daemon adopted nothing.
    """
    from kvtier.launch.daemon_process import DaemonProcess

    tag = f"d{size}{'r' if restart else ''}"
    flags = _flags(size, policy)
    # configured by its flags alone: a KVTIER_* setting of the caller's (a limit, an admin
    # token) would make its answers differ from the simulations'
    daemon = DaemonProcess(root / tag, flags, isolated=True)
    _start(daemon, size)
    deadline = time.monotonic() + timeout_s
    n = len(chains)
    bounds = [(0, n)] if split is None else [(0, split), (split, n)]
    hits = [0] * n
    out: dict[str, Any] = {
        "order": [],
        "hits": hits,
        "mismatched_bytes": 0,
        "cpu": 0.0,
        "lat": {"lookup": [], "load": [], "store": []},
        "adopted": 0,
    }
    try:
        for phase, (lo, hi) in enumerate(bounds):
            if phase and restart:
                daemon.kill()  # SIGKILL: no chance to save anything
                daemon = DaemonProcess(root / tag, flags, isolated=True)
                _start(daemon, size)
                out["adopted"] = _adopted(daemon)
            r = _phase(
                root,
                f"{tag}-{phase}",
                daemon,
                chains,
                stamps,
                range(lo, hi),
                engines,
                speedup,
                deadline,
            )
            _served(daemon)
            if r["failed_transfers"]:
                raise TraceBenchError(
                    f"{r['failed_transfers']} LOADs or STOREs of the replay failed: its hit "
                    "rate would be false"
                )
            out["order"] += r["order"]
            for req, h in r["hits"].items():
                hits[req] = h
            out["mismatched_bytes"] += r["mismatched_bytes"]
            out["cpu"] += r["cpu"]
            for op, v in r["lat"].items():
                out["lat"][op] += v
    finally:
        daemon.discard()
    return out


def _start(daemon: Any, size: int) -> None:
    """Start the bench's daemon; a TraceBenchError naming why it would not start."""
    from kvtier.launch.daemon_process import DaemonStartError

    try:
        daemon.start(timeout=60)
    except DaemonStartError as err:
        last = str(err).strip().splitlines()
        raise TraceBenchError(
            f"kvtierd with a pool of {size} pages did not start: {last[-1] if last else err}"
        ) from None


def _served(daemon: Any) -> None:
    """A TraceBenchError unless the daemon lived through the phase and refused nothing: a
    request it did not serve would count as a miss, and the hit rates would be false."""
    from kvtier.client.connection.admin import AdminClient

    if daemon.proc is None or daemon.proc.poll() is not None:
        raise TraceBenchError("kvtierd exited during the replay: its hit rate would be false")
    with AdminClient(daemon.endpoint) as admin:
        counters = admin.stats().get("counters", {})
    refused = counters.get("errors_by_code", {}) if isinstance(counters, dict) else {}
    if refused:
        raise TraceBenchError(f"kvtierd refused requests of the replay: {refused}")


def _adopted(daemon: Any) -> int:
    """The pages a restarted daemon adopted; a TraceBenchError when it adopted none."""
    from kvtier.client.connection.admin import AdminClient

    with AdminClient(daemon.endpoint) as admin:
        stats = admin.stats()
    adopt, pool = stats.get("adopt"), stats.get("pool")
    pages = int(adopt.get("pages_adopted", 0)) if isinstance(adopt, dict) else 0
    ready = int(pool.get("pages_ready", 0)) if isinstance(pool, dict) else 0
    if pages <= 0 or ready <= 0:
        raise TraceBenchError(
            f"the restarted kvtierd did not adopt the pool's pages: adopt {adopt!r}, "
            f"pages_ready {ready}"
        )
    return pages


def _phase(
    root: Path,
    tag: str,
    daemon: Any,
    chains: list[list[int]],
    stamps: list[int],
    reqs: range,
    engines: int,
    speedup: float,
    deadline: float,
) -> dict[str, Any]:
    """Requests ``reqs`` by ``engines`` fresh engine processes; what they saw."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = [root / f"engine-{tag}-{i}.log" for i in range(engines)]
    mine = [reqs[i::engines] for i in range(engines)]
    t_first = stamps[reqs.start] if len(reqs) else 0
    try:
        for i in range(engines):
            s = {
                "runtime_dir": str(daemon.runtime_dir),
                "chains": [chains[r] for r in mine[i]],
                "due": [(stamps[r] - t_first) / 1000.0 / speedup for r in mine[i]],
            }
            with open(logs[i], "wb") as log:
                p = subprocess.Popen(
                    [sys.executable, "-m", "kvtier.bench.trace.worker"],
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
        reap(procs)
    order: list[tuple[float, int]] = []  # (LOOKUP sent, request), every engine's
    hits: dict[int, int] = {}
    for i, r in enumerate(results):
        for req, t, h in zip(mine[i], r["sent"], r["hits"], strict=True):
            order.append((t, req))
            hits[req] = h
    order.sort()
    return {
        "order": [req for _, req in order],
        "hits": hits,
        "mismatched_bytes": sum(r["mismatched_bytes"] for r in results),
        "failed_transfers": sum(r["failed_transfers"] for r in results),
        "cpu": cpu,
        "lat": {
            op: [x for r in results for x in r["lat"][op]] for op in ("lookup", "load", "store")
        },
    }


def _expect(p: subprocess.Popen[bytes], deadline: float, log: Path, want: bytes | None) -> bytes:
    assert p.stdout is not None
    try:
        line = read_line(p.stdout, deadline, f"trace engine {log.stem}")
    except ScaleBenchError as err:
        raise TraceBenchError(f"{err}:\n{log.read_text(errors='replace')[-2000:]}") from err
    if want is not None and line != want:
        raise TraceBenchError(f"trace engine {log.stem} said {line[:200]!r}")
    return line
