"""``kvtierd``: run the daemon in the foreground (also ``kvtier serve``)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

# SIGHUP asks a running daemon to reload; its default action ends the process. Ignored from
# here (before the configuration's modules load; `kvtier serve`: from main()) until the event
# loop handles it, and again once the loop has closed: a reload requested while starting or
# stopping never kills kvtierd. Only in kvtierd's own process, not in one importing this.
if __name__ == "__main__":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

# numpy's OpenBLAS starts a thread per core as it loads (numpy comes with the wire format's
# packed keys, before the socket is bound), CPU spent before the daemon is healthy; the
# daemon does no floating-point linear algebra. Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kvtier.config import ConfigError, DaemonConfig, KvtierError
from kvtier.config.loader import (
    add_config_flags,
    add_version_flag,
    flags_to_dict,
    load_config,
)

_EPILOG = """\
Where it listens: ipc://<runtime_dir>/kvtierd.sock. With the defaults it keeps a 1 GiB host
pool in /dev/shm and an L3 disk store in <state_dir>/l3 (up to 16 GiB); use
--hicache-storage-backend none to keep to L2. Engines, and the admin commands (kvtier stats,
sessions, namespaces, flush, sync, health), find it through the same runtime directory."""


def build_parser(prog: str = "kvtierd") -> argparse.ArgumentParser:
    """Return the argument parser of ``kvtierd`` / ``kvtier serve``.

    Args:
        prog: the program name shown in usage and ``--version``.
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="kvtier daemon: the node's shared KV cache (L2/L3).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        "-c",
        default=os.environ.get("KVTIER_CONFIG"),
        help="TOML config file with keys named like the flags below (default: "
        "$KVTIER_CONFIG, else none)",
    )
    add_version_flag(p, prog)
    add_config_flags(p, DaemonConfig)
    return p


def configure_logging(level: str) -> None:
    """Log one line per event to stderr, control characters escaped
    (:class:`~kvtier.daemon.log_lines.LineFormatter`); when stderr is the journal's stream
    without a timestamp (journald adds one) and with each line's syslog priority."""
    from kvtier.daemon.log_lines import LineFormatter, stderr_is_journal

    systemd = stderr_is_journal()
    fmt = "%(levelname)s %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(fmt if systemd else "%(asctime)s " + fmt, systemd))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def run(cfg: DaemonConfig, reload=None) -> int:
    """Run a daemon with ``cfg`` until SIGTERM/SIGINT; return the exit code.

    Args:
        cfg: the configuration.
        reload: re-reads the configuration from the same sources (SIGHUP).
    """
    import uvloop
    from kvtier.daemon.service.server import Daemon, install_signal_handlers
    from kvtier.daemon.service.strain import raise_descriptor_limit

    raise_descriptor_limit()  # engines' memory arrives as descriptors

    async def main() -> None:
        daemon = Daemon(cfg, reload=reload)
        install_signal_handlers(daemon)

        # What the start made (modules, the pool's index) lives as long as the process:
        # frozen out of the collector's sight once serving, a full collection scans only
        # what came after (a scan of everything would hold the event loop for milliseconds,
        # every engine waiting). Only here, in kvtierd's own process, not in one embedding it.
        # The threads that answer requests preempt the copy threads when they wake up (a
        # process-wide setting of its threads: kvtierd's own process only, as above).
        def ready(_d: Daemon) -> None:
            gc.freeze()
            _answering_first(cfg)

        await daemon.run(on_ready=ready)

    try:
        uvloop.run(main())
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the closed loop gave it back to default
    return 0


def _answering_first(cfg: DaemonConfig) -> None:
    """Shorter time slices for the event loop and the ZeroMQ I/O threads
    (:mod:`~kvtier.daemon.transfer.cpu_priority`)."""
    from kvtier.daemon.transfer.cpu_priority import answering_threads_first

    got = answering_threads_first(cfg.loop_slice_us)
    if got:
        logging.getLogger("kvtier.daemon").debug(
            "a %d µs time slice for threads %s", cfg.loop_slice_us, got
        )


def main(argv: list[str] | None = None, prog: str = "kvtierd") -> int:
    """Entry point of ``kvtierd``."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the `kvtierd` script and `kvtier serve`
    args = build_parser(prog).parse_args(argv)
    cli = flags_to_dict(args, DaemonConfig)

    def load() -> DaemonConfig:
        return load_config(DaemonConfig, file=args.config, cli=cli)

    try:
        cfg = load()
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level)
    try:
        return run(cfg, reload=load)
    except ConfigError as err:  # a setting the start could not apply: restarting will not help
        logging.getLogger("kvtier.daemon").error("%s", err)
        return 2
    except KvtierError as err:
        logging.getLogger("kvtier.daemon").error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
