"""``kvtier``: the command line — serve, demo, bench, and the admin commands."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from kvtier.bench import write_json
from kvtier.config.arg_types import CliError, OneLineParser, bounded_int, directory, positive_int


def _serve(argv: list[str]) -> int:
    # The daemon is its own program: exec it so ``kvtier serve`` and ``kvtierd`` are one thing.
    os.execv(sys.executable, [sys.executable, "-m", "kvtier.daemon", *argv])
    return 0  # not reached


MIN_L2_MIB = 256
"""Least MiB ``kvtier bench l2`` moves per measurement: less than that times caches and
per-request overhead, not the bandwidth the bench reports (see :mod:`kvtier.bench.l2`)."""

ENGINE_BENCHES = {
    "sglang": "SGLang's HiCache controller: backup/prefetch vs HiCacheFile; shared vs private L2",
    "vllm": "a real vLLM: TTFT with a kvtier hit vs recompute; vs vLLM's ExampleConnector",
    "events": "KV events: whole (vLLM decodes them, nothing missed), replayable, their cost",
}
"""Benches that parse their own flags; ``sglang`` and ``vllm`` drive a real engine, ``events``
decodes with vLLM's types (installed by ``make engines``)."""


def _bench(argv: list[str]) -> int:
    if argv[:1] and argv[0] in ENGINE_BENCHES:
        import importlib

        engine_bench = importlib.import_module(f"kvtier.bench.{argv[0]}")
        return int(engine_bench.main(argv[1:]))
    if argv[:1] == ["trace"]:  # parses its own flags
        from kvtier.bench import trace

        return trace.main(argv[1:])
    p = OneLineParser(prog="kvtier bench", description="Measure kvtier against baselines.")
    sub = p.add_subparsers(dest="what", required=True)
    for name, text in ENGINE_BENCHES.items():
        sub.add_parser(name, help=f"{text} (run `kvtier bench {name} --help`)")
    sub.add_parser(
        "trace",
        help="replay a request trace through kvtierd per pool size: hit rate "
        "vs simulated LRU and Belady's MIN (run `kvtier bench trace --help`)",
    )
    l2 = sub.add_parser("l2", help="host pool load/store bandwidth and lookup latency")
    l2.add_argument("--json", metavar="PATH", help="write the results here")
    l2.add_argument(
        "--mib",
        type=bounded_int(MIN_L2_MIB),
        default=MIN_L2_MIB,
        help=f"MiB moved per measurement (>= {MIN_L2_MIB})",
    )
    e2e = sub.add_parser("e2e", help="TTFT with an L2 hit vs recompute, and the miss overhead")
    e2e.add_argument("--json", metavar="PATH")
    e2e.add_argument(
        "--runs", type=positive_int, default=5, help="timed runs of each case (default 5)"
    )
    l3 = sub.add_parser("l3", help="L3 backend bandwidth against its raw baseline")
    l3.add_argument("--backend", choices=["file", "redis", "mooncake"], default="file")
    l3.add_argument("--json", metavar="PATH")
    l3.add_argument(
        "--path",
        type=directory,
        help="an existing directory for the file backend's files (default: a temp dir)",
    )
    rs = sub.add_parser("restart", help="how fast a restarted daemon adopts its host pool")
    rs.add_argument("--json", metavar="PATH")
    rs.add_argument(
        "--mib", type=positive_int, default=1024, help="size of the host pool (default 1024)"
    )
    sc = sub.add_parser("scale", help="eight engines, 128K-token contexts, a million pages")
    sc.add_argument("--json", metavar="PATH", help="write the results here")
    sc.add_argument("--plot", metavar="PNG", help="draw the N-engine curves here (matplotlib)")
    sc.add_argument("--quick", action="store_true", help="tiny sizes: seconds, not minutes")
    sc.add_argument(
        "--million-pages",
        type=positive_int,
        metavar="N",
        help="pages of the big pool (default 1,000,000; --quick: 4,096)",
    )
    sc.add_argument(
        "--copy-threads",
        type=positive_int,
        default=2,
        help="the daemons' copy threads, and the memcpy baselines' (default 2)",
    )
    sc.add_argument(
        "--only",
        metavar="PART[,PART]",
        help="run only these parts, of sizes, engines, control, long, stall, million "
        "(e.g. stall: under a minute)",
    )
    try:
        args = p.parse_args(argv)
    except CliError as err:
        print(f"kvtier bench: {err}", file=sys.stderr)
        return err.code
    result: dict[str, Any]
    print_table: Callable[[dict[str, Any]], None]
    if args.what == "l2":
        from kvtier.bench import l2 as l2_mod

        result, print_table = l2_mod.run_l2_bench(mib=args.mib), l2_mod.print_table
    elif args.what == "e2e":
        from kvtier.bench import e2e as e2e_mod

        result, print_table = e2e_mod.run_e2e_bench(runs=args.runs), e2e_mod.print_table
    elif args.what == "restart":
        from kvtier.bench import restart as restart_mod

        result, print_table = restart_mod.run_restart_bench(mib=args.mib), restart_mod.print_table
    elif args.what == "scale":
        from kvtier.bench import scale as scale_mod

        result, print_table = scale_mod.run_from_args(args), scale_mod.print_table
    elif args.backend == "file":
        import tempfile

        from kvtier.bench import l3 as l3_mod

        try:
            scratch = tempfile.TemporaryDirectory(prefix="kvtier-l3-", dir=args.path)
        except OSError as err:  # e.g. --path not writable by this user
            print(f"kvtier bench: --path {args.path}: {err.strerror}", file=sys.stderr)
            return 2
        with scratch as d:
            result, print_table = l3_mod.run_file_bench(d), l3_mod.print_table
    else:
        from kvtier.bench import l3_cluster as l3_cluster_mod

        result = l3_cluster_mod.run_cluster_bench(args.backend)
        print_table = l3_cluster_mod.print_table
    print_table(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _demo(argv: list[str]) -> int:
    from kvtier.cli.demo import main as demo_main

    return demo_main(argv)


def _pools(argv: list[str]) -> int:
    from kvtier.cli.pools import main as pools_main

    return pools_main(argv)


def _events(argv: list[str]) -> int:
    from kvtier.cli.events import main as events_main

    return events_main(argv)


def _admin(argv: list[str]) -> int:
    from kvtier.cli.admin import main as admin_main

    return admin_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "run kvtierd in the foreground (same flags as kvtierd)"),
    "demo": (_demo, "multi-turn workload on the reference engine, private kvtierd, a restart"),
    "bench": (_bench, "benchmarks: l2, l3, e2e, restart, scale, trace, sglang, vllm, events"),
    "stats": (_admin, "pool use, sessions, hit rates, bytes moved"),
    "sessions": (_admin, "registered engine sessions"),
    "namespaces": (_admin, "the pool's namespaces: pages in L2, tenant, model"),
    "flush": (_admin, "drop cached pages, from L2 unless --tier l3|all (admin)"),
    "sync": (_admin, "write L2 pages to L3 and wait (admin)"),
    "health": (_admin, "exit 0 when the daemon is healthy"),
    "events": (_events, "tail a kvtierd's KV events, decoded (--json: one object a line)"),
    "pools": (_pools, "host pool files in /dev/shm, which daemon holds each; --remove, --stale"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvtier``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        from kvtier.config.loader import package_version

        print(f"kvtier {package_version()}")
        return 0
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        # one line naming the word, on stderr as every usage error: not the usage block
        print(f"kvtier: {argv[0]!r} is not a command (see kvtier --help)", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: kvtier COMMAND [ARGS]   (kvtier COMMAND --help: its options; "
            "kvtier --version)\n\ncommands:"
        )
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    fn, _ = COMMANDS[argv[0]]
    return fn(argv if fn is _admin else argv[1:])


if __name__ == "__main__":
    sys.exit(main())
