"""Arguments of ``kvtier stats | sessions | flush | sync | health``: one parser per command,
the argument types of their own that check values before anything is sent (the shared ones
and the one-line parser: :mod:`kvtier.config.arg_types`), where the daemon is, and whether this
user may reach it.

Where the daemon is, lowest precedence first: the default runtime directory, then
``KVTIER_RUNTIME_DIR`` / ``KVTIER_ENDPOINT`` (read by the config loader, as engines read
them), then ``--runtime-dir`` / ``--endpoint``.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from kvtier.config.arg_types import (
    CliError,
    OneLineParser,
    positive_int,
    positive_seconds,
    utf8_text,
)
from kvtier.config import (
    ClientConfig,
    ConfigError,
    load_config,
    runtime_dir,
    socket_path,
)
from kvtier.config.loader import add_version_flag
from kvtier.ipc import protocol as P
from kvtier.ipc.sockets import ipc_endpoint

__all__ = [
    "ADMIN_TOKEN_ENV",
    "COMMANDS",
    "CliError",
    "build_parser",
    "check_reachable",
    "default_timeout",
    "resolve_endpoint",
]

COMMANDS = ("stats", "sessions", "namespaces", "flush", "sync", "health")
WATCH_MIN_S = 0.1  # refresh no faster than this: a STATS reply walks every session
WATCH_MAX_S = 3600.0
SYNC_MAX_S = 3600.0
ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"
FLUSH_DEFAULT_TIER = "l2"


# ---------------------------------------------------------------------------- arguments
def _watch_seconds(text: str) -> float:
    """argparse type: the ``--watch`` interval, bounded to [WATCH_MIN_S, WATCH_MAX_S]."""
    value = positive_seconds(text)
    if not WATCH_MIN_S <= value <= WATCH_MAX_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside [{WATCH_MIN_S}, {WATCH_MAX_S:.0f}] seconds"
        )
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
            f"({2 * P.KEY_BYTES} hex digits)"
        )
    return raw.hex()


def _admin_token(text: str) -> str:
    """argparse type: an admin token that can be sent (as UTF-8). A bad one is refused
    without being echoed: terminals and CI logs keep what is printed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise argparse.ArgumentTypeError(
            f"the token (from --admin-token or ${ADMIN_TOKEN_ENV}) is not UTF-8: an "
            f"undecodable byte at character {err.start} (the token is not shown)"
        ) from None
    return text


def _sync_seconds(text: str) -> float:
    """argparse type: the ``sync --wait`` deadline, in (0, SYNC_MAX_S] seconds."""
    value = positive_seconds(text)
    if value > SYNC_MAX_S:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {SYNC_MAX_S:.0f} seconds")
    return value


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
        "namespaces": "The host pool's namespaces (one per model, KV layout, tenant and, for "
        "most models, tensor-parallel rank): pages held "
        "in L2, sessions, tenant, model; the 64-hex-digit namespace is what flush "
        "--namespace takes, also after its engines are gone.",
        "flush": f"Drop cached pages: from L2 only unless --tier says otherwise (default "
        f"{FLUSH_DEFAULT_TIER}; L3 copies stay, so the pages can come back from L3). "
        "Needs the admin token when the daemon has one.",
        "sync": "Write every L2 page not yet in L3 to L3 and wait until written (before a "
        "reboot or maintenance: L2 lives in memory, L3 on disk or in a cluster).",
        "health": "Print one line and exit 0 when kvtierd is healthy, 1 otherwise (probes).",
    }
    if command not in texts:
        raise ValueError(f"command = {command!r} is not one of {', '.join(COMMANDS)}")
    # Defaults are spelled out in each help text (ArgumentDefaultsHelpFormatter would print
    # the admin token taken from the environment).
    p = OneLineParser(prog=f"kvtier {command}", description=texts[command])
    add_version_flag(p, "kvtier")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--runtime-dir",
        metavar="DIR",
        type=Path,
        help="the daemon's runtime directory (default: $KVTIER_RUNTIME_DIR, else "
        "$XDG_RUNTIME_DIR/kvtier, else /tmp/kvtier-<uid>)",
    )
    where.add_argument(
        "--endpoint",
        metavar="ENDPOINT",
        type=utf8_text,
        help="ZeroMQ endpoint (ipc://PATH or tcp://HOST:PORT) or a socket path; "
        "default: $KVTIER_ENDPOINT, else the runtime directory's socket",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=positive_seconds,
        default=None,
        help="wait this long for each reply (default: request_timeout_s, 2)",
    )
    if command != "health":
        p.add_argument(
            "--admin-token",
            metavar="TOKEN",
            type=_admin_token,  # argparse checks a str default with it too: the variable
            default=os.environ.get(ADMIN_TOKEN_ENV, ""),  # read once, as a default
            help=f"the daemon's admin credential, needed by stats, sessions, namespaces, flush "
            f"and sync when kvtierd has an admin_token (its --admin-token flag, "
            f"KVTIER_ADMIN_TOKEN variable or admin_token TOML key); default: "
            f"${ADMIN_TOKEN_ENV}, the better place (command lines are visible "
            f"to other users)",
        )
    if command in ("stats", "sessions", "namespaces"):
        p.add_argument("--json", action="store_true", help="print the daemon's raw answer as JSON")
    if command == "stats":
        p.add_argument(
            "--watch",
            metavar="SECONDS",
            nargs="?",
            const=2.0,
            type=_watch_seconds,
            help=f"refresh every SECONDS (default 2, within [{WATCH_MIN_S}, "
            f"{WATCH_MAX_S:.0f}]) until Ctrl-C; with --json, one line per refresh",
        )
        p.add_argument(
            "--count", metavar="N", type=positive_int, help="with --watch: stop after N refreshes"
        )
    if command == "flush":
        p.add_argument(
            "--tier",
            choices=("l2", "l3", "all"),
            default=FLUSH_DEFAULT_TIER,
            help="which tier to drop pages from: l2 (the host pool), l3 (the "
            f"storage backend) or all (both); default: {FLUSH_DEFAULT_TIER}",
        )
        p.add_argument(
            "--namespace",
            metavar="HEX",
            type=_namespace_hex,
            default=None,
            help="only this namespace fingerprint (64 hex digits; default: all)",
        )
    if command == "sync":
        p.add_argument(
            "--wait",
            metavar="SECONDS",
            type=_sync_seconds,
            default=600.0,
            help="answer after at most this long, writes still pending or not "
            "(default 600, at most 3600); exit 1 if pages were left or failed",
        )
    if command == "health":
        p.add_argument(
            "--strict",
            action="store_true",
            help="treat a degraded daemon (L2 serving, L3 failing) as unhealthy",
        )
    return p


def resolve_endpoint(runtime_dir_flag: Path | None, endpoint_flag: str | None) -> str:
    """Where the daemon listens, as engines would find it (whether this user may reach it
    is for :func:`check_reachable`, when the command opens it).

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


def check_reachable(endpoint: str) -> str:
    """Return ``endpoint``, after checking that this user may connect to an ``ipc://``
    socket: enter every directory on the way and write to the socket file (a missing
    socket is for the command to report).

    Without this check a socket of another user looks like a hung daemon: ZeroMQ retries
    the refused connect in the background and the request times out, saying nothing of
    permissions.

    Raises:
        CliError: (code 1) a directory on the way cannot be entered, or the socket cannot
            be written to; the message names it, its owner, group and mode, and this user.
    """
    if not endpoint.startswith("ipc://"):
        return endpoint
    sock = Path(endpoint[len("ipc://") :])
    try:
        st = os.stat(sock)
    except PermissionError as err:
        raise CliError(1, _directory_message(sock)) from err
    except OSError:
        return endpoint  # missing, or not a directory on the way: the command says so
    if not os.access(sock, os.W_OK):
        raise CliError(
            1,
            f"cannot connect to kvtierd's socket {sock}: permission denied ({_owner(st)}; "
            f"{_this_user()}); run as the daemon's user or join its group, or point "
            "--runtime-dir / --endpoint elsewhere",
        )
    return endpoint


def _directory_message(sock: Path) -> str:
    """Name the first directory above ``sock`` that this user cannot enter."""
    blocked = sock.parent
    for d in reversed(sock.parents):
        if not os.access(d, os.X_OK):
            blocked = d
            break
    try:
        what = _owner(os.stat(blocked))
    except OSError:
        what = "its owner and mode unreadable"
    return (
        f"cannot reach kvtierd's socket {sock}: permission denied entering {blocked} "
        f"({what}; {_this_user()}); run as the daemon's user or a member of its group, or "
        "point --runtime-dir / --endpoint elsewhere"
    )


def _owner(st: os.stat_result) -> str:
    """A file's owner, group and permission bits, as a permission error names them."""
    return f"owner uid {st.st_uid}, group gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _this_user() -> str:
    """This process's uid and groups, as a permission error names them."""
    groups = ",".join(str(g) for g in os.getgroups()) or "-"
    return f"this user is uid {os.getuid()}, groups {groups}"


def default_timeout(flag: float | None) -> float:
    """``--timeout``, or the client config's default request timeout."""
    if flag is not None:
        return flag
    return float(ClientConfig.model_fields["request_timeout_s"].default)
