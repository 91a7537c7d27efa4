"""``kvtier events``: tail a kvtierd's KV events, decoded.

The endpoints come from ``--endpoint`` / ``--replay``, else from the daemon's own
configuration (``--config`` file and ``KVTIER_KV_EVENTS_*`` variables). One line per event:
``seq topic type medium blocks...``; ``--json`` prints one JSON object per event instead
(``seq``, ``topic``, ``ts``, ``replayed`` and the event's fields, bytes hashes as hex).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvtier.config.arg_types import (
    CliError,
    OneLineParser,
    bounded_int,
    non_negative_seconds,
    sequence_number,
    utf8_text,
)
from kvtier.client.connection.events import EventSubscriber
from kvtier.config import ConfigError, DaemonConfig
from kvtier.config.loader import add_version_flag, load_config
from kvtier.daemon.log_lines import escape_controls
from kvtier.ipc.kv_events import as_dict

__all__ = ["build_parser", "main"]


def _short(h: object) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else str(h)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kvtier events`` (usage errors: one line, code 2)."""
    ap = OneLineParser(prog="kvtier events", description=__doc__.split("\n")[0])
    add_version_flag(ap, "kvtier")
    ap.add_argument("--endpoint", type=utf8_text, help="the daemon's kv_events_endpoint")
    ap.add_argument(
        "--replay", type=utf8_text, help="its kv_events_replay_endpoint (fills gaps, --from)"
    )
    ap.add_argument("--config", help="read the endpoints from this kvtierd config file")
    ap.add_argument(
        "--topic",
        type=utf8_text,
        default="",
        help="topic prefix, e.g. kvtier/<model id>/ (in the model id, %% as %%25 and / as %%2F)",
    )
    ap.add_argument(
        "--from",
        dest="start",
        type=sequence_number,
        metavar="SEQ",
        help="replay from this sequence number first (0: all the daemon keeps; below 2**64)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per event")
    ap.add_argument(
        "--timeout",
        type=non_negative_seconds,
        default=0.0,
        help="stop after this many quiet seconds (0: never)",
    )
    ap.add_argument(
        "--count",
        type=bounded_int(0),
        default=0,
        help="stop after this many events (0: no limit)",
    )
    return ap


def main(argv: list[str]) -> int:
    """Entry point of ``kvtier events``; exit 0 when the stream went quiet or ``--count``
    events were printed, 2 on bad usage (a bad value, no endpoint configured, an endpoint
    ZeroMQ cannot connect to), 130 when interrupted."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as err:
        print(f"kvtier events: {err}", file=sys.stderr)
        return err.code
    endpoint, replay = args.endpoint, args.replay
    if endpoint is None:
        try:
            cfg = load_config(DaemonConfig, file=args.config)
        except ConfigError as err:
            print(f"kvtier events: {err}", file=sys.stderr)
            return 2
        endpoint, replay = cfg.kv_events_endpoint, replay or cfg.kv_events_replay_endpoint
    if endpoint is None:
        print(
            "kvtier events: no endpoint: pass --endpoint or set kv_events_endpoint", file=sys.stderr
        )
        return 2
    try:
        return _tail(args, endpoint, replay)
    except ConfigError as err:  # an endpoint or topic ZeroMQ refuses
        print(f"kvtier events: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _tail(args: argparse.Namespace, endpoint: str, replay: str | None) -> int:
    """Print the events of ``endpoint`` until the stream is quiet or ``--count`` is reached."""
    printed = 0
    quiet = args.timeout if args.timeout > 0 else 1e9
    with EventSubscriber(endpoint, replay=replay, topic=args.topic) as sub:
        try:
            for msg in sub.iter(quiet, start_seq=args.start):
                for ev in msg.batch.events:
                    if args.json:
                        print(
                            json.dumps(
                                _finite(
                                    {
                                        "seq": msg.seq,
                                        "topic": msg.topic,
                                        "ts": msg.batch.ts,
                                        "replayed": msg.replayed,
                                        **as_dict(ev),
                                    }
                                ),
                                allow_nan=False,
                            ),
                            flush=True,
                        )
                    else:
                        blocks = getattr(ev, "block_hashes", [])
                        medium = escape_controls(str(getattr(ev, "medium", "") or ""))
                        print(
                            f"{msg.seq:>8} {escape_controls(msg.topic)} {type(ev).__name__:<16} "
                            f"{medium:<8} {len(blocks):>5} "
                            f"{' '.join(_short(h) for h in blocks[:4])}"
                            f"{' ...' if len(blocks) > 4 else ''}",
                            flush=True,
                        )
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
            return 0
        finally:  # also on Ctrl-C
            _skipped(sub.malformed)


def _skipped(malformed: int) -> None:
    """Say on stderr how many messages were not KV event batches (skipped)."""
    if malformed:
        print(
            f"kvtier events: skipped {malformed} message(s) that were not KV event batches",
            file=sys.stderr,
        )


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, ±inf: not JSON) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
