"""``kvtier stats | sessions | namespaces | flush | sync | health``: the operator's view of a running
kvtierd.

Each command opens an :class:`~kvtier.client.connection.admin.AdminClient` on the daemon's control
socket, sends one request (``STATS``, ``FLUSH``, ``SYNC`` or ``HEALTH``), prints the answer
and exits. Nothing here registers an engine or touches shared memory.

Where the daemon is: see :mod:`kvtier.cli.admin_args`. The admin credential comes from
``--admin-token`` or ``$KVTIER_ADMIN_TOKEN`` (prefer the variable: command lines are
visible to every user of the machine). What the tables show: :mod:`kvtier.cli.stats_view`.

Exit codes, for scripts and probes::

    0  success (health: the daemon answers and is serving: ``ok``, or ``degraded``, L3
       failing, without ``--strict``)
    1  the daemon refused the request, is unhealthy (``--strict``: or degraded), cannot
       be reached (no socket, or one this user may not connect to) or did not answer
    2  bad usage (unknown flag, bad value); nothing was sent
    130  interrupted (Ctrl-C) outside ``stats --watch``

Errors print one line on stderr: ``kvtier <command>: <what went wrong>``, except that
``health`` prints a daemon it cannot reach or that does not answer as ``unhealthy: <why>``
on stdout, the line probes read (bad usage stays on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
from kvtier.cli.admin_args import (
    ADMIN_TOKEN_ENV,
    COMMANDS,
    CliError,
    build_parser,
    check_reachable,
    default_timeout,
    resolve_endpoint,
)
from kvtier.cli.stats_view import render_namespaces, render_sessions, render_stats
from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.daemon.log_lines import escape_controls
from kvtier.ipc import protocol as P

__all__ = [
    "COMMANDS",
    "CliError",
    "build_parser",
    "fetch_stats",
    "main",
    "render_namespaces",
    "render_sessions",
    "render_stats",
]

# One line each, appended to a refusal: what the user can do about it.
TOKEN_HINT = f"a token goes in --admin-token or ${ADMIN_TOKEN_ENV}"
START_HINT = (
    "start one with `kvtier serve` (or `make serve`), or point --runtime-dir / "
    "--endpoint at the one that runs"
)

FLUSH_REPLY_S = 300.0
"""How much longer than ``--timeout`` ``kvtier flush`` waits for its reply: the daemon
first waits for the L3 reads and writes in flight, then lists and deletes L3's pages."""


# ---------------------------------------------------------------------------- requests
def _open(endpoint: str, timeout_s: float, admin_token: str = "") -> AdminClient:
    """An AdminClient on ``endpoint``.

    Fails at once, with what to do, when an ipc:// socket cannot be reached by this user
    (see :func:`~kvtier.cli.admin_args.check_reachable`) or its file is missing, and when
    the endpoint is malformed.

    Raises:
        CliError: (code 1) one of those.
    """
    check_reachable(endpoint)
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://") :])
        if not path.exists():
            raise CliError(1, f"kvtierd is not running: no socket at {path}; {START_HINT}")
    try:
        return AdminClient(endpoint, timeout_s=timeout_s, admin_token=admin_token)
    except zmq.ZMQError as err:  # a malformed endpoint, e.g. tcp://no-port
        raise CliError(1, f"cannot open {endpoint}: {err}") from err
    except UnicodeEncodeError as err:  # $KVTIER_ENDPOINT of bytes that are not UTF-8
        raise CliError(
            1, f"cannot open {endpoint!r}: not UTF-8 (an undecodable byte at character {err.start})"
        ) from err


def _request(
    client: AdminClient, msg: P.Request, want: type[P.Reply], wait_s: float | None = None
) -> Any:
    """Send ``msg`` and return its reply of type ``want``.

    Args:
        client: an open admin client.
        msg: the request.
        want: the reply type that means success.
        wait_s: how long to wait for the reply (default: the client's timeout).

    Raises:
        CliError: (code 1) no answer, an error reply (with a hint on what to do about an
            UNAUTHORIZED one), or an unexpected reply.
    """
    try:
        rep = client.call(msg, wait_s=wait_s)
    except AdminError as err:
        raise CliError(1, str(err)) from err
    if isinstance(rep, P.ErrorReply):
        name = (
            P.ErrorCode(rep.code).name
            if rep.code in P.ErrorCode._value2member_map_
            else f"error {rep.code}"
        )
        hint = f" ({TOKEN_HINT})" if rep.code == P.ErrorCode.UNAUTHORIZED else ""
        raise CliError(1, f"{name}: {rep.message}{hint}")
    if not isinstance(rep, want):
        raise CliError(1, f"unexpected reply {type(rep).__name__} to {type(msg).__name__}")
    return rep


def fetch_stats(
    endpoint: str, timeout_s: float, admin_token: str, namespaces: bool = False
) -> dict[str, Any]:
    """Return the daemon's STATS snapshot (``namespaces``: with L2's namespaces listed).

    Raises:
        CliError: (code 1) unreachable, no answer, or refused (e.g. UNAUTHORIZED).
    """
    with _open(endpoint, timeout_s, admin_token) as client:
        ask = P.Stats(req_id=0, admin_token=admin_token, namespaces=namespaces)
        rep = _request(client, ask, P.StatsReply)
    return dict(rep.stats)


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
            from rich.markup import escape

            return f"[red]kvtier stats: {escape(escape_controls(str(err)))}[/] (retrying every {args.watch:g}s)"
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


def _cmd_namespaces(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier namespaces``: L2's namespaces, most pages first."""
    snap = fetch_stats(endpoint, timeout_s, args.admin_token, namespaces=True)
    if "namespaces" not in snap:
        raise CliError(1, "the daemon did not list its namespaces (a kvtierd older than this CLI)")
    rows = snap["namespaces"] or []
    total = int(snap.get("namespaces_total", len(rows)))
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif not rows:
        print("no namespaces")
    else:
        _console().print(render_namespaces(rows, total))
    if total > len(rows):
        print(
            f"kvtier namespaces: {len(rows)} of {total} listed (those holding the most pages)",
            file=sys.stderr,
        )
    return 0


def _cmd_flush(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier flush``: drop pages of one tier (or all), optionally of one namespace; 1
    when L3's pages were not all deleted (the daemon says why)."""
    with _open(endpoint, timeout_s, args.admin_token) as client:
        rep = _request(
            client,
            P.Flush(
                req_id=0,
                admin_token=args.admin_token,
                tier=args.tier,
                namespace=args.namespace or "",
            ),
            P.FlushReply,
            wait_s=timeout_s + FLUSH_REPLY_S,
        )
    scope = f"namespace {args.namespace}" if args.namespace else "every namespace"
    if rep.tenants:
        scope += f" of tenant {', '.join(rep.tenants)}"
    print(
        f"flushed {rep.l2_pages} L2 pages and {rep.l3_pages} L3 pages (tier {args.tier}, {scope})"
    )
    if rep.l3_error:
        print(f"kvtier flush: L3 not flushed in full: {rep.l3_error}", file=sys.stderr)
        return 1
    return 0


def _cmd_sync(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier sync``: write L2 to L3; 1 when pages were left pending or not written."""
    start = time.monotonic()
    with _open(endpoint, timeout_s, args.admin_token) as client:
        rep = _request(
            client,
            P.Sync(req_id=0, admin_token=args.admin_token, timeout_s=args.wait),
            P.SyncReply,
            wait_s=args.wait + timeout_s,
        )
    took = time.monotonic() - start
    print(
        f"{rep.written} of {rep.pages} pages written to L3 in {took:.2f} s"
        f" ({rep.failed} not written, {rep.left} still pending)"
        + (f"; {rep.l3_error}" if rep.l3_error else "")
    )
    return 0 if rep.failed == 0 and rep.left == 0 else 1


def _cmd_health(args: argparse.Namespace, endpoint: str, timeout_s: float) -> int:
    """``kvtier health``: one line; 0 when healthy (degraded counts unless ``--strict``)."""
    try:
        with _open(endpoint, timeout_s) as client:
            rep = _request(client, P.Health(req_id=0), P.HealthReply)
    except CliError as err:
        print(f"unhealthy: {err}")
        return 1
    proto = (
        ""
        if rep.protocol_version == P.PROTOCOL_VERSION
        else (f", speaks protocol {rep.protocol_version} (this client {P.PROTOCOL_VERSION})")
    )
    detail = f"kvtierd at {endpoint}, epoch {rep.epoch:x}, {rep.sessions} sessions{proto}"
    status = rep.status
    if status == "ok" or (status.startswith("degraded") and not args.strict):
        print(f"{status}: {detail}")
        return 0
    print(f"unhealthy: {status}: {detail}")
    return 1


_HANDLERS: dict[str, Callable[[argparse.Namespace, str, float], int]] = {
    "stats": _cmd_stats,
    "sessions": _cmd_sessions,
    "namespaces": _cmd_namespaces,
    "flush": _cmd_flush,
    "sync": _cmd_sync,
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
        return _HANDLERS[command](args, endpoint, default_timeout(args.timeout))
    except CliError as err:
        print(f"kvtier {command}: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
