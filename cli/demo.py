"""``kvtier demo``: a multi-turn workload on the reference engine, with a restart half-way.

Several conversations share a system prompt; each turn sends the conversation's history plus a
new user message, and appends the model's reply. The engine runs in a subprocess
(:mod:`kvtier.engine.worker`); half-way through, the demo kills it with SIGKILL and starts
a new one, whose L1 is cold: what it reuses comes from kvtierd's L2. Every turn is also run with
kvtier off, to check that the generated tokens are the same.

The daemon is always a private one: a ``kvtierd`` started for the demo in a runtime directory of
its own (``/tmp/kvtier-demo-*``: its socket, log and state directory), with a 256 MiB host pool
in ``/dev/shm`` and L3 off (``--hicache-storage-backend none``), configured by flags only (the
caller's ``KVTIER_*`` variables and ``$KVTIER_CONFIG`` are not passed on). A kvtierd the user
runs (``make serve``) is never used, and nothing is written to the user's state directory. All
of it is removed at the end; the demo prints where it is while it runs.

``--restart daemon`` kills the engine and the daemon (both SIGKILL), starts kvtierd again on the
same runtime directory (it adopts the pool file the killed one left), then a new engine: the
table's ``engine`` and ``kvtierd`` columns both go 0 → 1, L1 starts empty, and what the first
turn after it reuses is what the restarted daemon kept.

``restart_reuse_ratio`` = tokens the first turn after the restart loaded from L2 / tokens of
that conversation's prefix that L2 held before the restart (1.0: nothing was lost).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from kvtier.config.arg_types import CliError, OneLineParser, bounded_int, positive_int
from kvtier.cli.demo_report import (
    header,
    print_lines,
    restart_banner,
    row_line,
    summary_lines,
    write_plot,
)
from kvtier.config import KvtierError, format_size, parse_size
from kvtier.config.loader import pool_path
from kvtier.engine.worker import MODELS, model_config
from kvtier.launch.daemon_process import DaemonProcess

__all__ = ["DEFAULT_PLOT", "DemoConfig", "main", "run_demo"]

_DEFAULTS = {  # model -> (page_size, system, user, reply tokens)
    "default": (64, 1024, 96, 24),
    "tiny": (16, 256, 40, 12),
}
# L3 off: the demo is about L2, and its private daemon writes nothing to disk (see the docstring).
_POOL_SIZE = "256MiB"
_DAEMON_FLAGS = [
    "--hicache-size",
    _POOL_SIZE,
    "--lease-s",
    "10",
    "--hicache-storage-backend",
    "none",
]
DEFAULT_PLOT = "kvtier-demo.png"  # in the current directory
_REPLY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's workload and setup.

    Attributes:
        model: ``default`` or ``tiny``.
        page_size: tokens per KV page.
        conversations / turns: the workload's shape.
        system_tokens / user_tokens / reply_tokens: lengths of the shared system prompt, of each
            user message and of each reply.
        restart: ``engine`` (SIGKILL the engine half-way) or ``daemon`` (SIGKILL both, then
            restart the daemon and a new engine).
        seed: seed of the token streams.
        threads: the engine's torch compute threads (one by default: on a small shared machine
            two threads that other processes preempt stall at every operator, which makes
            short prefills look far slower than they are).
    """

    model: str = "default"
    page_size: int = 64
    conversations: int = 3
    turns: int = 6
    system_tokens: int = 1024
    user_tokens: int = 96
    reply_tokens: int = 24
    restart: str = "engine"
    seed: int = 0
    threads: int = 1


class _Worker:
    """An engine subprocess speaking JSON lines."""

    def __init__(self, cfg: DemoConfig, rdir: Path, num_pages: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kvtier.engine.worker",
            "--model",
            cfg.model,
            "--page-size",
            str(cfg.page_size),
            "--num-pages",
            str(num_pages),
            "--runtime-dir",
            str(rdir),
            "--threads",
            str(cfg.threads),
        ]
        # no KVTIER_* variables: a $KVTIER_ENDPOINT would send the engine to another daemon
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        self._buf = b""
        try:
            ready = self._read()
            if not ready.get("ready"):
                raise KvtierError(f"engine worker did not start: {ready}")
        except BaseException:
            self.kill()
            raise
        self.pid = int(ready["pid"])

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply; KvtierError when the worker reports one."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        rep = self._read()
        if not rep.get("ok"):
            raise KvtierError(f"engine worker: {rep.get('error')}")
        return rep

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise KvtierError(f"engine worker silent for {_REPLY_TIMEOUT_S}s")
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise KvtierError(f"engine worker exited with {self.proc.wait()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close_pipes()

    def quit(self) -> None:
        """Ask the worker to exit (it closes its engines); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call({"op": "quit"})
                self.proc.wait(30)
            except (KvtierError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def where_lines(daemon: DaemonProcess) -> list[str]:
    """What the demo tells the user about its private daemon and where its files are."""
    pool = pool_path(Path("/dev/shm"), daemon.runtime_dir)
    return [
        f"kvtier demo: a private kvtierd (pid {daemon.pid}), not one you may run yourself:",
        f"  runtime dir  {daemon.runtime_dir} (socket, kvtierd.log, state/)",
        f"  host pool    {format_size(parse_size(_POOL_SIZE))} in {pool}",
        "  L3           off: nothing is written to your state directory",
        "  all of it is removed when the demo ends",
    ]


def run_demo(cfg: DemoConfig, out: TextIO | None = None) -> dict[str, Any]:
    """Run the workload on a private daemon and return the per-turn rows and the reuse ratio.

    Args:
        cfg: the workload.
        out: where to print, as it happens, where the daemon is and the table's lines (one
            per turn, and one where the restart happens); None: print nothing.

    Returns:
        ``{"turns": [...], "restart_reuse_ratio": float | None, "all_match": bool, ...}``;
        each turn has ``engine`` and ``daemon``: how many restarts each went through.

    Raises:
        KvtierError: a worker or the daemon failed.
    """
    vocab = model_config(cfg.model).vocab_size
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, vocab, cfg.system_tokens).tolist()
    users = [
        [rng.integers(0, vocab, cfg.user_tokens).tolist() for _ in range(cfg.turns)]
        for _ in range(cfg.conversations)
    ]
    longest = cfg.system_tokens + cfg.turns * (cfg.user_tokens + cfg.reply_tokens)
    num_pages = max(256, 4 * (-(-longest // cfg.page_size)))
    rdir = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir="/tmp"))
    # flags only: --state-dir beats a $KVTIER_STATE_DIR, and isolated drops KVTIER_* / KVTIER_CONFIG
    flags = [*_DAEMON_FLAGS, "--state-dir", str(rdir / "state")]
    daemon: DaemonProcess | None = None
    worker: _Worker | None = None
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    try:
        daemon = DaemonProcess(rdir, flags, isolated=True).start()
        if out is not None:
            print_lines([*where_lines(daemon), "", *header()], out)
        worker = _Worker(cfg, rdir, num_pages)
        engines = daemons = 0
        restart_at = cfg.turns // 2
        history = [system + users[c][0] for c in range(cfg.conversations)]
        for turn in range(cfg.turns):
            if turn == restart_at and turn > 0:
                worker.kill()
                engines += 1
                if cfg.restart == "daemon":
                    daemon.kill()  # as a crash would: the pool file stays, the next one adopts it
                    daemon = DaemonProcess(rdir, flags, isolated=True).start()
                    daemons += 1
                if out is not None:
                    print_lines([restart_banner(cfg.restart)], out)
                worker = _Worker(cfg, rdir, num_pages)
            for conv in range(cfg.conversations):
                prompt = history[conv]
                rep = worker.call(
                    {
                        "op": "generate",
                        "tokens": prompt,
                        "max_new_tokens": cfg.reply_tokens,
                        "compare": True,
                        "report_stored": True,
                    }
                )
                row = {k: v for k, v in rep.items() if k not in ("ok", "tokens")}
                row.update(
                    conversation=conv,
                    turn=turn,
                    engine=engines,
                    daemon=daemons,
                    first_after_restart=turn == restart_at and turn > 0 and conv == 0,
                )
                rows.append(row)
                if out is not None:
                    print_lines([row_line(row)], out)
                if turn + 1 < cfg.turns:
                    history[conv] = prompt + list(rep["tokens"]) + users[conv][turn + 1]
        worker.quit()
        worker = None
    finally:
        if worker is not None:
            worker.kill()
        if daemon is not None:
            daemon.discard()
        shutil.rmtree(rdir, ignore_errors=True)
    return _summarize(cfg, rows, time.monotonic() - t0)


def _summarize(cfg: DemoConfig, rows: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """The result dict: the rows plus the restart reuse ratio and whether every turn matched."""
    first = next((r for r in rows if r["first_after_restart"]), None)
    ratio = stored = reused = None
    if first is not None:
        before = [
            r
            for r in rows
            if r["conversation"] == first["conversation"] and r["turn"] == int(first["turn"]) - 1
        ]
        stored = int(before[-1]["stored_tokens"]) if before else 0
        reused = int(first["cached_l2"])
        ratio = reused / stored if stored else None
    return {
        "model": cfg.model,
        "page_size": cfg.page_size,
        "restart": cfg.restart,
        "daemon": "private",
        "turns": rows,
        "restart_reuse_ratio": ratio,
        "restart_stored_tokens": stored,
        "restart_reused_tokens": reused,
        "all_match": all(bool(r["matches_uncached"]) for r in rows),
        "elapsed_s": round(elapsed, 2),
    }


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kvtier demo``."""
    p = OneLineParser(
        prog="kvtier demo",
        description=__doc__.splitlines()[0],
        epilog="The demo always starts a private kvtierd under /tmp (256 MiB pool in /dev/shm, "
        "L3 off) and removes it at the end: a kvtierd you run yourself is not used, and nothing "
        "is written to your state directory (~/.local/state/kvtier). Model defaults (page "
        "size, system / user / reply tokens): default 64, 1024, 96, 24; tiny 16, 256, 40, 12.",
    )
    p.add_argument(
        "--model", choices=MODELS, default="default", help="reference model size (default: default)"
    )
    p.add_argument(
        "--restart",
        choices=("engine", "daemon"),
        default="engine",
        help="what is SIGKILLed half-way: the engine, or the engine and kvtierd "
        "(kvtierd then restarts on its pool file before the new engine starts); "
        "default: engine",
    )
    p.add_argument(
        "--conversations",
        type=positive_int,
        default=3,
        help="conversations, one table row each per turn (default: 3)",
    )
    p.add_argument(
        "--turns",
        type=positive_int,
        default=6,
        help="turns per conversation; the restart comes before turn TURNS // 2 (default: 6)",
    )
    p.add_argument("--page-size", type=positive_int, help="tokens per KV page (default: per model)")
    p.add_argument(
        "--system-tokens", type=positive_int, help="shared system prompt (default: per model)"
    )
    p.add_argument(
        "--user-tokens", type=positive_int, help="each user message (default: per model)"
    )
    p.add_argument("--reply-tokens", type=positive_int, help="each reply (default: per model)")
    p.add_argument(
        "--seed", type=bounded_int(0), default=0, help="seed of the token streams (default: 0)"
    )
    p.add_argument(
        "--threads", type=positive_int, default=1, help="engine compute threads (default: 1)"
    )
    p.add_argument(
        "--own-daemon",
        action="store_true",
        help="accepted for old scripts: the demo always runs its own daemon",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    p.add_argument(
        "--plot",
        metavar="PATH",
        default=DEFAULT_PLOT,
        help="write a PNG of TTFT and tokens per tier, turn by turn, here "
        f"(default: {DEFAULT_PLOT} in the current directory)",
    )
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    return p


def _unwritable(path: str | None) -> str | None:
    """Why a file cannot be written at ``path`` (its directory is made if missing), or
    None when it can (or ``path`` is None)."""
    if path is None:
        return None
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        return f"cannot make its directory: {err.strerror}"
    if os.path.isdir(path):
        return "is a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is not writable"
    return None


@contextlib.contextmanager
def _cleanup_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (a ``kill``, a closed terminal, a cancelled job) end the demo as
    Ctrl-C does, through its ``finally``: its private kvtierd stopped, its pool and runtime
    directory removed, rather than left behind by the signal's default action."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    """Entry point of ``kvtier demo``.

    Args:
        argv: the arguments after ``demo``.

    Returns:
        0 when every turn matched the uncached run and the restart reuse ratio is at least
        0.99, 1 when not, 2 when the demo could not run.
    """
    try:
        args = build_parser().parse_args(argv)
    except CliError as err:
        print(f"kvtier demo: {err}", file=sys.stderr)
        return err.code
    page, system, user, reply = _DEFAULTS[args.model]
    cfg = DemoConfig(
        model=args.model,
        page_size=args.page_size or page,
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens or system,
        user_tokens=args.user_tokens or user,
        reply_tokens=args.reply_tokens or reply,
        restart=args.restart,
        seed=args.seed,
        threads=args.threads,
    )
    plot = None if args.no_plot else os.path.abspath(args.plot)
    path = os.path.abspath(args.json) if args.json else None
    for flag, target in (("--plot", plot), ("--json", path)):
        why = _unwritable(target)
        if why is not None:  # said now: the demo takes minutes, and its numbers would be lost
            print(f"kvtier demo: {flag} {target}: {why}", file=sys.stderr)
            return 2
    try:
        with _cleanup_on_signals():
            result = run_demo(cfg, out=sys.stdout)
    except KvtierError as err:
        print(f"kvtier demo: {err}", file=sys.stderr)
        return 2
    outputs: list[tuple[str, str]] = []
    try:
        if plot is not None:
            try:
                write_plot(result, plot)
                outputs.append(("plot", plot))
            except ImportError:
                missing = "not written: matplotlib is missing (pip install 'kvtier[plot]')"
                outputs.append(("plot", missing))
        if path is not None:
            with open(path, "w") as fh:
                json.dump(result, fh, indent=2)
            outputs.append(("json", path))
    except OSError as err:
        print(f"kvtier demo: cannot write {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    print_lines(["", *summary_lines(result, outputs)], sys.stdout)
    ratio = result["restart_reuse_ratio"]
    ok = bool(result["all_match"]) and (ratio is None or float(ratio) >= 0.99)
    if not ok:
        print(
            "kvtier demo: targets not met (every turn equal to uncached, reuse ratio >= 0.99)",
            file=sys.stderr,
        )
    return 0 if ok else 1
