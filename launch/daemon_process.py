"""Start and stop a ``kvtierd`` process (used by the demo, the benchmarks and the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.config import KvtierError, socket_path
from kvtier.config.loader import pool_path

if TYPE_CHECKING:
    from typing import Self


class DaemonStartError(KvtierError):
    """kvtierd exited or did not become healthy in time (the message has its log tail)."""


class DaemonProcess:
    """A ``kvtierd`` subprocess with its own runtime directory and its own state directory.

    The state directory is where the default ``file`` L3 store lives (``<state_dir>/l3``).
    A daemon started here never shares the user's (``~/.local/state/kvtier``, or a service's
    ``$STATE_DIRECTORY``): it gets ``state_dir`` as ``$STATE_DIRECTORY``, the lowest-ranked
    source, so ``--state-dir``, a ``state_dir`` key of a ``--config`` file and
    ``$KVTIER_STATE_DIR`` still win (like systemd, this helper only offers a directory).

    Args:
        runtime_dir: the daemon's runtime directory (socket, completion blocks).
        args: extra ``kvtierd`` flags, e.g. ``["--hicache-size", "256MiB"]``.
        env: extra environment variables (a ``STATE_DIRECTORY`` here replaces ``state_dir``).
        log_path: where its stderr goes (default: ``<runtime_dir>/kvtierd.log``).
        state_dir: the state directory offered to the daemon (default:
            ``<runtime_dir>/state``: private to it, and gone with its runtime directory).
        isolated: configure the daemon by ``args`` (and ``env``) only: the caller's
            ``KVTIER_*`` variables, ``$KVTIER_CONFIG`` included, are not passed on (the demo
            uses this so that a user's settings cannot point its daemon at their files).
        module: the module run with ``python -m`` (a launcher that runs the daemon's own
            ``main`` after setting something up, e.g. a test's CUDA backend).
    """

    def __init__(
        self,
        runtime_dir: str | Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        state_dir: str | Path | None = None,
        isolated: bool = False,
        module: str = "kvtier.daemon",
    ) -> None:
        self.runtime_dir = Path(runtime_dir)
        self.state_dir = Path(state_dir) if state_dir else self.runtime_dir / "state"
        self.args = list(args)
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else self.runtime_dir / "kvtierd.log"
        self.isolated = isolated
        self.module = module
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        """The control socket's path."""
        return socket_path(self.runtime_dir)

    @property
    def endpoint(self) -> str:
        """The control socket's ZeroMQ endpoint."""
        return f"ipc://{self.socket}"

    @property
    def pid(self) -> int:
        """The process id (0 when not running)."""
        return self.proc.pid if self.proc else 0

    def start(self, timeout: float = 30.0) -> Self:
        """Start the daemon and wait until it answers HEALTH."""
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        inherited = {
            k: v for k, v in os.environ.items() if not (self.isolated and k.startswith("KVTIER_"))
        }
        env = {
            **inherited,
            "STATE_DIRECTORY": str(self.state_dir),
            **self.env,
            "KVTIER_RUNTIME_DIR": str(self.runtime_dir),
        }
        env.pop("NOTIFY_SOCKET", None) if "NOTIFY_SOCKET" not in self.env else None
        # stays open while the daemon runs (its stdout and stderr); _reap closes it
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonStartError(
                    f"kvtierd exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self.socket.exists():
                try:
                    with AdminClient(self.endpoint, timeout_s=0.5) as admin:
                        status = admin.health().status
                        # degraded: serving L2 while its L3 is away (it retries L3 itself)
                        if (status == "ok" or status.startswith("degraded")) and self._holds_dir():
                            return self
                except AdminError:
                    pass
            time.sleep(0.05)
        self.kill()
        raise DaemonStartError(f"kvtierd not healthy after {timeout}s:\n{self.log_tail()}")

    def _holds_dir(self) -> bool:
        """True when this process is the daemon holding the runtime dir's lock (its pid is
        in ``kvtierd.lock``): a HEALTH answer may come from another daemon on the dir."""
        try:
            text = (self.runtime_dir / "kvtierd.lock").read_text().strip()
        except OSError:
            return False
        return self.proc is not None and text.split()[:1] == [str(self.proc.pid)]

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the daemon logged."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._reap()

    def kill(self) -> int:
        """SIGKILL now and reap."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return self._reap()

    def discard(self, timeout: float = 20.0) -> int:
        """Stop the daemon and remove its pool file, also when the stop is interrupted (a
        Ctrl-C while waiting): for runs whose pool is not kept for a next start (benchmarks,
        the demo). Returns the exit code."""
        try:
            return self.stop(timeout)
        finally:
            self.remove_pool()

    def remove_pool(self, pool_dir: str | Path = "/dev/shm") -> None:
        """Remove the host pool file a killed daemon left behind."""
        pool_path(Path(pool_dir), self.runtime_dir).unlink(missing_ok=True)

    def _reap(self) -> int:
        assert self.proc is not None
        code = self.proc.returncode
        self._log.close()
        self.proc = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
