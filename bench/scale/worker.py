"""Engine processes for ``kvtier bench scale``: the worker entry and the launcher that runs N.

Each worker is a separate Python process (``python -m kvtier.bench.scale.worker ARGS``),
as a real engine is, so N engines compete for the daemon and not for one client's GIL.
A worker gets its settings as one JSON argument, prepares (connects, registers, hashes
its keys, stores what it will look up), prints ``ready``, waits for ``go`` on stdin,
runs a fixed number of operations, and prints one JSON line: the operations, the bytes
moved, ``t0``/``t1`` from ``time.monotonic()`` (one clock for every process on Linux), and
the CPU seconds the worker itself used meanwhile (``cpu``: what an engine spends on its
requests and waits, next to the daemon's share).
The launcher starts all N, waits for every ``ready``, says ``go`` to all, reads every
result, then says ``done``: only then does a worker close its session and exit, so that
what the daemon spends between ``go`` and the last result is the timed operations' alone
(no REGISTER, first mapping or teardown of any engine). It reduces the results to one
aggregate rate over the span from the first start to the last end.

Modes:
    ``transfer``: ``iters`` times, STORE ``pages`` fresh pages, then LOAD them back (one
    untimed pair first, before ``ready``).
    ``lookup``: LOOKUP the same ``pages`` keys (stored before ``ready``) ``iters`` times.
    ``echo``: send a LOOKUP's encoded bytes to the echo server ``iters`` times.
    ``latency``: LOOKUP the same ``pages`` keys (stored before ``ready``) for ``seconds``
    (at most ``iters`` times), pausing ``pause_s`` after each, and report every round trip
    (``lat_us``) and when it started (``at``, ``time.monotonic``: one clock for every process
    of the machine): what an engine waits while another one's requests hold the daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.scale.baselines import ScaleBenchError, cpu_seconds, read_line, reap
from kvtier.client.connection.request_codec import lookup_request
from kvtier.ipc import protocol as P

__all__ = ["Aggregate", "run_workers"]

REQUEST_TIMEOUT_S = 60.0
"""Client timeouts in the workers: generous, as eight engines may share two cores."""


@dataclass(frozen=True, slots=True)
class Aggregate:
    """What N workers did together.

    Attributes:
        workers: how many ran.
        ops: operations (transfers or round trips) of all workers.
        nbytes: page bytes all workers moved (0 for lookups and echoes).
        seconds: from the first worker's start to the last one's end.
        cpu_seconds: CPU time all workers used over their runs.
        watched_cpu_seconds: CPU time the watched process (``watch_pid``) used from ``go``
            to the last result (0.0 when none was watched).
        details: each worker's own result line, in worker order.
    """

    workers: int
    ops: int
    nbytes: int
    seconds: float
    cpu_seconds: float = 0.0
    watched_cpu_seconds: float = 0.0
    details: tuple[dict[str, Any], ...] = ()

    @property
    def gbps(self) -> float:
        """Aggregate GB/s."""
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    @property
    def ops_per_s(self) -> float:
        """Aggregate operations per second."""
        return self.ops / max(self.seconds, 1e-9)


def run_workers(
    mode: str,
    n: int,
    settings: dict[str, Any],
    log_dir: Path,
    timeout_s: float = 300.0,
    watch_pid: int | None = None,
) -> Aggregate:
    """Run ``n`` workers of ``mode`` at once and aggregate what they did.

    Args:
        mode: ``transfer``, ``lookup`` or ``echo``.
        n: worker processes.
        settings: the workers' shared settings (``runtime_dir`` or ``endpoint``,
            ``geometry``, ``pages``, ``iters``, ``tag``); each also gets its ``index``.
        log_dir: where each worker's stderr goes (``<tag>-<index>.log``).
        timeout_s: bound on the whole run, start to last result.
        watch_pid: a process (the daemon) whose CPU time from ``go`` to the last result
            is reported as ``watched_cpu_seconds``.

    Returns:
        The aggregate over all ``n``.

    Raises:
        ScaleBenchError: a worker failed, or the run passed ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen[bytes]] = []
    logs = [log_dir / f"{settings['tag']}-{i}.log" for i in range(n)]
    try:
        for i in range(n):
            arg = json.dumps({**settings, "mode": mode, "index": i})
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "kvtier.bench.scale.worker", arg],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                    )
                )
        for i, p in enumerate(procs):
            _expect(p, deadline, b"ready", logs[i])
        watched = cpu_seconds(watch_pid) if watch_pid is not None else 0.0
        _say(procs, logs, b"go\n")
        results = [json.loads(_expect(p, deadline, None, logs[i])) for i, p in enumerate(procs)]
        if watch_pid is not None:
            watched = cpu_seconds(watch_pid) - watched
        _say(procs, logs, b"done\n")
        for i, p in enumerate(procs):
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as err:
                raise ScaleBenchError(f"engine worker {logs[i].stem} did not exit") from err
    finally:
        reap(procs)
    return Aggregate(
        workers=n,
        ops=sum(r["ops"] for r in results),
        nbytes=sum(r["nbytes"] for r in results),
        seconds=max(r["t1"] for r in results) - min(r["t0"] for r in results),
        cpu_seconds=sum(r.get("cpu", 0.0) for r in results),
        watched_cpu_seconds=watched,
        details=tuple(results),
    )


def _say(procs: list[subprocess.Popen[bytes]], logs: list[Path], line: bytes) -> None:
    for p, log in zip(procs, logs, strict=True):
        assert p.stdin is not None
        try:
            p.stdin.write(line)
            p.stdin.flush()
        except BrokenPipeError as err:  # the worker died: its log says why
            raise ScaleBenchError(f"engine worker {log.stem} went away; its log: {log}") from err


def _expect(p: subprocess.Popen[bytes], deadline: float, want: bytes | None, log: Path) -> bytes:
    assert p.stdout is not None
    try:
        line = read_line(p.stdout, deadline, f"engine worker {log.stem}")
    except ScaleBenchError as err:
        raise ScaleBenchError(f"{err}:\n{log.read_text(errors='replace')[-2000:]}") from err
    if want is not None and line != want:
        raise ScaleBenchError(f"engine worker {log.stem} said {line[:200]!r}")
    return line


# -- the worker ------------------------------------------------------------------------


def _keys(conn: Any, pages: int, first_page: int) -> list[bytes]:
    """Keys of ``pages`` fresh pages: one chain over tokens ``first_page * page_size ...``."""
    ps = conn.geometry.page_size
    return conn.page_keys(range(first_page * ps, (first_page + pages) * ps))


def _transfer(conn: Any, s: dict[str, Any]) -> dict[str, Any]:
    pages, iters, g = s["pages"], s["iters"], conn.geometry
    batches = [_keys(conn, pages, i * pages) for i in range(iters + 1)]
    src, dst = list(range(pages)), list(range(pages, 2 * pages))

    def pair(keys: list[bytes]) -> None:
        h = conn.store(keys, src)
        if h.writing != pages or not h.wait():
            raise ScaleBenchError(f"store moved {h.writing}/{pages} pages")
        h = conn.load(keys, dst)
        if h.count != pages or not h.wait():
            raise ScaleBenchError(f"load moved {h.count}/{pages} pages")

    pair(batches.pop())  # warm-up: the daemon maps this engine's pages on first use
    _go()
    c0, t0 = time.process_time(), time.monotonic()
    for keys in batches:
        pair(keys)
    t1 = time.monotonic()
    return {
        "ops": 2 * iters,
        "nbytes": 2 * iters * pages * g.page_bytes,
        "t0": t0,
        "t1": t1,
        "cpu": time.process_time() - c0,
    }


def _lookup(conn: Any, s: dict[str, Any]) -> dict[str, Any]:
    pages, iters = s["pages"], s["iters"]
    keys = _keys(conn, pages, 0)
    h = conn.store(keys, list(range(pages)))
    if h.writing != pages or not h.wait():
        raise ScaleBenchError(f"store moved {h.writing}/{pages} pages")
    if conn.lookup(keys).l2 != pages:
        raise ScaleBenchError("stored pages not found")
    _go()
    c0, t0 = time.process_time(), time.monotonic()
    for _ in range(iters):
        if conn.lookup(keys).l2 != pages:
            raise ScaleBenchError("a lookup missed (daemon late or pages evicted)")
    return {
        "ops": iters,
        "nbytes": 0,
        "t0": t0,
        "t1": time.monotonic(),
        "cpu": time.process_time() - c0,
    }


def _latency(conn: Any, s: dict[str, Any]) -> dict[str, Any]:
    pages = s["pages"]
    keys = _keys(conn, pages, 0)
    h = conn.store(keys, list(range(pages)))
    if h.writing != pages or not h.wait():
        raise ScaleBenchError(f"store moved {h.writing}/{pages} pages")
    _go()
    lat: list[float] = []
    at: list[float] = []
    t0 = time.monotonic()
    end = t0 + s["seconds"]
    while time.monotonic() < end and len(lat) < s["iters"]:
        at.append(time.monotonic())
        a = time.perf_counter()
        conn.lookup(keys)  # another engine's stores may evict these pages: a miss still counts
        lat.append(round((time.perf_counter() - a) * 1e6, 1))
        time.sleep(s["pause_s"])
    return {"ops": len(lat), "nbytes": 0, "t0": t0, "t1": time.monotonic(), "lat_us": lat, "at": at}


def _echo(s: dict[str, Any]) -> None:
    import zmq

    keys = [bytes([i % 256]) * 32 for i in range(s["pages"])]
    payload = P.encode(lookup_request(1, keys, True))  # as the client sends it
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(s["endpoint"])
    try:
        _go()
        t0 = time.monotonic()
        for _ in range(s["iters"]):
            sock.send(payload)
            if not sock.poll(int(REQUEST_TIMEOUT_S * 1000)):
                raise ScaleBenchError("echo server did not answer")
            sock.recv()
        _report({"ops": s["iters"], "nbytes": 0, "t0": t0, "t1": time.monotonic()})
    finally:
        sock.close(0)
        ctx.term()


def _go() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise ScaleBenchError("the launcher went away before saying go")


def _report(result: dict[str, Any]) -> None:
    """Print ``result`` and wait for the launcher's ``done`` (or its exit) before the caller
    closes its session: the teardown stays out of the launcher's timed window."""
    print(json.dumps(result), flush=True)
    sys.stdin.readline()


def main(argv: list[str]) -> int:
    """Worker entry: ``python -m kvtier.bench.scale.worker JSON`` (see the module docstring)."""
    s = json.loads(argv[0])
    if s["mode"] == "echo":
        _echo(s)
        return 0
    from kvtier.client.connection.connection import Connection
    from kvtier.client.kv_pool.shared import SharedKVPool
    from kvtier.config import ClientConfig

    geometry = P.Geometry(**s["geometry"])
    cfg = ClientConfig(
        runtime_dir=Path(s["runtime_dir"]),
        request_timeout_s=REQUEST_TIMEOUT_S,
        load_timeout_s=REQUEST_TIMEOUT_S,
    )
    with (
        SharedKVPool(geometry, 2 * s["pages"]) as kv,
        Connection(kv, model_id=f"scale-{s['tag']}-{s['index']}", config=cfg) as conn,
    ):
        run = {"transfer": _transfer, "lookup": _lookup, "latency": _latency}[s["mode"]]
        _report(run(conn, s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
