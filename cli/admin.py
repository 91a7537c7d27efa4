"""``kvtier stats | sessions | flush | sync | health``: the operator's view of a running
kvtierd.

Each command opens an :class:`~kvtier.client.admin.AdminClient` on the daemon's control
socket, sends one request (``STATS``, ``FLUSH``, ``SYNC`` or ``HEALTH``), prints the answer
and exits. Nothing here registers an engine or touches shared memory.

Where the daemon is, lowest precedence first: the default runtime directory, then
``KVTIER_RUNTIME_DIR`` / ``KVTIER_ENDPOINT`` (read by the config loader, as engines read
them), then ``--runtime-dir`` / ``--endpoint``. The admin credential comes from
``--admin-token`` or ``$KVTIER_ADMIN_TOKEN`` (prefer the variable: command lines are
visible to every user of the machine).

Exit codes, for scripts and probes::

    0  success (health: the daemon answers and is healthy)
    1  the daemon refused the request, is unhealthy, or did not answer
    2  bad usage (unknown flag, bad value); nothing was sent
    130  interrupted (Ctrl-C) outside ``stats --watch``

Errors print one line on stderr: ``kvtier <command>: <what went wrong>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import zmq
from kvtier.client.admin import AdminClient, AdminError
from kvtier.config import (
    ClientConfig,
    ConfigError,
    format_size,
    load_config,
    runtime_dir,
    socket_path,
)
from kvtier.ipc import protocol as P
from kvtier.ipc.sockets import ipc_endpoint

__all__ = ["COMMANDS", "CliError", "build_parser", "main", "render_sessions", "render_stats"]

COMMANDS = ("stats", "sessions", "flush", "sync", "health")
WATCH_MIN_S = 0.1  # refresh no faster than this: a STATS reply walks every session
WATCH_MAX_S = 3600.0
ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"


class CliError(Exception):
    """A command failed; ``code`` is the exit status (1: daemon side, 2: usage)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------- arguments
class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (a :class:`CliError`, code 2)."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage block and exiting."""
        raise CliError(2, f"{message} (see {self.prog} --help)")


def _positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _watch_seconds(text: str) -> float:
    """argparse type: the ``--watch`` interval, bounded to [WATCH_MIN_S, WATCH_MAX_S]."""
    value = _positive_seconds(text)
    if not WATCH_MIN_S <= value <= WATCH_MAX_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside [{WATCH_MIN_S}, {WATCH_MAX_S:.0f}] seconds")
    return value


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _namespace_hex(text: str) -> str:
    """argparse type: a namespace fingerprint, 32 bytes as 64 hex digits."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not hexadecimal") from None
    if len(raw) != P.KEY_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} has {len(raw)} bytes; a namespace fingerprint has {P.KEY_BYTES} "
            f"({2 * P.KEY_BYTES} hex digits)")
    return raw.hex()


def build_parser(command: str) -> argparse.ArgumentParser:
    """Return the argument parser of ``kvtier <command>``.

    Args:
        command: one of :data:`COMMANDS`.

    Raises:
        ValueError: ``command`` is not an admin command.
    """
    texts = {
        "stats": "Pool use, sessions, hit rates per tier, bytes moved and L3 health.",
        "sessions": "Engine sessions registered with the daemon.",
        "flush": "Drop cached pages (needs the admin token when the daemon has one).",
        "sync": "Write every L2 page not yet in L3 to L3 and wait until written (before a "
                "reboot or maintenance: L2 lives in memory, L3 on disk or in a cluster).",
        "health": "Print one line and exit 0 when kvtierd is healthy, 1 otherwise (probes).",
    }
    if command not in texts:
        raise ValueError(f"command = {command!r} is not one of {', '.join(COMMANDS)}")
    p = _Parser(prog=f"kvtier {command}", description=texts[command])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--runtime-dir", metavar="DIR", type=Path,
                       help="the daemon's runtime directory (default: $KVTIER_RUNTIME_DIR, else "
                            "$XDG_RUNTIME_DIR/kvtier, else /tmp/kvtier-<uid>)")
    where.add_argument("--endpoint", metavar="ENDPOINT",
                       help="ZeroMQ endpoint (ipc://PATH or tcp://HOST:PORT) or a socket path; "
                            "default: $KVTIER_ENDPOINT, else the runtime directory's socket")
    p.add_argument("--timeout", metavar="SECONDS", type=_positive_seconds, default=None,
                   help="wait this long for each reply (default: request_timeout_s, 2)")
    if command != "health":
        p.add_argument("--admin-token", metavar="TOKEN",
                       default=os.environ.get(ADMIN_TOKEN_ENV, ""),  # read once, as a default
                       help=f"admin credential (default: ${ADMIN_TOKEN_ENV}; prefer the "
                            "variable, command lines are visible to other users)")
    if command in ("stats", "sessions"):
        p.add_argument("--json", action="store_true", help="print the daemon's raw answer as JSON")
    if command == "stats":
        p.add_argument("--watch", metavar="SECONDS", nargs="?", const=2.0, type=_watch_seconds,
                       help=f"refresh every SECONDS (default 2, within [{WATCH_MIN_S}, "
                            f"{WATCH_MAX_S:.0f}]) until Ctrl-C; with --json, one line per refresh")
        p.add_argument("--count", metavar="N", type=_positive_int,
                       help="with --watch: stop after N refreshes")
    if command == "flush":
        p.add_argument("--tier", choices=("l2", "l3", "all"), default="l2",
                       help="which tier to drop pages from (default: l2)")
        p.add_argument("--namespace", metavar="HEX", type=_namespace_hex, default=None,
                       help="only this namespace fingerprint (64 hex digits; default: all)")
    if command == "sync":
        p.add_argument("--wait", metavar="SECONDS", type=_sync_seconds, default=600.0,
                       help="answer after at most this long, writes still pending or not "
                            "(default 600, at most 3600); exit 1 if pages were left or failed")
    if command == "health":
        p.add_argument("--strict", action="store_true",
                       help="treat a degraded daemon (L2 serving, L3 failing) as unhealthy")
    return p


def resolve_endpoint(runtime_dir_flag: Path | None, endpoint_flag: str | None) -> str:
    """Where the daemon listens, as engines would find it.

    Args:
        runtime_dir_flag: ``--runtime-dir``, or None.
        endpoint_flag: ``--endpoint``, or None.

    Returns:
        A ZeroMQ endpoint (``ipc://...`` or ``tcp://...``).

    Raises:
        CliError: (code 2) a ``KVTIER_*`` variable holds a bad value.
    """
    if endpoint_flag:
        return endpoint_flag if "://" in endpoint_flag else ipc_endpoint(endpoint_flag)
    cli = {"runtime_dir": runtime_dir_flag} if runtime_dir_flag is not None else {}
    try:
        cfg = load_config(ClientConfig, cli=cli)
    except ConfigError as err:
        raise CliError(2, str(err)) from err
    if cfg.endpoint and runtime_dir_flag is None:
        return cfg.endpoint if "://" in cfg.endpoint else ipc_endpoint(cfg.endpoint)
    return ipc_endpoint(socket_path(runtime_dir(cfg.runtime_dir)))


def _timeout(flag: float | None) -> float:
    """``--timeout``, or the client config's default request timeout."""
    if flag is not None:
        return flag
    return float(ClientConfig.model_fields["request_timeout_s"].default)


# ---------------------------------------------------------------------------- requests
def _open(endpoint: str, timeout_s: float, admin_token: str = "") -> AdminClient:
    """An AdminClient on ``endpoint``; fails at once when an ipc:// socket file is missing."""
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        if not path.exists():
            raise CliError(1, f"kvtierd is not running: no socket at {path}")
    try:
        return AdminClient(endpoint, timeout_s=timeout_s, admin_token=admin_token)
    except zmq.ZMQError as err:  # a malformed endpoint, e.g. tcp://no-port
        raise CliError(1, f"cannot open {endpoint}: {err}") from err


def _request(client: AdminClient, msg: P.Request, want: type[P.Reply]) -> Any:
    """Send ``msg`` and return its reply of type ``want``.

    Raises:
        CliError: (code 1) no answer, an error reply, or an unexpected reply.
    """
    try:
        rep = client.call(msg)
    except AdminError as err:
        raise CliError(1, str(err)) from err
    if isinstance(rep, P.ErrorReply):
        name = (P.ErrorCode(rep.code).name if rep.code in P.ErrorCode._value2member_map_
                else f"error {rep.code}")
        hint = (f" (pass --admin-token or set ${ADMIN_TOKEN_ENV})"
                if rep.code == P.ErrorCode.UNAUTHORIZED else "")
        raise CliError(1, f"{name}: {rep.message}{hint}")
    if not isinstance(rep, want):
        raise CliError(1, f"unexpected reply {type(rep).__name__} to {type(msg).__name__}")
    return rep


def fetch_stats(endpoint: str, timeout_s: float, admin_token: str) -> dict[str, Any]:
    """Return the daemon's STATS snapshot.

    Raises:
        CliError: (code 1) unreachable, no answer, or refused (e.g. UNAUTHORIZED).
    """
    with _open(endpoint, timeout_s, admin_token) as client:
        rep = _request(client, P.Stats(req_id=0, admin_token=admin_token), P.StatsReply)
    return dict(rep.stats)


# ---------------------------------------------------------------------------- rendering
def _num(section: Mapping[str, Any], key: str) -> float | None:
    """A numeric field of a snapshot section, None when absent."""
    value = section.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _ratio(part: float | None, whole: float | None) -> str:
    """``part of whole (pct)``, or an em dash when either is unknown."""
    if part is None or whole is None:
        return "—"
    pct = f"{100.0 * part / whole:.1f}%" if whole > 0 else "—"
    return f"{int(part):,} of {int(whole):,} ({pct})"


def _duration(seconds: float) -> str:
    """``3d 04h``, ``2h 05m``, ``4m 09s`` or ``12.3s``."""
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{seconds:.1f}s"


_DIRECTIONS = (
    ("to_host", "engine → L2", "bytes_to_host", None),
    ("to_engine", "L2 → engine", "bytes_to_engine", None),
    ("to_l3", "L2 → L3", "bytes_to_l3", "put_bytes"),
    ("from_l3", "L3 → L2", "bytes_from_l3", "get_bytes"),
)


def _bytes_moved(snap: Mapping[str, Any]) -> dict[str, float]:
    """Bytes per direction (the same sources as ``kvtier_transfer_bytes_total``)."""
    counters = snap.get("counters") or {}
    l3 = snap.get("l3") or {}
    out: dict[str, float] = {}
    for direction, _, key, l3_key in _DIRECTIONS:
        value = _num(counters, key)
        if value is None and l3_key is not None:
            value = _num(l3, l3_key)
        if value is not None:
            out[direction] = value
    return out


def render_stats(snap: Mapping[str, Any], endpoint: str = "",
                 previous: Mapping[str, Any] | None = None) -> Any:
    """Build the ``kvtier stats`` view of one snapshot as a rich renderable.

    Args:
        snap: the STATS snapshot (``Daemon.snapshot()``); missing sections show as "—".
        endpoint: shown in the title.
        previous: an earlier snapshot of the same daemon epoch; when given, bytes moved
            also show a per-second rate over the daemon's own clock.

    Returns:
        A :class:`rich.console.Group` of tables.
    """
    from rich.console import Group
    from rich.table import Table

    pool: Mapping[str, Any] = snap.get("pool") or {}
    c: Mapping[str, Any] = snap.get("counters") or {}
    sessions = snap.get("sessions") or []
    l3: Mapping[str, Any] = snap.get("l3") or {}

    head = Table(title="kvtierd", show_header=False, box=None, title_justify="left",
                 padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    if endpoint:
        head.add_row("endpoint", endpoint)
    uptime = _num(snap, "uptime_s")
    head.add_row("epoch", str(snap.get("epoch", "—")))
    head.add_row("uptime", _duration(uptime) if uptime is not None else "—")
    head.add_row("sessions", f"{len(sessions)}")
    head.add_row("requests", f"{int(_num(c, 'requests') or 0):,}")
    errors = c.get("errors_by_code") or {}
    head.add_row("errors", ", ".join(f"{k} {v:,}" for k, v in sorted(errors.items())) or "0")

    pt = Table(title="L2 host pool", show_header=False, title_justify="left")
    pt.add_column(style="bold")
    pt.add_column(justify="right")
    used, cap = _num(pool, "used_bytes"), _num(pool, "capacity_bytes")
    if used is not None and cap is not None:
        pct = f" ({100.0 * used / cap:.1f}%)" if cap > 0 else ""
        pt.add_row("used", f"{format_size(int(used))} of {format_size(int(cap))}{pct}")
    for label, key in (("pages ready", "pages_ready"), ("pages writing", "pages_writing"),
                       ("pages pinned", "pages_pinned"), ("evictions", "evictions")):
        value = _num(pool, key)
        pt.add_row(label, f"{int(value):,}" if value is not None else "—")
    free, total = _num(pool, "extents_free"), _num(pool, "extents_total")
    if free is not None and total is not None:
        pt.add_row("extents free", f"{int(free)} of {int(total)}")

    ht = Table(title="Hit rates", title_justify="left")
    ht.add_column("tier", style="bold")
    ht.add_column("lookups hit", justify="right")
    ht.add_column("pages hit", justify="right")
    ht.add_column("tokens hit", justify="right")
    lookups, pages, toks = _num(c, "lookups"), _num(c, "lookup_keys"), _num(c, "lookup_tokens")
    ht.add_row("L2", _ratio(_num(c, "lookup_hits"), lookups),
               _ratio(_num(c, "lookup_hit_keys"), pages), _ratio(_num(c, "lookup_hit_tokens"), toks))
    ht.add_row("L3", _ratio(_num(c, "lookup_l3_hits"), lookups),
               _ratio(_num(c, "lookup_l3_keys"), pages), _ratio(_num(c, "lookup_l3_tokens"), toks))
    saved = _num(c, "loaded_tokens")
    ht.add_row("saved", "", "", f"{int(saved):,} tokens loaded" if saved is not None else "—")

    bt = Table(title="Bytes moved", title_justify="left")
    bt.add_column("direction", style="bold")
    bt.add_column("total", justify="right")
    moved = _bytes_moved(snap)
    rates: dict[str, float] = {}
    if previous is not None and previous.get("epoch") == snap.get("epoch"):
        dt = (_num(snap, "uptime_s") or 0.0) - (_num(previous, "uptime_s") or 0.0)
        before = _bytes_moved(previous)
        if dt > 0:
            rates = {d: (v - before[d]) / dt for d, v in moved.items() if d in before}
    if rates:
        bt.add_column("per second", justify="right")
    for direction, label, _, _ in _DIRECTIONS:
        if direction not in moved:
            continue
        row = [label, format_size(int(moved[direction]))]
        if rates:
            row.append(format_size(int(max(0.0, rates.get(direction, 0.0)))) + "/s")
        bt.add_row(*row)
    bt.add_row("pages stored", f"{int(_num(c, 'store_pages') or 0):,}"
               f" (+{int(_num(c, 'store_failed_pages') or 0):,} failed)", *([""] if rates else []))
    bt.add_row("pages loaded", f"{int(_num(c, 'load_pages') or 0):,}"
               f" (+{int(_num(c, 'load_failed_pages') or 0):,} failed)", *([""] if rates else []))

    lt = Table(title="L3 storage", show_header=False, title_justify="left")
    lt.add_column(style="bold")
    lt.add_column(justify="right")
    if not l3 or l3.get("backend") == "none":
        lt.add_row("backend", "none")
    else:
        healthy = l3.get("healthy")
        lt.add_row("backend", str(l3.get("backend", "—")))
        lt.add_row("health", "—" if healthy is None else ("[green]ok[/]" if healthy
                                                          else "[red]failing[/]"))
        for label, key in (("write policy", "write_policy"),
                           ("prefetch policy", "prefetch_policy")):
            if key in l3:
                lt.add_row(label, str(l3[key]))
        for label, key in (("write queue", "write_queue"), ("prefetching", "prefetching"),
                           ("errors", "errors"), ("corrupt objects", "corrupt"),
                           ("misses", "misses")):
            value = _num(l3, key)
            if value is not None:
                lt.add_row(label, f"{int(value):,}")
        unused = _num(c, "l3_prefetch_unused_pages")
        if unused is not None:
            lt.add_row("prefetched, unused", f"{int(unused):,} pages")
    return Group(head, pt, ht, bt, lt)


def render_sessions(sessions: Sequence[Mapping[str, Any]]) -> Any:
    """Build the ``kvtier sessions`` table (a rich renderable) from the snapshot's sessions."""
    from rich.table import Table

    t = Table(title=f"{len(sessions)} session{'s' if len(sessions) != 1 else ''}",
              title_justify="left")
    for name, justify in (("id", "right"), ("tenant", "left"), ("pid", "right"),
                          ("rank", "right"), ("state", "left"), ("page", "right"),
                          ("pages", "right"), ("transfers", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for s in sessions:
        page = s.get("page_bytes")
        t.add_row(str(s.get("session_id", "")), str(s.get("tenant", "")), str(s.get("pid", "")),
                  f"{s.get('tp_rank', 0)}/{s.get('tp_size', 1)}", str(s.get("state", "")),
                  format_size(int(page)) if isinstance(page, int) else "—",
                  str(s.get("num_pages", "")), str(s.get("transfers", "")))
    return t


def _console() -> Any:
    """A rich console on stdout (plain text when stdout is not a terminal)."""
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False)


# ---------------------------------------------------------------------------- commands
def _cmd_stats(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier stats``: one snapshot, or a refreshing view with ``--watch``."""
    if args.count is not None and args.watch is None:
        raise CliError(2, "--count needs --watch (see kvtier stats --help)")
    if args.watch is None:
        snap = fetch_stats(endpoint, timeout_s, args.admin_token)
        if args.json:
            print(json.dumps(snap, indent=2, sort_keys=True))
        else:
            _console().print(render_stats(snap, endpoint))
        return 0
    return _watch(args, endpoint, timeout_s)


def _watch(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """Refresh the stats every ``args.watch`` seconds until Ctrl-C or ``args.count``.

    A failed refresh shows its error and the next one retries; the exit status is that
    of the last refresh (Ctrl-C ends the watch with 0).
    """
    console = _console()
    live_view = console.is_terminal and not args.json
    previous: dict[str, Any] | None = None
    rc, done = 0, 0

    def frame() -> Any:
        nonlocal previous, rc
        try:
            snap = fetch_stats(endpoint, timeout_s, args.admin_token)
        except CliError as err:
            rc = err.code
            if args.json:
                print(json.dumps({"error": str(err)}), flush=True)
                return None
            return f"[red]kvtier stats: {err}[/] (retrying every {args.watch:g}s)"
        rc = 0
        if args.json:
            print(json.dumps(snap, sort_keys=True), flush=True)
            return None
        view = render_stats(snap, endpoint, previous)
        previous = snap
        return view

    try:
        if live_view:
            from rich.live import Live

            with Live(console=console, auto_refresh=False) as live:
                while True:
                    live.update(frame(), refresh=True)
                    done += 1
                    if args.count is not None and done >= args.count:
                        break
                    time.sleep(args.watch)
        else:
            while True:
                view = frame()
                if view is not None:
                    console.rule(time.strftime("%H:%M:%S"))
                    console.print(view)
                done += 1
                if args.count is not None and done >= args.count:
                    break
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    return rc


def _cmd_sessions(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier sessions``: the sessions of the STATS snapshot."""
    sessions = fetch_stats(endpoint, timeout_s, args.admin_token).get("sessions") or []
    if args.json:
        print(json.dumps(sessions, indent=2, sort_keys=True))
    elif not sessions:
        print("no sessions")
    else:
        _console().print(render_sessions(sessions))
    return 0


def _cmd_flush(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier flush``: drop pages of one tier (or all), optionally of one namespace."""
    with _open(endpoint, timeout_s, args.admin_token) as client:
        rep = _request(client, P.Flush(req_id=0, admin_token=args.admin_token, tier=args.tier,
                                       namespace=args.namespace or ""), P.FlushReply)
    scope = f"namespace {args.namespace}" if args.namespace else "every namespace"
    print(f"flushed {rep.l2_pages} L2 pages and {rep.l3_pages} L3 pages "
          f"(tier {args.tier}, {scope})")
    return 0


def _sync_seconds(text: str) -> float:
    value = _positive_seconds(text)
    if value > 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 3600 seconds")
    return value


def _cmd_sync(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier sync``: write L2 to L3; 1 when pages were left pending or not written."""
    start = time.monotonic()
    with _open(endpoint, timeout_s, args.admin_token) as client:
        try:
            rep = client.sync(args.wait)
        except AdminError as err:
            raise CliError(1, str(err)) from err
    took = time.monotonic() - start
    print(f"{rep.written} of {rep.pages} pages written to L3 in {took:.2f} s"
          f" ({rep.failed} not written, {rep.left} still pending)")
    return 0 if rep.failed == 0 and rep.left == 0 else 1


def _cmd_health(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier health``: one line; 0 when healthy (degraded counts unless ``--strict``)."""
    try:
        with _open(endpoint, timeout_s) as client:
            rep = _request(client, P.Health(req_id=0), P.HealthReply)
    except CliError as err:
        print(f"unhealthy: {err}")
        return 1
    proto = "" if rep.protocol_version == P.PROTOCOL_VERSION else (
        f", speaks protocol {rep.protocol_version} (this client {P.PROTOCOL_VERSION})")
    detail = f"kvtierd at {endpoint}, epoch {rep.epoch:x}, {rep.sessions} sessions{proto}"
    status = rep.status
    if status == "ok" or (status.startswith("degraded") and not args.strict):
        print(f"{status}: {detail}")
        return 0
    print(f"unhealthy: {status}: {detail}")
    return 1


_HANDLERS: dict[str, Callable[[argparse.Namespace, str, float], int]] = {
    "stats": _cmd_stats, "sessions": _cmd_sessions, "flush": _cmd_flush, "sync": _cmd_sync,
    "health": _cmd_health,
}


def main(argv: Sequence[str]) -> int:
    """Run one admin command and return its exit status.

    Args:
        argv: the command name followed by its arguments, e.g.
            ``["flush", "--tier", "all"]`` (as ``kvtier`` passes them).

    Returns:
        0 on success, 1 when the daemon refused, failed a health check or did not answer,
        2 for bad usage, 130 when interrupted.
    """
    if not argv or argv[0] not in _HANDLERS:
        name = argv[0] if argv else ""
        print(f"kvtier: {name!r} is not an admin command ({', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    command = argv[0]
    parser = build_parser(command)
    try:
        try:
            args = parser.parse_args(list(argv[1:]))
        except SystemExit as stop:  # --help was printed; report its status, don't exit
            return stop.code if isinstance(stop.code, int) else 0
        endpoint = resolve_endpoint(args.runtime_dir, args.endpoint)
        return _HANDLERS[command](args, endpoint, _timeout(args.timeout))
    except CliError as err:
        print(f"kvtier {command}: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
