"""Baselines and probes for ``kvtier bench scale``: memcpy, a bare ZeroMQ echo, /proc readings.

Every ratio the scale bench reports divides a kvtier figure by one of these, measured in
the same run on the same machine:

- :func:`memcpy_gbps`: numpy copies between prefaulted buffers by as many threads as the
  daemon copies with (numpy releases the GIL while it copies), so the ratio compares the
  daemon against the memory bandwidth its copy threads could reach at best.
- :func:`memcpy_cpu_s_per_gb`: the CPU time a plain copy spends per GB between the memory
  kinds the daemon copies between (a file in ``/dev/shm``, as the host pool is, and a
  memfd, as an engine's KV memory is), both ways, by as many threads: what the daemon's
  CPU per GB moved is set against.
- :class:`EchoServer` / :func:`echo_rtts`: the bare uvloop ROUTER of
  :mod:`kvtier.bench.echo_server` on ``ipc://``, answering the same payload bytes a LOOKUP
  carries.
- :func:`cpu_seconds` / :func:`memory_status`: a process's CPU time (utime + stime) and
  resident memory split by kind, from ``/proc/<pid>``.
"""

from __future__ import annotations

import itertools
import os
import select
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
from kvtier.config import KvtierError

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "EchoServer",
    "ScaleBenchError",
    "cpu_seconds",
    "echo_rtts",
    "gbps",
    "memcpy_cpu_s_per_gb",
    "memcpy_gbps",
    "memory_status",
    "p50",
    "read_line",
    "reap",
]

MEMCPY_MAX_BYTES = 512 << 20
"""Largest buffer :func:`memcpy_gbps` copies; bigger totals repeat it (the rate is the same
once a buffer is far beyond the caches)."""
ECHO_WARMUP = 50
"""Round trips discarded before an echo's samples are kept."""
_TICKS = os.sysconf("SC_CLK_TCK")


class ScaleBenchError(KvtierError):
    """The scale bench could not measure something (a process died, a transfer fell short)."""


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10⁹ bytes per second) for ``nbytes`` moved in ``seconds``."""
    return nbytes / max(seconds, 1e-9) / 1e9


def p50(samples: list[float]) -> float:
    """Median of ``samples`` (which must not be empty)."""
    if not samples:
        raise ScaleBenchError("no samples to take a median of")
    return statistics.median(samples)


def memcpy_gbps(nbytes: int, threads: int, repeats: int = 3) -> float:
    """Median GB/s of copying ``nbytes`` between prefaulted buffers with ``threads`` threads.

    Args:
        nbytes: bytes per measurement; above :data:`MEMCPY_MAX_BYTES` one buffer of that
            size is copied as many times as it takes.
        threads: copying threads; each copies one contiguous share of the buffer.
        repeats: measurements; the median is returned.

    Returns:
        The median rate in GB/s.
    """
    size = max(threads * 4096, min(nbytes, MEMCPY_MAX_BYTES))
    rounds = max(1, -(-nbytes // size))
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    cut = [size * i // threads for i in range(threads + 1)]
    shares = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(cut)]
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(rounds):
                list(pool.map(lambda pair: np.copyto(pair[0], pair[1]), shares))
            times.append(time.perf_counter() - t0)
    return gbps(size * rounds, p50(times))


def memcpy_cpu_s_per_gb(nbytes: int, threads: int, repeats: int = 3) -> float:
    """CPU seconds per GB (10⁹ bytes) of copying between shared memory and a memfd.

    A buffer of ``min(nbytes, MEMCPY_MAX_BYTES)`` bytes in ``/dev/shm`` (the host pool's
    kind of memory) and one in a memfd (an engine's), both prefaulted, are copied into each
    other in turn by ``threads`` threads, one contiguous share each, ``repeats`` times each
    way; this process's CPU time (every thread's, user and system) over the bytes copied.

    Raises:
        ScaleBenchError: there is no ``/dev/shm`` or no memfd here.
    """
    import mmap
    import tempfile

    size = max(threads * 4096, min(nbytes, MEMCPY_MAX_BYTES))
    try:
        with tempfile.TemporaryFile(dir="/dev/shm") as shm:
            fd = os.memfd_create("kvtier-bench-memcpy")
            try:
                for f in (shm.fileno(), fd):
                    os.ftruncate(f, size)
                maps = [mmap.mmap(f, size) for f in (shm.fileno(), fd)]
            finally:
                os.close(fd)
            try:
                cpu = _copy_cpu(maps, size, threads, repeats)
            finally:
                for m in maps:
                    m.close()
    except (OSError, AttributeError) as err:  # no /dev/shm, or no memfd_create
        raise ScaleBenchError(f"cannot map shared memory and a memfd here: {err}") from err
    return cpu / (2 * repeats * size / 1e9)


def _copy_cpu(maps: list[Any], size: int, threads: int, repeats: int) -> float:
    """CPU seconds of ``repeats`` copies each way between the two mappings (their numpy
    views are gone when this returns, so that the mappings can close)."""
    host, engine = (np.frombuffer(m, dtype=np.uint8) for m in maps)
    host[:] = 1  # prefaulted, as the daemon's and the engines' memory are
    engine[:] = 2
    cut = [size * i // threads for i in range(threads + 1)]
    ways = [
        [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(cut)]
        for dst, src in ((host, engine), (engine, host))
    ]
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.process_time()
        for _ in range(repeats):
            for shares in ways:
                list(pool.map(lambda pair: np.copyto(pair[0], pair[1]), shares))
        return time.process_time() - t0


def reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the child processes still running, wait for them and close their pipes."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                stream.close()


def read_line(stream: IO[bytes], deadline: float, what: str) -> bytes:
    """Read one line from a child's pipe, waiting at most until ``deadline`` (monotonic).

    Raises:
        ScaleBenchError: the deadline passed, or the child closed the pipe first.
    """
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([stream], [], [], left)[0]:
        raise ScaleBenchError(f"{what}: no answer in time")
    line = stream.readline()
    if not line:
        raise ScaleBenchError(f"{what}: the process exited")
    return line.strip()


class EchoServer:
    """The bare ZeroMQ ROUTER echo server (:mod:`kvtier.bench.echo_server`) as a subprocess.

    Args:
        directory: where its ``ipc://`` socket goes (a short path).
    """

    def __init__(self, directory: Path) -> None:
        self.endpoint = f"ipc://{directory}/echo.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.echo_server", self.endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        assert self._proc.stdout is not None
        try:
            if read_line(self._proc.stdout, time.monotonic() + 60, "echo server") != b"ready":
                raise ScaleBenchError("echo server: unexpected first line")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None


def echo_rtts(endpoint: str, payload: bytes, n: int, timeout_s: float = 5.0) -> list[float]:
    """Round trips (seconds) of ``n`` echoes of ``payload`` through a DEALER, after a warm-up.

    Raises:
        ScaleBenchError: the server did not answer within ``timeout_s``.
    """
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    rtts = []
    try:
        for i in range(n + ECHO_WARMUP):
            t0 = time.perf_counter()
            sock.send(payload)
            if not sock.poll(int(timeout_s * 1000)):
                raise ScaleBenchError(f"echo server at {endpoint} did not answer")
            sock.recv()
            if i >= ECHO_WARMUP:
                rtts.append(time.perf_counter() - t0)
    finally:
        sock.close(0)
        ctx.term()
    return rtts


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (its threads included)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces; skip past it
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)


def memory_status(pid: int) -> dict[str, int]:
    """Resident memory of process ``pid`` in bytes: ``rss``, ``anon``, ``file``, ``shmem``.

    ``rss - shmem`` is what the process holds beyond shared memory (for kvtierd: beyond
    its host pool and the engines' mapped KV pools).
    """
    names = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = dict.fromkeys(names.values(), 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[names[key]] = int(value.split()[0]) * 1024  # kB
    return out
