"""``kvtier demo``: a multi-turn workload on the reference engine, with an engine restart.

Several conversations share a system prompt; each turn sends the conversation's history plus a
new user message, and appends the model's reply. The engine runs in a subprocess
(:mod:`kvtier.client.engine.worker`); half-way through, the demo kills it with SIGKILL and starts
a new one, whose L1 is cold: what it reuses comes from kvtierd's L2. Every turn is also run with
kvtier off, to check that the generated tokens are the same.

The daemon: with ``--own-daemon``, or when no daemon answers at the default runtime directory
(what ``kvtier health`` checks), the demo starts a private one in a runtime directory of its
own under /tmp and stops it at the end; otherwise it uses the running one. The private daemon
runs with L3 off (``--hicache-storage-backend none``, not kvtierd's default ``file`` store):
the demo shows what L2 keeps across a restart, and it leaves nothing behind, neither in the
user's state directory (``~/.local/state/kvtier``) nor anywhere else.

``restart_reuse_ratio`` = tokens the first turn after the restart loaded from L2 / tokens of
that conversation's prefix that L2 held before the restart (1.0: nothing was lost).
With ``--restart daemon`` the daemon is restarted too (stop, start on the same runtime
directory), which only reuses anything once kvtierd keeps its pool across restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.client.admin import AdminClient, AdminError
from kvtier.client.daemon_process import DaemonProcess
from kvtier.client.engine.worker import MODELS, model_config
from kvtier.config import KvtierError, runtime_dir, socket_path

__all__ = ["DemoConfig", "main", "print_table", "run_demo", "write_plot"]

_DEFAULTS = {  # model -> (page_size, system, user, reply tokens)
    "default": (64, 1024, 96, 24),
    "tiny": (16, 256, 40, 12),
}
# L3 off: the demo is about L2, and a private daemon writes nothing to disk (see the docstring).
_DAEMON_FLAGS = ["--hicache-size", "256MiB", "--lease-s", "10", "--hicache-storage-backend", "none"]
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
        restart: ``engine`` (SIGKILL the engine half-way) or ``daemon`` (restart both).
        own_daemon: always start a private daemon.
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
    own_daemon: bool = False
    seed: int = 0
    threads: int = 1


class _Worker:
    """An engine subprocess speaking JSON lines."""

    def __init__(self, cfg: DemoConfig, rdir: Path, num_pages: int) -> None:
        cmd = [sys.executable, "-m", "kvtier.client.engine.worker", "--model", cfg.model,
               "--page-size", str(cfg.page_size), "--num-pages", str(num_pages),
               "--runtime-dir", str(rdir), "--threads", str(cfg.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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


def _default_daemon_healthy() -> Path | None:
    rdir = runtime_dir(None)
    if not socket_path(rdir).exists():
        return None
    try:
        with AdminClient(socket_path(rdir), timeout_s=1.0) as admin:
            return rdir if admin.health().status == "ok" else None
    except AdminError:
        return None


def run_demo(cfg: DemoConfig, log: bool = True) -> dict[str, Any]:
    """Run the workload and return the per-turn rows and the restart reuse ratio.

    Args:
        cfg: the workload.
        log: print one progress line per turn to stderr.

    Returns:
        ``{"turns": [...], "restart_reuse_ratio": float | None, "all_match": bool, ...}``.

    Raises:
        KvtierError: a worker or the daemon failed, or ``--restart daemon`` with a daemon the
            demo does not own.
    """
    vocab = model_config(cfg.model).vocab_size
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, vocab, cfg.system_tokens).tolist()
    users = [[rng.integers(0, vocab, cfg.user_tokens).tolist() for _ in range(cfg.turns)]
             for _ in range(cfg.conversations)]
    longest = cfg.system_tokens + cfg.turns * (cfg.user_tokens + cfg.reply_tokens)
    num_pages = max(256, 4 * (-(-longest // cfg.page_size)))
    external = None if cfg.own_daemon else _default_daemon_healthy()
    if external is not None and cfg.restart == "daemon":
        raise KvtierError("--restart daemon needs a daemon the demo owns (use --own-daemon)")
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir="/tmp")) if external is None else None
    daemon = DaemonProcess(tmp, _DAEMON_FLAGS).start() if tmp is not None else None
    rdir = external or tmp
    assert rdir is not None
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    worker: _Worker | None = None
    try:
        worker = _Worker(cfg, rdir, num_pages)
        generation, restart_at = 0, cfg.turns // 2
        history = [system + users[c][0] for c in range(cfg.conversations)]
        for turn in range(cfg.turns):
            if turn == restart_at and turn > 0:
                worker.kill()
                if daemon is not None and cfg.restart == "daemon":
                    daemon.stop()
                    daemon = DaemonProcess(rdir, _DAEMON_FLAGS).start()
                generation += 1
                worker = _Worker(cfg, rdir, num_pages)
            for conv in range(cfg.conversations):
                prompt = history[conv]
                rep = worker.call({"op": "generate", "tokens": prompt,
                                   "max_new_tokens": cfg.reply_tokens, "compare": True,
                                   "report_stored": True})
                row = {k: v for k, v in rep.items() if k not in ("ok", "tokens")}
                row.update(conversation=conv, turn=turn, engine=generation,
                           first_after_restart=turn == restart_at and turn > 0 and conv == 0)
                rows.append(row)
                if log:
                    print(f"conv {conv} turn {turn}: {row['prompt_tokens']} tokens, "
                          f"L1 {row['cached_l1']} L2 {row['cached_l2']} computed "
                          f"{row['computed']}, TTFT {row['ttft_ms']:.1f} ms", file=sys.stderr)
                if turn + 1 < cfg.turns:
                    history[conv] = prompt + list(rep["tokens"]) + users[conv][turn + 1]
        worker.quit()
        worker = None
    finally:
        if worker is not None:
            worker.kill()
        if daemon is not None:
            daemon.stop()
            daemon.remove_pool()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return _summarize(cfg, rows, time.monotonic() - t0, external)


def _summarize(cfg: DemoConfig, rows: list[dict[str, Any]], elapsed: float,
               external: Path | None) -> dict[str, Any]:
    first = next((r for r in rows if r["first_after_restart"]), None)
    ratio = stored = reused = None
    if first is not None:
        before = [r for r in rows if r["conversation"] == first["conversation"]
                  and r["turn"] == int(first["turn"]) - 1]
        stored = int(before[-1]["stored_tokens"]) if before else 0
        reused = int(first["cached_l2"])
        ratio = reused / stored if stored else None
    return {"model": cfg.model, "page_size": cfg.page_size, "restart": cfg.restart,
            "daemon": str(external) if external else "private", "turns": rows,
            "restart_reuse_ratio": ratio, "restart_stored_tokens": stored,
            "restart_reused_tokens": reused,
            "all_match": all(bool(r["matches_uncached"]) for r in rows),
            "elapsed_s": round(elapsed, 2)}


def print_table(result: dict[str, Any]) -> None:
    """Print the per-turn table and the summary.

    Args:
        result: from :func:`run_demo`.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier demo ({result['model']} model, restart: {result['restart']})")
    for col in ("conv", "turn", "engine", "prompt", "L1", "L2", "L3", "computed", "TTFT ms",
                "uncached ms", "= uncached"):
        table.add_column(col, justify="right")
    for r in result["turns"]:
        style = "bold" if r["first_after_restart"] else None
        table.add_row(str(r["conversation"]), str(r["turn"]), str(r["engine"]),
                      str(r["prompt_tokens"]), str(r["cached_l1"]), str(r["cached_l2"]),
                      str(r["cached_l3"]), str(r["computed"]), f"{r['ttft_ms']:.1f}",
                      f"{r['uncached_ttft_ms']:.1f}", "yes" if r["matches_uncached"] else "NO",
                      style=style)
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    ratio = result["restart_reuse_ratio"]
    shown = f"{ratio:.3f}" if isinstance(ratio, float) else "n/a"
    console.print(f"restart_reuse_ratio: {shown} ({result['restart_reused_tokens']} of "
                  f"{result['restart_stored_tokens']} stored tokens reused after the restart); "
                  f"all turns match uncached: {result['all_match']}; {result['elapsed_s']} s")


def write_plot(result: dict[str, Any], path: str) -> None:
    """Write a PNG of TTFT and tokens per tier, turn by turn.

    Args:
        result: from :func:`run_demo`.
        path: the PNG's path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, Any]] = result["turns"]
    x = np.arange(len(rows))

    def get(key: str) -> np.ndarray:
        return np.array([float(r[key]) for r in rows])

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.plot(x, get("ttft_ms"), "o-", label="kvtier on")
    ax1.plot(x, get("uncached_ttft_ms"), "s--", label="kvtier off")
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    bottom = np.zeros(len(x))
    for key, label in (("cached_l1", "L1"), ("cached_l2", "L2"), ("cached_l3", "L3"),
                       ("computed", "computed")):
        ax2.bar(x, get(key), bottom=bottom, label=label)
        bottom += get(key)
    ax2.set_ylabel("prompt tokens")
    ax2.set_xlabel("turn (all conversations, in order)")
    ax2.legend()
    for i, r in enumerate(rows):
        if r["first_after_restart"]:
            for ax in (ax1, ax2):
                ax.axvline(i - 0.5, color="red", linestyle=":")
    fig.suptitle(f"kvtier demo: {result['restart']} restart at the red line")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Entry point of ``kvtier demo``.

    Args:
        argv: the arguments after ``demo``.

    Returns:
        0 when every turn matched the uncached run and the restart reuse ratio is at least
        0.99, else 1.
    """
    p = argparse.ArgumentParser(
        prog="kvtier demo", description=__doc__.splitlines()[0],
        epilog="The demo uses the kvtierd running at the default runtime directory; with "
        "--own-daemon, or when none answers, it starts a private one under /tmp with a 256 MiB "
        "pool and L3 off (--hicache-storage-backend none): it shows L2 reuse and leaves no "
        "files behind (nothing in ~/.local/state/kvtier).")
    p.add_argument("--model", choices=MODELS, default="default")
    p.add_argument("--restart", choices=("engine", "daemon"), default="engine")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--page-size", type=int)
    p.add_argument("--system-tokens", type=int)
    p.add_argument("--user-tokens", type=int)
    p.add_argument("--reply-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="engine compute threads")
    p.add_argument("--own-daemon", action="store_true",
                   help="always start a private daemon (L2 only, removed at the end)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of TTFT and hits per turn")
    args = p.parse_args(argv)
    page, system, user, reply = _DEFAULTS[args.model]
    cfg = DemoConfig(model=args.model, page_size=args.page_size or page,
                     conversations=args.conversations, turns=args.turns,
                     system_tokens=args.system_tokens or system, user_tokens=args.user_tokens or user,
                     reply_tokens=args.reply_tokens or reply, restart=args.restart,
                     own_daemon=args.own_daemon, seed=args.seed, threads=args.threads)
    try:
        result = run_demo(cfg)
    except KvtierError as err:
        print(f"kvtier demo: {err}", file=sys.stderr)
        return 2
    print_table(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.plot:
        write_plot(result, args.plot)
    ratio = result["restart_reuse_ratio"]
    ok = bool(result["all_match"]) and (ratio is None or float(ratio) >= 0.99)
    if not ok:
        print("kvtier demo: targets not met (every turn equal to uncached, reuse ratio >= 0.99)"
              + (" - kvtierd does not keep its pool across restarts yet"
                 if args.restart == "daemon" and not ratio else ""), file=sys.stderr)
    return 0 if ok else 1
