"""Local servers for the L3 benches and tests: redis-server or mooncake_master on loopback.

Each server is started in a temporary work directory, waited for with a deadline (it must
answer, not merely exist), and stopped with SIGTERM (SIGKILL after 10 s) when the block ends.
Nothing binds beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from kvtier.daemon.storage.base import StorageBackend
from kvtier.daemon.storage.registry import create_backend

__all__ = ["LOOPBACK", "free_port", "free_ports", "port_open", "redis_pong", "server_backend"]

LOOPBACK = "127.0.0.1"
_READY_DEADLINE_S = 15.0


# -- servers ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def server_backend(
    backend: str, data_bytes: int, options: dict[str, Any], placement: str
) -> AsyncIterator[StorageBackend]:
    """Start the server (and a segment holder) on loopback; yield an unopened backend for it."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvtier-bench-{backend}-"))
    try:
        if backend == "redis":
            port = free_port()
            argv = [
                _binary("redis-server"),
                "--bind",
                LOOPBACK,
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ]
            with _process(argv, workdir, lambda: redis_pong(port), "redis-server"):
                yield create_backend(
                    "redis", {"url": f"redis://{LOOPBACK}:{port}/0", "timeout_s": 30, **options}
                )
        else:
            rpc, http, metrics = free_ports(3)
            argv = [
                _binary("mooncake_master"),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={http}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={metrics}",
            ]

            def ready() -> bool:
                return port_open(rpc) and port_open(http)

            config: dict[str, Any] = {
                "master_server_address": f"{LOOPBACK}:{rpc}",
                "metadata_server": f"http://{LOOPBACK}:{http}/metadata",
                "global_segment_size": 2 * data_bytes + (64 << 20),
            }
            with _process(argv, workdir, ready, "mooncake_master"):
                if placement == "local segment":
                    yield create_backend("mooncake", {**config, **options})
                    return
                flag = workdir / "holder.ready"
                holder = [sys.executable, "-c", _HOLDER, json.dumps(config), str(flag)]
                with _process(holder, workdir, flag.exists, "segment-holder"):
                    yield create_backend(
                        "mooncake", {**config, "global_segment_size": 0, **options}
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_HOLDER = """
import json, os, signal, sys, time
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
from mooncake.store import MooncakeDistributedStore
config = json.loads(sys.argv[1])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", config["metadata_server"], config["global_segment_size"], 16 << 20,
                 "tcp", "", config["master_server_address"])
if rc != 0:
    sys.exit(f"segment holder: setup failed ({rc})")
open(sys.argv[2], "w").close()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
"""
"""A process that only mounts memory into the store: the 'other node' pages live on."""


@contextlib.contextmanager
def _process(
    argv: list[str], workdir: Path, ready: Callable[[], bool], what: str
) -> Iterator[None]:
    log_path = workdir / f"{what}.log"
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": os.environ.get("MC_TCP_BIND_ADDRESS", LOOPBACK)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            env=env,
        )
    try:
        deadline = time.monotonic() + _READY_DEADLINE_S
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{what} did not start: {tail}")
            time.sleep(0.02)
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _binary(name: str) -> str:
    candidate = Path(sys.prefix) / "bin" / name
    found = str(candidate) if candidate.is_file() else shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} not found (make sysdeps / pip install 'kvtier[redis,mooncake]')"
        )
    return found


def free_port() -> int:
    """Return a free TCP port on the loopback address."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free TCP ports on the loopback address (all bound at once while
    they are chosen, so the kernel cannot hand out one port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_open(port: int) -> bool:
    """True when something accepts TCP connections on the loopback ``port``."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


def redis_pong(port: int) -> bool:
    """True when a Redis-protocol server on the loopback ``port`` answers PING."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
