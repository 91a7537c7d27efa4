"""Test-side handle of SGLang instance processes (``sglang_instance.py``) and their daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import protocol as P
from kvtier.launch.daemon_process import DaemonProcess

HERE = Path(__file__).resolve().parent
START_DEADLINE_S = 120.0
"""An instance imports SGLang (seconds on a busy machine): generous, it is a deadline."""
REPLY_DEADLINE_S = 120.0

DAEMON_ARGS = [
    "--hicache-size",
    "64MiB",
    "--extent-size",
    "4MiB",
    "--hicache-storage-backend",
    "none",
]


README = Path(__file__).resolve().parents[3] / "README.md"


def readme_extra_config() -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` JSON of README.md's SGLang section,
    as a user copies it (the tests load the backend with exactly that)."""
    text = README.read_text()
    section = text[text.index("## Using kvtier with SGLang") :]
    section = section[: section.index("\n## ", 1)]
    match = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", section)
    assert match, "README's SGLang section has no --hicache-storage-backend-extra-config"
    return json.loads(match.group(1))


def extra_config(runtime_dir: Path | str, **kvtier_keys: Any) -> dict[str, Any]:
    """README's extra config, pointed at a test daemon (plus ``kvtier_keys``)."""
    return {**readme_extra_config(), "runtime_dir": str(runtime_dir), **kvtier_keys}


class Instance:
    """One ``sglang_instance.py`` process, commanded line by line.

    Args:
        log_dir: where its stderr goes (``<name>.log``).
        name: a name for the log file.
        layout: SGLang's host layout.
        extra: the storage backend's extra config.
        env: extra environment variables.
        **cfg: more instance settings (``mla``, ``tp_rank``, ``tp_size``, ...).
    """

    def __init__(
        self,
        log_dir: Path,
        name: str,
        layout: str,
        extra: dict[str, Any],
        env: dict[str, str] | None = None,
        **cfg: Any,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        config = {"layout": layout, "extra": extra, **cfg}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close/kill)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "sglang_instance.py"), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self._ready = False

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its stderr."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def reply(self, deadline_s: float = REPLY_DEADLINE_S) -> dict[str, Any]:
        """The next ``@@`` reply, waiting at most ``deadline_s``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no reply in {deadline_s}s\n{self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n{self.log_tail()}")
            if line.startswith("@@"):
                rep = json.loads(line[2:])
                if "error" in rep:
                    raise RuntimeError(f"{self.name}: {rep['error']}\n{self.log_tail()}")
                return rep

    def wait_ready(self) -> Instance:
        """Wait until SGLang's classes are built and the backend attached."""
        if not self._ready:
            self.reply(START_DEADLINE_S)
            self._ready = True
        return self

    def send(self, op: str, **kw: Any) -> None:
        """Send a command (read its reply with :meth:`reply`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        """Send a command and return its reply."""
        self.wait_ready()
        self.send(op, **kw)
        return self.reply()

    def kill(self) -> None:
        """SIGKILL it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        """Ask it to quit (detaching the backend), SIGKILL it if it does not."""
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._log.close()


def start_daemon(runtime_dir: Path, *args: str) -> DaemonProcess:
    """A kvtierd on ``runtime_dir``: 64 MiB pool, 4 MiB extents, no L3; ``args`` come after
    (a later flag wins)."""
    return DaemonProcess(runtime_dir, [*DAEMON_ARGS, *args]).start()


def admin_stats(daemon: DaemonProcess) -> dict[str, Any]:
    """The daemon's STATS."""
    with AdminClient(daemon.endpoint) as admin:
        return dict(admin.stats())


def flush_l2(daemon: DaemonProcess) -> int:
    """Write L2 to L3 (SYNC), then drop every L2 page; the pages dropped."""
    with AdminClient(daemon.endpoint, timeout_s=30) as admin:
        admin.sync(30)
        rep = admin.call(P.Flush(req_id=0, admin_token="", tier="l2"))
    assert isinstance(rep, P.FlushReply), rep
    return rep.l2_pages


def both_ranks(ranks: list[Instance], op: str, **kw: Any) -> list[dict[str, Any]]:
    """The same command on every rank at once (SGLang's ranks run in lockstep); their
    replies, in rank order."""
    for r in ranks:
        r.wait_ready()
    for r in ranks:
        r.send(op, **kw)
    return [r.reply() for r in ranks]
