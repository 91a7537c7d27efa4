"""Real servers for integration tests: redis-server and mooncake_master on loopback.

Each server runs as a subprocess bound to 127.0.0.1 on free ports, is ready when its ports
answer (bounded by a deadline), and is stopped (redis-server: SIGTERM, then SIGKILL;
mooncake_master, which persists nothing: SIGKILL). Tests use the ``start_*`` functions, the
``running_*`` context managers, or fixtures. A test module declares its fixture from a
generator body, so no imported fixture name is shadowed by test parameters::

    @pytest.fixture
    def redis_server() -> Iterator[RedisServer]:
        yield from serve_redis()

(``redis_server`` / ``mooncake_master`` are also importable as ready-made fixtures, or a
conftest can list this module in ``pytest_plugins``.) A fixture skips its test, with the
reason, only when the binary is not installed (``make sysdeps`` installs redis-server; the
venv carries mooncake_master).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvtier.bench.local_servers import free_port, free_ports, port_open, redis_pong

__all__ = [
    "MooncakeMaster",
    "RedisServer",
    "find_binary",
    "free_port",
    "mooncake_master",
    "redis_server",
    "running_mooncake_master",
    "running_redis",
    "start_mooncake_master",
    "start_redis",
]

LOOPBACK = "127.0.0.1"
READY_DEADLINE_S = 15.0


def find_binary(name: str) -> str | None:
    """Find ``name`` in this interpreter's environment (the venv's bin) first, then on PATH."""
    candidate = Path(sys.prefix) / "bin" / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


@dataclass
class _Process:
    """A server subprocess with its log file."""

    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.log_path.parent,
                start_new_session=True,
            )

    def wait_ready(self, ready: Callable[[], bool], what: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while not ready():
            assert self.proc is not None
            if self.proc.poll() is not None:
                message = f"{what} exited with {self.proc.returncode}: {self.log_tail()}"
                self.remove()
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                self.stop()
                message = f"{what} not ready after {deadline_s} s: {self.log_tail()}"
                self.remove()
                raise RuntimeError(message)
            time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def remove(self) -> None:
        """Stop the process and delete its working directory (log included)."""
        self.stop()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)


@dataclass
class RedisServer:
    """A redis-server on 127.0.0.1 (no persistence).

    Attributes:
        port: its port; ``url``: ``redis://127.0.0.1:<port>/0``.
    """

    port: int
    _process: _Process = field(repr=False)

    @property
    def url(self) -> str:
        """The URL a client connects to."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def kill(self) -> None:
        """Kill the server (SIGKILL)."""
        self._process.kill()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers."""
        assert self._process.proc is not None
        self._process.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT)."""
        assert self._process.proc is not None
        self._process.proc.send_signal(signal.SIGCONT)

    def restart(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Start the server again on the same port (empty, as nothing is persisted)."""
        self._process.stop()
        self._process.spawn()
        self._process.wait_ready(lambda: redis_pong(self.port), "redis-server", deadline_s)

    def stop(self) -> None:
        """Stop the server and remove its working directory."""
        self._process.remove()


@dataclass
class MooncakeMaster:
    """A mooncake_master on 127.0.0.1 with its HTTP metadata server.

    Attributes:
        rpc_port, http_port, metrics_port: its ports.
    """

    rpc_port: int
    http_port: int
    metrics_port: int
    _process: _Process = field(repr=False)

    @property
    def master_server_address(self) -> str:
        """``host:port`` of the master's RPC server."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """URL of the HTTP metadata server."""
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def extra_config(self, **overrides: object) -> dict[str, object]:
        """Extra config for the ``mooncake`` backend pointing at this master (small segments)."""
        config: dict[str, object] = {
            "master_server_address": self.master_server_address,
            "metadata_server": self.metadata_server,
            "local_hostname": LOOPBACK,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
        }
        config.update(overrides)
        return config

    def kill(self) -> None:
        """Kill the master (SIGKILL)."""
        self._process.kill()

    def restart(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Start the master again on the same ports (it comes back empty)."""
        self._process.stop()
        self._process.spawn()
        self._process.wait_ready(
            lambda: port_open(self.rpc_port) and port_open(self.http_port),
            "mooncake_master",
            deadline_s,
        )

    def stop(self) -> None:
        """Stop the master (SIGKILL: it persists nothing, and SIGTERM costs a second) and
        remove its working directory."""
        self._process.kill()
        self._process.remove()


def start_redis(*extra_args: str, deadline_s: float = READY_DEADLINE_S) -> RedisServer:
    """Start ``redis-server --bind 127.0.0.1 --port <free> --save '' --appendonly no``.

    Args:
        extra_args: more ``--directive value`` arguments (e.g. ``--rename-command EVAL ""``).

    Raises:
        FileNotFoundError: redis-server is not installed.
        RuntimeError: it exited or did not answer PING within ``deadline_s``.
    """
    binary = find_binary("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not found (make sysdeps installs it)")
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
    argv = [
        binary,
        "--bind",
        LOOPBACK,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "yes",
        "--dir",
        str(log_dir),
        "--daemonize",
        "no",
        *extra_args,
    ]
    process = _Process(argv, log_dir / "redis.log")
    process.spawn()
    process.wait_ready(lambda: redis_pong(port), "redis-server", deadline_s)
    return RedisServer(port, process)


def start_mooncake_master(deadline_s: float = READY_DEADLINE_S) -> MooncakeMaster:
    """Start ``mooncake_master`` with its HTTP metadata server, all on 127.0.0.1.

    Raises:
        FileNotFoundError: mooncake_master is not installed.
        RuntimeError: it exited or its ports did not open within ``deadline_s``.
    """
    binary = find_binary("mooncake_master")
    if binary is None:
        raise FileNotFoundError(
            "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
        )
    rpc, http, metrics = free_ports(3)
    log_dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
    argv = [
        binary,
        f"--rpc_address={LOOPBACK}",
        f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={LOOPBACK}",
        f"--http_metadata_server_port={http}",
        f"--metrics_host={LOOPBACK}",
        f"--metrics_port={metrics}",
    ]
    process = _Process(argv, log_dir / "master.log")
    process.spawn()
    process.wait_ready(lambda: port_open(rpc) and port_open(http), "mooncake_master", deadline_s)
    return MooncakeMaster(rpc, http, metrics, process)


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A redis-server for the ``with`` block."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_mooncake_master() -> Iterator[MooncakeMaster]:
    """A mooncake_master for the ``with`` block."""
    master = start_mooncake_master()
    try:
        yield master
    finally:
        master.stop()


def serve_redis(*extra_args: str) -> Generator[RedisServer, None, None]:
    """Fixture body: a fresh redis-server, stopped afterwards; skips when the binary is missing.

    A test module declares its own fixture with it (no imported fixture names to shadow)::

        @pytest.fixture
        def redis_server() -> Iterator[RedisServer]:
            yield from serve_redis()
    """
    try:
        server = start_redis(*extra_args)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    try:
        yield server
    finally:
        server.stop()


def serve_mooncake_master() -> Generator[MooncakeMaster, None, None]:
    """Fixture body: a fresh mooncake_master, stopped afterwards; skips when it is missing."""
    try:
        master = start_mooncake_master()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    try:
        yield master
    finally:
        master.stop()


redis_server = pytest.fixture(serve_redis, name="redis_server")
"""The same as an importable fixture: ``from tests.servers import redis_server``."""

mooncake_master = pytest.fixture(serve_mooncake_master, name="mooncake_master")
"""The same as an importable fixture: ``from tests.servers import mooncake_master``."""


class RawDealer:
    """A bare ZeroMQ DEALER for tests that speak to kvtierd frame by frame: it sends
    whatever frames it is given (well-formed or not) and waits, bounded, for one reply.

    Args:
        endpoint: the daemon's ``ipc://`` endpoint.
        wait_s: how long :meth:`ask` waits for the reply.
    """

    def __init__(self, endpoint: str, wait_s: float = 5.0) -> None:
        import zmq

        self.rdir = Path(endpoint.removeprefix("ipc://")).parent  # the handover socket's dir
        self.wait_s = wait_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes):  # -> P.Reply
        """Send ``frames`` as one message; the decoded reply (fails the test on none)."""
        from kvtier.ipc import protocol as P

        self.sock.send_multipart(list(frames))
        assert self.sock.poll(int(self.wait_s * 1000)), "kvtierd did not answer"
        return P.decode_reply(self.sock.recv())

    def close(self) -> None:
        """Close the socket and its context."""
        self.sock.close(0)
        self.ctx.term()


def run_kvtierd(rdir: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvtierd --runtime-dir rdir ARGS`` to its end (a start expected to be refused),
    with no ``KVTIER_*`` variable and no systemd notify socket of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--runtime-dir", str(rdir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
